"""Running notebook code elsewhere: seeding what runs, and (next) DDP process groups and background jobs."""

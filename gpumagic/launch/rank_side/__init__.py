"""What runs inside rank processes: the rank runtime, the process group, a launch's rank and a persistent group's
rank, the rank server they are forked from, and torch elastic's agent. Never imports the kernel side."""

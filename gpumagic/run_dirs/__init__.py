"""Run directories: what a launch, a persistent group, a background job or a kernel's own logging leaves on disk
(layout, private files, sealed pickles, records, metrics, outcomes, how the run ended). See docs/architecture.md."""

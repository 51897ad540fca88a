"""Background jobs: notebook code run detached from the kernel, queued per machine until GPUs are free.

``api`` (submit, sweep, Job), ``executors`` (where a job runs: ``local``, this machine's queue, or ``slurm``),
``queue`` (who gets which GPUs), ``runner`` (the detached process that carries one local job), ``comparison``
(jobs and runs side by side). A job's directory is ``run_dirs.records``; how it ended, ``run_dirs.run_end``.
"""

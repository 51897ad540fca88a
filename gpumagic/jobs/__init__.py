"""Background jobs: notebook code run detached from the kernel, queued per machine until GPUs are free.

``api`` (submit, sweep, Job), ``executors`` (where a job runs: ``local``, this machine's queue, or ``slurm``),
``records`` (the job's directory), ``queue`` (who gets which GPUs), ``runner`` (the detached process that
carries one local job).
"""

"""Background jobs: notebook code run detached from the kernel, queued per machine until GPUs are free.

``api`` (submit, sweep, Job), ``records`` (the job's directory), ``queue`` (who gets which GPUs),
``runner`` (the detached process that carries one job).
"""

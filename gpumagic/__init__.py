"""gpumagic: see, pick and use GPUs from a Jupyter notebook.

``%load_ext gpumagic`` registers the magics; the same work is available as plain functions::

    import gpumagic
    gpumagic.pick(2, min_free="20GB")   # lease the 2 best free GPUs, set CUDA_VISIBLE_DEVICES
    gpumagic.status()                   # table of GPUs, processes, leases and what this kernel sees
    gpumagic.jobs_with(gpus=1, name="A1").submit(train, cfg)  # a background job, queued until a GPU is free

Importing gpumagic is fast: it never imports torch, bokeh or pynvml, and never initializes CUDA. Each public name
below is its owner's own function or class (``help(gpumagic.pick)`` shows the real signature), imported from
``_EXPORTS`` when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpumagic import debug_log as _debug_log  # noqa: F401 - GPUMAGIC_DEBUG=1: every process's lines on stderr
from gpumagic.errors import (
    GpuCapError,
    GpuLeasedError,
    GpumagicError,
    InvalidArgument,
    KillRefused,
    LeaseDirectoryError,
    NoGpuError,
    NotEnoughGpusError,
)

if TYPE_CHECKING:  # what type checkers and IDEs see: the owners' own signatures and docstrings
    from gpumagic.devices.inventory import read_inventory as gpus
    from gpumagic.devices.own_processes import kill_gpu_process as kill
    from gpumagic.devices.selection import pick, release, use, why
    from gpumagic.devices.visibility import visible_gpus
    from gpumagic.jobs.api import (
        Job,
        JobFailed,
        job,
        jobs_with,
        list_jobs,
        select_jobs,
        submit,
        sweep,
    )
    from gpumagic.launch.failures import LaunchError, LaunchInterrupted
    from gpumagic.launch.kernel_side.ddp import launch_ddp, spawn
    from gpumagic.launch.kernel_side.group import CellFailed, CellInterrupted
    from gpumagic.launch.kernel_side.session import ddp_group, ranks
    from gpumagic.launch.rank_side.checkpoints import CheckpointError, checkpoint, restore
    from gpumagic.launch.rank_side.group_rank import keep
    from gpumagic.launch.seeding import seed
    from gpumagic.run_dirs.store import list_runs as runs
    from gpumagic.run_dirs.store import load_run
    from gpumagic.telemetry.exporting import export
    from gpumagic.telemetry.log import log
    from gpumagic.telemetry.tracking import track
    from gpumagic.widgets.views import compare, plot_run, status, watch_jobs

__version__ = "0.1.0"

# public name -> (the module that owns it, its name there); imported on first use, so ``import gpumagic`` stays
# a few milliseconds (tests/unit/test_public_api.py holds this table equal to the TYPE_CHECKING imports above)
_EXPORTS = {
    "gpus": ("gpumagic.devices.inventory", "read_inventory"),
    "kill": ("gpumagic.devices.own_processes", "kill_gpu_process"),
    "pick": ("gpumagic.devices.selection", "pick"),
    "release": ("gpumagic.devices.selection", "release"),
    "use": ("gpumagic.devices.selection", "use"),
    "why": ("gpumagic.devices.selection", "why"),
    "visible_gpus": ("gpumagic.devices.visibility", "visible_gpus"),
    "Job": ("gpumagic.jobs.api", "Job"),
    "JobFailed": ("gpumagic.jobs.api", "JobFailed"),
    "job": ("gpumagic.jobs.api", "job"),
    "jobs_with": ("gpumagic.jobs.api", "jobs_with"),
    "list_jobs": ("gpumagic.jobs.api", "list_jobs"),
    "select_jobs": ("gpumagic.jobs.api", "select_jobs"),
    "submit": ("gpumagic.jobs.api", "submit"),
    "sweep": ("gpumagic.jobs.api", "sweep"),
    "LaunchError": ("gpumagic.launch.failures", "LaunchError"),
    "LaunchInterrupted": ("gpumagic.launch.failures", "LaunchInterrupted"),
    "launch_ddp": ("gpumagic.launch.kernel_side.ddp", "launch_ddp"),
    "spawn": ("gpumagic.launch.kernel_side.ddp", "spawn"),
    "CellFailed": ("gpumagic.launch.kernel_side.group", "CellFailed"),
    "CellInterrupted": ("gpumagic.launch.kernel_side.group", "CellInterrupted"),
    "ddp_group": ("gpumagic.launch.kernel_side.session", "ddp_group"),
    "ranks": ("gpumagic.launch.kernel_side.session", "ranks"),
    "keep": ("gpumagic.launch.rank_side.group_rank", "keep"),
    "checkpoint": ("gpumagic.launch.rank_side.checkpoints", "checkpoint"),
    "restore": ("gpumagic.launch.rank_side.checkpoints", "restore"),
    "CheckpointError": ("gpumagic.launch.rank_side.checkpoints", "CheckpointError"),
    "seed": ("gpumagic.launch.seeding", "seed"),
    "runs": ("gpumagic.run_dirs.store", "list_runs"),
    "load_run": ("gpumagic.run_dirs.store", "load_run"),
    "export": ("gpumagic.telemetry.exporting", "export"),
    "log": ("gpumagic.telemetry.log", "log"),
    "track": ("gpumagic.telemetry.tracking", "track"),
    "compare": ("gpumagic.widgets.views", "compare"),
    "plot_run": ("gpumagic.widgets.views", "plot_run"),
    "status": ("gpumagic.widgets.views", "status"),
    "watch_jobs": ("gpumagic.widgets.views", "watch_jobs"),
}

__all__ = [  # the errors above, load_ipython_extension and every name of _EXPORTS
    "CellFailed",
    "CellInterrupted",
    "CheckpointError",
    "GpuCapError",
    "GpuLeasedError",
    "GpumagicError",
    "InvalidArgument",
    "Job",
    "JobFailed",
    "KillRefused",
    "LaunchError",
    "LaunchInterrupted",
    "LeaseDirectoryError",
    "NoGpuError",
    "NotEnoughGpusError",
    "checkpoint",
    "compare",
    "ddp_group",
    "export",
    "gpus",
    "job",
    "jobs_with",
    "keep",
    "kill",
    "launch_ddp",
    "list_jobs",
    "load_ipython_extension",
    "load_run",
    "log",
    "pick",
    "plot_run",
    "ranks",
    "release",
    "restore",
    "runs",
    "seed",
    "select_jobs",
    "spawn",
    "status",
    "submit",
    "sweep",
    "track",
    "use",
    "visible_gpus",
    "watch_jobs",
    "why",
]


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its owner on first use (``_EXPORTS``)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpumagic' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip this function: log() costs nothing extra
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def load_ipython_extension(ipython: Any) -> None:
    """Called by ``%load_ext gpumagic``: registers ``%gpu``, ``%%launch_ddp``, ``%ddp``/``%%ddp``,
    ``%%launch_bg`` and ``%jobs``; in a Jupyter kernel, has the ranks end before the kernel does."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.devices.idle_release import watch_cells
    from gpumagic.launch.kernel_side.kernel_end import watch_kernel_end
    from gpumagic.magics.ddp import DdpMagics
    from gpumagic.magics.gpu import GpuMagics
    from gpumagic.magics.jobs import JobMagics
    from gpumagic.magics.launch import LaunchMagics

    ipython.register_magics(GpuMagics)
    ipython.register_magics(LaunchMagics)
    ipython.register_magics(DdpMagics)
    ipython.register_magics(JobMagics)
    watch_kernel_end(ipython)
    watch_cells(ipython)  # its leases' records say whether it is idle (docs/devices.md, "For administrators")

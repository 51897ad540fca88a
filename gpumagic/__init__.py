"""gpumagic: see, pick and use GPUs from a Jupyter notebook.

``%load_ext gpumagic`` registers the magics; the same work is available as plain functions::

    import gpumagic
    gpumagic.pick(2, min_free="20GB")   # lease the 2 best free GPUs, set CUDA_VISIBLE_DEVICES
    gpumagic.status()                   # table of GPUs, processes, leases and what this kernel sees
    gpumagic.submit(train, cfg, gpus=1) # a background job, queued until a GPU is free; gpumagic.job(name)

Importing gpumagic is fast: it never imports torch, bokeh or pynvml, and never initializes CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumagic import debug_log as _debug_log  # noqa: F401 - GPUMAGIC_DEBUG=1: every process's lines on stderr
from gpumagic.errors import (
    GpuLeasedError,
    GpumagicError,
    InvalidArgument,
    KillRefused,
    LeaseDirectoryError,
    NoGpuError,
    NotEnoughGpusError,
)

if TYPE_CHECKING:
    from gpumagic.devices.model import Inventory
    from gpumagic.devices.processes import KillReport
    from gpumagic.devices.selection import PickOutlook, Selection
    from gpumagic.devices.visibility import Visibility
    from gpumagic.jobs.api import Job, JobFailed
    from gpumagic.launch.failures import LaunchError, LaunchInterrupted
    from gpumagic.launch.kernel_side.group import RankGroup
    from gpumagic.launch.seeding import SeedReport
    from gpumagic.telemetry.log import log
    from gpumagic.widgets.compare import Comparison
    from gpumagic.widgets.job_watch import JobWatch
    from gpumagic.widgets.status_table import StatusTable

__version__ = "0.1.0"

__all__ = [
    "CellFailed",
    "CellInterrupted",
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
    "compare",
    "ddp_group",
    "gpus",
    "job",
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
    "runs",
    "seed",
    "select_jobs",
    "spawn",
    "status",
    "submit",
    "sweep",
    "use",
    "visible_gpus",
    "watch_jobs",
    "why",
]


_LAZY = {
    "log": ("gpumagic.telemetry.log", "log"),
    "LaunchError": ("gpumagic.launch.failures", "LaunchError"),
    "LaunchInterrupted": ("gpumagic.launch.failures", "LaunchInterrupted"),
    "JobFailed": ("gpumagic.jobs.api", "JobFailed"),
    "Job": ("gpumagic.jobs.api", "Job"),
    "CellFailed": ("gpumagic.launch.kernel_side.group", "CellFailed"),
    "CellInterrupted": ("gpumagic.launch.kernel_side.group", "CellInterrupted"),
}


def __getattr__(name: str) -> Any:
    """Import ``log`` and the launch errors on first use, keeping ``import gpumagic`` light."""
    if name in _LAZY:
        # lazy: import gpumagic stays a few milliseconds
        import importlib

        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # later lookups skip this function: log() costs nothing extra
        return value
    raise AttributeError(f"module 'gpumagic' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """Called by ``%load_ext gpumagic``: registers ``%gpu``, ``%%launch_ddp``, ``%ddp``/``%%ddp``,
    ``%%launch_bg`` and ``%jobs``; in a Jupyter kernel, has the ranks end before the kernel does."""
    # lazy: import gpumagic stays a few milliseconds
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


def gpus() -> Inventory:
    """Every GPU of this machine now: memory, utilization, temperature, power, processes.

    Simulated GPUs when ``GPUMAGIC_SIMULATE`` is set. With no driver the inventory is empty and its
    ``problem`` says why. Raises InvalidArgument if ``GPUMAGIC_SIMULATE`` is malformed.
    """
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.devices.inventory import read_inventory

    return read_inventory()


def status() -> StatusTable:
    """The ``%gpu status`` table (HTML in a notebook, text in a terminal); its ``.status`` holds the data."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.devices.status import gather_status
    from gpumagic.widgets.status_table import StatusTable

    return StatusTable(gather_status())


def pick(n: int = 1, **options: Any) -> Selection:
    """Lease the ``n`` best free GPUs and make them this kernel's ``cuda:0..n-1``.

    Options: ``min_free`` ("20GB", "50%"), ``max_util`` (percent), ``exclude`` ("0,1"), ``wait`` ("10m").
    See ``gpumagic.devices.selection.pick``. Raises NotEnoughGpusError listing what each GPU lacked.
    """
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.devices.selection import pick as _pick

    return _pick(n, **options)


def why(n: int = 1, **options: Any) -> PickOutlook:
    """What ``pick(n, ...)`` would get now and why: every GPU's reason, the queue in the order it is served
    (what each ticket does), and what is ignored or passed over in the lease directory. Takes nothing.

    Options as ``pick``'s: ``min_free``, ``max_util``, ``exclude``.
    """
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.devices.selection import why as _why

    return _why(n, **options)


def use(spec: object, *, force: bool = False) -> Selection:
    """Make the GPUs ``spec`` names (``"0,2"``, ``"GPU:*"``, ``"A100"``, a UUID, ``"none"``) this kernel's."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.devices.selection import use as _use

    return _use(spec, force=force)


def release() -> tuple[int, ...]:
    """Give back this kernel's leases and restore ``CUDA_VISIBLE_DEVICES``; returns the GPUs released."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.devices.selection import release as _release

    return _release()


def visible_gpus() -> Visibility:
    """Which GPU each ``cuda:N`` of this kernel is, given ``CUDA_VISIBLE_DEVICES`` now."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.devices.inventory import read_inventory
    from gpumagic.devices.visibility import current_visibility

    return current_visibility(read_inventory())


def seed(value: int, *, deterministic: bool = False) -> SeedReport:
    """Seed python, numpy and torch (CPU and every CUDA device, lazily); see ``launch.seeding.seed``."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.launch.seeding import seed as _seed

    return _seed(value, deterministic=deterministic)


def kill(pid: int, *, timeout: float = 5.0) -> KillReport:
    """Stop one of your own GPU processes: SIGTERM, then SIGKILL after ``timeout`` seconds.

    Raises KillRefused for processes of other users, processes not on a GPU, and this kernel itself.
    """
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.devices.own_processes import kill_gpu_process

    return kill_gpu_process(pid, timeout)


def launch_ddp(
    fn: Any, nprocs: int | None = None, args: tuple = (), kwargs: dict | None = None, **options: Any
) -> dict:
    """Call ``fn(*args, **kwargs)`` on ``nprocs`` DDP ranks (process group ready); returns ``{rank: value}``.

    ``fn`` may be defined in the notebook. See ``gpumagic.launch.kernel_side.ddp.launch_ddp`` for the options.
    Raises LaunchError naming the failing rank, with its traceback and the other ranks' fates.
    """
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.launch.kernel_side.ddp import launch_ddp as _launch_ddp

    return _launch_ddp(fn, nprocs, args, kwargs, **options)


def spawn(fn: Any, args: tuple = (), nprocs: int = 1, join: bool = True, **options: Any) -> Any:
    """``torch.multiprocessing.spawn`` that works on notebook-defined functions: ``fn(rank, *args)``."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.launch.kernel_side.ddp import spawn as _spawn

    return _spawn(fn, args, nprocs, join, **options)


def ranks(nprocs: int | None = None, **options: Any) -> RankGroup:
    """Start ``nprocs`` ranks with their process group ready, kept across calls (``%ddp start``'s API).

    ``group.run(fn, *args)`` and ``group.exec(code)`` return ``{rank: value}``; each rank keeps its namespace
    between them (``rank``, ``world_size``, ``device``, ``dist`` defined). ``group.pull(name, rank=0)`` copies a
    value to the kernel (tensors on the CPU), ``group.push(name=value)`` sets names on every rank,
    ``group.status()``, ``group.free()``, ``group.close()``; a context manager. Options: ``gpus`` (a spec,
    ``"auto"`` or ``"none"``), ``gpus_per_rank``, ``backend``, ``timeout`` (the process group's), ``grace``
    (how long an interrupted rank may stay busy before its collective is broken, default 5 s), ``output``
    (``rank0``, ``all``, ``none``), ``hang_after`` (a collective waiting this long is reported with where every
    rank is: ``"10s"``; 0: off; ``group.hang_reports`` keeps them). ``group.debug(rank)`` opens pdb on a rank
    whose last call failed. See docs/launch.md.
    """
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.launch.kernel_side.group import RankGroup
    from gpumagic.launch.options import LaunchOptions

    group_only = {name: options.pop(name) for name in ("grace", "write", "on_note") if name in options}
    return RankGroup(LaunchOptions.for_group(nprocs, **options), **group_only)


def ddp_group() -> RankGroup | None:
    """The group ``%ddp start`` (or the first ``%%ddp`` cell) started in this kernel; ``None`` if none runs."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.magics.ddp import DdpMagics

    group = DdpMagics.group
    return group if group is not None and not group.closed else None


def keep(*objects: Any, **named: Any) -> None:
    """In a rank of a persistent group: state to restore when a dead rank is replaced (``keep(model, optimizer)``
    or ``keep(model=m)``). A healthy rank's copy is sent to the fresh rank; DDP models are wrapped again. Outside
    such a rank it does nothing."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.launch.rank_side.group_rank import keep as _keep

    _keep(*objects, **named)


def runs() -> list:
    """Every run of this user (launches and kernels that logged), oldest first; see ``load_run``."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.run_dirs.store import list_runs

    return list_runs()


def load_run(run_id: str) -> Any:
    """Reopen a run by id (or a unique prefix): ``.metrics()`` gives ``{rank: {name: Series}}``."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.run_dirs.store import load_run as _load_run

    return _load_run(run_id)


def plot_run(run: Any, metrics: list[str] | None = None) -> Any:
    """Plot a run (a ``Run`` or its id): one figure per metric, one curve per rank; displays in a notebook."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.run_dirs.store import Run, load_run
    from gpumagic.widgets.run_plot import RunPlot

    return RunPlot(run if isinstance(run, Run) else load_run(str(run)), metrics)


def compare(
    runs_or_jobs: Any = None,
    metrics: str | list[str] | None = None,
    x: str = "step",
    *,
    sort_by: str | None = None,
    descending: bool | None = None,
    all_columns: bool = False,
    group_seeds: bool = True,
) -> Comparison:
    """Runs and jobs side by side; displays in a notebook: a table (hyperparameters, seed, status, duration, GPU
    hours, each metric's last and best value) that sorts and filters by any column, parallel coordinates of the
    hyperparameters against the metric, every run's curves with a smoothing slider, and one selection across
    them (working in the browser alone); ``.filter("lr<=0.001")``, ``.sort("loss")``, ``.to_pandas()`` and
    ``.to_csv(path)`` from Python.

    ``runs_or_jobs``: ``Job``s, job names, patterns (``"A-*"``), ``Run``s or run ids; None: every job of yours.
    ``x``: ``"step"``, ``"elapsed"`` or ``"time"``. ``sort_by``: a column or a metric (its best value).
    Runs that differ only by ``seed`` are drawn as their mean with a ± std band (``group_seeds=False``: not).
    ``.rows`` and ``.curves`` hold the data; ``.refresh()`` reads the runs again. Raises InvalidArgument for an
    unknown run, job, metric or column, or when there is nothing to compare.
    """
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.widgets.compare import Comparison

    return Comparison(
        runs_or_jobs,
        metrics,
        x,
        sort_by=sort_by,
        descending=descending,
        all_columns=all_columns,
        group_seeds=group_seeds,
    )


def submit(fn: Any, *args: Any, **options: Any) -> Job:
    """Run ``fn(*args, **kwargs)`` as a detached background job, queued until its GPUs are free; returns a ``Job``.

    Options: ``gpus`` (count, default 1, or a spec), ``name``, ``min_free`` ("20GB": may share a GPU),
    ``ddp`` (ranks), ``after`` (jobs to finish first); other keywords go to ``fn``. See ``jobs.api.submit``.
    """
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.jobs.api import submit as _submit

    return _submit(fn, *args, **options)


def sweep(fn: Any, grid: dict, gpus_per_job: int | str = 1, **options: Any) -> list[Job]:
    """One background job per combination of ``grid`` values: ``fn(**point)``; see ``jobs.api.sweep``."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.jobs.api import sweep as _sweep

    return _sweep(fn, grid, gpus_per_job, **options)


def job(name: str) -> Job:
    """The background job called ``name`` (from any kernel): status, logs, metrics, result, kill."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.jobs.api import job as _job

    return _job(name)


def list_jobs() -> list[Job]:
    """Every background job of this user, oldest first."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.jobs.api import list_jobs as _list_jobs

    return _list_jobs()


def select_jobs(names: Any = None, states: Any = None) -> list[Job]:
    """Your jobs (oldest first) whose name matches ``names`` (a name or pattern, ``"A-*"``, or a list of them) and
    whose status is one of ``states`` (``"running,queued"``); None: any. Raises InvalidArgument for an unknown
    state, naming the valid ones."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.jobs.api import select_jobs as _select_jobs

    return _select_jobs(names, states)


def watch_jobs(
    names: Any = None, states: Any = None, *, metric: str = "loss", interval: float = 1.0, history: int = 5000
) -> JobWatch:
    """``%jobs watch``: a live table of the jobs ``names`` and ``states`` choose (as ``select_jobs``; jobs
    submitted later that match join it) with Kill and Logs buttons and why each waits in one line, and every
    job's curve of ``metric`` in one plot; refreshed every ``interval`` seconds. ``close()`` stops it and leaves
    a static copy of its last state where it was shown. Raises InvalidArgument for an unknown state."""
    # lazy: import gpumagic stays a few milliseconds
    from gpumagic.widgets.job_watch import JobWatch as _JobWatch

    return _JobWatch(metric=metric, interval=interval, history=history, names=names, states=states)

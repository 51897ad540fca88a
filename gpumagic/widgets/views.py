"""The public functions that make a view (``gpumagic.status``, ``plot_run``, ``compare``, ``watch_jobs``): each
reads what its floor below owns and returns the view, which displays itself in a notebook."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpumagic.devices.status import gather_status
from gpumagic.run_dirs.store import Run, load_run
from gpumagic.widgets.compare import Comparison
from gpumagic.widgets.job_watch import JobWatch
from gpumagic.widgets.run_plot import RunPlot
from gpumagic.widgets.status_table import StatusTable


def status() -> StatusTable:
    """The ``%gpu status`` table (HTML in a notebook, text in a terminal) of every GPU, its processes and leases,
    and what this kernel sees; its ``.status`` holds the data."""
    return StatusTable(gather_status())


def plot_run(run: Run | str, metrics: list[str] | None = None) -> RunPlot:
    """Plot a run (a ``Run`` or its id): one figure per metric, one curve per rank; displays in a notebook.

    Raises:
        InvalidArgument: no such run, or a metric it did not log (named).
    """
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

    ``runs_or_jobs``: ``Job``s, job names, patterns (``"A-*"``), ``Run``s, run ids or directories of TensorBoard
    runs (each folder of event files a run; ``loss/rank0`` read as ``loss``); None: every job of yours. Runs
    exported to a tracker (``gpumagic.track``) get a ``tracked`` column saying as what.
    ``x``: ``"step"``, ``"elapsed"`` or ``"time"``. ``sort_by``: a column or a metric (its best value).
    Runs that differ only by ``seed`` are drawn as their mean with a ± std band (``group_seeds=False``: not).
    ``.rows`` and ``.curves`` hold the data; ``.refresh()`` reads the runs again.

    Raises:
        InvalidArgument: an unknown run, job, metric or column, or nothing to compare.
    """
    return Comparison(
        runs_or_jobs,
        metrics,
        x,
        sort_by=sort_by,
        descending=descending,
        all_columns=all_columns,
        group_seeds=group_seeds,
    )


def watch_jobs(
    names: str | Iterable[str] | None = None,
    states: str | Iterable[str] | None = None,
    *,
    metric: str = "loss",
    interval: float = 1.0,
    history: int = 5000,
) -> JobWatch:
    """``%jobs watch``: a live table of the jobs ``names`` and ``states`` choose (as ``select_jobs``; jobs
    submitted later that match join it) with Kill and Logs buttons and why each waits in one line, and every
    job's curve of ``metric`` in one plot; refreshed every ``interval`` seconds. ``close()`` stops it and leaves
    a static copy of its last state where it was shown.

    Raises:
        InvalidArgument: an unknown state.
    """
    return JobWatch(metric=metric, interval=interval, history=history, names=names, states=states)

"""The data of a comparison of runs (``gpumagic.compare``, ``%jobs compare``): the runs and jobs read from disk
(and TensorBoard's runs: ``tensorboard_runs``), their hyperparameters, a summary of each metric (last and best
value), their curves, sorting and filtering by any column, and exports (``to_pandas``, ``to_csv``).
``gpumagic.widgets.compare`` draws it.

Everything is read from disk when the comparison is built (``refresh()`` reads again): it works in a new kernel
for jobs that ended long ago, and shows live jobs as far as they have got. Rank 0's metrics stand for a run.
Curves are numpy arrays, summaries columnar operations over them: a thousand runs of a thousand points each are
summarized in milliseconds (benchmarks/compare.py).
"""

from __future__ import annotations

import contextlib
import csv
import fnmatch
import io
import logging
import math
import operator
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumagic.devices.inventory import read_inventory
from gpumagic.errors import InvalidArgument
from gpumagic.jobs import executors
from gpumagic.jobs.api import Job, list_jobs
from gpumagic.jobs.tensorboard_runs import TensorBoardRun, find_runs, read_run
from gpumagic.run_dirs import records
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.store import RankReader, Run, Series, load_run
from gpumagic.telemetry.metric_kinds import higher_is_better
from gpumagic.telemetry.tracking import tracked_summary
from gpumagic.units import as_number, format_duration, plain

_log = logging.getLogger(__name__)

X_AXES = ("step", "elapsed", "time")
SEED_KEY = "seed"
FIXED_COLUMNS = ("name", "status", "duration", "GPUs", "GPU hours")
TRACKED = "tracked"  # what a run was exported as: a column only where one was
MISSING = "–"
OPERATORS = ("<=", ">=", "==", "!=", "<", ">", "=", "~")
COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "=": operator.eq}
COMPARE.update({"==": operator.eq, "!=": operator.ne})
CONDITION = re.compile(r"^\s*(.+?)\s*(<=|>=|==|!=|<|>|=|~)\s*(.*?)\s*$")


@dataclass
class Member:
    """One run or job as read from disk: what its row and curves are made of."""

    name: str
    status: str
    duration: float  # seconds it ran (so far)
    gpus: str
    params: dict[str, Any]
    metrics: dict[str, Any]  # rank 0's {metric: Series}
    path: Path
    gpu_count: int = 0
    tracked: str = ""  # tracked_summary of its run.json
    cache: dict[tuple[str, str], Any] = field(default_factory=dict)

    def array(self, metric: str, column: str) -> Any:
        """A column of a metric's series (``steps``, ``values``, ``times``) as a float array, made once."""
        if (metric, column) not in self.cache:
            # lazy: heavy; `import gpumagic` and %jobs stay free of it
            import numpy

            self.cache[metric, column] = numpy.asarray(getattr(self.metrics[metric], column), dtype=float)
        return self.cache[metric, column]

    def first_time(self) -> float:
        """When it logged its first point (any metric): the 0 of ``x="elapsed"``."""
        return min((s.times[0] for s in self.metrics.values() if len(s)), default=0.0)

    @property
    def gpu_hours(self) -> float:
        return self.duration * self.gpu_count / 3600.0


@dataclass
class Points:
    """One line of one figure: x and y; for a seed group, y is the mean and lower..upper its band."""

    x: list[float]
    value: list[float]
    lower: list[float] | None = None
    upper: list[float] | None = None
    runs: int = 1


@dataclass
class Line:
    """What one legend entry shows: a run, or the mean of a seed group with its band."""

    name: str
    members: list[int]  # indices into the comparison's members
    grouped: bool = False
    points: dict[str, Points] = field(default_factory=dict)  # per metric

    @property
    def label(self) -> str:
        """The legend's words: a seed group's say how many runs it is of, and what its band is."""
        if not self.grouped:
            return self.name
        return f"{self.name} ({len(self.members)} seeds, mean ± std)"


def resolve(selection: Any) -> list[Any]:
    """The jobs (``Job``) and runs (``Run``) ``selection`` names, in its order, each once.

    ``selection``: None (every job of this user), or one or a list of: a ``Job``, a ``Run``, a job name, a job
    name pattern with ``*`` (``"A-*"``), a run id (or its unique prefix), a directory of TensorBoard runs (each
    a ``TensorBoardRun``).

    Raises:
        InvalidArgument: a name that is no job or run, a pattern matching nothing, or nothing to compare.
    """
    if selection is None:
        found: list[Any] = list_jobs()
        if not found:
            raise InvalidArgument("no runs or jobs to compare: you have no background jobs yet (gpumagic.sweep)")
        return found
    if not isinstance(selection, (str, Path, Job, Run, Iterable)):
        raise InvalidArgument(
            f"compare takes jobs, job names, runs or run ids (or a list of them), got {type(selection).__name__}"
        )
    items = [selection] if isinstance(selection, (str, Path, Job, Run)) else list(selection)
    found = []
    for item in items:
        if isinstance(item, Job):
            found.append(item)
        elif isinstance(item, Run):
            found.append(Job(item.path) if item.info.get("kind") == "job" else item)
        elif isinstance(item, (str, Path)):
            found.extend(_named(str(item)))
        else:
            raise InvalidArgument(
                f"compare takes jobs, job names, runs or run ids, got {type(item).__name__} {item!r:.60}"
            )
    unique = list({source.path: source for source in found}.values())
    if not unique:
        raise InvalidArgument("no runs or jobs to compare: name jobs (A-*), runs, or leave it empty for every job")
    return unique


def _named(name: str) -> list[Any]:
    """The jobs a name or pattern means, else the run it names."""
    if any(c in name for c in "*?["):  # never in a job name: a pattern
        paths = []
        for path in records.all_jobs():
            with contextlib.suppress(OSError, ValueError):  # removed meanwhile
                if fnmatch.fnmatchcase(records.read(path).get("name", ""), name):
                    paths.append(path)
        if not paths:
            known = ", ".join(records.names()) or "none yet"
            raise InvalidArgument(f"no job name matches {name!r} (jobs: {known}); %jobs lists them")
        return [Job(p) for p in paths]
    if records.exists(name):
        return [Job(records.find(name))]
    folder = Path(name).is_dir()
    tensorboard = find_runs(name) if folder else []
    if tensorboard:
        return tensorboard
    try:
        run = load_run(name)
    except InvalidArgument:
        raise InvalidArgument(
            f"no job or run named {name!r}; %jobs lists jobs, gpumagic.runs() lists runs; a directory of TensorBoard "
            f"runs holds events.out.tfevents.* files{' (this one holds none)' if folder else ''}"
        ) from None
    return [Job(run.path) if run.info.get("kind") == "job" else run]


def read_member(source: Any) -> Member:
    """A job's or run's row material as it is on disk now (a TensorBoard run's: as it is in its event files)."""
    if isinstance(source, TensorBoardRun):
        read = read_run(source)  # no status in TensorBoard: its points are all there is
        kept = {metric: _forward(series) for metric, series in read.metrics.items() if len(series)}
        return Member(source.name, "finished", read.duration, "-", read.params, kept, source.path)
    if isinstance(source, Job):
        info = source.info
        status, duration, name = executors.status(info), records.elapsed(info), info.get("name") or source.path.name
        # as %jobs shows them (Slurm shapes too)
        gpus = executors.executor_of(info).resources(info) or ("-" if status in ("queued", "cancelled") else "cpu")
        count = _job_gpu_count(info)
    else:
        run = load_run(str(source.path))  # settled: a run whose kernel died reads lost
        info, end, name = run.info, run.end, run.id
        status, duration = end.status, max(0.0, (end.ended or time.time()) - float(info.get("created") or time.time()))
        gpus, count = _run_gpus(info.get("gpus"), status), len(_uuids(info.get("gpus")))
    metrics = RankReader(RunFiles(source.path).metrics, 0).read()  # rank 0 stands for the run
    kept = {metric: _forward(series) for metric, series in metrics.items() if len(series)}
    params = dict(info.get("params") or {})
    return Member(name, status, duration, gpus, params, kept, source.path, count, tracked_summary(info))


def _job_gpu_count(info: dict[str, Any]) -> int:
    """The GPUs a job holds (or held): its NVML indices, or a Slurm allocation's nodes x GPUs per node."""
    if info.get("executor") == "slurm":
        slurm = info.get("slurm") or {}
        per_node = slurm.get("gpus_per_node")
        return int(slurm.get("nodes", 1)) * per_node if isinstance(per_node, int) else 0
    return len(info.get("gpus") or ())


def _forward(series: Any) -> Any:
    """The points of a series whose step is not before an earlier one's (a loop that restarts at step 0 is
    not drawn back to the start): a point stays where its step is at least every step before it."""
    # lazy: heavy; `import gpumagic` and %jobs stay free of it
    import numpy

    steps = numpy.asarray(series.steps, dtype=float)
    if len(steps) < 2 or bool(numpy.all(steps[1:] >= steps[:-1])):
        return series
    before = numpy.maximum.accumulate(numpy.concatenate(([-math.inf], steps[:-1])))
    kept = numpy.flatnonzero(steps >= before).tolist()
    return Series(*([column[i] for i in kept] for column in (series.steps, series.values, series.times)))


def _uuids(gpus: Any) -> list[str]:
    uuids: list[str] = []
    for entry in gpus or ():
        for uuid in entry if isinstance(entry, (list, tuple)) else (entry,):
            if str(uuid) not in uuids:
                uuids.append(str(uuid))
    return uuids


def _run_gpus(gpus: Any, status: str) -> str:
    """A launch's GPUs (its record keeps each rank's GPU UUIDs): their NVML indices where this machine has
    them, else how many; ``cpu`` for CPU ranks."""
    uuids = _uuids(gpus)
    if not uuids:
        return "-" if status in ("queued", "cancelled") else "cpu"
    try:
        index = {gpu.uuid: gpu.nvml_index for gpu in read_inventory().gpus}
    except Exception:  # noqa: BLE001 - no driver here: the count still says something
        _log.debug("the GPU inventory cannot be read; GPUs are counted instead of named", exc_info=True)
        index = {}
    if all(uuid in index for uuid in uuids):
        return ",".join(str(index[uuid]) for uuid in uuids)
    return f"{len(uuids)} GPU{'s' if len(uuids) != 1 else ''}"


def differing_keys(members: Sequence[Member]) -> list[str]:
    """Configuration keys whose values are not the same for every member (missing counts as a value)."""
    return [key for key in all_keys(members) if len({repr(m.params.get(key, MISSING)) for m in members}) > 1]


def all_keys(members: Sequence[Member]) -> list[str]:
    """Every configuration key of any member, in the order they first appear."""
    return list(dict.fromkeys(key for m in members for key in m.params))


def seed_groups(members: Sequence[Member]) -> list[list[int]]:
    """Indices of members with a ``seed`` whose configurations are otherwise the same, two or more together."""
    groups: dict[str, list[int]] = {}
    for index, member in enumerate(members):
        if SEED_KEY in member.params:
            rest = sorted((k, repr(v)) for k, v in member.params.items() if k != SEED_KEY)
            groups.setdefault(repr((_experiment(member), rest)), []).append(index)
    return [indices for indices in groups.values() if len(indices) > 1]


def _experiment(member: Member) -> str:
    """A sweep job's name without its grid values (``A-lr=0.1,seed=1`` -> ``A``): two sweeps with the same
    grid are not one group."""
    name = member.name
    for key in member.params:
        name = re.sub(rf"(^|[-,]){re.escape(key)}=[^,]*", "", name)
    return name


def lines(members: Sequence[Member], group_seeds: bool) -> list[Line]:
    """The lines to draw, in the members' order: a seed group where its first member is."""
    groups = {g[0]: g for g in seed_groups(members)} if group_seeds else {}
    grouped = {i for g in groups.values() for i in g}
    shown = [k for k in differing_keys(members) if k != SEED_KEY]
    found = []
    for index, member in enumerate(members):
        if index in groups:
            config = {k: v for k, v in member.params.items() if k != SEED_KEY}
            named = [k for k in shown if k in config] or list(config)  # what tells it apart, else what it is
            label = ",".join(f"{k}={config[k]}" for k in named) or "seeds"
            found.append(Line(label, groups[index], grouped=True))
        elif index not in grouped:
            found.append(Line(member.name, [index]))
    return found


def xs_of(member: Member, series: Any, x: str) -> list[float]:
    """A series' x values: its steps, seconds since the member's first point, or the wall clock (ms)."""
    if x == "step":
        return list(series.steps)
    if x == "elapsed":
        start = member.first_time()
        return [t - start for t in series.times]
    return [t * 1000.0 for t in series.times]  # a datetime axis counts milliseconds


def group_points(members: Sequence[Member], metric: str, x: str) -> Points | None:
    """The mean over a seed group's runs at each step they all logged, its band (± the sample standard
    deviation) over the runs that logged it, two at least, and x there (the mean of the runs' elapsed time; wall-
    clock time is never grouped: seeds that ran one after another share no time)."""
    # lazy: heavy; `import gpumagic` and %jobs stay free of it
    import numpy

    per_run = []
    for member in members:
        series = member.metrics.get(metric)
        if series is not None:
            xs = xs_of(member, series, x)
            per_run.append({step: (value, at) for step, value, at in zip(series.steps, series.values, xs, strict=True)})
    if not per_run:
        return None
    at_least = min(2, len(per_run))  # a step counts where two runs logged it (a crashed seed cuts nothing short)
    xs_out, mean, lower, upper = [], [], [], []
    for step in sorted({step for points in per_run for step in points}):
        logged = [points[step] for points in per_run if step in points]
        if len(logged) < at_least:
            continue
        values = numpy.array([value for value, _ in logged])
        spread = values.std(ddof=1) if len(values) > 1 else 0.0
        xs_out.append(float(numpy.mean([at for _, at in logged])))
        mean.append(float(values.mean()))
        lower.append(float(values.mean() - spread))
        upper.append(float(values.mean() + spread))
    if not xs_out:
        return None
    return Points(xs_out, mean, lower, upper, len(per_run))


def best_of(metric: str, values: Sequence[float]) -> float:
    """The best finite value of ``values`` (the highest for accuracy-like names, else the lowest); NaN if none."""
    # lazy: heavy; `import gpumagic` and %jobs stay free of it
    import numpy

    array = numpy.asarray(values, dtype=float)
    finite = array[numpy.isfinite(array)]
    if not len(finite):
        return math.nan
    return float(finite.max() if higher_is_better(metric) else finite.min())


def format_number(value: Any) -> str:
    """4 significant digits (``0.1235``, ``1.235e+04``); ``–`` for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def sort_key(value: Any) -> float | str | None:
    """A number where the value is one (``"0.01"`` too), else its text; None for a missing value or NaN."""
    number = None if value is None else as_number(value)
    if number is None:
        return None if value is None else str(value)
    return None if math.isnan(number) else number


def matches(value: Any, op: str, wanted: str) -> bool:
    """Whether ``value`` passes ``op wanted`` (numbers compare as numbers, else as text; ``~``: contains; a number
    is neither less nor more than a text). A missing value passes only ``!=``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return op == "!="
    if op == "~":
        return wanted.lower() in str(value).lower()
    left, right = as_number(value), as_number(wanted)
    if (left is None) != (right is None) and op not in ("=", "==", "!="):
        return False
    pair = (left, right) if left is not None and right is not None else (str(value), wanted)
    return bool(COMPARE[op](*pair))


def parse_condition(text: str) -> tuple[str, str, str]:
    """``"lr <= 0.01"`` -> ``("lr", "<=", "0.01")``. Raises InvalidArgument if it has no operator."""
    found = CONDITION.match(text) if isinstance(text, str) else None
    if found is None or not found.group(1):
        raise InvalidArgument(
            f"a filter is 'COLUMN OP VALUE' with OP one of {' '.join(OPERATORS)} (lr<=0.01, status=finished, "
            f"name~A-), got {text!r}"
        )
    return found.group(1), found.group(2), found.group(3)


class RunComparison:
    """Runs and jobs side by side, as data: ``rows`` (one dict per run, in the table's order: sorted, filtered),
    ``columns`` (the table's), ``shared`` (the hyperparameters every run has with one value), ``curves``
    (``{metric: {label: (xs, ys)}}``, a seed group's ys being its mean) and ``bands`` (``{metric: {label: (xs,
    lower, upper)}}``); ``to_pandas()`` and ``to_csv()`` export it, ``repr`` prints it as text.

    Args: as ``gpumagic.compare``'s (``selection``: what ``resolve`` takes; ``all_columns``: every configuration
    key a column, not only those that differ; ``group_seeds``: seed groups' mean and band in ``curves``, ``bands``).

    Raises InvalidArgument: nothing to compare, an unknown run, job, metric or column, a bad ``x``.
    """

    def __init__(
        self,
        selection: Any = None,
        metrics: str | Sequence[str] | None = None,
        x: str = "step",
        *,
        sort_by: str | None = None,
        descending: bool | None = None,
        all_columns: bool = False,
        group_seeds: bool = True,
    ) -> None:
        check_x(x)
        if isinstance(metrics, str):
            metrics = [metrics]
        if metrics is not None and not all(isinstance(m, str) for m in metrics):
            raise InvalidArgument(f"metrics is a list of metric names, got {metrics!r:.80}")
        self.x = x
        self.wanted = list(metrics) if metrics is not None else None
        self.all_columns = all_columns
        self.group_seeds = group_seeds
        self.sources = resolve(selection)
        self.conditions: list[tuple[str, str, str]] = []
        self._read()
        self.sort_by: str | None = None
        self.descending = False
        self.sort(sort_by, descending)

    def _read(self) -> None:
        here = [(s.path if isinstance(s, TensorBoardRun) else RunFiles(s.path).record).exists() for s in self.sources]
        self.sources = [s for s, kept in zip(self.sources, here, strict=True) if kept]  # a job removed meanwhile
        if not self.sources:
            raise InvalidArgument("no runs or jobs to compare: every one of them has been removed")
        self.members = [read_member(source) for source in self.sources]
        known = sorted({m for member in self.members for m in member.metrics})
        unknown = [m for m in self.wanted or () if m not in known]
        if unknown:
            raise InvalidArgument(
                f"no run here logged {', '.join(map(repr, unknown))}; the metrics are: {', '.join(known) or 'none yet'}"
            )
        self.metrics = self.wanted if self.wanted is not None else known
        self.keys = all_keys(self.members)
        differing = differing_keys(self.members)
        self.shared = {key: self.members[0].params[key] for key in self.keys if key not in differing}
        shown = self.keys if self.all_columns else differing
        self.config_columns = {key: f"{key} (config)" if key in (*FIXED_COLUMNS, TRACKED) else key for key in self.keys}
        self.tracked = any(member.tracked for member in self.members)
        self.columns = [
            *FIXED_COLUMNS,
            *(self.config_columns[key] for key in shown),
            *(f"{metric} {which}" for metric in self.metrics for which in ("last", "best")),
            *([TRACKED] if self.tracked else []),
        ]
        self._unsorted = [self._row(index, member) for index, member in enumerate(self.members)]
        self._curves: Any = None

    def _row(self, index: int, member: Member) -> dict[str, Any]:
        """A run's row: every column, every hyperparameter (a shared one with its value), and ``_member``."""
        row: dict[str, Any] = dict(zip(FIXED_COLUMNS, (member.name, member.status, member.duration), strict=False))
        row.update({"GPUs": member.gpus, "GPU hours": member.gpu_hours, "_member": index})
        for key, column in self.config_columns.items():
            row[column] = member.params.get(key)
        for metric in self.metrics:
            series = member.metrics.get(metric)
            row[f"{metric} last"] = float(series.values[-1]) if series is not None else None
            row[f"{metric} best"] = best_of(metric, member.array(metric, "values")) if series is not None else None
        if self.tracked:
            row[TRACKED] = member.tracked or None
        return row

    def refresh(self) -> None:
        """Read every run again from disk (a live job's new points, its status)."""
        self._read()
        self.sort(self.sort_by if self.sort_by in self.columns else None, self.descending)

    def sort(self, by: str | None, descending: bool | None = None) -> RunComparison:
        """Order the rows by a column or a metric's best value (None: the order given); missing values last.
        Returns the comparison. Raises InvalidArgument for an unknown column or metric, naming the known ones."""
        column = self.column(by, "sort by")
        if descending is None:
            descending = column is not None and column.endswith((" last", " best")) and higher_is_better(column)
        self.sort_by, self.descending = column, bool(descending)
        self._arrange()
        return self

    def filter(self, *conditions: str, **equal: Any) -> RunComparison:
        """Keep the rows that pass every condition (``"lr <= 0.01"``, ``"loss best < 0.3"``, ``"name ~ A-"``:
        contains; operators ``< <= > >= = != ~``) and whose columns named by keywords equal their values
        (``status="finished"``); no argument: every row again. Numbers compare as numbers. Returns the
        comparison. Raises InvalidArgument for a condition without an operator or an unknown column."""
        parsed = [parse_condition(text) for text in conditions]
        parsed += [(key, "=", str(value)) for key, value in equal.items()]
        self.conditions = [(self.column(column, "filter by") or column, op, value) for column, op, value in parsed]
        self._arrange()
        return self

    def _arrange(self) -> None:
        rows = [r for r in self._unsorted if all(matches(r.get(c), op, v) for c, op, v in self.conditions)]
        column = self.sort_by
        if column is not None:
            keys = [sort_key(r.get(column)) for r in rows]
            present = [(key, r) for key, r in zip(keys, rows, strict=True) if key is not None]
            by_number = all(isinstance(key, float) for key, _ in present)
            present.sort(key=lambda item: item[0] if by_number else str(item[0]), reverse=self.descending)
            rows = [r for _, r in present] + [r for key, r in zip(keys, rows, strict=True) if key is None]
        self.rows = rows

    def column(self, by: str | None, what: str = "sort by") -> str | None:
        """The column ``by`` names: a column, a hyperparameter, or a metric (its best value); None for None.
        Raises InvalidArgument for another, naming the known ones."""
        if by is None or by == "":
            return None
        if by in self.columns:
            return by
        if by in self.config_columns:
            return self.config_columns[by]
        if by in self.metrics:
            return f"{by} best"
        metrics = f"; or a metric: {', '.join(self.metrics)}" if self.metrics else ""
        extra = [self.config_columns[k] for k in self.keys if self.config_columns[k] not in self.columns]
        known = ", ".join([*self.columns, *extra])
        raise InvalidArgument(f"cannot {what} {by!r}; {what} a column: {known}{metrics}")

    @property
    def curves(self) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
        """``{metric: {label: (xs, ys)}}``: a curve per run, or per seed group its mean (computed on first use)."""
        return self._curve_data()[0]

    @property
    def bands(self) -> dict[str, dict[str, tuple[list[float], list[float], list[float]]]]:
        """``{metric: {label: (xs, lower, upper)}}``: each seed group's mean ± one standard deviation."""
        return self._curve_data()[1]

    @property
    def lines(self) -> list[Line]:
        """The curves' legend entries, with their points per metric."""
        return self._curve_data()[2]

    def _curve_data(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[Line]]:
        if self._curves is not None:
            return self._curves
        curves: dict[str, dict[str, Any]] = {}
        bands: dict[str, dict[str, Any]] = {}
        found = lines(self.members, self.group_seeds and self.x != "time")  # wall-clock x: never grouped
        for line in found:
            for metric in self.metrics:
                if line.grouped:
                    points = group_points([self.members[i] for i in line.members], metric, self.x)
                else:
                    member = self.members[line.members[0]]
                    series = member.metrics.get(metric)
                    points = None if series is None else Points(xs_of(member, series, self.x), list(series.values))
                if points is None:
                    continue
                line.points[metric] = points
                curves.setdefault(metric, {})[line.label] = (points.x, points.value)
                if points.lower is not None and points.upper is not None:
                    bands.setdefault(metric, {})[line.label] = (points.x, points.lower, points.upper)
        self._curves = curves, bands, found
        return self._curves

    def switch_x(self, x: str) -> None:
        """Use another x axis (``step``, ``elapsed``, ``time``) for the curves. Raises InvalidArgument for another."""
        check_x(x)
        self.x = x
        self._curves = None

    def arrays(self, metric: str, row: dict[str, Any]) -> tuple[Any, Any] | None:
        """The x and y (numpy float arrays) of one row's run for ``metric``, None where it logged none."""
        member = self.members[row["_member"]]
        if metric not in member.metrics:
            return None
        values = member.array(metric, "values")
        if self.x == "step":
            return member.array(metric, "steps"), values
        times = member.array(metric, "times")
        return (times - member.first_time(), values) if self.x == "elapsed" else (times * 1000.0, values)

    def export_columns(self) -> list[str]:
        """The columns of ``to_pandas`` and ``to_csv``."""
        keys = [k for k in self.keys if k != SEED_KEY]
        named = [f"{m}_{which}" for m in self.metrics for which in ("best", "last")]
        tracked = [TRACKED] if self.tracked else []  # only where a run was exported: as before otherwise
        return ["name", "status", *keys, SEED_KEY, "duration_s", "gpu_hours", "gpus", *named, *tracked]

    def records(self) -> list[dict[str, Any]]:
        """One dict per row (in the table's order) with the ``export_columns``: every hyperparameter (numbers as
        numbers), seed, status, duration_s, gpu_hours, and each metric's best and last value."""
        found = []
        for row in self.rows:
            member = self.members[row["_member"]]
            record = {"name": row["name"], "status": row["status"], **{k: None for k in self.keys}, SEED_KEY: None}
            record.update({key: plain(value) for key, value in member.params.items()})
            record.update(duration_s=member.duration, gpu_hours=member.gpu_hours, gpus=member.gpus)
            record.update({f"{m}_{w}": row[f"{m} {w}"] for m in self.metrics for w in ("best", "last")})
            record.update({TRACKED: row[TRACKED]} if self.tracked else {})
            found.append(record)
        return found

    def to_pandas(self) -> Any:
        """A pandas DataFrame of ``records()``: one row per run (as the table shows them: sorted, filtered).
        Raises ImportError where pandas is not installed (``pip install pandas``)."""
        # lazy: heavy; `import gpumagic` and %jobs stay free of it
        import pandas

        return pandas.DataFrame(self.records(), columns=self.export_columns())

    def to_csv(self, path: str | Path | None = None) -> str:
        """The ``records()`` as CSV (a header, then a row per run, numbers in full); written to ``path`` when
        given. Returns the text."""
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=self.export_columns(), lineterminator="\n")
        writer.writeheader()
        missing = (None, math.nan)
        writer.writerows({k: "" if v in missing or v != v else v for k, v in r.items()} for r in self.records())
        text = out.getvalue()
        if path is not None:
            Path(path).write_text(text)
        return text

    def cells(self, row: dict[str, Any]) -> list[str]:
        """A row's cells as the table shows them."""

        def cell(column: str, value: Any) -> str:
            if column == "duration":
                return MISSING if value is None else format_duration(value)
            return (f"{value:.3g}" if value else "0") if column == "GPU hours" else format_number(value)

        return [cell(column, row.get(column)) for column in self.columns]

    def numeric(self, column: str) -> bool:
        """Whether a column holds numbers (aligned right)."""
        if column in ("duration", "GPU hours") or column.endswith((" last", " best")):
            return True
        if column in FIXED_COLUMNS:
            return False
        values = [r[column] for r in self._unsorted if r.get(column) is not None]
        return bool(values) and all(as_number(v) is not None for v in values)

    def notes(self) -> list[str]:
        """The lines under the table: the sort, the filter, the shared hyperparameters, the seed groups."""
        found = []
        if self.sort_by:
            found.append(f"sorted by {self.sort_by} ({'descending' if self.descending else 'ascending'})")
        if self.conditions:
            shown = ", ".join(f"{c}{op}{v}" for c, op, v in self.conditions)
            found.append(f"filtered by {shown}: {len(self.rows)} of {len(self.members)} runs")
        hidden = {k: v for k, v in self.shared.items() if self.config_columns[k] not in self.columns}
        if hidden:
            found.append("same in every run: " + ", ".join(f"{k}={format_number(v)}" for k, v in hidden.items()))
        groups = [line.label for line in lines(self.members, self.group_seeds and self.x != "time") if line.grouped]
        if groups:
            more = f" … ({len(groups)} groups)" if len(groups) > 4 else ""
            found.append(f"seed groups: {', '.join(groups[:4])}{more}")
        return found

    def __repr__(self) -> str:
        table = [list(self.columns)] + [self.cells(r) for r in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(self.columns))]
        right = [self.numeric(c) for c in self.columns]
        text = []
        for line in table:
            cells = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(line, widths, right, strict=True)]
            text.append("  ".join(cells).rstrip())
        return "\n".join(text + self.notes())

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


def check_x(x: Any) -> None:
    """Raises InvalidArgument unless ``x`` is one of ``X_AXES``."""
    if x not in X_AXES:
        raise InvalidArgument(
            f"x is one of step, elapsed (seconds since each run's first point) or time (wall clock), got {x!r}"
        )

"""Runs and jobs side by side (``gpumagic.compare``, ``%jobs compare``): a table with one row per run (status,
duration, GPUs, the configuration that differs, each metric's last and best value) and one figure per metric
with a curve per run on shared axes. Runs that differ only by their ``seed`` are drawn as one mean curve with
a band of ± one standard deviation.

Everything is read from disk when the comparison is built (``refresh()`` reads again): it works in a new kernel
for jobs that ended long ago, and shows live jobs as far as they have got. Rank 0's metrics stand for a run.
"""

from __future__ import annotations

import contextlib
import fnmatch
import html
import math
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumagic.errors import InvalidArgument
from gpumagic.widgets.plots import Forward, close_tree, higher_is_better, loss_like

X_AXES = ("step", "elapsed", "time")
SEED_KEY = "seed"
FIXED_COLUMNS = ("name", "status", "duration", "GPUs")
MISSING = "–"
PLOT_HEIGHT = 260
BAND_ALPHA = 0.18
CELL_PADDING = "padding:1px 8px"  # a widget's HTML gets none of the notebook's table style


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

    def first_time(self) -> float:
        """When it logged its first point (any metric): the 0 of ``x="elapsed"``."""
        return min((s.times[0] for s in self.metrics.values() if len(s)), default=0.0)


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
    name pattern with ``*`` (``"A-*"``), a run id (or its unique prefix).

    Raises:
        InvalidArgument: a name that is no job or run, a pattern matching nothing, or nothing to compare.
    """
    from gpumagic.jobs.api import Job, list_jobs
    from gpumagic.telemetry.store import Run

    if selection is None:
        found: list[Any] = list_jobs()
        if not found:
            raise InvalidArgument("no runs or jobs to compare: you have no background jobs yet (gpumagic.sweep)")
        return found
    items = [selection] if isinstance(selection, (str, Path, Job, Run)) else list(_iterable(selection))
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


def _iterable(selection: Any) -> Iterable[Any]:
    if isinstance(selection, Iterable):
        return selection
    raise InvalidArgument(
        f"compare takes jobs, job names, runs or run ids (or a list of them), got {type(selection).__name__}"
    )


def _named(name: str) -> list[Any]:
    """The jobs a name or pattern means, else the run it names."""
    from gpumagic.jobs import records
    from gpumagic.jobs.api import Job
    from gpumagic.telemetry.store import load_run

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
    try:
        run = load_run(name)
    except InvalidArgument:
        raise InvalidArgument(f"no job or run named {name!r}; %jobs lists jobs, gpumagic.runs() lists runs") from None
    return [Job(run.path) if run.info.get("kind") == "job" else run]


def read_member(source: Any) -> Member:
    """A job's or run's row material as it is on disk now."""
    from gpumagic.jobs import executors, records
    from gpumagic.jobs.api import Job
    from gpumagic.telemetry.run_files import RunFiles
    from gpumagic.telemetry.store import RankReader, load_run

    if isinstance(source, Job):
        from gpumagic.widgets.job_table import job_row

        info = source.info
        status = executors.status(info)
        duration = records.elapsed(info)
        name = info.get("name") or source.path.name
        gpus = job_row(source, info, {}).gpus  # as %jobs shows them (Slurm shapes too)
    else:
        run = load_run(str(source.path))  # settled: a run whose kernel died reads lost
        info, status = run.info, run.status
        duration = max(0.0, (info.get("ended") or time.time()) - float(info.get("created") or time.time()))
        name = run.id
        gpus = _run_gpus(info.get("gpus"), status)
    metrics = RankReader(RunFiles(source.path).metrics, 0).read()  # rank 0 stands for the run
    return Member(
        name=name,
        status=status,
        duration=duration,
        gpus=gpus,
        params=dict(info.get("params") or {}),
        metrics={metric: _forward(series) for metric, series in metrics.items() if len(series)},
        path=source.path,
    )


def _forward(series: Any) -> Any:
    """The points of a series whose step is not before an earlier one's (a loop that restarts at step 0 is
    not drawn back to the start)."""
    kept = Forward().keep(series.steps)
    if len(kept) == len(series):
        return series
    from gpumagic.telemetry.store import Series

    return Series(*([column[i] for i in kept] for column in (series.steps, series.values, series.times)))


def _run_gpus(gpus: Any, status: str) -> str:
    """A launch's GPUs (its record keeps each rank's GPU UUIDs): their NVML indices where this machine has
    them, else how many; ``cpu`` for CPU ranks."""
    uuids: list[str] = []
    for entry in gpus or ():
        for uuid in entry if isinstance(entry, (list, tuple)) else (entry,):
            if str(uuid) not in uuids:
                uuids.append(str(uuid))
    if not uuids:
        return "-" if status in ("queued", "cancelled") else "cpu"
    try:
        from gpumagic.devices.inventory import read_inventory

        index = {gpu.uuid: gpu.nvml_index for gpu in read_inventory().gpus}
    except Exception:  # noqa: BLE001 - no driver here: the count still says something
        index = {}
    if all(uuid in index for uuid in uuids):
        return ",".join(str(index[uuid]) for uuid in uuids)
    return f"{len(uuids)} GPU{'s' if len(uuids) != 1 else ''}"


def differing_keys(members: Sequence[Member]) -> list[str]:
    """Configuration keys whose values are not the same for every member (missing counts as a value)."""
    return [key for key in _all_keys(members) if len({repr(m.params.get(key, MISSING)) for m in members}) > 1]


def _all_keys(members: Sequence[Member]) -> list[str]:
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


def _lines(members: Sequence[Member], group_seeds: bool) -> list[Line]:
    """The lines to draw, in the members' order: a seed group where its first member is."""
    groups = {g[0]: g for g in seed_groups(members)} if group_seeds else {}
    grouped = {i for g in groups.values() for i in g}
    shown = [k for k in differing_keys(members) if k != SEED_KEY]
    lines = []
    for index, member in enumerate(members):
        if index in groups:
            config = {k: v for k, v in member.params.items() if k != SEED_KEY}
            named = [k for k in shown if k in config] or list(config)  # what tells it apart, else what it is
            label = ",".join(f"{k}={config[k]}" for k in named) or "seeds"
            lines.append(Line(label, groups[index], grouped=True))
        elif index not in grouped:
            lines.append(Line(member.name, [index]))
    return lines


def _xs(member: Member, series: Any, x: str) -> list[float]:
    if x == "step":
        return list(series.steps)
    if x == "elapsed":
        start = member.first_time()
        return [t - start for t in series.times]
    return [t * 1000.0 for t in series.times]  # a datetime axis counts milliseconds


def _group_points(members: Sequence[Member], metric: str, x: str) -> Points | None:
    """The mean over a seed group's runs at each step they all logged, its band (± the sample standard
    deviation) over the runs that logged it, two at least, and x there (the mean of the runs' elapsed time; wall-
    clock time is never grouped: seeds that ran one after another share no time)."""
    import numpy

    per_run = []
    for member in members:
        series = member.metrics.get(metric)
        if series is not None:
            xs = _xs(member, series, x)
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


def _best(metric: str, values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan
    return max(finite) if higher_is_better(metric) else min(finite)


def format_number(value: Any) -> str:
    """4 significant digits (``0.1235``, ``1.235e+04``); ``–`` for a missing value."""
    if value is None:
        return MISSING
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _sort_key(value: Any) -> float | str | None:
    """A number where the value is one (``"0.01"`` too), else its text; None for a missing value or NaN."""
    if value is None:
        return None
    number = _number(value)
    if number is None:
        return str(value)
    return None if math.isnan(number) else number


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value))
    except ValueError:
        return None


class Comparison:
    """Runs and jobs side by side: ``rows`` (one dict per run, in the table's order), ``curves`` (``{metric:
    {label: (xs, ys)}}``, a seed group's ys being its mean) and ``bands`` (``{metric: {label: (xs, lower,
    upper)}}``); ``widget`` shows them in a notebook (x axis and sort controls, the table, the figures), and
    ``repr`` as text in a terminal.

    Args:
        selection: what to compare (see ``resolve``); None: every job of this user.
        metrics: the metrics to show (default: every metric any run logged).
        x: ``"step"``, ``"elapsed"`` (seconds since each run's first point) or ``"time"`` (wall clock).
        sort_by: a column (``"lr"``, ``"duration"``, ``"loss last"``) or a metric (its best value).
        descending: the sort's direction; None: best first for a metric's values, ascending for the rest.
        all_columns: show every configuration key, not only those that differ between the runs.
        group_seeds: draw runs that differ only by their ``seed`` as one mean curve with a ± std band.

    Raises:
        InvalidArgument: nothing to compare, an unknown run, job, metric or column, a bad ``x``.
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
        self._check_x(x)
        if isinstance(metrics, str):
            metrics = [metrics]
        if metrics is not None and not all(isinstance(m, str) for m in metrics):
            raise InvalidArgument(f"metrics is a list of metric names, got {metrics!r:.80}")
        self.x = x
        self.wanted = list(metrics) if metrics is not None else None
        self.all_columns = all_columns
        self.group_seeds = group_seeds
        self.sources = resolve(selection)
        self._widget: Any = None
        self._read()
        self.sort_by: str | None = None
        self.descending = False
        self.sort(sort_by, descending)

    # data

    def _read(self) -> None:
        from gpumagic.telemetry.run_files import RunFiles

        self.sources = [s for s in self.sources if RunFiles(s.path).record.exists()]  # a job removed meanwhile
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
        keys = _all_keys(self.members) if self.all_columns else differing_keys(self.members)
        self.config_columns = {key: f"{key} (config)" if key in FIXED_COLUMNS else key for key in keys}
        self.columns = [
            *FIXED_COLUMNS,
            *self.config_columns.values(),
            *(f"{metric} {which}" for metric in self.metrics for which in ("last", "best")),
        ]
        self._unsorted = [self._row(member) for member in self.members]
        self._compute_curves()

    def _row(self, member: Member) -> dict[str, Any]:
        row: dict[str, Any] = {
            "name": member.name,
            "status": member.status,
            "duration": member.duration,
            "GPUs": member.gpus,
        }
        for key, column in self.config_columns.items():
            row[column] = member.params.get(key)
        for metric in self.metrics:
            series = member.metrics.get(metric)
            row[f"{metric} last"] = series.values[-1] if series is not None else None
            row[f"{metric} best"] = _best(metric, series.values) if series is not None else None
        return row

    def _compute_curves(self) -> None:
        self.curves: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
        self.bands: dict[str, dict[str, tuple[list[float], list[float], list[float]]]] = {}
        self._lines = _lines(self.members, self.group_seeds and self.x != "time")  # wall-clock x: never grouped
        for line in self._lines:
            line.points = {}
            for metric in self.metrics:
                if line.grouped:
                    points = _group_points([self.members[i] for i in line.members], metric, self.x)
                else:
                    member = self.members[line.members[0]]
                    series = member.metrics.get(metric)
                    points = None if series is None else Points(_xs(member, series, self.x), list(series.values))
                if points is None:
                    continue
                line.points[metric] = points
                label = line.label
                self.curves.setdefault(metric, {})[label] = (points.x, points.value)
                if points.lower is not None and points.upper is not None:
                    self.bands.setdefault(metric, {})[label] = (points.x, points.lower, points.upper)

    def refresh(self) -> None:
        """Read every run again from disk (a live job's new points, its status) and redraw."""
        self._read()
        self.sort(self.sort_by if self.sort_by in self.columns else None, self.descending)
        if self._widget is not None:
            if tuple(self._sort_menu.options) != self._sort_options():  # a metric logged since
                self._quiet = True
                try:
                    self._sort_menu.options = self._sort_options()
                    self._sort_menu.value = self.sort_by or ""
                finally:
                    self._quiet = False
            self._show_plots()

    # sorting

    def sort(self, by: str | None, descending: bool | None = None) -> None:
        """Order the rows by a column or a metric's best value (None: the order given); missing values last.

        Raises:
            InvalidArgument: no such column or metric.
        """
        column = self._column(by)
        if descending is None:
            descending = column is not None and column.endswith((" last", " best")) and higher_is_better(column)
        self.sort_by, self.descending = column, bool(descending)
        rows = list(self._unsorted)
        if column is not None:
            keys = [_sort_key(r.get(column)) for r in rows]
            present = [(key, r) for key, r in zip(keys, rows, strict=True) if key is not None]
            by_number = all(isinstance(key, float) for key, _ in present)
            present.sort(key=lambda item: item[0] if by_number else str(item[0]), reverse=self.descending)
            rows = [r for _, r in present] + [r for key, r in zip(keys, rows, strict=True) if key is None]
        self.rows = rows
        if self._widget is not None:
            self._table.value = self._repr_html_()

    def _column(self, by: str | None) -> str | None:
        if by is None or by == "":
            return None
        if by in self.columns:
            return by
        if by in self.metrics:
            return f"{by} best"
        metrics = f"; or a metric: {', '.join(self.metrics)}" if self.metrics else ""
        raise InvalidArgument(f"cannot sort by {by!r}; sort by a column: {', '.join(self.columns)}{metrics}")

    # rendering

    def _cells(self, row: dict[str, Any]) -> list[str]:
        cells = []
        for column in self.columns:
            value = row.get(column)
            cells.append(format_duration_cell(value) if column == "duration" else format_number(value))
        return cells

    def _numeric(self, column: str) -> bool:
        if column == "duration" or column.endswith((" last", " best")):
            return True
        if column in FIXED_COLUMNS:
            return False
        values = [r[column] for r in self.rows if r.get(column) is not None]
        return bool(values) and all(_number(v) is not None for v in values)

    def __repr__(self) -> str:
        table = [list(self.columns)] + [self._cells(r) for r in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(self.columns))]
        right = [self._numeric(c) for c in self.columns]
        lines = []
        for line in table:
            cells = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(line, widths, right, strict=True)]
            lines.append("  ".join(cells).rstrip())
        notes = (
            [f"sorted by {self.sort_by} ({'descending' if self.descending else 'ascending'})"] if self.sort_by else []
        )
        groups = [c for metric in self.bands.values() for c in metric]
        if groups:
            notes.append(f"seed groups: {', '.join(dict.fromkeys(groups))}")
        return "\n".join(lines + notes)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        from gpumagic.widgets.job_table import STATUS_COLOURS

        right = {c: self._numeric(c) for c in self.columns}
        head = []
        for column in self.columns:
            arrow = (" ▼" if self.descending else " ▲") if column == self.sort_by else ""
            title = ""
            if column.endswith(" best"):
                title = f" title='{'highest' if higher_is_better(column) else 'lowest'} value logged'"
            align = "right" if right[column] else "left"
            head.append(f"<th style='text-align:{align};{CELL_PADDING}'{title}>{html.escape(column)}{arrow}</th>")
        body = []
        for row in self.rows:
            cells = []
            for column, text in zip(self.columns, self._cells(row), strict=True):
                shown = html.escape(text)
                if column == "status":
                    shown = f"<b style='color:{STATUS_COLOURS.get(text, 'inherit')}'>{shown}</b>"
                align = "right" if right[column] else "left"
                cells.append(f"<td style='text-align:{align};{CELL_PADDING}'>{shown}</td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        return (
            f"<table class='gpumagic-compare'><thead><tr>{''.join(head)}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>"
        )

    # the notebook view

    @property
    def widget(self) -> Any:
        """The notebook view (built on first use): x axis and sort controls, the table, the figures."""
        if self._widget is None:
            self._widget = self._build_widget()
        return self._widget

    def _build_widget(self) -> Any:
        import ipywidgets

        self._x_buttons = ipywidgets.ToggleButtons(options=list(X_AXES), value=self.x, description="x")
        self._x_buttons.style.button_width = "5.5em"
        self._quiet = False  # True while the controls are set from here: their observers do nothing
        self._sort_menu = ipywidgets.Dropdown(
            options=self._sort_options(), value=self.sort_by or "", description="sort by"
        )
        self._descending_box = ipywidgets.Checkbox(value=self.descending, description="descending", indent=False)
        refresh = ipywidgets.Button(description="Refresh", tooltip="read the runs again from disk")
        self._x_buttons.observe(lambda change: self._switch_x(change["new"]), names="value")
        self._sort_menu.observe(lambda change: self._resort(change["new"], None), names="value")
        self._descending_box.observe(lambda change: self._resort(self._sort_menu.value, change["new"]), names="value")
        refresh.on_click(lambda _: self.refresh())
        self._table = ipywidgets.HTML(self._repr_html_())
        self._plots = ipywidgets.VBox([])
        self._model: Any = None
        self._layout: Any = None
        controls = ipywidgets.HBox([self._x_buttons, self._sort_menu, self._descending_box, refresh])
        widget = ipywidgets.VBox([controls, self._table, self._plots])
        self._widget = widget
        self._show_plots()
        return widget

    def _sort_options(self) -> tuple[tuple[str, str], ...]:
        return (("order given", ""), *((c, c) for c in self.columns))

    def _switch_x(self, x: str) -> None:
        self._check_x(x)
        self.x = x
        self._compute_curves()
        self._show_plots()

    def _resort(self, by: str, descending: bool | None) -> None:
        if self._quiet:
            return
        self.sort(by or None, descending)
        self._quiet = True
        try:
            self._descending_box.value = self.descending  # a new column starts in its natural direction
        finally:
            self._quiet = False

    def _show_plots(self) -> None:
        import ipywidgets

        from gpumagic.widgets.plots import live_model

        old = self._model, self._layout
        self._layout = self.layout()
        self._model = None if self._layout is None else live_model(self._layout, threading.RLock())
        self._plots.children = [self._model or ipywidgets.HTML("<i>no metrics logged yet</i>")]
        _close_plots(*old)

    def layout(self) -> Any:
        """The bokeh layout of the figures (one per metric; a linear and a log-y tab for loss-like ones), or None
        when no run has logged anything."""
        from bokeh.layouts import column

        from gpumagic.widgets.plots import PALETTE, log_tabs, styled_figure

        self.figures: dict[str, Any] = {}
        blocks = []
        options: dict[str, Any] = {"x_label": {"step": "step", "elapsed": "elapsed", "time": "time"}[self.x]}
        if self.x == "elapsed":
            options["elapsed_x"] = True
        elif self.x == "time":
            options["x_axis_type"] = "datetime"
        for metric in self.metrics:
            if loss_like(metric):
                block, linear, log = log_tabs(metric, PLOT_HEIGHT, **options)
                plots = [linear, log]
            else:
                block = linear = styled_figure(metric, PLOT_HEIGHT, **options)
                plots = [linear]
            for plot in plots:
                _hover(plot, self.x)
            for number, line in enumerate(self._lines):
                points = line.points.get(metric)
                if points is not None:
                    _draw(plots, line.label, PALETTE[number % len(PALETTE)], points)
            self.figures[metric] = linear
            blocks.append(block)
        return column(*blocks, sizing_mode="stretch_width") if blocks else None

    def _ipython_display_(self) -> None:
        from gpumagic.launch.output import in_kernel
        from gpumagic.widgets.plots import display_live

        if not in_kernel():
            print(repr(self))
            return
        display_live(self.widget, text=repr(self))

    def close(self) -> None:
        """Close the notebook view's widgets, the plots' included (a later ``widget`` builds a new view)."""
        if self._widget is not None:
            _close_plots(self._model, self._layout)
            self._model = self._layout = None
            close_tree(self._widget)
            self._widget = None

    @staticmethod
    def _check_x(x: Any) -> None:
        if x not in X_AXES:
            raise InvalidArgument(
                f"x is one of step, elapsed (seconds since each run's first point) or time (wall clock), got {x!r}"
            )


def _close_plots(model: Any, layout: Any) -> None:
    """Close the widget showing ``layout`` and free its bokeh document (so that closing it again is a no-op)."""
    if model is not None:
        model.close()
    if layout is not None and layout.document is not None:
        layout.document.remove_root(layout)


def format_duration_cell(seconds: Any) -> str:
    from gpumagic.units import format_duration

    return MISSING if seconds is None else format_duration(seconds)


def _hover(plot: Any, x: str) -> None:
    """Values under the mouse; wall-clock x shown as a date and time."""
    from gpumagic.widgets.plots import hover

    if x != "time":
        hover(plot, x, elapsed=x == "elapsed")
        return
    from bokeh.models import HoverTool

    plot.add_tools(
        HoverTool(
            tooltips=[("", "$name"), ("time", "$snap_x{%F %T}"), ("value", "$snap_y{0,0.[0000]}")],
            formatters={"$snap_x": "datetime"},
            line_policy="nearest",
        )
    )


def _draw(plots: list[Any], label: str, color: str, points: Points) -> None:
    """One line on each of ``plots``: smoothed over the faint raw one, over its band for a seed group."""
    from bokeh.models import ColumnDataSource

    from gpumagic.widgets.plots import Smoother, curve

    columns = {"x": points.x, "value": points.value, "smooth": Smoother().feed(points.value)}
    if points.lower is not None:
        columns.update(lower=points.lower, upper=points.upper)
    source = ColumnDataSource(columns)
    for plot in plots:
        if points.lower is not None:
            plot.varea(
                x="x",
                y1="lower",
                y2="upper",
                source=source,
                fill_color=color,
                fill_alpha=BAND_ALPHA,
                legend_label=label,
            )
        curve(plot, source, "x", "value", label=label, color=color, smooth="smooth")

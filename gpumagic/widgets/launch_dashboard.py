"""The dashboard under a ``%%launch_ddp`` cell: a status line (ranks alive, step rate, elapsed), a curve per
rank for every metric the ranks ``gpumagic.log`` (smoothed over the faint raw points; a tab with log y for a loss),
and beside them, small, each rank's resources: its GPU's memory and utilization, or on a CPU-only machine its
process's resident memory and CPU use.

It updates from its own thread while the cell blocks (the kernel's event loop cannot run then): one sampler
thread tails the run's metric files and samples the rank processes, and is the only writer of the bokeh
document, under the plots' lock, which a page that connects later takes to read the plots whole; each source
gets at most one stream per push, and only points at a step after its last one.

Its cost does not grow with a session (a ``%ddp`` group's dashboard lives for hundreds of cells): each source
holds at most ``history`` points (``stream_within``: the whole curve, its older part thinned), the cells'
marks are rows of one source every metric plot shares (the latest ``MARKS``) rather than models per cell, and
while nothing changes (no new metric bytes, no mark, no busy rank) its thread reads two file sizes and a few
``/proc`` entries per push and sends nothing: a rank's resources are drawn again when it works again.
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.processes import is_running
from gpumagic.launch.kernel_side.output import in_kernel
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.store import RankReader
from gpumagic.telemetry.log import TOTAL_STEPS
from gpumagic.telemetry.metric_kinds import lower_is_better
from gpumagic.telemetry.tracking import tracked_summary
from gpumagic.units import MIB
from gpumagic.widgets.live import LiveFrame, close_tree, embedded, live_model, unsynced
from gpumagic.widgets.plots import (
    MUTED,
    PALETTE,
    Smoothing,
    SteadySpan,
    StepCurve,
    curve,
    forward_only,
    hover,
    log_tabs,
    stream_within,
    styled_figure,
)

_log = logging.getLogger(__name__)
RESOURCE_WIDTH, RESOURCE_HEIGHT = 300, 130  # each resource plot beside the metrics, px
MARKS = 500  # cells marked on the metric plots: the latest ones
RESOURCE_INTERVAL = 0.5  # s at least between samples of the ranks' resources, whatever the push interval
IDLE_BUSY = 5.0  # % of a CPU (or of a GPU) under which a rank idles: 2 clock ticks (20 ms) in 0.5 s read as 4 %
IDLE_MEMORY = 1.0  # MiB a rank's memory moves by before it is drawn again
RATE_WINDOW = 10.0  # s of rank 0's latest points the step rate is measured over
TRACKED_READ_S = 2.0  # s between reads of what the run is exported as


class LaunchDashboard:
    """Create it before the launch, ``attach`` the run when the ranks start (it shows itself then, so a launch
    refused before any rank started shows nothing), ``finish`` when they end.

    Light on a launch: until the ranks have run ``live_after`` seconds it is a status line; then its thread
    builds the live plots (a bokeh widget) under it. ``stoppable`` (``--no-wait``) adds a Stop button.
    Finished, it turns into a static copy of its last state, curves included, and closes its widgets: a
    notebook that launches hundreds of times keeps no live widget per launch. ``history``: the most points a
    curve or a rank's resources hold; past that their older part is thinned, so the whole run stays drawn.
    """

    def __init__(
        self,
        history: int = 2000,
        push_interval: float = 0.5,
        *,
        stoppable: bool = False,
        live_after: float = 0.5,
        title: str = "%%launch_ddp",
    ) -> None:
        self.title = title  # what the status line is about: a launch, or a persistent group (%ddp)
        self.nprocs = 0
        self.history = history
        self.push_interval = push_interval
        self.stoppable = stoppable
        self.live_after = live_after
        self.started = time.monotonic()
        self.run_dir: Path | None = None
        self._remote_usage: dict[int, int] = {}
        self._attached_epoch = 0.0
        self.pids: list[int | None] = []
        self.gpu_uuids: list[str] = []
        self.use_gpus = False
        self.state = "starting"
        self.points = 0
        self.cancel = threading.Event()
        self.metric_sources: dict[tuple[str, int], Any] = {}
        self.metric_figures: dict[str, list[Any]] = {}  # metric -> its figures (linear, and log for a loss)
        self.resource_sources: dict[int, Any] = {}
        self.resource_figures: tuple[Any, ...] = ()
        self.layout: Any = None
        self._metrics_column: Any = None
        self._spans: dict[str, SteadySpan] = {}
        self._curves: dict[tuple[str, int], StepCurve] = {}
        self._hovers: dict[int, Any] = {}  # id(metric figure) -> its hover tool
        self._plots_lock = threading.RLock()
        self.plots: Any = None
        self.status: Any = None
        self.stop_button: Any = None
        self.widget: Any = None
        self.snapshot = ""  # the static copy it turns into when finished (HTML)
        self._shown = False
        self._concluded = False
        self._frame: LiveFrame | None = None  # where it shows, in a kernel
        self._note = ""
        self._tracked, self._tracked_read = "", 0.0  # what the run is exported as (gpumagic.track), when read
        self._figures_html = ""  # the static copy's plots
        self.total_steps: float | None = None  # what the ranks said they will run (gpumagic.log(total_steps=))
        self._pace: dict[str, str] = {}  # "metric": the one whose rank-0 points pace the step rate
        self._rank0_points: deque[tuple[float, float]] = deque(maxlen=history)  # (time, step), rank 0's latest
        self._pending_marks: deque[tuple[str, float]] = deque()  # cells started, not drawn yet: (label, time)
        self.cell_marks: deque[tuple[str, float]] = deque(maxlen=MARKS)  # (label, step) on every metric plot
        self.marks: Any = None  # the cells' marks, a source every metric plot draws
        self._readers: list[Any] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._processes: dict[int, Any] = {}
        self._samples: dict[int, dict[str, list[float]]] = {}  # resources sampled before the plots exist
        self._drawn: dict[int, tuple[float, float]] = {}  # each rank's last (memory, busy) drawn
        self._held: dict[int, dict[str, list[float]]] = {}  # an idle rank's latest sample, not drawn (yet)
        self._changed = time.time()  # when something was last drawn
        self._idle_since: float | None = None  # when nothing changed any more (time.time()), while it lasts
        self._sampled = -RESOURCE_INTERVAL  # when the ranks' resources were last sampled (since attached)
        self._moved = False  # metrics drawn since that sample
        self._attached = self.started  # when the ranks started: the 0 of the resource plots' time

    def show(self) -> None:
        """Display the status line now (with the Stop button if ``stoppable``); the plots join it later."""

        if self._shown:
            return
        self._shown = True
        self._make_widget()
        if not in_kernel():  # a script, a test: nowhere to show it
            return
        self._frame = LiveFrame(
            self.widget, text=f"{self.title} dashboard", plots=lambda: self.plots, status=self._status_html
        )
        self._frame.show()

    def attach(
        self,
        run_dir: Path,
        pids: list[int | None],
        *,
        rank_gpus: Sequence[Sequence[str]] = (),
        use_gpus: bool = False,
    ) -> None:
        """The ranks started: follow the run's metrics and their processes until ``finish`` (a pid ``None``: a
        rank on another node, its metrics only; ``rank_gpus``: each rank's GPU UUIDs)."""
        self.run_dir = Path(run_dir)
        self._attached = time.monotonic()
        self.pids = list(pids)
        self.nprocs = len(pids)
        self.use_gpus = use_gpus
        self.gpu_uuids = [gpus[0] if gpus else "" for gpus in rank_gpus]
        self.state = "running"
        self.show()
        metrics = RunFiles(self.run_dir).metrics
        self._readers = [RankReader(metrics, rank) for rank in range(self.nprocs)]
        self._processes = _rank_processes(self.pids)
        # the ranks on other nodes: their agents sample them into the run directory (bytes read so far)
        self._remote_usage = {rank: 0 for rank, pid in enumerate(self.pids) if pid is None}
        self._attached_epoch = time.time()
        try:  # a dashboard hiccup must never break the launch
            self._push_resources(self._processes)  # now, while the ranks surely live: a launch of 0.1 s has one
        except Exception:  # noqa: BLE001
            _log.debug("the dashboard's first look at the ranks failed; the loop looks again", exc_info=True)
        self._thread = threading.Thread(target=self._loop, name="gpumagic-launch-dashboard", daemon=True)
        self._thread.start()

    def follow(self, pids: list[int | None]) -> None:
        """The ranks' processes changed (a persistent group replaced a dead rank): sample these from now on."""
        if list(pids) != self.pids:
            self.pids = list(pids)
            self._processes = _rank_processes(self.pids)

    def finish(self, state: str) -> None:
        """The launch ended (``finished``, ``failed``, ``interrupted``). Returns at once: the dashboard's thread
        makes a last update, then turns the dashboard into a static copy of itself and closes its widgets
        (``join`` waits for that)."""
        self.state = state
        self._stop.set()
        if self._thread is None or not self._thread.is_alive():
            self._conclude()

    def join(self, timeout: float | None = 10.0) -> None:
        """Wait until a finished dashboard has made its last update and closed its widgets."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _make_widget(self) -> None:
        """The live widget: the status line (and Stop button), to which ``_go_live`` adds the plots."""
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        self.status = ipywidgets.HTML(self._status_text())
        row: list[Any] = [self.status]
        if self.stoppable:
            self.stop_button = ipywidgets.Button(
                description="Stop", icon="stop", tooltip="stop every rank (a blocking cell: the kernel's interrupt)"
            )
            self.stop_button.on_click(lambda _: self.cancel.set())
            row.insert(0, self.stop_button)
        self.widget = ipywidgets.VBox([ipywidgets.HBox(row)])

    def _go_live(self) -> None:
        """The launch runs on: the live plots, under the status line."""
        self._build_figures()
        self.plots = live_model(self.layout, self._plots_lock)
        self.widget.children = (*self.widget.children, self.plots)

    def _build_figures(self) -> None:
        # lazy: bokeh is heavy, for views only
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource

        if self.layout is not None:
            return
        small = {"elapsed_x": True, "y_from_zero": True, "legend": False, "sizing_mode": "fixed"}
        small["width"] = RESOURCE_WIDTH
        gpu = self.use_gpus
        memory = styled_figure(
            "GPU memory per rank, MiB" if gpu else "resident memory per rank, MiB", RESOURCE_HEIGHT, **small
        )
        busy = styled_figure(
            "GPU utilization per rank, %" if gpu else "CPU use per rank, %", RESOURCE_HEIGHT, linked=memory, **small
        )
        self.resource_figures = (memory, busy)
        for rank in range(self.nprocs):
            sampled = self._samples.pop(rank, {"time": [], "memory": [], "busy": []})
            source = self.resource_sources[rank] = forward_only(ColumnDataSource(sampled), "time")
            color = PALETTE[rank % len(PALETTE)]
            curve(memory, source, "time", "memory", label=f"rank {rank}", color=color, width=1.5)
            curve(busy, source, "time", "busy", label=f"rank {rank}", color=color, width=1.5)
        for plot in self.resource_figures:
            hover(plot, "elapsed", elapsed=True)
        self.smoothing = Smoothing()
        # in the row from the first metric on: the smoothing slider over the metrics' plots
        self._metrics_column = column(self.smoothing.slider, sizing_mode="stretch_width")
        resources = column(memory, busy, sizing_mode="fixed", width=RESOURCE_WIDTH, height=2 * RESOURCE_HEIGHT)
        self.layout = row(resources, sizing_mode="stretch_width")

    def _has_data(self) -> bool:
        """Something to draw: a metric logged, or two samples of a rank's resources."""
        return any(_size(reader.bin_path) > 0 for reader in self._readers) or any(
            len(kept["time"]) >= 2 for kept in self._samples.values()
        )

    def _loop(self) -> None:
        live = False
        wait = min(0.1, self.push_interval)  # the first resource sample soon: a short launch gets one too
        try:
            while not self._stop.wait(wait):
                wait = self.push_interval
                if not live and time.monotonic() - self.started >= self.live_after and self._has_data():
                    self._go_live()  # the launch runs on: the plots, with what was sampled so far
                    live = True
                changed = False
                try:
                    if live:
                        changed = self._push_metrics()
                        self.plots.catch_up_once()
                    changed = self._push_resources(self._processes, moved=changed) or changed
                except Exception:  # noqa: BLE001 - a dashboard hiccup must never break the launch
                    _log.debug("a dashboard update failed; the next one tries again", exc_info=True)
                if self._show_status(changed):
                    try:
                        self._draw_held()  # the ranks' resources up to when the group went quiet, once
                    except Exception:  # noqa: BLE001
                        _log.debug("the dashboard's held resources could not be drawn", exc_info=True)
                if self._frame is not None:
                    self._frame.refresh()  # the still picture, where the rich view does not draw
        except Exception:  # noqa: BLE001 - a dashboard hiccup must never break the launch
            _log.debug("the dashboard's loop failed; it waits for the launch to end", exc_info=True)
            self._stop.wait()
        finally:
            try:
                self._conclude()
            except Exception:  # noqa: BLE001
                _log.debug("the dashboard could not conclude; it stays as it is", exc_info=True)

    def _show_status(self, changed: bool) -> bool:
        """Set the status line where what it says changed. While something changes it counts the seconds; once
        nothing has for a while (two samples of the ranks' resources), it says since when, once: an idle group
        sends nothing. Whether it went quiet now."""
        now = time.time()
        if changed:
            self._changed = now
        was_quiet = self._idle_since is not None
        quiet = now - self._changed > max(2 * RESOURCE_INTERVAL, 1.5 * self.push_interval)
        self._idle_since = self._changed if quiet else None
        if self.status is not None:
            text = self._status_text()
            if text != self.status.value:
                self.status.value = text
        return quiet and not was_quiet

    def _conclude(self) -> None:
        """The last update, then the static copy in place of the live widgets, which are closed."""
        if self._concluded or not self._shown:
            return
        self._concluded = True
        self._build_figures()
        try:
            self._push_resources(self._processes, moved=self._push_metrics())
            self._draw_held()  # the copy's resources run to its end
        except Exception:  # noqa: BLE001 - the copy shows what there is
            _log.debug("the dashboard's last push failed; the copy shows what there is", exc_info=True)
        self._idle_since = None  # the copy says how long it ran
        if self.status is not None:
            self.status.value = self._status_text()
        with self._plots_lock:
            self.smoothing.settle()  # the copy's curves smoothed as their density suits
            if not any(len(s.data["time"]) for s in self.resource_sources.values()):
                # a launch too short to sample: no empty frames
                self.layout.children = [c for c in self.layout.children if c is self._metrics_column]
            drawn = bool(self.layout.children)
        if drawn:
            self._figures_html = embedded(self.layout, self._plots_lock)
        self._close_widgets()  # first: the live view and its document go before the copy's (same models) come
        self._show_snapshot()

    def add_note(self, html: str) -> None:
        """A line under the status (a background launch's error), in the live view and in the static copy."""
        self._note = f"<br>{html}"
        if self._concluded:
            self._show_snapshot()
        elif self.status is not None:
            self.status.value = self._status_text()

    def _show_snapshot(self) -> None:
        self.snapshot = self._status_html() + self._figures_html
        if self._frame is not None:
            self._frame.freeze(self.snapshot)

    def _close_widgets(self) -> None:
        """Close the live widgets (their comms, styles and layouts) and free the bokeh document."""
        if self.stop_button is not None:
            self.stop_button.disabled = True
        close_tree(self.widget)
        if self.layout is not None and self.layout.document is not None:
            self.layout.document.remove_root(self.layout)  # frees the document; a second close() is a no-op

    def _status_html(self) -> str:
        return f"<div class='gpumagic-launch-dashboard'>{self._status_text()}</div>"

    def _push_metrics(self) -> bool:
        """Draw the points logged since the last push, then the cells started meanwhile; whether anything was."""
        drew = False
        for rank, reader in enumerate(self._readers):
            if _size(reader.bin_path) <= reader.offset:
                continue  # nothing new: not even opened
            for name, series in reader.read().items():
                if name == TOTAL_STEPS:  # not a curve: the length of the run, for the ETA
                    self.total_steps = series.values[-1] if series.values else self.total_steps
                    continue
                if (name, rank) in self._curves:
                    with self._plots_lock:
                        drawn = self._curves[(name, rank)].stream(series.steps, series.values)
                        self._spans[name].feed(drawn, series=rank)
                else:
                    drawn = self._add_metric(name, rank, series.steps, series.values)
                self.points += len(drawn)
                drew = drew or bool(drawn)
                if rank == 0 and series.steps and self._pace.setdefault("metric", name) == name:
                    # one metric's points (rank 0's first): the step rate's and the cells' marks' points
                    self._rank0_points.extend(zip(series.times, series.steps, strict=True))
        return self._draw_marks() or drew

    def step_rate(self, window_s: float = RATE_WINDOW) -> float | None:
        """Rank 0's steps per second over its points of the last ``window_s`` seconds (at least its last two
        points); ``None`` while it has not logged two steps, or logged none in that window (an idle group)."""
        points = self._rank0_points
        if len(points) < 2 or time.time() - points[-1][0] > window_s:
            return None
        latest_time, latest_step = points[-1]
        first_time, first_step = points[-2]
        for when, step in reversed(points):
            if when < latest_time - window_s:
                break
            first_time, first_step = when, step
        if latest_time <= first_time or latest_step <= first_step:
            return None
        return (latest_step - first_step) / (latest_time - first_time)

    @property
    def points_behind(self) -> int:
        """Points not drawn because their step was not after the last one drawn for that metric and rank."""
        return sum(curve.dropped for curve in self._curves.values())

    def mark(self, label: str) -> None:
        """A cell (``label``) starts now: a dashed line at rank 0's latest step on every metric plot (a group's
        dashboard: its curves continue across cells). Drawn by the dashboard's thread."""
        self._pending_marks.append((label, time.time()))

    def _draw_marks(self) -> bool:
        """Place the cells started since the last push: at the last step rank 0 logged before each started (its
        points up to then are on disk: a rank writes them out when a cell ends). One stream into the marks'
        source, whatever the number of plots; whether there were any."""
        batch: dict[str, list[Any]] = {"step": [], "label": []}
        while self._pending_marks:
            label, started = self._pending_marks.popleft()
            step = next((step for when, step in reversed(self._rank0_points) if when <= started), 0)
            self.cell_marks.append((label, step))
            batch["step"].append(step)
            batch["label"].append(label)
        if not batch["step"]:
            return False
        with self._plots_lock:
            self._mark_sources()
            self.marks.stream(batch, rollover=MARKS)
        return True

    def _mark_sources(self) -> None:
        # lazy: bokeh is heavy, for views only
        from bokeh.models import ColumnDataSource

        if self.marks is None:
            self.marks = ColumnDataSource({"step": [], "label": []})

    def _draw_marks_on(self, plot: Any) -> None:
        """The cells' marks on ``plot``: a thin line each, its cell and step under the mouse."""
        # lazy: bokeh is heavy, for views only
        from bokeh.models import HoverTool

        self._mark_sources()
        lines = plot.vspan(x="step", source=self.marks, line_color=MUTED, line_alpha=0.6, line_width=1, name="cell")
        plot.add_tools(HoverTool(renderers=[lines], tooltips=[("cell", "@label"), ("from step", "@step{0,0}")]))

    def _add_metric(self, name: str, rank: int, steps: Sequence[float], values: Sequence[float]) -> list[float]:
        """A new curve (and a new figure for a new metric), holding its first points when it reaches the page:
        BokehJS never draws a figure that came to a page empty (its ranges stay NaN); returns the points drawn."""
        document = self.layout.document
        # the document walks all its models after each change to their graph: once, after the figure is whole
        with self._plots_lock:
            with document.models.freeze() if document is not None else contextlib.nullcontext():
                drawn = self._add_curve(name, rank, steps, values)
            unsynced(self.layout)  # the new figure, source and lines too
        return drawn

    def _add_curve(self, name: str, rank: int, steps: Sequence[float], values: Sequence[float]) -> list[float]:
        plots = self.metric_figures.get(name)
        shown = None
        if plots is None:
            if lower_is_better(name):  # a loss spans decades: a log-y tab beside the linear one
                shown, *plots = log_tabs(name, 220, x_label="step")
            else:
                shown = styled_figure(name, 200, x_label="step")
                plots = [shown]
            for plot in plots:
                self._hovers[id(plot)] = hover(plot, "step", points=True)
                self._draw_marks_on(plot)
            self.metric_figures[name] = plots
            self._spans[name] = SteadySpan(plots[0])  # the linear view
        self._curves[(name, rank)] = line = StepCurve(limit=self.history)
        self.metric_sources[(name, rank)] = line.source
        drawn = line.stream(steps, values)  # before the line joins the page: it comes with its points
        self._spans[name].feed(drawn, series=rank)
        self.smoothing.follow(line.source)
        for plot in plots:
            color = PALETTE[rank % len(PALETTE)]
            smooth = curve(plot, line.source, "step", "value", label=f"rank {rank}", color=color, smooth="smooth")
            tool = self._hovers[id(plot)]  # a row's values under the mouse: of the smoothed lines, not the marks
            tool.renderers = [*tool.renderers, smooth] if tool.renderers != "auto" else [smooth]
        if shown is not None:  # the new figure joins the page whole, its first points in it
            self._metrics_column.children.append(shown)
            if self._metrics_column not in self.layout.children:
                self.layout.children.insert(0, self._metrics_column)  # the metrics first, resources beside
        return drawn

    def _push_resources(self, processes: dict[int, Any], moved: bool = False) -> bool:
        """Sample each rank's memory and CPU (or GPU) use and draw it, unless the rank idles as it did when last
        drawn and no metric ``moved`` since the last sample (then the sample is held back, and drawn before the
        rank's next one: the line stays flat over the idle time). Whether anything was drawn."""
        self._moved = self._moved or moved
        now = time.monotonic() - self._attached  # seconds since the ranks started, drawn as 0:42
        if now - self._sampled < 0.99 * RESOURCE_INTERVAL:  # over less, a clock tick of CPU reads as busy
            return False
        self._sampled, moved, self._moved = now, self._moved, False
        gpus = {}
        if self.use_gpus:
            gpus = {g.uuid: g for g in read_inventory().gpus}
        drew = False
        for rank, process in processes.items():
            try:
                if self.use_gpus and rank < len(self.gpu_uuids) and self.gpu_uuids[rank] in gpus:
                    gpu = gpus[self.gpu_uuids[rank]]
                    own = [p.gpu_memory for p in gpu.processes if p.pid == process.pid and p.gpu_memory is not None]
                    used = own[0] if own else gpu.memory_used  # the rank's own share where NVML names it
                    memory, busy = (used or 0) / MIB, gpu.utilization or 0.0
                else:
                    memory, busy = process.memory_info().rss / MIB, process.cpu_percent(None)
                    if memory == 0:  # a rank that ended (a zombie has no memory): not a point at 0 MiB
                        continue
            except psutil.Error:
                continue
            sample = {"time": [now], "memory": [memory], "busy": [busy]}
            drawn = self._drawn.get(rank)
            idle = drawn is not None and max(busy, drawn[1]) < IDLE_BUSY and abs(memory - drawn[0]) < IDLE_MEMORY
            if idle and not moved:
                self._held[rank] = sample
                continue
            held = self._held.pop(rank, None)
            if held is not None:
                sample = {key: held[key] + values for key, values in sample.items()}
            self._drawn[rank] = (memory, busy)
            self._draw_sample(rank, sample)
            drew = True
        return self._push_remote_usage() or drew

    def _push_remote_usage(self) -> bool:
        """Draw the samples the other nodes' agents wrote since the last look (``ranks/rank-R.usage.jsonl``)."""
        if not self._remote_usage or self.run_dir is None:
            return False
        files, drew = RunFiles(self.run_dir), False
        for rank, offset in self._remote_usage.items():
            try:
                with open(files.rank_usage(rank), "rb") as handle:
                    handle.seek(offset)
                    data = handle.read()
            except FileNotFoundError:  # no sample yet
                continue
            except OSError:
                _log.debug("rank %d's usage file is unreadable; looked at again later", rank, exc_info=True)
                continue
            complete = data[: data.rfind(b"\n") + 1]  # a line being written waits for the next look
            self._remote_usage[rank] = offset + len(complete)
            sample: dict[str, list[float]] = {"time": [], "memory": [], "busy": []}
            for line in complete.splitlines():
                try:
                    point = json.loads(line)
                    when, memory, busy = float(point["time"]), float(point["memory"]), float(point["busy"])
                except (ValueError, KeyError, TypeError):
                    continue
                sample["time"].append(max(0.0, when - self._attached_epoch))
                sample["memory"].append(memory)
                sample["busy"].append(busy)
            if sample["time"]:
                self._drawn[rank] = (sample["memory"][-1], sample["busy"][-1])
                self._draw_sample(rank, sample)
                drew = True
        return drew

    def _draw_held(self) -> None:
        """Draw the samples held back (the ranks idled until the end)."""
        for rank in list(self._held):
            self._draw_sample(rank, self._held.pop(rank))

    def _draw_sample(self, rank: int, sample: dict[str, list[float]]) -> None:
        if rank in self.resource_sources:
            with self._plots_lock:
                stream_within(self.resource_sources[rank], sample, "time", ("memory", "busy"), self.history)
        else:  # not live yet: kept for the plots
            kept = self._samples.setdefault(rank, {"time": [], "memory": [], "busy": []})
            for key, values in sample.items():
                kept[key] = (kept[key] + values)[-self.history :]

    def _status_text(self) -> str:
        elapsed = time.monotonic() - self.started
        alive = sum(1 for pid in self.pids if pid is not None and is_running(pid)) if self.state == "running" else 0
        progress = ""
        if self._rank0_points:
            step = self._rank0_points[-1][1]
            progress = f" · step {step:,.0f}"
            if self.total_steps:
                progress += f" of {self.total_steps:,.0f}"
            rate = self.step_rate()
            if rate:
                progress += f" · {rate:,.0f} steps/s" if rate >= 100 else f" · {rate:.3g} steps/s"
                if self.total_steps and self.total_steps > step and self.state == "running":
                    progress += f" · ETA {_duration((self.total_steps - step) / rate)}"
        behind = self.points_behind
        note = (
            f"<br>{behind:,} points not drawn: their step was not after one already drawn (log increasing steps,"
            " or none: gpumagic.log then counts its calls)"
            if behind
            else ""
        )
        if self.state == "starting":
            return f"<b>{self.title}</b> · starting the ranks · {elapsed:,.1f}s" + self._note
        clock = f"{elapsed:,.1f}s"
        if self._idle_since is not None and self.state == "running":
            clock = f"idle since {time.strftime('%H:%M:%S', time.localtime(self._idle_since))}"
        return (
            f"<b>{self.title}</b> · {self.state} · {alive}/{self.nprocs} ranks alive{progress} · {clock}"
            + self._tracked_words()
            + note
            + self._note
        )

    def _tracked_words(self) -> str:
        """`` · tracked: mlflow 3f9c1a2b · tensorboard runs/…``: what the run is exported as (``gpumagic.track``),
        from its ``run.json``, read every few seconds (the exporters record it once their tracker answered)."""
        now = time.monotonic()
        if self.run_dir is not None and (self._concluded or now - self._tracked_read > TRACKED_READ_S):
            self._tracked_read = now
            with contextlib.suppress(OSError, ValueError):  # being replaced: the next read has it
                self._tracked = tracked_summary(json.loads(RunFiles(self.run_dir).record.read_text()))
        return f" · tracked: {html.escape(self._tracked)}" if self._tracked else ""


def _duration(seconds: float) -> str:
    """``42s``, ``3m 05s``, ``2h 07m``."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    return f"{whole // 3600}h {whole % 3600 // 60:02d}m"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # nothing logged yet
        return 0
    except OSError:
        _log.debug("%s cannot be stat'ed; its size taken as 0", path, exc_info=True)
        return 0


def _rank_processes(pids: list[int | None]) -> dict[int, Any]:
    """The local ranks' processes by rank (their CPU use counted from now)."""
    processes = {}
    for rank, pid in enumerate(pids):
        if pid is None:  # a rank on another node
            continue
        try:
            processes[rank] = psutil.Process(pid)
            processes[rank].cpu_percent(None)
        except psutil.Error:
            pass
    return processes

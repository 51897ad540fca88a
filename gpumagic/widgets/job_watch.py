"""``%jobs watch``: a live table of background jobs with Kill and Logs buttons, and every job's curve of one
metric in one plot, to compare variants as they train; a name pattern and states choose the jobs. Each job keeps
one colour (``PALETTE``: 20) in the table and the plot; its why is one line, in full under the mouse.

One thread reads the job directories (``run.json`` and rank 0's metric file, tailed) every ``interval`` and
is the only writer of the widgets and the bokeh document (under the plots' lock, which a page that connects later
takes to read the plots whole); each job's source gets at most one ``stream`` per refresh, of the points at a
step after its last one, smoothed over the faint raw line. Buttons only set requests the thread carries out
(a kill runs on its own thread: it may take seconds). Closed, or replaced by a new ``%jobs watch``, it turns
into a static copy of its last state (table and plot) where it was shown.
"""

from __future__ import annotations

import html
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpumagic.jobs import executors
from gpumagic.jobs.api import Job, JobFilter
from gpumagic.jobs.queue import places
from gpumagic.run_dirs import records
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.store import RankReader
from gpumagic.widgets.job_table import job_row, status_html
from gpumagic.widgets.live import ERROR, TEXT, Frames, live_model, owned_box, unsynced
from gpumagic.widgets.plots import PALETTE, Smoothing, StepCurve, curve, hover, styled_figure

_log = logging.getLogger(__name__)

LOG_LINES = 30
HEADINGS = ("name", "status", "GPUs", "elapsed", "latest / why")
WIDTHS = ("180px", "100px", "60px", "80px", None)  # None: the rest of the row, whatever the output's width
ONE_LINE = "white-space:nowrap;overflow:hidden;text-overflow:ellipsis"  # the full text under the mouse
CELL = "padding:2px 8px;text-align:left;vertical-align:top;white-space:nowrap"


class JobWatch:
    """The live job dashboard. ``widget`` is what a notebook displays; ``close()`` stops its thread and leaves a
    static copy of its last state where it was shown. ``names`` (names or patterns, ``"A-*"``) and ``states``
    (``"running,queued"``) choose the jobs shown; a job that leaves those states leaves the table and the plot.

    Raises:
        InvalidArgument: an unknown state (the message lists the valid ones).
    """

    def __init__(
        self,
        metric: str = "loss",
        interval: float = 1.0,
        history: int = 5000,
        names: str | Iterable[str] | None = None,
        states: str | Iterable[str] | None = None,
    ) -> None:
        # lazy: ipywidgets and bokeh are heavy, for views only
        import ipywidgets
        from bokeh.layouts import column

        if interval <= 0 or history < 2:
            raise ValueError("interval must be > 0 and history >= 2")
        self.chosen = JobFilter.of(names, states)
        self.metric = metric
        self.interval = interval
        self.history = history
        self.pushes = 0
        self.sources: dict[Path, Any] = {}  # job directory -> its curve's source
        self.rows: dict[Path, dict[str, Any]] = {}
        self.colours: dict[Path, str] = {}  # each job's colour, kept while the watch lives
        self.shown: list[Path] = []  # the jobs in the table now, in submission order
        self.snapshot = ""  # the static copy it turns into when closed (HTML)
        self._readers: dict[Path, Any] = {}
        self._curves: dict[Path, StepCurve] = {}
        self._plots_lock = threading.RLock()
        self._latest: dict[Path, dict[str, tuple[float, float]]] = {}  # rank 0's last point of each metric
        self._texts: dict[Path, tuple[str, ...]] = {}  # name, status, GPUs, elapsed, latest or why, full why
        self._log_job: Path | None = None
        self._metrics_seen: set[str] = {metric}
        self._menu_changing = False
        self._switch_to: str | None = None
        self._stop = threading.Event()
        self._closed = False
        self._frames = Frames("%jobs watch", plots=lambda: self.plots, status=self._static_html)  # where it shows
        self._queue: dict[str, tuple[int, int]] | None = None  # where this user's queued jobs wait
        self.plot = styled_figure(f"{metric} per job", 300, x_label="step")
        self._hover = hover(self.plot, "step", points=True)
        self._hover.renderers = []  # the smoothed lines, each added with its job
        self.smoothing = Smoothing()
        self.layout = column(self.smoothing.slider, self.plot, sizing_mode="stretch_width")
        self.header = ipywidgets.HTML()
        self.metric_menu = ipywidgets.Dropdown(options=[metric], value=metric, description="metric")
        self.metric_menu.observe(lambda change: self._switch(change["new"]), names="value")
        self.table = ipywidgets.VBox([self._row_widgets(HEADINGS)])
        self.log_view = ipywidgets.HTML()
        self.message = ipywidgets.HTML()
        self._update_lock = threading.Lock()  # tailing readers must not be read by two threads at once
        self.update()  # before the plot widget exists: its first state has every job's curve
        self.plots = live_model(self.layout, self._plots_lock)
        controls = ipywidgets.HBox([self.header, self.metric_menu])
        self.widget = owned_box([controls, self.table, self.message, self.plots, self.log_view], owner=self)
        self._thread = threading.Thread(target=self._loop, name="gpumagic-job-watch", daemon=True)
        self._thread.start()

    def _ipython_display_(self) -> None:
        self._frames.show(self.widget)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread, bring the table up to date one last time (no live Kill button is left on a job that
        ended) and close the widgets: where the watch was shown, a static copy of its last state (table and
        plot) takes their place. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self.interval))
        try:
            self.update()
        except Exception:  # noqa: BLE001 - the last look may fail (a job removed meanwhile): the buttons still go
            _log.debug("the job watch's last update failed; its buttons are disabled anyway", exc_info=True)
        for row in self.rows.values():
            row["kill"].disabled = True
        self.header.value = self._header_text(stopped=True)
        self.snapshot = self._frames.freeze(self._static_html(), self.widget, self.plots, self.layout, self._plots_lock)

    def _static_html(self) -> str:
        """The header and the table as plain HTML, for the static copy."""
        rows = []
        for path in self.shown:
            name, status, gpus, elapsed, line, why = self._texts[path]
            cells = [
                f"<td style='{CELL};border-left:4px solid {self.colours[path]}'><b>{html.escape(name)}</b></td>",
                f"<td style='{CELL}'>{status_html(status)}</td>",
                f"<td style='{CELL}'>{html.escape(gpus)}</td><td style='{CELL}'>{html.escape(elapsed)}</td>",
                f"<td style='{CELL};max-width:40em;overflow:hidden;text-overflow:ellipsis' "
                f"title='{html.escape(why)}'>{html.escape(line)}</td>",
            ]
            rows.append("<tr>" + "".join(cells) + "</tr>")
        head = "".join(f"<th style='{CELL}'>{html.escape(h)}</th>" for h in HEADINGS)
        return (
            f"<div class='gpumagic-job-watch' style='{TEXT}'><div style='margin:4px 0'>{self.header.value}</div>"
            f"<table style='border-collapse:collapse;font-size:12px'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>{self.message.value}</div>"
        )

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.update()
                self.plots.catch_up_once()
                self._frames.refresh()  # the still picture, where the rich view does not draw
            except Exception as err:  # noqa: BLE001 - a hiccup (a job removed meanwhile) skips one update
                _log.debug("an update of the job watch failed; told in it, the next tries again", exc_info=True)
                self.message.value = f"<span style='{ERROR}'>{html.escape(f'{type(err).__name__}: {err}')}</span>"

    def update(self) -> None:
        """Read every job once and push what changed (the thread calls it; so may anyone, one at a time)."""
        with self._update_lock:
            self._update()

    def _update(self) -> None:
        if self._switch_to is not None:
            self._reset_curves(self._switch_to)
            self._switch_to = None
        paths = records.all_jobs()
        self._queue = None  # where queued jobs wait: read once per update, if any is
        shown = []
        for path in paths:
            try:
                texts = self._texts_of(path, records.read(path))
            except (OSError, ValueError, KeyError):  # removed meanwhile
                _log.debug("the job %s cannot be read; left out of this update", path, exc_info=True)
                continue
            if texts is None:
                continue
            if texts != self._texts.get(path):
                self._texts[path] = texts
                self._set_row(path, texts)
            shown.append(path)
        for gone in [p for p in self.rows if p not in paths]:
            texts = (*self._texts.get(gone, ("?",))[:1], "removed", "", "", "", "")
            self._texts[gone] = texts
            self._set_row(gone, texts)
            shown.append(gone)
        self._show_only(shown)
        if self._log_job is not None and self._log_job.exists():
            self._show_log(self._log_job)
        self.header.value = self._header_text()

    def _texts_of(self, path: Path, info: dict[str, Any]) -> tuple[str, ...] | None:
        """A job's cells (name, status, GPUs, elapsed, latest metrics or why in one line, the full why), its
        metrics drawn first; None for a job the filter leaves out."""
        name = info.get("name", path.name)
        status = executors.status(info)
        if not self.chosen.matches(name, status):
            return None
        if path not in self.rows:
            self._add_job(path, name)
        self._push_metrics(path)
        place = self._place(name) if status == "queued" else None
        row = job_row(Job(path), info, self._latest.get(path, {}), place)
        shown = row.latest if row.status in ("running", "finished") and row.latest else row.line
        return (row.name, row.status, row.gpus, row.elapsed, shown, row.why)

    def _place(self, name: str) -> tuple[int, int] | None:
        """Where job ``name`` waits in the machine's queue: (tickets ahead, of them jobs); None: no ticket."""
        if self._queue is None:
            try:
                self._queue = places()
            except Exception:  # noqa: BLE001 - a busy or unreadable lease directory: the why's first line instead
                _log.debug("the machine's queue cannot be read; no places shown", exc_info=True)
                self._queue = {}
        return self._queue.get(name)

    def _add_job(self, path: Path, name: str) -> None:
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        colour = self.colours[path] = PALETTE[len(self.colours) % len(PALETTE)]  # repeats past 20 jobs only
        kill = ipywidgets.Button(description="Kill", icon="stop", layout=ipywidgets.Layout(width="80px"))
        logs = ipywidgets.Button(description="Logs", icon="file-text", layout=ipywidgets.Layout(width="80px"))
        kill.on_click(lambda _: self._kill(path))
        logs.on_click(lambda _: self._select_log(path))
        cells = self._row_widgets((name, "", "", "", ""), colour)
        cells.children = (*cells.children, kill, logs)
        self.rows[path] = {"box": cells, "kill": kill, "logs": logs}
        self.table.children = (*self.table.children, cells)
        self._curves[path] = line = StepCurve()
        with self._plots_lock:
            before = len(self.plot.renderers)
            smooth = curve(self.plot, line.source, "step", "value", label=name, color=colour, smooth="smooth")
            self._hover.renderers = [*self._hover.renderers, smooth]
            self.smoothing.follow(line.source)
            self.rows[path]["renderers"] = self.plot.renderers[before:]
            unsynced(self.plot)
        self.sources[path] = line.source
        self._readers[path] = RankReader(RunFiles(path).metrics, 0)

    @staticmethod
    def _row_widgets(texts: tuple[str, ...], colour: str | None = None) -> Any:
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        cells = []
        for position, (text, width) in enumerate(zip(texts, WIDTHS, strict=True)):
            if width is None:  # shrinks (its text cut with an ellipsis) so that the row never wraps
                layout = ipywidgets.Layout(flex="1 1 0", min_width="0", overflow="hidden")
            else:
                layout = ipywidgets.Layout(width=width, flex="0 0 auto", overflow="hidden")
            if position == 0:  # the job's colour in the plot, beside its name (none on the headings)
                layout.border_left = f"4px solid {colour or 'transparent'}"
                layout.padding = "0 0 0 4px"
            cells.append(ipywidgets.HTML(f"<b>{html.escape(text)}</b>" if position == 0 else html.escape(text)))
            cells[-1].layout = layout
        return ipywidgets.HBox(cells)

    def _set_row(self, path: Path, texts: tuple[str, ...]) -> None:
        row = self.rows.get(path)
        if row is None:
            return
        name, status, gpus, elapsed, line, why = texts
        values = (
            f"<b>{html.escape(name)}</b>",
            status_html(status) if status else "",
            html.escape(gpus),
            html.escape(elapsed),
            f"<div title='{html.escape(why)}' style='{ONE_LINE}'>{html.escape(line)}</div>",
        )
        for cell, value in zip(row["box"].children, values, strict=False):
            if cell.value != value:
                cell.value = value
        row["kill"].disabled = status not in ("queued", "running")

    def _show_only(self, shown: list[Path]) -> None:
        """Hide the rows and curves of the jobs that left the filter's states; show those that came back."""
        if shown == self.shown:
            return
        self.shown = shown
        with self._plots_lock:
            for path, row in self.rows.items():
                visible = path in shown
                row["box"].layout.display = None if visible else "none"
                for renderer in row["renderers"]:
                    if renderer.visible != visible:
                        renderer.visible = visible
                for legend in self.plot.legend:
                    for item in legend.items:
                        if any(r in row["renderers"] for r in item.renderers) and item.visible != visible:
                            item.visible = visible

    def _push_metrics(self, path: Path) -> None:
        series = self._readers[path].read()
        latest = self._latest.setdefault(path, {})
        for name, points in series.items():
            if len(points):
                latest[name] = (points.steps[-1], points.values[-1])
        if set(series) - self._metrics_seen:
            self._metrics_seen |= set(series)
            self._menu_changing = True  # new options reset the value: not the user's choice
            try:
                self.metric_menu.options = sorted(self._metrics_seen)
                self.metric_menu.value = self.metric
            finally:
                self._menu_changing = False
        points = series.get(self.metric)
        if points is not None and len(points):
            with self._plots_lock:
                drawn = self._curves[path].stream(points.steps, points.values, rollover=self.history)
            if drawn:
                self.pushes += 1

    def _switch(self, metric: str) -> None:
        if not self._menu_changing and metric != self.metric:
            self._switch_to = metric  # carried out by the thread, the only writer of the plot

    def _reset_curves(self, metric: str) -> None:
        self.metric = metric
        with self._plots_lock:
            self.plot.title.text = f"{metric} per job"
            for path, line in self._curves.items():
                line.reset()
                self._readers[path] = RankReader(RunFiles(path).metrics, 0)

    def _kill(self, path: Path) -> None:
        def run() -> None:
            job = Job(path)
            try:
                job.kill()
                self.message.value = html.escape(f"{job.name}: {job.status} ({job.reason})")
            except Exception as err:  # noqa: BLE001 - shown in the widget
                _log.debug("killing the job %s failed; told in the widget", path, exc_info=True)
                self.message.value = f"<span style='{ERROR}'>{html.escape(str(err))}</span>"

        self.message.value = "stopping…"
        threading.Thread(target=run, name="gpumagic-job-kill", daemon=True).start()

    def _select_log(self, path: Path) -> None:
        self._log_job = None if self._log_job == path else path
        if self._log_job is None:
            self.log_view.value = ""
        else:
            self._show_log(path)

    def _show_log(self, path: Path) -> None:
        job = Job(path)
        text = job.logs(LOG_LINES)
        value = (
            f"<b>{html.escape(job.name)}</b>: last {LOG_LINES} lines of output"
            f"<pre style='max-height:20em;overflow:auto'>{html.escape(text)}</pre>"
        )
        if self.log_view.value != value:
            self.log_view.value = value

    def _header_text(self, stopped: bool = False) -> str:
        count = len(self.shown)
        state = f"closed at {time.strftime('%H:%M:%S')}" if stopped else f"live, every {self.interval:g}s"
        chosen = self.chosen.describe()
        if not count and chosen:
            return f"<b>no job matches {html.escape(chosen)} yet</b> · {state}"
        where = f" ({html.escape(chosen)})" if chosen else ""
        return f"<b>{count} background job{'s' if count != 1 else ''}</b>{where} · {state}"

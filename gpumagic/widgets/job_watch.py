"""``%jobs watch``: a live table of background jobs with Kill and Logs buttons, and every job's curve of one
metric in one plot, to compare variants as they train.

One thread reads the job directories (``run.json`` and rank 0's metric file, tailed) every ``interval`` and
is the only writer of the widgets and the bokeh document (under the plots' lock, which a page that connects later
takes to read the plots whole); each job's source gets at most one ``stream`` per refresh, of the points at a
step after its last one, smoothed over the faint raw line. Buttons only set requests the thread carries out
(a kill runs on its own thread: it may take seconds).
"""

from __future__ import annotations

import html
import threading
import time
from pathlib import Path
from typing import Any

from gpumagic.telemetry.run_files import RunFiles
from gpumagic.widgets.gpu_watch import _owned_box_class
from gpumagic.widgets.plots import (
    FIRST_REFRESH_S,
    PALETTE,
    StepCurve,
    curve,
    display_live,
    hover,
    live_model,
    styled_figure,
    unsynced,
)

LOG_LINES = 30


class JobWatch:
    """The live job dashboard. ``widget`` is what a notebook displays; ``close()`` stops its thread."""

    def __init__(self, metric: str = "loss", interval: float = 1.0, history: int = 5000) -> None:
        import ipywidgets
        from bokeh.layouts import column

        if interval <= 0 or history < 2:
            raise ValueError("interval must be > 0 and history >= 2")
        self.metric = metric
        self.interval = interval
        self.history = history
        self.refreshes = 0
        self.pushes = 0
        self.sources: dict[Path, Any] = {}  # job directory -> its curve's source
        self.rows: dict[Path, dict[str, Any]] = {}
        self._readers: dict[Path, Any] = {}
        self._curves: dict[Path, StepCurve] = {}
        self._plots_lock = threading.RLock()
        self._latest: dict[Path, dict[str, tuple[float, float]]] = {}  # rank 0's last point of each metric
        self._texts: dict[Path, tuple[str, ...]] = {}
        self._log_job: Path | None = None
        self._metrics_seen: set[str] = {metric}
        self._menu_changing = False
        self._switch_to: str | None = None
        self._stop = threading.Event()
        self._closed = False
        self._close_widget = ipywidgets.DOMWidget.close
        self.plot = styled_figure(f"{metric} per job", 300, x_label="step")
        hover(self.plot, "step")
        self.layout = column(self.plot, sizing_mode="stretch_width")
        self.header = ipywidgets.HTML()
        self.metric_menu = ipywidgets.Dropdown(options=[metric], value=metric, description="metric")
        self.metric_menu.observe(lambda change: self._switch(change["new"]), names="value")
        self.table = ipywidgets.VBox([self._row_widgets(("name", "status", "GPUs", "elapsed", "latest / why"))])
        self.log_view = ipywidgets.HTML()
        self.message = ipywidgets.HTML()
        self._update_lock = threading.Lock()  # tailing readers must not be read by two threads at once
        self.update()  # before the plot widget exists: its first state has every job's curve
        self.plots = live_model(self.layout, self._plots_lock)
        controls = ipywidgets.HBox([self.header, self.metric_menu])
        self.widget = _owned_box_class()([controls, self.table, self.message, self.plots, self.log_view], owner=self)
        self._thread = threading.Thread(target=self._loop, name="gpumagic-job-watch", daemon=True)
        self._thread.start()

    def _ipython_display_(self) -> None:
        display_live(self.widget)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread, bring the table up to date one last time (no live Kill button is left on a job that
        ended) and close the plot widget. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self.interval))
        try:
            self.update()
        except Exception:  # noqa: BLE001 - the last look may fail (a job removed meanwhile): the buttons still go
            pass
        for row in self.rows.values():
            row["kill"].disabled = True
        self.header.value = self._header_text(len(self.rows), stopped=True)
        self._close_widget(self.plots)

    def _loop(self) -> None:
        shown = time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self.update()
                if not self.refreshes and time.monotonic() - shown >= FIRST_REFRESH_S:
                    self.plots.catch_up()  # once: a view built after the first pushes missed them
                    self.refreshes += 1
            except Exception as err:  # noqa: BLE001 - a hiccup (a job removed meanwhile) skips one update
                self.message.value = f"<span style='color:#b00'>{html.escape(f'{type(err).__name__}: {err}')}</span>"

    def update(self) -> None:
        """Read every job once and push what changed (the thread calls it; so may anyone, one at a time)."""
        with self._update_lock:
            self._update()

    def _update(self) -> None:
        from gpumagic.jobs import records
        from gpumagic.jobs.api import Job
        from gpumagic.widgets.job_table import job_row

        if self._switch_to is not None:
            self._reset_curves(self._switch_to)
            self._switch_to = None
        paths = records.all_jobs()
        for path in paths:
            if path not in self.rows:
                self._add_job(path)
            self._push_metrics(path)
            try:
                row = job_row(Job(path), records.read(path), self._latest.get(path, {}))
            except (OSError, ValueError, KeyError):
                continue
            latest_or_why = row.latest if row.status in ("running", "finished") and row.latest else row.why
            texts = (row.name, row.status, row.gpus, row.elapsed, latest_or_why)
            if texts != self._texts.get(path):
                self._texts[path] = texts
                self._set_row(path, texts)
        for gone in [p for p in self.rows if p not in paths]:
            self._set_row(gone, (*self._texts.get(gone, ("?",))[:1], "removed", "", "", ""))
        if self._log_job is not None and self._log_job.exists():
            self._show_log(self._log_job)
        self.header.value = self._header_text(len(paths))

    def _add_job(self, path: Path) -> None:
        import ipywidgets

        from gpumagic.jobs import records
        from gpumagic.telemetry.store import RankReader

        name = records.read(path).get("name", path.name)
        kill = ipywidgets.Button(description="Kill", icon="stop", layout=ipywidgets.Layout(width="80px"))
        logs = ipywidgets.Button(description="Logs", icon="file-text", layout=ipywidgets.Layout(width="80px"))
        kill.on_click(lambda _: self._kill(path))
        logs.on_click(lambda _: self._select_log(path))
        cells = self._row_widgets((name, "", "", "", ""))
        cells.children = (*cells.children, kill, logs)
        self.rows[path] = {"box": cells, "kill": kill, "logs": logs}
        self.table.children = (*self.table.children, cells)
        colour = PALETTE[(len(self.sources)) % len(PALETTE)]
        self._curves[path] = line = StepCurve()
        with self._plots_lock:
            curve(self.plot, line.source, "step", "value", label=name, color=colour, smooth="smooth")
            unsynced(self.plot)
        self.sources[path] = line.source
        self._readers[path] = RankReader(RunFiles(path).metrics, 0)

    @staticmethod
    def _row_widgets(texts: tuple[str, ...]) -> Any:
        import ipywidgets

        widths = ("180px", "90px", "60px", "80px", "420px")
        return ipywidgets.HBox(
            [
                ipywidgets.HTML(f"<b>{html.escape(t)}</b>" if i == 0 else html.escape(t), layout={"width": w})
                for i, (t, w) in enumerate(zip(texts, widths, strict=True))
            ]
        )

    def _set_row(self, path: Path, texts: tuple[str, ...]) -> None:
        from gpumagic.widgets.job_table import STATUS_COLOURS

        row = self.rows.get(path)
        if row is None:
            return
        cells = row["box"].children
        for position, text in enumerate(texts):
            value = html.escape(text)
            if position == 0:
                value = f"<b>{value}</b>"
            elif position == 1:
                value = f"<b style='color:{STATUS_COLOURS.get(text, 'inherit')}'>{value}</b>"
            if cells[position].value != value:
                cells[position].value = value
        row["kill"].disabled = texts[1] not in ("queued", "running")

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
        from gpumagic.telemetry.store import RankReader

        self.metric = metric
        with self._plots_lock:
            self.plot.title.text = f"{metric} per job"
            for path, line in self._curves.items():
                line.reset()
                self._readers[path] = RankReader(RunFiles(path).metrics, 0)

    def _kill(self, path: Path) -> None:
        from gpumagic.jobs.api import Job

        def run() -> None:
            job = Job(path)
            try:
                job.kill()
                self.message.value = html.escape(f"{job.name}: {job.status} ({job.reason})")
            except Exception as err:  # noqa: BLE001 - shown in the widget
                self.message.value = f"<span style='color:#b00'>{html.escape(str(err))}</span>"

        self.message.value = "stopping…"
        threading.Thread(target=run, name="gpumagic-job-kill", daemon=True).start()

    def _select_log(self, path: Path) -> None:
        self._log_job = None if self._log_job == path else path
        if self._log_job is None:
            self.log_view.value = ""
        else:
            self._show_log(path)

    def _show_log(self, path: Path) -> None:
        from gpumagic.jobs.api import Job

        job = Job(path)
        text = job.logs(LOG_LINES)
        value = (
            f"<b>{html.escape(job.name)}</b>: last {LOG_LINES} lines of output"
            f"<pre style='max-height:20em;overflow:auto'>{html.escape(text)}</pre>"
        )
        if self.log_view.value != value:
            self.log_view.value = value

    def _header_text(self, count: int, stopped: bool = False) -> str:
        state = "stopped" if stopped else f"live, every {self.interval:g}s"
        return f"<b>{count} background job{'s' if count != 1 else ''}</b> · {state}"

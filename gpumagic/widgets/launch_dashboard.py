"""The dashboard under a ``%%launch_ddp`` cell: a status line (ranks alive, step rate, elapsed), a curve per
rank for every metric the ranks ``gpumagic.log``, and each rank's resources: its GPU's memory and utilization,
or on a CPU-only machine its process's resident memory and CPU use.

It updates from its own thread while the cell blocks (the kernel's event loop cannot run then): one sampler
thread tails the run's metric files and samples the rank processes, and is the only writer of the bokeh
document; each source gets at most one ``stream(batch, rollover)`` per push.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from gpumagic.widgets.gpu_watch import REFRESH_EVERY_S
from gpumagic.widgets.plots import load_bokehjs, rank_curve, refresh, step_figure, time_figure

MIB = float(1 << 20)


class LaunchDashboard:
    """Create it before the launch, ``attach`` the run when the ranks start, ``finish`` when they end."""

    def __init__(self, history: int = 2000, push_interval: float = 0.5) -> None:
        import ipywidgets
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource
        from jupyter_bokeh.widgets import BokehModel

        self.nprocs = 0
        self.history = history
        self.push_interval = push_interval
        self.started = time.monotonic()
        self.run_dir: Path | None = None
        self.pids: list[int] = []
        self.use_gpus = False
        self.state = "starting"
        self.points = 0
        self._steps: list[tuple[float, float]] = []  # (time, step) of rank 0's latest points, for the step rate
        self._readers: list[Any] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.metric_sources: dict[tuple[str, int], ColumnDataSource] = {}
        self.metric_figures: dict[str, Any] = {}
        self.resource_sources: dict[int, Any] = {}
        self._column_data_source = ColumnDataSource
        memory = time_figure("memory per rank, MiB", 180)
        busy = time_figure("utilization per rank, %", 160, linked=memory)
        self.resource_figures = (memory, busy)
        self.layout = column(memory, busy, sizing_mode="stretch_width")
        self.cancel = threading.Event()
        self.status = ipywidgets.HTML(self._status_text())
        self.stop_button = ipywidgets.Button(
            description="Stop",
            icon="stop",
            tooltip="stop every rank (with --no-wait; a blocking cell stops with the kernel's interrupt)",
        )
        self.stop_button.on_click(lambda _: self.cancel.set())
        self.plots = BokehModel(self.layout)
        self.widget = ipywidgets.VBox([ipywidgets.HBox([self.stop_button, self.status]), self.plots])

    def show(self) -> None:
        from IPython.display import display

        load_bokehjs()
        display(self.widget)

    def attach(self, plan: Any, pids: list[int | None]) -> None:
        """The ranks of ``plan`` (a ``LaunchPlan``) started: follow their metrics and processes until ``finish``
        (``None`` for a rank on another node: its metrics only)."""
        from gpumagic.telemetry.store import RankReader

        self.run_dir = Path(plan.job_dir).parent  # the launch's files live in <run dir>/launch
        use_gpus = plan.use_cuda
        self.pids = list(pids)
        self.nprocs = len(pids)
        memory, busy = self.resource_figures
        for rank in range(self.nprocs):
            source = self.resource_sources[rank] = self._column_data_source({"time": [], "memory": [], "busy": []})
            rank_curve(memory, source, rank, x="time", y="memory")
            rank_curve(busy, source, rank, x="time", y="busy")
        self.use_gpus = use_gpus
        self.gpu_uuids = [gpus[0] if gpus else "" for gpus in plan.rank_gpus]
        self.state = "running"
        self._readers = [RankReader(self.run_dir / "metrics", rank) for rank in range(self.nprocs)]
        self.resource_figures[0].title.text = (
            "GPU memory per rank, MiB" if use_gpus else "resident memory per rank (CPU ranks), MiB"
        )
        self.resource_figures[1].title.text = "GPU utilization per rank, %" if use_gpus else "CPU use per rank, %"
        self._thread = threading.Thread(target=self._loop, name="gpumagic-launch-dashboard", daemon=True)
        self._thread.start()

    def finish(self, state: str) -> None:
        """The launch ended (``finished``, ``failed``, ``interrupted``): a last update, then the thread stops."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.state = state
        self.status.value = self._status_text()
        self.stop_button.disabled = True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        import psutil

        processes = {}
        for rank, pid in enumerate(self.pids):
            if pid is None:  # a rank on another node
                continue
            try:
                processes[rank] = psutil.Process(pid)
                processes[rank].cpu_percent(None)
            except psutil.Error:
                pass
        last_refresh = time.monotonic()
        while True:
            stopping = self._stop.wait(self.push_interval)
            try:
                self._push_metrics()
                self._push_resources(processes)
                if stopping or time.monotonic() - last_refresh >= REFRESH_EVERY_S:
                    refresh(self.plots, self.layout)  # so a browser reload shows the curves, also at the end
                    last_refresh = time.monotonic()
            except Exception:  # noqa: BLE001 - a dashboard hiccup must never break the launch
                pass
            self.status.value = self._status_text()
            if stopping:
                return

    def _push_metrics(self) -> None:
        for rank, reader in enumerate(self._readers):
            for name, series in reader.read().items():
                source = self.metric_sources.get((name, rank)) or self._add_metric(name, rank)
                source.stream({"step": series.steps, "value": series.values}, rollover=self.history)
                self.points += len(series)
                if rank == 0 and series.steps:
                    self._steps.append((series.times[-1], series.steps[-1]))

    def _add_metric(self, name: str, rank: int) -> Any:
        plot = self.metric_figures.get(name)
        if plot is None:
            plot = self.metric_figures[name] = step_figure(name, 200)
            self.layout.children.insert(len(self.metric_figures) - 1, plot)
        source = self._column_data_source({"step": [], "value": []})
        rank_curve(plot, source, rank)
        self.metric_sources[(name, rank)] = source
        return source

    def _push_resources(self, processes: dict[int, Any]) -> None:
        import psutil

        now = time.time() * 1000
        gpus = {}
        if self.use_gpus:
            import gpumagic

            gpus = {g.uuid: g for g in gpumagic.gpus().gpus}
        for rank, process in processes.items():
            try:
                if self.use_gpus and rank < len(self.gpu_uuids) and self.gpu_uuids[rank] in gpus:
                    gpu = gpus[self.gpu_uuids[rank]]
                    own = [p.gpu_memory for p in gpu.processes if p.pid == process.pid and p.gpu_memory is not None]
                    used = own[0] if own else gpu.memory_used  # the rank's own share where NVML names it
                    memory, busy = (used or 0) / MIB, gpu.utilization or 0.0
                else:
                    memory, busy = process.memory_info().rss / MIB, process.cpu_percent(None)
            except psutil.Error:
                continue
            self.resource_sources[rank].stream(
                {"time": [now], "memory": [memory], "busy": [busy]}, rollover=self.history
            )

    def _status_text(self) -> str:
        elapsed = time.monotonic() - self.started
        alive = sum(1 for pid in self.pids if pid is not None and _alive(pid)) if self.state == "running" else 0
        progress = ""
        if self._steps:
            (t0, s0), (t1, s1) = self._steps[0], self._steps[-1]
            rate = (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0
            progress = f" · step {s1:,.0f} ({rate:,.1f} steps/s)"
        return f"<b>%%launch_ddp</b> · {self.state} · {alive}/{self.nprocs} ranks alive{progress} · {elapsed:,.1f}s"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

"""``%gpu watch``: a live dashboard of every GPU (memory, with this kernel's share apart from other users',
utilization, temperature), sampled on a background thread and pushed to the browser at a bounded rate.

Only the pusher thread touches the bokeh document after the dashboard is shown (the document is not
thread-safe; comm sends from a thread are, in ipykernel 7.1+). Samples are buffered and each source gets
one ``stream(batch, rollover=history)`` per push for all GPUs, whatever the sampling rate, so the browser receives a
bounded number of messages and the memory used stays bounded however long it runs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Any

from gpumagic.telemetry.samplers import GpuSample, GpuSampler
from gpumagic.widgets.plots import FIRST_REFRESH_S, PALETTE, load_bokehjs, refresh, time_figure

GIB = float(1 << 30)
COLUMNS = ("time", "used", "mine", "others", "total", "utilization", "temperature")
REFRESH_EVERY_S = 30.0  # how often the widget's saved state catches up with the plots (browser reloads)


class GpuWatch:
    """A live GPU dashboard. ``widget`` is what a notebook displays; ``close()`` stops its threads."""

    def __init__(
        self,
        interval: float = 1.0,
        history: int = 600,
        push_interval: float = 0.5,
        sampler: GpuSampler | None = None,
        refresh_every: float = REFRESH_EVERY_S,
    ) -> None:
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource

        if interval <= 0 or push_interval <= 0 or history < 2:
            raise ValueError("interval and push_interval must be > 0 and history >= 2")
        self.interval = interval
        self.history = int(history)
        self.push_interval = push_interval
        self.sampler = sampler or GpuSampler()
        inventory, first = self.sampler.sample()
        self.simulated = inventory.simulated
        self.indices = [s.nvml_index for s in first]
        # One source for all GPUs (columns used_0, used_1, ...): one stream per push, not one per GPU,
        # which is most of the dashboard's cost in the kernel.
        self.source = ColumnDataSource({"time": [], **{_column(c, i): [] for i in self.indices for c in COLUMNS[1:]}})
        self._pending: deque[list[GpuSample]] = deque(maxlen=self.history)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._paused = threading.Event()
        self.pushes = 0
        self.refreshes = 0
        self.refresh_every = refresh_every
        title = "GPUs" + (" (SIMULATED)" if self.simulated else "")
        memory = time_figure(f"{title}: memory used, GiB (solid: all users, dashed: this kernel, dotted: total)", 220)
        busy = time_figure("utilization, %", 180, linked=memory, y_range=(0, 100))
        heat = time_figure("temperature, °C", 160, linked=memory)
        self.kernel_gpus = _kernel_gpus(inventory)
        for position, index in enumerate(self.indices):
            color = PALETTE[position % len(PALETTE)]
            mine = index in self.kernel_gpus
            label = f"GPU {index} (this kernel: cuda:{self.kernel_gpus[index]})" if mine else f"GPU {index}"
            width = 4 if mine else 1.5  # the GPUs this kernel sees stand out
            line = {"source": self.source, "color": color, "line_width": width}
            memory.line("time", _column("used", index), legend_label=label, **line)
            memory.line("time", _column("mine", index), line_dash="dashed", **line)
            memory.line("time", _column("total", index), line_dash="dotted", alpha=0.6, **line)
            busy.line("time", _column("utilization", index), legend_label=label, **line)
            heat.line("time", _column("temperature", index), legend_label=label, **line)
        for plot in (memory, busy, heat):
            plot.legend.location = "top_left"
            plot.legend.click_policy = "hide"
        self.layout = column(memory, busy, heat, sizing_mode="stretch_width")
        self._record(first)
        self.widget = self._build_widget()
        self._sampler_thread = threading.Thread(target=self._sample_loop, name="gpumagic-gpu-sampler", daemon=True)
        self._pusher_thread = threading.Thread(target=self._push_loop, name="gpumagic-gpu-pusher", daemon=True)
        self._sampler_thread.start()
        self._pusher_thread.start()

    def _build_widget(self) -> Any:
        import ipywidgets
        from jupyter_bokeh.widgets import BokehModel

        self._closed = False
        self._close_widget = ipywidgets.DOMWidget.close  # bound now: close() may run late in shutdown

        self.header = ipywidgets.HTML(self._header_text())
        self.pause_button = ipywidgets.ToggleButton(description="Pause", icon="pause", tooltip="pause sampling")
        self.stop_button = ipywidgets.Button(description="Stop", icon="stop", tooltip="stop and close")
        self.pause_button.observe(lambda change: self.pause(change["new"]), names="value")
        self.stop_button.on_click(lambda _: self.close())
        self.plots = BokehModel(self.layout)
        controls = ipywidgets.HBox([self.pause_button, self.stop_button, self.header])
        return _owned_box_class()([controls, self.plots], owner=self)

    def _header_text(self) -> str:
        state = "paused" if self._paused.is_set() else "stopped" if self._stop.is_set() else "live"
        label = " · SIMULATED" if self.simulated else ""
        return (
            f"<b>{len(self.indices)} GPUs{label}</b> · {state} · sampling every {self.interval:g}s, "
            f"keeping {self.history} points"
        )

    def pause(self, paused: bool = True) -> None:
        """Stop (or resume) sampling; what was drawn stays."""
        if paused:
            self._paused.set()
        else:
            self._paused.clear()
        self.header.value = self._header_text()

    def close(self) -> None:
        """Stop both threads (within one sampling interval) and close the widgets. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for thread in (self._sampler_thread, self._pusher_thread):
            if thread is not threading.current_thread():
                thread.join(timeout=max(5.0, 2 * self.interval))
        self.header.value = self._header_text()
        # DOMWidget.close, not BokehModel.close: jupyter_bokeh's close unhooks the document and raises when
        # ipywidgets' __del__ calls it a second time; leaving that to __del__ makes it happen exactly once.
        self._close_widget(self.plots)

    @property
    def running(self) -> bool:
        return self._sampler_thread.is_alive() or self._pusher_thread.is_alive()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        load_bokehjs()
        display(self.widget)

    def _record(self, samples: list[GpuSample]) -> None:
        by_index = {s.nvml_index: s for s in samples}
        if all(i in by_index for i in self.indices):  # a sample missing a GPU (lost meanwhile) is skipped
            with self._lock:
                self._pending.append([by_index[i] for i in self.indices])

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self._paused.is_set():
                continue
            try:
                _, samples = self.sampler.sample()
            except Exception:  # noqa: BLE001 - a failed read (driver hiccup) skips one sample
                continue
            self._record(samples)

    def _push_loop(self) -> None:
        last_refresh = time.monotonic() - self.refresh_every + min(FIRST_REFRESH_S, self.refresh_every)
        while True:
            stopping = self._stop.wait(self.push_interval)
            self.push()
            if stopping:
                return
            if time.monotonic() - last_refresh >= self.refresh_every:
                refresh(self.plots, self.layout)
                self.refreshes += 1
                last_refresh = time.monotonic()

    def push(self) -> None:
        """Send what was sampled since the last push as one ``stream`` (all GPUs share one source)."""
        with self._lock:
            rows = list(self._pending)
            self._pending.clear()
        if rows:
            self.source.stream(_columns(self.indices, rows), rollover=self.history)
            self.pushes += 1

    def series(self, nvml_index: int, column: str) -> list[float]:
        """What the plots hold for one GPU: ``column`` is one of used, mine, others, total (GiB),
        utilization, temperature, or time (ms since the epoch)."""
        return list(self.source.data["time" if column == "time" else _column(column, nvml_index)])


def _kernel_gpus(inventory: Any) -> dict[int, int]:
    """NVML index -> cuda index of the GPUs this kernel sees (set through %gpu pick/use or the environment)."""
    import os

    from gpumagic.devices.visibility import current_visibility

    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return {}  # every GPU is visible: highlighting all of them would say nothing
    return {nvml: cuda for cuda, nvml in enumerate(current_visibility(inventory).nvml_indices)}


def _owned_box_class() -> Any:
    import ipywidgets

    class OwnedBox(ipywidgets.VBox):
        """A VBox whose ``close()`` also stops the dashboard that owns it."""

        def __init__(self, children: list[Any], owner: Any) -> None:
            super().__init__(children)
            self._owner = owner

        def close(self) -> None:
            owner, self._owner = getattr(self, "_owner", None), None
            if owner is not None and not sys.is_finalizing():
                owner.close()
            super().close()

    return OwnedBox


def _column(name: str, nvml_index: int) -> str:
    return f"{name}_{nvml_index}"


def _columns(indices: list[int], rows: list[list[GpuSample]]) -> dict[str, list[float]]:
    data: dict[str, list[float]] = {"time": [row[0].time * 1000 for row in rows]}  # bokeh datetimes are ms
    for position, index in enumerate(indices):
        samples = [row[position] for row in rows]
        data[_column("used", index)] = [s.memory_used / GIB for s in samples]
        data[_column("mine", index)] = [s.memory_mine / GIB for s in samples]
        data[_column("others", index)] = [s.memory_others / GIB for s in samples]
        data[_column("total", index)] = [s.memory_total / GIB for s in samples]
        data[_column("utilization", index)] = [s.utilization for s in samples]
        data[_column("temperature", index)] = [s.temperature for s in samples]
    return data


def text_view(samples: list[GpuSample], simulated: bool) -> str:
    """The compact line a terminal shows per refresh."""
    parts = [
        f"GPU {s.nvml_index}: {s.memory_used / GIB:5.1f}/{s.memory_total / GIB:.0f} GiB"
        f" (mine {s.memory_mine / GIB:.1f}) {s.utilization:3.0f}%"
        for s in samples
    ]
    return time.strftime("%H:%M:%S ") + (" [simulated] " if simulated else "") + " | ".join(parts)

"""``%gpu watch``: a live dashboard of every GPU (memory, with this kernel's share apart from other users',
utilization, temperature), sampled on a background thread and pushed to the browser at a bounded rate.

Only the pusher thread changes the bokeh document after the dashboard is shown, under the plots' lock, which a
page that connects later takes to read the plots whole (the document is not thread-safe; comm sends from a
thread are, in ipykernel 7.1+). Samples are buffered and each source gets
one ``stream(batch, rollover=history)`` per push for all GPUs, whatever the sampling rate, so the browser receives a
bounded number of messages and the memory used stays bounded however long it runs.

Closed (``close()``, or a new ``%gpu watch`` replacing it), the dashboard turns into a static copy of its last
state where it was shown (the status line, the bars and the plots as HTML), and its widgets are closed.
"""

from __future__ import annotations

import html
import logging
import os
import threading
import time
from collections import deque
from typing import Any

from gpumagic.devices.visibility import current_visibility
from gpumagic.telemetry.samplers import GpuSample, GpuSampler
from gpumagic.units import GIB
from gpumagic.widgets.live import ERROR, TEXT, Frames, live_model, owned_box
from gpumagic.widgets.plots import PALETTE, Forward, curve, forward_only, hover, load_colour, pick, styled_figure

_log = logging.getLogger(__name__)
COLUMNS = ("time", "elapsed", "used", "mine", "others", "total", "utilization", "temperature")


class GpuWatch:
    """A live GPU dashboard: a bar per GPU (memory and utilization now), then their history. ``widget`` is
    what a notebook displays; ``stop()`` ends its threads and keeps what it drew; ``close()`` also closes the
    widgets, leaving a static copy of the last state (``snapshot``) where it was shown."""

    def __init__(
        self,
        interval: float = 1.0,
        history: int = 600,
        push_interval: float = 0.5,
        sampler: GpuSampler | None = None,
    ) -> None:
        # lazy: bokeh is heavy, for views only
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
        self.started = first[0].time if first else time.time()
        # One source for all GPUs (columns used_0, used_1, ...): one stream per push, not one per GPU,
        # which is most of the dashboard's cost in the kernel.
        self.source = forward_only(ColumnDataSource({name: [] for name in _column_names(self.indices)}), "elapsed")
        self._pending: deque[list[GpuSample]] = deque(maxlen=self.history)
        self._latest: list[GpuSample] = []
        self._lock = threading.Lock()  # the samples between the two threads
        self._plots_lock = threading.RLock()  # the plots: changed by the pusher, read for a page that connects
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._forward = Forward()
        self.pushes = 0
        self.samples = 0
        self.problem = ""  # the last push's failure, shown in the header
        self.snapshot = ""  # the static copy it turns into when closed (HTML)
        self._frames = Frames("%gpu watch", plots=lambda: self.plots, status=self._static_html)  # where it is shown
        title = "GPUs" + (" (SIMULATED)" if self.simulated else "")
        memory = styled_figure(
            f"{title}: memory used, GiB (solid: all users, dashed: this kernel, dotted: total)",
            200,
            elapsed_x=True,
            y_from_zero=True,
        )
        busy = styled_figure("utilization, %", 160, elapsed_x=True, linked=memory, y_range=(0, 100))
        heat = styled_figure("temperature, °C", 140, elapsed_x=True, linked=memory, y_from_zero=True)
        self.kernel_gpus = _kernel_gpus(inventory)
        for position, index in enumerate(self.indices):
            color = PALETTE[position % len(PALETTE)]
            mine = index in self.kernel_gpus
            label = f"GPU {index} (this kernel: cuda:{self.kernel_gpus[index]})" if mine else f"GPU {index}"
            width = 3.5 if mine else 1.5  # the GPUs this kernel sees stand out
            curve(memory, self.source, "elapsed", _column("used", index), label=label, color=color, width=width)
            memory.line("elapsed", _column("mine", index), source=self.source, color=color, line_dash="dashed")
            memory.line(
                "elapsed", _column("total", index), source=self.source, color=color, line_dash="dotted", alpha=0.5
            )
            curve(busy, self.source, "elapsed", _column("utilization", index), label=label, color=color, width=width)
            curve(heat, self.source, "elapsed", _column("temperature", index), label=label, color=color, width=width)
        for plot in (memory, busy, heat):
            hover(plot, "elapsed", elapsed=True)
        self.layout = column(memory, busy, heat, sizing_mode="stretch_width")
        self._record(first)
        self._latest = first
        self.widget = self._build_widget()
        self._sampler_thread = threading.Thread(target=self._sample_loop, name="gpumagic-gpu-sampler", daemon=True)
        self._pusher_thread = threading.Thread(target=self._push_loop, name="gpumagic-gpu-pusher", daemon=True)
        self._sampler_thread.start()
        self._pusher_thread.start()

    def _build_widget(self) -> Any:
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        self._closed = False
        self.header = ipywidgets.HTML(self._header_text())
        self.bars = ipywidgets.HTML(self._bars_html())
        self.pause_button = ipywidgets.ToggleButton(description="Pause", icon="pause", tooltip="pause sampling")
        self.stop_button = ipywidgets.Button(description="Stop", icon="stop", tooltip="stop sampling; keep the plots")
        self.pause_button.observe(lambda change: self.pause(change["new"]), names="value")
        self.stop_button.on_click(lambda _: self.stop())
        self.plots = live_model(self.layout, self._plots_lock)
        controls = ipywidgets.HBox([self.pause_button, self.stop_button, self.header])
        return owned_box([controls, self.bars, self.plots], owner=self)

    def _header_text(self, closed: bool = False) -> str:
        if closed:
            state = f"closed at {time.strftime('%H:%M:%S')} · {self.samples} samples (a static copy)"
        elif self._stop.is_set():
            state = f"stopped at {time.strftime('%H:%M:%S')} · {self.samples} samples"
        elif self._paused.is_set():
            state = "paused"
        else:
            state = f"live · a sample every {self.interval:g}s, the last {self.history} kept"
        label = " · SIMULATED" if self.simulated else ""
        problem = f" · <span style='{ERROR}'>last push failed: {html.escape(self.problem)}</span>"
        return f"<b>{len(self.indices)} GPUs{label}</b> · {state}" + (problem if self.problem else "")

    def _bars_html(self) -> str:
        """A bar per GPU: memory used of total and utilization now, coloured by load; this kernel's marked."""
        rows = []
        for sample in self._latest:
            memory = 100 * sample.memory_used / sample.memory_total if sample.memory_total else 0.0
            mine = sample.nvml_index in self.kernel_gpus
            tag = f" <b>· this kernel (cuda:{self.kernel_gpus[sample.nvml_index]})</b>" if mine else ""
            rows.append(
                "<div class='gpumagic-gpu-bar' style='display:flex;align-items:center;gap:8px;margin:1px 0'>"
                f"<span style='width:4.5em'>GPU {sample.nvml_index}</span>"
                f"{_bar(memory, 'memory')}<span style='width:11em'>"
                f"{sample.memory_used / GIB:.1f} / {sample.memory_total / GIB:.0f} GiB</span>"
                f"{_bar(sample.utilization, 'utilization')}<span style='width:3.5em'>{sample.utilization:.0f}%</span>"
                f"<span style='width:4em'>{sample.temperature:.0f} °C</span>{tag}</div>"
            )
        return f"<div style='font-size:12px;{TEXT}'>" + "".join(rows) + "</div>"

    def pause(self, paused: bool = True) -> None:
        """Stop (or resume) sampling; what was drawn stays."""
        if paused:
            self._paused.set()
        else:
            self._paused.clear()
        self.header.value = self._header_text()

    def stop(self) -> None:
        """End both threads (within one sampling interval); the plots stay as they are. Safe to call twice."""
        self._stop.set()
        for thread in (self._sampler_thread, self._pusher_thread):
            if thread is not threading.current_thread():
                thread.join(timeout=max(5.0, 2 * self.interval))
        self.header.value = self._header_text()
        self.pause_button.disabled = self.stop_button.disabled = True

    def close(self) -> None:
        """Stop, and close the widgets: where the dashboard was shown, a static copy of its last state (status
        line, bars, plots) takes their place. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        static = self._static_html(closed=True)
        self.snapshot = self._frames.freeze(static, self.widget, self.plots, self.layout, self._plots_lock)

    def _static_html(self, closed: bool = False) -> str:
        """The header and the bars as plain HTML: the static copy's, and a front end's with no widgets."""
        return (
            f"<div class='gpumagic-gpu-watch' style='{TEXT}'><div style='margin:4px 0'>"
            f"{self._header_text(closed=closed)}</div>{self._bars_html()}</div>"
        )

    @property
    def running(self) -> bool:
        return self._sampler_thread.is_alive() or self._pusher_thread.is_alive()

    def _ipython_display_(self) -> None:
        self._frames.show(self.widget)

    def _record(self, samples: list[GpuSample]) -> None:
        by_index = {s.nvml_index: s for s in samples}
        if all(i in by_index for i in self.indices):  # a sample missing a GPU (lost meanwhile) is skipped
            with self._lock:
                self._pending.append([by_index[i] for i in self.indices])
                self.samples += 1

    def _sample_loop(self) -> None:
        next_at = time.monotonic()
        while True:
            next_at += self.interval  # a fixed rate, whatever a sample takes
            if self._stop.wait(max(0.0, next_at - time.monotonic())):
                return
            if self._paused.is_set():
                continue
            try:
                _, samples = self.sampler.sample()
            except Exception:  # noqa: BLE001 - a failed read (driver hiccup) skips one sample
                _log.debug("a GPU sample failed; skipped", exc_info=True)
                continue
            self._record(samples)

    def _push_loop(self) -> None:
        while True:
            stopping = self._stop.wait(self.push_interval)
            try:
                self.push()
                if not stopping:
                    self.plots.catch_up_once()
                    self._frames.refresh()  # the still picture, where the rich view does not draw
            except Exception as err:  # noqa: BLE001 - one failed push is told, and the next one tries again
                _log.debug("a push of the GPU watch failed; told in its header, the next tries again", exc_info=True)
                self.problem = f"{type(err).__name__}: {err}"
                self.header.value = self._header_text()
            if stopping:
                return

    def push(self) -> None:
        """Send what was sampled since the last push as one ``stream`` (all GPUs share one source), and
        redraw the bars."""
        with self._lock:
            rows = list(self._pending)
            self._pending.clear()
        if not rows:
            return
        data = _columns(self.indices, rows, self.started)
        kept = self._forward.keep(data["time"])
        with self._plots_lock:
            self.source.stream(pick(data, kept), rollover=self.history)
        self.pushes += 1
        self._latest = rows[-1]
        bars = self._bars_html()
        if bars != self.bars.value:
            self.bars.value = bars
        if self.problem:
            self.problem = ""
            self.header.value = self._header_text()

    def series(self, nvml_index: int, column: str) -> list[float]:
        """What the plots hold for one GPU: ``column`` is one of used, mine, others, total (GiB),
        utilization, temperature, time (ms since the epoch) or elapsed (seconds since the watch started)."""
        return list(self.source.data[column if column in ("time", "elapsed") else _column(column, nvml_index)])


def _bar(percent: float, what: str) -> str:
    colour = load_colour(percent)
    width = max(0.0, min(100.0, percent))
    return (
        f"<span title='{what} {percent:.0f}%' style='display:inline-block;width:140px;height:10px;"
        f"border-radius:3px;background:rgba(128,128,128,0.2)'><span style='display:block;height:100%;"
        f"width:{width:.1f}%;border-radius:3px;background:{colour}'></span></span>"
    )


def _kernel_gpus(inventory: Any) -> dict[int, int]:
    """NVML index -> cuda index of the GPUs this kernel sees (set through %gpu pick/use or the environment)."""
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return {}  # every GPU is visible: highlighting all of them would say nothing
    return {nvml: cuda for cuda, nvml in enumerate(current_visibility(inventory).nvml_indices)}


def _column(name: str, nvml_index: int) -> str:
    return f"{name}_{nvml_index}"


def _column_names(indices: list[int]) -> list[str]:
    return ["time", "elapsed", *(_column(c, i) for i in indices for c in COLUMNS[2:])]


def _columns(indices: list[int], rows: list[list[GpuSample]], started: float) -> dict[str, list[float]]:
    data: dict[str, list[float]] = {
        "time": [row[0].time * 1000 for row in rows],  # ms since the epoch, bokeh's datetimes
        "elapsed": [row[0].time - started for row in rows],
    }
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

"""Plotting a run reopened from disk: one figure per metric, one curve per rank."""

from __future__ import annotations

import threading
from typing import Any

from gpumagic.errors import InvalidArgument
from gpumagic.widgets.live import LiveFrame, live_model
from gpumagic.widgets.plots import PALETTE, StepCurve, curve, hover, styled_figure


class RunPlot:
    """The curves of a finished (or running) run, as a notebook widget; ``figures`` maps metric -> figure."""

    def __init__(self, run: Any, metrics: list[str] | None = None) -> None:
        # lazy: bokeh is heavy, for views only
        from bokeh.layouts import column

        self.run = run
        self.figures: dict[str, Any] = {}
        data = run.metrics()
        names = sorted({name for per_rank in data.values() for name in per_rank})
        unknown = sorted(set(metrics or []) - set(names))
        if unknown:
            raise InvalidArgument(
                f"run {run.id} has no metric {', '.join(unknown)}; it has {', '.join(names) or 'none'}"
            )
        for name in metrics or names:
            plot = styled_figure(f"{name} · {run.id}", 240, x_label="step")
            tool = hover(plot, "step", points=True)
            tool.renderers = []
            for rank, per_rank in sorted(data.items()):
                if name in per_rank:
                    series = per_rank[name]
                    line = StepCurve()  # a loop that restarted at step 0 is not drawn backwards
                    line.stream(series.steps, series.values)
                    source = line.source
                    color = PALETTE[rank % len(PALETTE)]
                    smooth = curve(plot, source, "step", "value", label=f"rank {rank}", color=color, smooth="smooth")
                    tool.renderers = [*tool.renderers, smooth]
            self.figures[name] = plot
        self.layout = column(*self.figures.values(), sizing_mode="stretch_width") if self.figures else None

    def _ipython_display_(self) -> None:
        # lazy: IPython display, in a kernel only
        from IPython.display import display

        if self.layout is None:
            display(f"run {self.run.id} has no metrics")
            return
        LiveFrame(live_model(self.layout, threading.RLock()), text=f"run {self.run.id}").show()

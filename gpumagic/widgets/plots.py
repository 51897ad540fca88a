"""Bokeh building blocks the dashboards share: figures over time or steps, per-rank curves, BokehJS loading,
and re-saving a widget's state so browser reloads keep the history."""

from __future__ import annotations

from typing import Any

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
TOOLS = "pan,wheel_zoom,box_zoom,reset"
# Patches sent before the browser has built the widget's view are dropped by BokehJS: a full re-save this
# long after a live dashboard starts catches up a view that missed its first updates.
FIRST_REFRESH_S = 2.0
_bokehjs_loaded = False


def time_figure(title: str, height: int, linked: Any = None, **options: Any) -> Any:
    """A full-width figure with a datetime x axis, sharing ``linked``'s x range (panning one pans both)."""
    from bokeh.plotting import figure

    if linked is not None:
        options["x_range"] = linked.x_range
    return figure(
        title=title, height=height, sizing_mode="stretch_width", x_axis_type="datetime", tools=TOOLS, **options
    )


def step_figure(title: str, height: int = 220) -> Any:
    """A full-width figure with training steps on the x axis."""
    from bokeh.plotting import figure

    return figure(title=title, height=height, sizing_mode="stretch_width", x_axis_label="step", tools=TOOLS)


def rank_curve(plot: Any, source: Any, rank: int, x: str = "step", y: str = "value") -> None:
    """One rank's line, in that rank's colour, in the legend (click to hide)."""
    plot.line(x, y, source=source, color=PALETTE[rank % len(PALETTE)], line_width=2, legend_label=f"rank {rank}")
    plot.legend.click_policy = "hide"
    plot.legend.location = "top_left"


def refresh(plots: Any, layout: Any) -> None:
    """Re-save the plots' whole state into the widget: a browser reload redraws a BokehModel from its saved
    state, which otherwise is the state it was created with (empty plots)."""
    plots.update_from_model(layout)


def load_bokehjs() -> None:
    """Put BokehJS into the page once per kernel, from bokeh's inline resources (no CDN: works offline)."""
    global _bokehjs_loaded
    if _bokehjs_loaded:
        return
    from bokeh.io.notebook import load_notebook
    from bokeh.resources import INLINE

    load_notebook(resources=INLINE, hide_banner=True)
    _bokehjs_loaded = True

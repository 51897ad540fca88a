"""Bokeh building blocks the dashboards share: figures styled alike (legend outside, exact values under the
mouse, toolbar on hover, text and axes in the colours of JupyterLab's theme), curves with a smoothed line over
the faint raw one and a smoothing slider run in the browser, a log-y tab, elapsed-time axes with round ticks,
bounded sources (``StepCurve``, ``stream_within``). How a live dashboard reaches the page is ``widgets.live``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from gpumagic.telemetry.metric_kinds import MOST_SMOOTHING, SPARSE_POINTS, smoothing_default

# 20 colours told apart side by side (10 hues, then the same hues darker and turned a little), each at least 3:1
# against white and against JupyterLab's dark backgrounds (#111111, #212121): WCAG's contrast for graphics
PALETTE = (
    "#468de5", "#d6673f", "#47a34e", "#be67b7", "#b58300", "#00a5b0", "#d66077", "#8c79e0", "#8a9600", "#00a87e",
    "#5e6eba", "#a8601e", "#058a60", "#a65481", "#827600", "#0084a3", "#b0554b", "#885faa", "#588333", "#008a81",
)  # fmt: skip
MUTED = "#8a8a8a"  # text, axes and grid: readable on a white and on a near-black background
TOOLS = "pan,wheel_zoom,box_zoom,reset,save"
SMOOTHING = 0.6  # weight of the exponential moving average, TensorBoard's default
ELAPSED_FORMAT = """
const whole = Math.round(Math.max(0, tick));
const h = Math.floor(whole / 3600), m = Math.floor((whole % 3600) / 60), sec = whole % 60;
const two = (n) => String(n).padStart(2, "0");
return h > 0 ? `${h}:${two(m)}:${two(sec)}` : `${m}:${two(sec)}`;
"""


# Colours of the plots' text and lines from JupyterLab's theme (BokehJS reads --bk-* variables where a view is
# drawn): at least 4.5:1 against the light and the dark theme's background; outside JupyterLab, the fallbacks
THEMED_CSS = """
:host {
  --gm-text: var(--jp-ui-font-color1, #3b3b3b);
  --gm-muted: var(--jp-ui-font-color2, #5f5f5f);
  --bk-text-color: var(--gm-muted);
  --bk-major-label-text-color: var(--gm-muted);
  --bk-axis-label-text-color: var(--gm-muted);
  --bk-label-text-color: var(--gm-text);
  --bk-axis-line-color: var(--gm-muted);
  --bk-major-tick-line-color: var(--gm-muted);
  --color: var(--gm-text);
  --background-color: var(--jp-layout-color1, #ffffff);
  --hover-color: var(--jp-layout-color2, #eeeeee);
  --border-color: var(--jp-border-color1, #bdbdbd);
  --divider-color: var(--jp-border-color2, #e0e0e0);
  --inactive-fg: var(--gm-muted);
  color: var(--gm-text);
}
.noUi-target { background: var(--jp-layout-color2, #fafafa); border-color: var(--jp-border-color1, #d3d3d3); }
.noUi-handle { background: var(--jp-layout-color1, #ffffff); border-color: var(--jp-border-color1, #d9d9d9); }
.noUi-connect { background: var(--jp-brand-color1, #3fb8af); }
"""


def themed(model: Any) -> Any:
    """Draw ``model``'s text, axes and tabs in the colours of JupyterLab's theme (THEMED_CSS)."""
    # lazy: bokeh is heavy, for views only
    from bokeh.models import InlineStyleSheet

    model.stylesheets = [*model.stylesheets, InlineStyleSheet(css=THEMED_CSS)]
    return model


def elapsed_ticker(ticks: int = 5) -> Any:
    """Ticks of elapsed seconds at whole, round times (1, 2, 5, 10, 15, 30 s, the same in minutes, then in
    hours), about ``ticks`` of them: labels such as ``0:42`` that never overlap."""
    # lazy: bokeh is heavy, for views only
    from bokeh.models import AdaptiveTicker

    return AdaptiveTicker(base=60, mantissas=[1, 2, 5, 10, 15, 30], min_interval=1, desired_num_ticks=ticks)


def styled_figure(
    title: str,
    height: int,
    *,
    x_label: str | None = None,
    elapsed_x: bool = False,
    y_from_zero: bool = False,
    linked: Any = None,
    legend: bool = True,
    **options: Any,
) -> Any:
    """A full-width figure in the dashboards' style. ``elapsed_x``: x is seconds from a start, ticked ``0:42``;
    ``y_from_zero``: the y axis starts at 0 (memory, utilization: a flat line is not magnified);
    ``linked``: share that figure's x range (panning one pans both); ``legend``: a legend right of the plot."""
    # lazy: bokeh is heavy, for views only
    from bokeh.models import (
        CustomJSTickFormatter,
        DataRange1d,
        Legend,
        NumeralTickFormatter,
    )
    from bokeh.plotting import figure

    if linked is not None:
        options["x_range"] = linked.x_range
    if y_from_zero and "y_range" not in options:
        options["y_range"] = DataRange1d(start=0, only_visible=True)
    elif "y_range" not in options:
        options["y_range"] = DataRange1d(only_visible=True)
    options.setdefault("sizing_mode", "stretch_width")
    plot = figure(title=title, height=height, tools=TOOLS, x_axis_label=x_label, **options)
    narrow = options.get("sizing_mode") == "fixed" and options.get("width", 600) < 400
    if elapsed_x:
        plot.xaxis.ticker = elapsed_ticker(3 if narrow else 6)
        plot.xaxis.formatter = CustomJSTickFormatter(code=ELAPSED_FORMAT)
    else:  # steps: 950, 12k, 1.5M, a few of them: labels that never overlap
        plot.xaxis.formatter = NumeralTickFormatter(format="0.[0]a")
        plot.xaxis.ticker.desired_num_ticks = 4 if narrow else 6
    _style(plot)
    themed(plot)
    if legend:
        plot.add_layout(
            Legend(
                click_policy="hide",
                background_fill_alpha=0,
                border_line_alpha=0,
                label_text_color=MUTED,
                label_text_font_size="8pt",
                glyph_height=12,
                spacing=0,
                padding=2,
                margin=4,
            ),
            "right",
        )
    return plot


def _style(plot: Any) -> None:
    plot.toolbar.logo = None
    plot.toolbar.autohide = True
    plot.background_fill_alpha = 0
    plot.border_fill_alpha = 0
    plot.outline_line_alpha = 0.25
    plot.min_border_left = 50
    plot.title.text_color = MUTED
    plot.title.text_font_style = "normal"
    plot.title.text_font_size = "10pt"
    for axis in (*plot.xaxis, *plot.yaxis):
        axis.axis_line_color = MUTED
        axis.major_tick_line_color = MUTED
        axis.minor_tick_line_color = None
        axis.major_label_text_color = MUTED
        axis.axis_label_text_color = MUTED
        axis.axis_label_text_font_style = "normal"
    for grid in (*plot.xgrid, *plot.ygrid):
        grid.grid_line_color = MUTED
        grid.grid_line_alpha = 0.2


def hover(plot: Any, x_name: str, elapsed: bool = False, points: bool = False) -> Any:
    """Values under the mouse on every line of ``plot``: the line's name, x (``0:42`` when ``elapsed``) and y.
    ``points``: lines of ``StepCurve`` sources, whose rows show as they are: step, value and smoothed value to 6
    significant digits. Returns the tool (its ``renderers`` narrow it to some lines)."""
    # lazy: bokeh is heavy, for views only
    from bokeh.models import CustomJSHover, HoverTool

    if points:
        tool = HoverTool(
            tooltips=[("", "$name"), ("step", "@step{0,0}"), ("value", "@value{%.6g}"), ("smoothed", "@smooth{%.6g}")],
            formatters={"@value": "printf", "@smooth": "printf"},
            line_policy="nearest",
        )
        plot.add_tools(tool)
        return tool
    formatters: dict[str, Any] = {}
    x_field = "$snap_x{0,0.[00]}"
    if elapsed:
        formatters["$snap_x"] = CustomJSHover(code=ELAPSED_FORMAT.replace("tick", "value"))
        x_field = "$snap_x{custom}"
    tool = HoverTool(
        tooltips=[("", "$name"), (x_name, x_field), ("value", "$snap_y{0,0.[0000]}")],
        formatters=formatters,
        line_policy="nearest",
    )
    plot.add_tools(tool)
    return tool


def curve(
    plot: Any, source: Any, x: str, y: str, *, label: str, color: str, width: float = 2, smooth: str | None = None
) -> Any:
    """One series: the line of ``y`` (faint behind ``smooth`` when given) named ``label`` (in the legend where
    the plot has one)."""
    # lazy: bokeh is heavy, for views only
    from bokeh.models import Legend

    named: dict[str, Any] = {"name": label}
    if any(isinstance(panel, Legend) for panel in plot.right):
        named["legend_label"] = label
    if smooth is None:
        return plot.line(x, y, source=source, color=color, line_width=width, **named)
    plot.line(x, y, source=source, color=color, line_width=1, alpha=0.25, **named)
    return plot.line(x, smooth, source=source, color=color, line_width=width, **named)


def log_tabs(title: str, height: int, **options: Any) -> tuple[Any, Any, Any]:
    """Two views of one metric, a tab each (switched in the browser, no kernel needed): linear and log y.
    Returns (tabs, linear figure, log figure); draw every curve on both."""
    # lazy: bokeh is heavy, for views only
    from bokeh.models import TabPanel, Tabs

    linear = styled_figure(title, height, **options)
    log = styled_figure(title + " (log)", height, y_axis_type="log", **options)
    log.x_range = linear.x_range
    tabs = Tabs(tabs=[TabPanel(child=linear, title="linear"), TabPanel(child=log, title="log y")])
    tabs.sizing_mode = "stretch_width"
    return themed(tabs), linear, log


class SteadySpan:
    """Keeps a linear y axis from magnifying a flat series (a constant learning rate drawn on -1..1, 162.0 to
    162.5 MiB filling the plot): the axis spans at least 10 % of the values' magnitude. Changed only when the
    magnitude moves by 2x, so the browser gets a handful of updates per run. Several curves on one plot: each
    feeds its own ``series`` (the plot's magnitude is the largest of their latest ones; a rank at 0.01 and one at
    1 would otherwise change the axis at every push)."""

    def __init__(self, plot: Any) -> None:
        self.plot = plot
        self.magnitude = 0.0
        self._latest: dict[Hashable, float] = {}  # series -> the magnitude of its latest values

    def feed(self, values: Iterable[float], series: Hashable = None) -> None:
        finite = [abs(v) for v in values if math.isfinite(v)]
        if not finite:
            return
        self._latest[series] = max(finite)
        magnitude = max(self._latest.values())
        if magnitude > 0 and not (self.magnitude / 2 <= magnitude <= self.magnitude * 2):
            self.magnitude = magnitude
            self.plot.y_range.min_interval = 0.1 * magnitude


class Smoother:
    """The debiased exponential moving average of one series, TensorBoard's: ``ema / (1 - w**n)``, so the first
    points are not pulled towards 0 and a point's smoothed value never changes as the run grows."""

    def __init__(self, weight: float = SMOOTHING) -> None:
        self.weight = weight
        self.ema = 0.0
        self.count = 0

    def feed(self, values: Iterable[float]) -> list[float]:
        smoothed = []
        for value in values:
            if not math.isfinite(value):
                smoothed.append(value)  # a NaN or inf is shown as it is, and does not poison what follows
                continue
            self.count += 1
            self.ema = self.weight * self.ema + (1 - self.weight) * value
            smoothed.append(self.ema / (1 - self.weight**self.count))
        return smoothed


class Forward:
    """Keeps a plotted x series non-decreasing: ``keep`` returns the indices of the points after the last one
    sent (a point logged again, or at an earlier step, is not drawn backwards); ``dropped`` counts the rest."""

    def __init__(self) -> None:
        self.last = -math.inf
        self.dropped = 0

    def keep(self, xs: Sequence[float]) -> list[int]:
        kept = []
        for index, x in enumerate(xs):
            if x >= self.last:
                self.last = x
                kept.append(index)
            else:
                self.dropped += 1
        return kept


# Run in the browser after each stream into a source: if its x column goes back anywhere (the same points applied
# twice to a view, when a page built its plots from a state and then received an update already in it), keep
# only the rows whose x is not before an earlier one (as Forward does in the kernel).
FORWARD_ONLY = """
const data = cb_obj.data, isMap = data instanceof Map;
const get = (name) => (isMap ? data.get(name) : data[name]);
const xs = get(x);
if (!xs) return;
let backwards = false;
for (let i = 1; i < xs.length; i++) if (xs[i] < xs[i - 1]) { backwards = true; break; }
if (!backwards) return;
const keep = [];
let last = -Infinity;
for (let i = 0; i < xs.length; i++) if (xs[i] >= last) { keep.push(i); last = xs[i]; }
const names = isMap ? Array.from(data.keys()) : Object.keys(data);
const kept = names.map((name) => [name, keep.map((i) => get(name)[i])]);
cb_obj.data = isMap ? new Map(kept) : Object.fromEntries(kept);
"""


def forward_only(source: Any, x: str) -> Any:
    """Make the browser keep ``source``'s ``x`` column increasing after every stream (see FORWARD_ONLY)."""
    # lazy: bokeh is heavy, for views only
    from bokeh.models import CustomJS

    source.js_on_change("streaming", CustomJS(args={"x": x}, code=FORWARD_ONLY))
    return source


# Run in the browser when the smoothing slider moves and after each stream into a source: the "smooth" column
# from "value" (the debiased moving average of Smoother) at the slider's weight. Until the user moves the
# slider, its weight follows the points' density (smoothing_default of the longest curve).
SMOOTH_JS = """
const auto = (n) => (n < sparse ? 0 : Math.round(100 * Math.min(most, 1 - sparse / n)) / 100);
const column = (data, name) => (data instanceof Map ? data.get(name) : data[name]);
if (cb_obj === slider && !slider._gm_quiet) slider._gm_user = true;
if (!slider._gm_user) {
  const longest = Math.max(0, ...sources.map((s) => (column(s.data, "value") || []).length));
  const weight = auto(longest);
  if (weight !== slider.value) { slider._gm_quiet = true; slider.value = weight; slider._gm_quiet = false; }
}
const w = slider.value;
const targets = cb_obj === slider || !sources.includes(cb_obj) ? sources : [cb_obj];
for (const source of targets) {
  const values = column(source.data, "value"), smooth = column(source.data, "smooth");
  if (!values || !smooth || smooth.length !== values.length) continue;
  let ema = 0, n = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (!Number.isFinite(v)) { smooth[i] = v; continue; }
    n += 1; ema = w * ema + (1 - w) * v;
    smooth[i] = w > 0 ? ema / (1 - Math.pow(w, n)) : v;
  }
  source.change.emit();
}
"""


class Smoothing:
    """The smoothing slider of a dashboard (0 = raw points): it re-smooths every curve ``follow``ed, in the
    browser, when moved and after each stream (no kernel needed: it works in a static copy too); its weight
    follows the points' density (``smoothing_default``) until the user moves it."""

    def __init__(self) -> None:
        # lazy: bokeh is heavy, for views only
        from bokeh.models import CustomJS, Slider

        self.slider = themed(Slider(start=0, end=0.99, step=0.01, value=0.0, title="smoothing", width=220))
        self.sources: list[Any] = []
        rule = {"sparse": SPARSE_POINTS, "most": MOST_SMOOTHING}  # smoothing_default's, in the browser
        self._callback = CustomJS(args={"slider": self.slider, "sources": self.sources, **rule}, code=SMOOTH_JS)
        self.slider.js_on_change("value", self._callback)

    def follow(self, source: Any) -> None:
        """Smooth ``source`` (a ``StepCurve``'s, not on a page yet) with the slider's weight from now on, and at
        once as the curves' density suits (the caller holds the plots' lock)."""
        self.sources.append(source)
        self._callback.args = {**self._callback.args, "sources": list(self.sources)}
        source.js_on_change("streaming", self._callback)
        if self.slider.document is None:  # not on a page yet: it comes with the weight that suits the points
            self.slider.value = self._suited_weight()
        _smooth(source, self.slider.value)

    def settle(self) -> None:
        """Smooth every followed source in the kernel at the weight their density suits, and show it on the
        slider: what a static copy shows before anyone moves the slider (the caller holds the plots' lock)."""
        self.slider.value = weight = self._suited_weight()
        for source in self.sources:
            _smooth(source, weight)

    def _suited_weight(self) -> float:
        return smoothing_default(max((len(source.data["value"]) for source in self.sources), default=0))


def _smooth(source: Any, weight: float) -> None:
    """Set ``source``'s "smooth" column from its "value" column at ``weight`` (``Smoother``)."""
    source.data = {**source.data, "smooth": Smoother(weight).feed(source.data["value"])}


class StepCurve:
    """One curve's source, fed (step, value) batches: only points at or after its last step are drawn
    (``Forward``, in the kernel and in the browser), with the smoothed column beside the raw one
    (``Smoother``). ``dropped`` counts the points not drawn. With ``limit``, the source never holds more
    than ``limit`` points however long the run (``stream_within``): the whole curve, its older part thinned."""

    def __init__(self, limit: int | None = None) -> None:
        # lazy: bokeh is heavy, for views only
        from bokeh.models import ColumnDataSource

        self.limit = limit
        self.source = forward_only(ColumnDataSource({"step": [], "value": [], "smooth": []}), "step")
        self.reset()

    def reset(self) -> None:
        """Empty, as if new (the caller holds the plots' lock)."""
        self.source.data = {"step": [], "value": [], "smooth": []}
        self._forward = Forward()
        self._smoother = Smoother()

    @property
    def dropped(self) -> int:
        return self._forward.dropped

    def stream(self, steps: Sequence[float], values: Sequence[float], rollover: int | None = None) -> list[float]:
        """Append the points not behind the last step (the caller holds the plots' lock); returns their values.
        ``rollover``: keep only the latest points (ignored with a ``limit``, which keeps the whole curve)."""
        kept = self._forward.keep(steps)
        if not kept:
            return []
        columns = pick({"step": steps, "value": values}, kept)
        batch = {**columns, "smooth": self._smoother.feed(columns["value"])}
        if self.limit is None:
            self.source.stream(batch, rollover=rollover)
        else:
            stream_within(self.source, batch, "step", ("value",), self.limit)
        return columns["value"]


def stream_within(source: Any, batch: dict[str, list[Any]], x: str, ys: Sequence[str], limit: int) -> None:
    """Append ``batch`` to ``source`` (rows in increasing ``x``), which never holds more than ``limit`` rows:
    while they fit, a ``stream`` (the new rows alone reach the browser); past that, the source is replaced by
    its rows ``thinned`` (about three quarters of ``limit``: the next thinning is a quarter of ``limit`` rows
    away, so each point costs a few rows sent at most). The caller holds the plots' lock."""
    if len(source.data[x]) + len(batch[x]) <= limit:
        source.stream(batch)
        return
    merged = {name: [*values, *batch[name]] for name, values in source.data.items()}
    source.data = thinned(merged, x, ys, limit)


def thinned(columns: dict[str, list[Any]], x: str, ys: Sequence[str], limit: int) -> dict[str, list[Any]]:
    """``columns`` (rows in increasing ``x``) in at most ``3 * limit // 4`` rows: the latest ``limit // 2`` as
    they are; the older ones cut into equal spans of ``x`` (``limit // (8 * len(ys))`` of them), each kept as its
    rows of the lowest and highest of each of ``ys`` (a spike stays; a NaN is passed over unless a span holds
    nothing else), and the first row stays. The whole history keeps its shape in a bounded number of rows.

    >>> thinned({"x": list(range(10)), "y": [0, 5, 1, 1, 1, 1, 1, 1, 1, 1]}, "x", ["y"], 8)["x"]
    [0, 1, 6, 7, 8, 9]
    """
    # lazy: numpy is heavy, for views only
    import numpy

    rows = len(columns[x])
    recent = limit // 2
    if rows <= limit:
        return columns
    old = rows - recent
    spans = max(1, limit // (8 * len(ys)))
    xs = numpy.asarray(columns[x][:old], dtype=float)
    width = xs[-1] - xs[0]
    if width > 0 and numpy.isfinite(width):
        span = numpy.minimum(((xs - xs[0]) / width * spans).astype(int), spans - 1)
    else:
        span = numpy.zeros(old, dtype=int)
    keep = [numpy.zeros(1, dtype=int)]  # where the curve starts
    for y in ys:
        values = numpy.asarray(columns[y][:old], dtype=float)
        missing = numpy.isnan(values)
        for sign in (1, -1):  # the lowest, then the highest (a NaN sorts after every number)
            order = numpy.lexsort((numpy.where(missing, numpy.inf, sign * values), span))
            sorted_span = span[order]
            keep.append(order[numpy.r_[True, sorted_span[1:] != sorted_span[:-1]]])
    kept = numpy.unique(numpy.concatenate(keep))
    if len(kept) + recent > 3 * limit // 4:  # more spans than fit (a tiny limit): every n-th of them
        kept = kept[:: -(-len(kept) // max(1, 3 * limit // 4 - recent))]
    return {name: [values[i] for i in kept.tolist()] + list(values[old:]) for name, values in columns.items()}


def pick(columns: dict[str, Sequence[Any]], indices: list[int]) -> dict[str, list[Any]]:
    """The rows ``indices`` of column data."""
    return {name: [values[i] for i in indices] for name, values in columns.items()}


LOAD_COLOURS = ((90.0, "#cf222e"), (50.0, "#d29922"), (0.0, "#2ea043"))  # from this % up: this colour


def load_colour(percent: float) -> str:
    """Green under 50 %, amber under 90 %, red from 90 % (memory or utilization)."""
    return next(colour for floor, colour in LOAD_COLOURS if percent >= floor)

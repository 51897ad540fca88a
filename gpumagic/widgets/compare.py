"""The comparison of runs in a notebook (``gpumagic.compare``, ``%jobs compare``): it draws what
``gpumagic.jobs.comparison`` reads. One Bokeh document, interactive in the browser alone (a busy or ended
kernel changes nothing): a filter box, the smoothing slider and a CSV button; parallel coordinates (an axis per
hyperparameter and one for the metric, a polyline per run coloured by the metric); the table (sorts by a click
on any column); the curves of every run, per metric. All three share one selection: rows picked in the table, a
polyline tapped or a box drawn over the axes' points highlight those runs everywhere and dim the rest.

Curves are thinned to at most ``THIN_POINTS`` points (fewer with many runs: ``CURVE_BUDGET`` points a metric in
all; a bucket keeps its lowest and highest value, so a spike stays), the ``FULL_RUNS`` best runs' to
``FULL_POINTS`` (benchmarks/compare.py times a thousand runs of a thousand points).
"""

from __future__ import annotations

import functools
import html
import math
import threading
from typing import Any

from gpumagic.jobs.comparison import RunComparison, format_number, seed_groups
from gpumagic.launch.kernel_side.output import in_kernel
from gpumagic.telemetry.metric_kinds import higher_is_better, lower_is_better, smoothing_default
from gpumagic.units import plain
from gpumagic.widgets.job_table import status_html
from gpumagic.widgets.live import LiveFrame, close_tree, quiet
from gpumagic.widgets.picture import picture_of
from gpumagic.widgets.plots import MUTED, PALETTE, log_tabs, styled_figure

PLOT_HEIGHT = 260
AXES_HEIGHT = 300
THIN_POINTS = 100
CURVE_BUDGET = 50_000
FULL_POINTS = 1000
FULL_RUNS = 10
BAND_ALPHA = 0.18
GROUPED_RUNS = 100
CELL_PADDING = "padding:1px 8px"  # a widget's HTML gets none of the notebook's table style
# from the worst to the best value of the metric: PALETTE's orange, through its violet, to its blue
SCALE = (PALETTE[1], PALETTE[7], PALETTE[0])
FG, BG, BG2, LINE = ("var(--jp-ui-font-color1, #1f1f1f)", "var(--jp-layout-color1, white)",
                     "var(--jp-layout-color2, #eeeeee)", "var(--jp-border-color1, #bdbdbd)")  # fmt: skip
TABLE_CSS = f""".slick-header-column, .slick-cell {{ color: {FG}; background: {BG}; border-color: {BG2}; }}
.slick-header-column {{ font-weight: 600; background: {BG2}; }} .slick-row.odd .slick-cell {{ background: {BG2}; }}
.slick-row .slick-cell.selected {{ background: var(--jp-brand-color3, #bbdefb); color: var(--jp-ui-font-color0); }}
.slick-viewport, .bk-data-table {{ background: {BG}; }}"""
WIDGET_CSS = f""":host {{ color: {FG}; }} .bk-input {{ color: {FG}; background: {BG}; border-color: {LINE}; }}
.bk-btn-default {{ color: {FG}; background: {BG2}; border-color: {LINE}; }}"""
NUMBER_TEMPLATE = (
    '<div style="text-align:right"><%= value == null || isNaN(value) ? "–" : '
    "String(Number(Number(value).toPrecision(4))) %></div>"
)
DURATION_TEMPLATE = (
    '<div style="text-align:right"><%= value == null || isNaN(value) ? "–" : (() => { const t = Math.round(value); '
    "const two = (n) => String(n).padStart(2, '0'); return (t >= 3600 ? Math.floor(t / 3600) + ':' + "
    "two(Math.floor(t / 60) % 60) : Math.floor(t / 60)) + ':' + two(t % 60); })() %></div>"
)
JS_GET = "const col = (s, k) => (s.data instanceof Map ? s.data.get(k) : s.data[k]);\n"
SELECT_JS = """
const chosen = Array.from(runs.selected.indices).sort((a, b) => a - b);
for (const s of others)
    if (String(s.selected.indices) !== String(chosen)) s.selected.indices = chosen;
const names = col(runs, "name");
info.text = `<span style="color:var(--jp-ui-font-color1)">${names.length} runs` +
    (chosen.length ? ` · ${chosen.length} selected: ${chosen.slice(0, 4).map((i) => names[i]).join(", ")}` +
        (chosen.length > 4 ? " …" : "") : " · select rows, tap a line or draw a box over the axes") + "</span>";
"""
FOLLOW_JS = """
const chosen = Array.from(cb_obj.indices).sort((a, b) => a - b);
if (String(runs.selected.indices) !== String(chosen)) runs.selected.indices = chosen;
"""
BRUSH_JS = """
const run = col(points, "run");
const chosen = [...new Set(Array.from(points.selected.indices, (i) => run[i]))].sort((a, b) => a - b);
runs.selected.indices = chosen;
"""
SMOOTH_JS = """
const weight = slider.value;
sources.forEach((s) => {
    const raws = col(s, "raw"), out = [];
    for (const raw of raws) {
        // the same span of x for every curve: a curve with more points gets a heavier weight
        const w = weight <= 0 || !raw.length ? 0 :
            Math.min(0.999, Math.max(0, 1 - ((1 - weight) * reference) / raw.length));
        const ys = new Float64Array(raw.length);
        let ema = 0, count = 0;
        for (let i = 0; i < raw.length; i++) {
            const v = raw[i];
            if (!Number.isFinite(v)) { ys[i] = v; continue; }
            count += 1;
            ema = w * ema + (1 - w) * v;
            ys[i] = w > 0 ? ema / (1 - Math.pow(w, count)) : v;
        }
        out.push(ys);
    }
    s.data = s.data instanceof Map ? new Map([...s.data, ["ys", out]]) : Object.assign({}, s.data, {ys: out});
});
"""
FILTER_JS = """
const text = (input.value_input ?? input.value ?? "").trim(), n = col(runs, "name").length, parsed = [];
let problem = "";
for (const part of text.split(/\\s*(?:,|;|\\band\\b)\\s*/)) {
    if (!part.trim()) continue;
    const m = part.match(/^\\s*(.+?)\\s*(<=|>=|==|!=|<|>|=|~)\\s*(.*?)\\s*$/);
    if (!m) { problem = `a filter is COLUMN OP VALUE (lr<=0.01, status=finished, name~A-), got "${part}"`; continue; }
    let name = m[1];
    if (!columns.includes(name) && columns.includes(name + " best")) name += " best";
    if (!columns.includes(name)) { problem = `no column "${m[1]}"; the columns: ${columns.join(", ")}`; continue; }
    parsed.push([col(runs, name), m[2], m[3]]);
}
const number = (v) => (typeof v === "number" ? v : v === null || v === "" || isNaN(Number(v)) ? null : Number(v));
const pass = (v, op, w) => {
    if (v === null || v === undefined || (typeof v === "number" && isNaN(v))) return op === "!=";
    if (op === "~") return String(v).toLowerCase().includes(w.toLowerCase());
    let a = number(v), b = number(w);
    if (a === null || b === null) {
        if (!["=", "==", "!="].includes(op) && (a === null) !== (b === null)) return false;
        a = String(v); b = w;
    }
    return {"=": a === b, "==": a === b, "!=": a !== b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op];
};
const keep = Array.from({length: n}, (_, i) => parsed.every(([values, op, w]) => pass(values[i], op, w)));
const shown = keep.filter((k) => k).length;
filter.booleans = keep;
message.text = problem ? `<span style="color:var(--jp-error-color1)">${problem}</span>` :
    parsed.length ? `<span style="color:var(--jp-ui-font-color1)">${shown} of ${n} runs</span>` : "";
"""
CSV_JS = """
const keep = filter.booleans;
const quote = (v) => {
    if (v === null || v === undefined || (typeof v === "number" && isNaN(v))) return "";
    const s = String(v);
    return /[",\\n]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
};
const lines = [columns.map(([header]) => quote(header)).join(",")];
for (let i = 0; i < col(runs, "name").length; i++)
    if (!keep || keep[i]) lines.push(columns.map(([, f, value]) => quote(f ? col(runs, f)[i] : value)).join(","));
const blob = new Blob([lines.join("\\n") + "\\n"], {type: "text/csv"});
const link = Object.assign(document.createElement("a"), {href: URL.createObjectURL(blob), download: "comparison.csv"});
document.body.appendChild(link);
link.click();
link.remove();
"""


class Comparison(RunComparison):
    """Runs and jobs side by side (``gpumagic.compare``): the data of ``RunComparison`` (``rows``, ``curves``,
    ``sort``, ``filter``, ``to_pandas``, ``to_csv``) and its views: ``widget`` in a notebook (x axis buttons and
    Refresh over the Bokeh document ``layout()``), ``_repr_html_`` a static table, ``repr`` text."""

    def __init__(self, *args: Any, **options: Any) -> None:
        self._widget: Any = None
        self._frames: list[Any] = []
        super().__init__(*args, **options)

    def switch_x(self, x: str) -> None:
        super().switch_x(x)
        if self._widget is not None:
            self._show_plots()

    def _arrange(self) -> None:
        super()._arrange()
        if getattr(self, "_widget", None) is not None:
            self._show_plots()

    def _repr_html_(self) -> str:
        right = {c: self.numeric(c) for c in self.columns}
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
            for column, text in zip(self.columns, self.cells(row), strict=True):
                shown = html.escape(text)
                if column == "status":  # its word in the theme's text colour, after a dot of its hue
                    shown = status_html(text)
                cells.append(
                    f"<td style='text-align:{'right' if right[column] else 'left'};{CELL_PADDING}'>{shown}</td>"
                )
            body.append("<tr>" + "".join(cells) + "</tr>")
        notes = "".join(f"<div style='color:var(--jp-ui-font-color1)'>{html.escape(n)}</div>" for n in self.notes())
        return (
            f"<table class='gpumagic-compare'><thead><tr>{''.join(head)}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>{notes}"
        )

    @property
    def widget(self) -> Any:
        """The notebook view (built on first use): x axis buttons and Refresh over the Bokeh document."""
        if self._widget is None:
            self._widget = self._build_widget()
        return self._widget

    def _build_widget(self) -> Any:
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        self._x_buttons = ipywidgets.ToggleButtons(
            options=["step", "elapsed", "time"], value=self.x, tooltips=["x: the step", "x: seconds since each run's "
            "first point", "x: the wall clock"], layout=ipywidgets.Layout(width="auto")
        )  # fmt: skip
        self._x_buttons.style.button_width = "5.5em"
        refresh = ipywidgets.Button(description="Refresh", tooltip="read the runs again from disk")
        self._x_buttons.observe(lambda change: self.switch_x(change["new"]), names="value")
        refresh.on_click(lambda _: self.refresh())
        self._plots, self._model, self._layout = ipywidgets.VBox([]), None, None
        self._widget = ipywidgets.VBox([ipywidgets.HBox([self._x_buttons, refresh]), self._plots])
        self._show_plots()
        return self._widget

    def _show_plots(self) -> None:
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        old = self._model, self._layout
        self._layout = self.layout()
        self._model = None if self._layout is None else _static_model_class()(self._layout)
        self._plots.children = [self._model or ipywidgets.HTML("<i>no runs to show</i>")]
        _close_plots(*old)
        self._draw_stills()

    def layout(self) -> Any:
        """The Bokeh document: controls, parallel coordinates, the table, the curves; None with no rows."""
        # lazy: numpy and bokeh are heavy, for views only
        import numpy
        from bokeh.layouts import column, row
        from bokeh.models import BooleanFilter, CDSView, Div

        if not self.rows:
            return None
        self.runs, self.fields = self._runs_source()
        self.filter_model = BooleanFilter(booleans=[True] * len(self.rows))
        self.info = Div(text="", sizing_mode="stretch_width")
        self.axes = self._parallel_coordinates(CDSView(filter=self.filter_model))
        self.table = self._table(CDSView(filter=self.filter_model))
        self.figures: dict[str, Any] = {}
        self.curve_sources: dict[str, Any] = {}
        thinned = {metric: self._thinned(metric) for metric in self.metrics}
        # the densest metric's curves set the smoothing: a sparser one is smoothed over the same span of x, less
        lengths = [float(numpy.median([len(r) for r in raws if len(r)] or [1])) for _, raws in thinned.values()]
        self.reference = max(lengths, default=1.0)
        self.smoothing = smoothing_default(self.reference)
        self._seed_lines = self._groups_drawn()
        blocks = [self._metric_figure(m, CDSView(filter=self.filter_model), *thinned[m]) for m in self.metrics]
        points, others, runs = self._axis_points, list(self.curve_sources.values()), self.runs
        runs.selected.js_on_change("indices", _js(SELECT_JS, {"runs": runs, "others": others, "info": self.info}))
        for source in others:
            source.selected.js_on_change("indices", _js(FOLLOW_JS, {"runs": runs}))
        points.selected.js_on_change("indices", _js(BRUSH_JS, {"runs": runs, "points": points}))
        self.info.text = f"<span style='color:var(--jp-ui-font-color1)'>{len(self.rows)} runs · select rows, "
        self.info.text += "tap a line or draw a box over the axes</span>"
        controls = row(*self._controls(others))
        return column(controls, self.info, self.axes, self.table, *blocks, sizing_mode="stretch_width")

    def _runs_source(self) -> tuple[Any, list[str]]:
        """One row per run (the table's order): every column, the polyline over the axes, the colour."""
        # lazy: numpy and bokeh are heavy, for views only
        import numpy
        from bokeh.models import ColumnDataSource

        data: dict[str, Any] = {}
        for name in self.columns:
            values = [r.get(name) for r in self.rows]
            if self.numeric(name):
                data[name] = numpy.array([numpy.nan if v is None else float(v) for v in values])
            else:
                data[name] = ["" if v is None else str(v) for v in values]
        self.metric = self._primary_metric()
        best = data.get(f"{self.metric} best") if self.metric else None
        data["color"] = _colours(best, self.metric, len(self.rows))
        return ColumnDataSource(data), list(self.columns)

    def _primary_metric(self) -> str | None:
        """The metric the axes end with and the colours show: the sorted one, a loss, else the first."""
        if self.sort_by and self.sort_by.endswith((" best", " last")):
            return self.sort_by.rsplit(" ", 1)[0]
        return next((m for m in self.metrics if lower_is_better(m)), self.metrics[0] if self.metrics else None)

    def _parallel_coordinates(self, view: Any) -> Any:
        """An axis per hyperparameter that differs (and the metric's best), a polyline per run."""
        # lazy: numpy and bokeh are heavy, for views only
        import numpy
        from bokeh.models import (
            BoxSelectTool,
            ColumnDataSource,
            FixedTicker,
            HoverTool,
            Range1d,
            TapTool,
        )

        keys = [k for k in self.keys if k != "seed" and self.config_columns[k] in self.columns]
        axes = [self.config_columns[k] for k in keys] + ([f"{self.metric} best"] if self.metric else [])
        data = self.runs.data
        scaled = numpy.array([_scale(data[a])[0] for a in axes]).reshape(len(axes), len(self.rows))
        xs = numpy.arange(len(axes), dtype=float)
        self.runs.data["axes_x"] = [xs.tolist()] * len(self.rows)
        self.runs.data["axes_y"] = scaled.T.tolist()
        plot = styled_figure(
            f"{len(self.rows)} runs: hyperparameters and {self.metric or 'no metric'} (best)",
            AXES_HEIGHT,
            legend=False,
            x_range=Range1d(-0.3, max(len(axes) - 0.4, 0.7)),
            y_range=Range1d(-0.08, 1.08),
        )
        plot.yaxis.visible = plot.ygrid.visible = plot.xgrid.visible = False
        plot.xaxis.ticker = FixedTicker(ticks=list(range(len(axes))))
        plot.xaxis.major_label_overrides = {i: a for i, a in enumerate(axes)}
        plot.xaxis.major_label_text_font_size = "9pt"
        alpha = min(0.8, max(0.2, 40 / max(1, len(self.rows))))
        lines = plot.multi_line(
            "axes_x", "axes_y", source=self.runs, view=view, line_color="color", line_alpha=alpha, line_width=1.5
        )
        lines.selection_glyph = lines.glyph.clone(line_alpha=1.0, line_width=3)
        lines.nonselection_glyph = lines.glyph.clone(line_alpha=0.03)
        labels = [(i + 0.04, y, text) for i, axis in enumerate(axes) for y, text in _scale(data[axis])[1]]
        ticks = {name: [label[k] for label in labels] for k, name in enumerate(("x", "y", "text"))}
        plot.segment(x0=xs, y0=0, x1=xs, y1=1, line_color=MUTED, line_width=1.5)
        plot.text("x", "y", "text", source=ColumnDataSource(ticks), text_color=MUTED, text_font_size="8pt",
                  text_baseline="middle")  # fmt: skip
        run = numpy.tile(numpy.arange(len(self.rows)), len(axes))  # axis by axis: x never goes back
        self._axis_points = ColumnDataSource(
            {"x": numpy.repeat(xs, len(self.rows)), "y": scaled.reshape(-1), "run": run}
        )
        dots = plot.scatter("x", "y", source=self._axis_points, size=4, color=MUTED, alpha=0.3)
        dots.selection_glyph = dots.glyph.clone(fill_alpha=0.9, line_alpha=0.9)
        dots.nonselection_glyph = dots.glyph.clone(fill_alpha=0.15, line_alpha=0.15)
        plot.add_tools(BoxSelectTool(renderers=[dots]), TapTool(renderers=[lines]))
        numbers = [a for a in axes if self.numeric(a)]  # to 6 significant digits, as logged (0.0003, 1.234e-05)
        tips = [("run", "@name"), *((a, f"@{{{a}}}" + ("{%.6g}" if a in numbers else "")) for a in axes)]
        formats = {f"@{{{a}}}": "printf" for a in numbers}
        plot.add_tools(HoverTool(renderers=[lines], tooltips=[*tips, ("status", "@status")], formatters=formats))
        plot.toolbar.active_drag = plot.select_one(BoxSelectTool)
        return plot

    def _table(self, view: Any) -> Any:
        """The table: every column, sortable with a click on its header, rows selectable. Hyperparameters as
        they were given, metrics to 4 significant digits, durations as ``1:02:03``."""
        # lazy: bokeh is heavy, for views only
        from bokeh.models import (
            DataTable,
            HTMLTemplateFormatter,
            InlineStyleSheet,
            StringFormatter,
            TableColumn,
        )

        number, duration = (
            HTMLTemplateFormatter(template=NUMBER_TEMPLATE),
            HTMLTemplateFormatter(template=DURATION_TEMPLATE),
        )
        text = {True: StringFormatter(text_align="right", nan_format="–"), False: StringFormatter(nan_format="–")}
        columns = []
        for name in self.columns:
            if name == "duration":
                formatter = duration
            elif name == "GPU hours" or name.endswith((" best", " last")):
                formatter = number
            else:
                formatter = text[self.numeric(name)]
            numbers = self.numeric(name) and name not in self.config_columns.values()
            longest = 9 if numbers else max((len(str(v)) for v in self.runs.data[name][:200]), default=0)
            width = min(240, max(60, 8 * max(len(name), longest) + 12))  # a share of the table's width
            columns.append(TableColumn(field=name, title=name, width=width, formatter=formatter))
        return DataTable(
            source=self.runs,
            view=view,
            columns=columns,
            index_position=None,
            height=min(320, 30 + 25 * len(self.rows)),
            sizing_mode="stretch_width",
            stylesheets=[InlineStyleSheet(css=TABLE_CSS)],
        )

    def _thinned(self, metric: str) -> tuple[list[Any], list[Any]]:
        """Each row's curve of ``metric`` (x and y), thinned: ``FULL_POINTS`` for the best runs, else fewer."""
        # lazy: numpy is heavy, for views only
        import numpy

        arrays = [self.arrays(metric, r) for r in self.rows]
        best = self.runs.data.get(f"{metric} best")
        order = numpy.argsort(best * (-1 if higher_is_better(metric) else 1)) if best is not None else []
        limit = int(min(THIN_POINTS, max(40, CURVE_BUDGET / max(1, len(self.rows)))))
        full = {int(i) for i in order[:FULL_RUNS] if best is not None and math.isfinite(best[i])}
        xs, raws = [], []
        empty = numpy.zeros(0, dtype=numpy.float32)
        x_type = numpy.float64 if self.x == "time" else numpy.float32  # half the bytes; a date needs 64 bits
        limits = [FULL_POINTS if index in full else limit for index in range(len(arrays))]
        kept = thin_indices([empty if pair is None else pair[1] for pair in arrays], limits)
        for pair, keep in zip(arrays, kept, strict=True):
            xs.append(empty if pair is None else pair[0][keep].astype(x_type))
            raws.append(empty if pair is None else pair[1][keep].astype(numpy.float32))
        return xs, raws

    def _metric_figure(self, metric: str, view: Any, xs: list[Any], raws: list[Any]) -> Any:
        """One metric's figure: a curve per run, dimmed where others are selected; seed groups' mean and band
        over them. A linear and a log-y tab for loss-like metrics."""
        # lazy: bokeh is heavy, for views only
        from bokeh.models import ColumnDataSource, HoverTool, TapTool

        ys = smoothed(raws, self.smoothing, self.reference)
        names, colours = list(self.runs.data["name"]), list(self.runs.data["color"])
        source = ColumnDataSource({"xs": xs, "raw": raws, "ys": ys, "name": names, "color": colours})
        options: dict[str, Any] = {"x_label": self.x, "legend": False, "elapsed_x": self.x == "elapsed"}
        if self.x == "time":
            options["x_axis_type"] = "datetime"
        if lower_is_better(metric):
            block, linear, log = log_tabs(metric, PLOT_HEIGHT, **options)
            plots = [linear, log]
        else:
            block = linear = styled_figure(metric, PLOT_HEIGHT, **options)
            plots = [linear]
        alpha = min(0.9, max(0.15, 20 / max(1, len(self.rows))))
        for plot in plots:
            curves = plot.multi_line("xs", "ys", source=source, view=view, line_color="color", line_alpha=alpha)
            curves.selection_glyph = curves.glyph.clone(line_alpha=1.0, line_width=2.5)
            curves.nonselection_glyph = curves.glyph.clone(line_alpha=0.04)
            x_tip = "$snap_x{%F %T}" if self.x == "time" else "$snap_x{0,0.[00]}"
            plot.add_tools(
                HoverTool(
                    renderers=[curves],
                    tooltips=[("run", "@name"), (self.x, x_tip), (metric, "$snap_y{%.6g}")],
                    formatters={"$snap_y": "printf", **({"$snap_x": "datetime"} if self.x == "time" else {})},
                    line_policy="nearest",
                ),
                TapTool(renderers=[curves]),
            )
            self._draw_groups(plot, metric)
        self.figures[metric] = linear
        self.curve_sources[metric] = source
        return block

    def _groups_drawn(self) -> list[Any]:
        """The seed groups drawn as mean and band: all of them, if there are a few (``GROUPED_RUNS`` runs in
        ``len(PALETTE)`` groups at most; with more, the table's seed column tells them apart)."""
        groups = seed_groups(self.members) if self.group_seeds and self.x != "time" else []
        few = 0 < len(groups) <= len(PALETTE) and sum(map(len, groups)) <= GROUPED_RUNS
        return [line for line in self.lines if line.grouped] if few else []

    def _draw_groups(self, plot: Any, metric: str) -> None:
        """Each seed group's mean and ± std band, with a legend entry (a few groups at most)."""
        # lazy: bokeh is heavy, for views only
        from bokeh.models import ColumnDataSource, Legend

        groups = [line for line in self._seed_lines if metric in line.points]
        if groups:
            legend = Legend(background_fill_alpha=0, border_line_alpha=0, label_text_color=MUTED)
            legend.label_text_font_size = "8pt"
            plot.add_layout(legend, "right")
        for number, line in enumerate(groups):
            points = line.points[metric]
            colour = PALETTE[number % len(PALETTE)]
            data = {"x": points.x, "value": points.value, "lower": points.lower, "upper": points.upper}
            source = ColumnDataSource(data)
            plot.varea(x="x", y1="lower", y2="upper", source=source, fill_color=colour, fill_alpha=BAND_ALPHA,
                       legend_label=line.label)  # fmt: skip
            plot.line("x", "value", source=source, color=colour, line_width=2.5, legend_label=line.label)

    def _controls(self, sources: list[Any]) -> list[Any]:
        """The filter box, the smoothing slider and the CSV button, all working in the browser alone."""
        # lazy: bokeh is heavy, for views only
        from bokeh.models import Button, Div, InlineStyleSheet, Slider, TextInput

        style = [InlineStyleSheet(css=WIDGET_CSS)]
        message = Div(text="", width=240)
        box = TextInput(placeholder="filter: lr<=0.01, status=finished, name~A-", width=330, stylesheets=style)
        shared = {"runs": self.runs, "filter": self.filter_model}
        filtering = {**shared, "input": box, "message": message, "columns": self.fields}
        box.js_on_change("value_input", _js(FILTER_JS, filtering))
        slider = Slider(start=0, end=0.99, step=0.01, value=self.smoothing, title="smoothing", width=220)
        slider.stylesheets = style
        slider.js_on_change(
            "value",
            _js(SMOOTH_JS, {"slider": slider, "sources": sources, "reference": self.reference}),
        )
        csv = Button(label="CSV", width=70, stylesheets=style)
        csv.js_on_event("button_click", _js(CSV_JS, {**shared, "columns": self._csv_columns()}))
        self.slider, self.filter_box, self.csv_button = slider, box, csv
        return [box, slider, csv, message]

    def _csv_columns(self) -> list[list[str]]:
        """``[header, field of the runs' source or "", the value where no field]`` for the columns of ``to_csv``."""
        fields = {"duration_s": "duration", "gpu_hours": "GPU hours", "gpus": "GPUs"}
        fields.update({f"{m}_{w}": f"{m} {w}" for m in self.metrics for w in ("best", "last")})
        fields.update({k: self.config_columns[k] for k in self.keys if self.config_columns[k] in self.columns})
        shared = {k: "" if v is None else str(plain(v)) for k, v in self.shared.items()}
        return [[h, fields.get(h, h if h in self.columns else ""), shared.get(h, "")] for h in self.export_columns()]

    def _ipython_display_(self) -> None:
        if not in_kernel():
            print(repr(self))
            return
        self._frames.append(LiveFrame(self.widget, repr(self)))  # BokehJS (tables, widgets too), then the view
        self._frames[-1].show()
        self._draw_stills()

    def _draw_stills(self) -> None:
        """The curves as a picture in each frame, shown where the plots cannot draw (no jupyter_bokeh)."""
        if self._frames and self._layout is not None:
            picture = picture_of(self._layout, threading.RLock())  # the kernel never changes a shown layout
            for frame in self._frames:
                frame.draw_still(picture)

    def close(self) -> None:
        """Close the notebook view's widgets, the plots' included (a later ``widget`` builds a new view)."""
        if self._widget is not None:
            _close_plots(self._model, self._layout)
            self._model = self._layout = None
            close_tree(self._widget)
            self._widget = None
        while self._frames:
            close_tree(self._frames.pop().frame)


@functools.cache
def _static_model_class() -> type:
    # lazy: jupyter_bokeh imports bokeh
    from jupyter_bokeh.widgets import BokehModel

    class StaticBokehModel(BokehModel):
        """A BokehModel of a document the kernel never changes once shown (a new view replaces it): serialized
        once, its state what any page gets. The browser's changes (a selection, the smoothed curves, the
        filter) stay in the browser: nothing is sent back, however many runs."""

        def __init__(self, layout: Any) -> None:
            super().__init__(quiet(layout))

        def _sync_model(self, model: Any, content: dict[str, Any], buffers: list[Any]) -> None:
            """Nothing comes back from the browser (its models are unsynced): the kernel's view stays as drawn."""

    return StaticBokehModel


def _js(code: str, args: dict[str, Any]) -> Any:
    """A CustomJS running ``code`` with ``args`` and ``col(source, name)``, a column of a source."""
    # lazy: bokeh is heavy, for views only
    from bokeh.models import CustomJS

    return CustomJS(args=args, code=JS_GET + code)


def _close_plots(model: Any, layout: Any) -> None:
    """Close the widget showing ``layout`` and free its bokeh document (so that closing it again is a no-op)."""
    if model is not None:
        model.close()
    if layout is not None and layout.document is not None:
        layout.document.remove_root(layout)


def thin_indices(rows: list[Any], limits: list[int]) -> list[Any]:
    """For each row of values, the indices of at most its limit of points that keep its shape: the row cut into
    ``limit // 2 - 1`` equal runs of points, each kept as its lowest and highest value (a NaN only where a run
    has nothing else), and the first and last point; all of them when there are no more than the limit. Rows
    of one length and limit are thinned together.

    >>> [kept.tolist() for kept in thin_indices([[0.0, 5, 1, 1, 1, 1, 1, 1, 9, 1]], [6])]
    [[0, 1, 5, 8, 9]]
    """
    # lazy: numpy is heavy, for views only
    import numpy

    found: list[Any] = [None] * len(rows)
    groups: dict[tuple[int, int], list[int]] = {}
    for index, (row, limit) in enumerate(zip(rows, limits, strict=True)):
        groups.setdefault((len(row), limit), []).append(index)
    for (count, limit), indices in groups.items():
        if count <= limit:
            for index in indices:
                found[index] = numpy.arange(count)
            continue
        buckets = max(1, limit // 2 - 1)
        size = -(-count // buckets)
        grid = numpy.full((len(indices), buckets * size), numpy.nan)
        grid[:, :count] = numpy.vstack([rows[i] for i in indices])
        grid = grid.reshape(len(indices), buckets, size)
        offsets, missing = numpy.arange(buckets) * size, numpy.isnan(grid)
        low = offsets + numpy.argmin(numpy.where(missing, numpy.inf, grid), axis=2)
        high = offsets + numpy.argmax(numpy.where(missing, -numpy.inf, grid), axis=2)
        kept = numpy.sort(numpy.concatenate((numpy.tile([0, count - 1], (len(indices), 1)), low, high), axis=1), axis=1)
        for k, index in enumerate(indices):
            row = kept[k][kept[k] < count]
            found[index] = row[numpy.r_[True, row[1:] != row[:-1]]]
    return found


def smoothed(rows: list[Any], weight: float, reference: float) -> list[Any]:
    """Each row's debiased exponential moving average (TensorBoard's: ``ema / (1 - w**n)``; a NaN stays and
    does not spread), ``weight`` for a row of ``reference`` points and heavier for longer rows, so that every
    curve is averaged over the same span of x (the browser's SMOOTH_JS does the same when the slider moves).
    Rows of one length are smoothed together, a column at a time."""
    # lazy: numpy is heavy, for views only
    import numpy

    result: list[Any] = list(rows)
    by_length: dict[int, list[int]] = {}
    for index, row in enumerate(rows):
        by_length.setdefault(len(row), []).append(index)
    for length, indices in by_length.items():
        w = 0.0 if weight <= 0 or not length else min(0.999, max(0.0, 1 - (1 - weight) * reference / length))
        if w == 0:
            continue
        matrix = numpy.vstack([rows[i] for i in indices])
        out = numpy.empty_like(matrix)
        ema = numpy.zeros(len(indices))
        count = numpy.zeros(len(indices))
        for j in range(length):
            values = matrix[:, j]
            finite = numpy.isfinite(values)
            count += finite
            ema = numpy.where(finite, w * ema + (1 - w) * numpy.where(finite, values, 0), ema)
            out[:, j] = numpy.where(finite, ema / (1 - w ** numpy.maximum(count, 1)), values)
        for k, index in enumerate(indices):
            result[index] = out[k]
    return result


def _scale(values: Any) -> tuple[Any, list[tuple[float, str]]]:
    """A column on an axis of 0..1: numbers linearly (logarithmically where they span two decades or more),
    text as evenly spaced categories; with the axis' labels ``[(y, text)]``. Missing values are NaN."""
    # lazy: numpy is heavy, for views only
    import numpy

    if isinstance(values, numpy.ndarray) and values.dtype.kind == "f":
        finite = values[numpy.isfinite(values)]
        if not len(finite):
            return numpy.full(len(values), numpy.nan), []
        low, high = float(finite.min()), float(finite.max())
        log = low > 0 and high / low >= 100
        shown = numpy.log10(values) if log else values
        lo, hi = (math.log10(low), math.log10(high)) if log else (low, high)
        if hi == lo:
            return numpy.where(numpy.isfinite(values), 0.5, numpy.nan), [(0.5, format_number(low))]
        ticks = [10.0**p for p in range(math.ceil(lo), math.floor(hi) + 1)] if log else []
        ticks = ticks if len(ticks) >= 2 else [10**v if log else v for v in numpy.linspace(lo, hi, 5)]
        labelled = [((math.log10(t) if log else t) - lo) / (hi - lo) for t in ticks]
        return (shown - lo) / (hi - lo), [
            (y, format_number(float(f"{t:.3g}"))) for y, t in zip(labelled, ticks, strict=True)
        ]
    texts = ["" if v is None else str(v) for v in values]
    categories = sorted({t for t in texts if t})
    where = {c: (i / (len(categories) - 1) if len(categories) > 1 else 0.5) for i, c in enumerate(categories)}
    scaled = numpy.array([where.get(t, numpy.nan) for t in texts], dtype=float)
    step = max(1, len(categories) // 12)
    return scaled, [(where[c], c[:14]) for c in categories[::step]]


def _colours(best: Any, metric: str | None, count: int) -> list[str]:
    """Each run's colour by the rank of its best value: PALETTE's blue for the best, orange for the worst;
    ``MUTED`` for a run without one."""
    # lazy: numpy is heavy, for views only
    import numpy

    if best is None or metric is None:
        return [MUTED] * count
    finite = numpy.isfinite(best)
    order = numpy.argsort(numpy.where(finite, -best if higher_is_better(metric) else best, numpy.inf))
    rank = numpy.empty(len(best))
    rank[order] = numpy.arange(len(best))
    share = 1 - rank / max(1, finite.sum() - 1)  # 1: the best
    ramp = _ramp()
    return [ramp[round(min(max(t, 0.0), 1.0) * 255)] if ok else MUTED for t, ok in zip(share, finite, strict=True)]


@functools.cache
def _ramp() -> list[str]:
    """256 colours from SCALE's first to its last, through the middle ones."""
    stops = [tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in SCALE]
    found = []
    for step in range(256):
        at = step / 255 * (len(stops) - 1)
        low = min(int(at), len(stops) - 2)
        a, b, f = stops[low], stops[low + 1], at - low
        found.append("#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b, strict=True)))
    return found

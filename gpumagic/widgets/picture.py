"""A still picture of a dashboard's plots, drawn in the kernel as SVG from the same Bokeh sources the live view
streams: for where BokehJS cannot draw them (a front end without the jupyter_bokeh extension, a renderer with
no widgets, a saved notebook viewed where no script runs). Needs nothing in the page; a few kilobytes.
"""

from __future__ import annotations

import html
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpumagic.widgets.plots import MUTED

PANEL_WIDTH = 440
PANEL_HEIGHT = 180
COLUMNS = 2
MOST_POINTS = 300  # a line's points drawn at most: enough for its shape at this size
FAINT = 0.5  # a line less opaque than this is a faint one
PANEL_POINTS = 12_000  # the points of a multi_line's lines together (hundreds of runs), at most
TITLE_CHARACTERS = 64  # a longer title is cut (whole in its tooltip): it would run into the next panel
LEGEND_ENTRIES = 8
_LEFT, _RIGHT, _TOP, _BOTTOM = 54, 10, 22, 22  # the margins inside a panel: axis labels, title


@dataclass(frozen=True)
class Line:
    """One line of a figure as it is now: its points (finite ones), colour, opacity and width."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    colour: str
    alpha: float
    width: float
    label: str
    dash: str = ""  # SVG's stroke-dasharray ("" for solid)


@dataclass(frozen=True)
class Panel:
    """One figure: its title, lines, whether its x is elapsed seconds and whether its y starts at 0."""

    title: str
    lines: tuple[Line, ...]
    elapsed_x: bool
    y_from_zero: bool


def panels_of(layout: Any, lock: threading.RLock) -> list[Panel]:
    """The figures of ``layout`` in the order they are laid out (of a ``Tabs``, its active tab), read under
    ``lock``."""
    if layout is None:
        return []
    with lock:
        return [_panel(plot) for plot in _figures_in(layout)]


def svg_of(panels: Sequence[Panel], columns: int = COLUMNS) -> str:
    """``panels`` drawn side by side, ``columns`` to a row, as one SVG element ("" where there is none)."""
    if not panels:
        return ""
    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    width, height = columns * PANEL_WIDTH, rows * PANEL_HEIGHT
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="gpumagic-picture" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" style="max-width:100%;height:auto" font-family="sans-serif" '
        f'font-size="11" role="img"><title>{html.escape(", ".join(p.title for p in panels))}</title>'
    ]
    for number, panel in enumerate(panels):
        x0, y0 = (number % columns) * PANEL_WIDTH, (number // columns) * PANEL_HEIGHT
        parts.append(f'<g transform="translate({x0},{y0})">{_panel_svg(panel)}</g>')
    parts.append("</svg>")
    return "".join(parts)


def picture_of(layout: Any, lock: threading.RLock) -> str:
    """``layout``'s figures as they are now, as SVG ("" for none)."""
    return svg_of(panels_of(layout, lock))


# --- reading the figures --------------------------------------------------------------------------------------


def _figures_in(model: Any) -> Iterator[Any]:
    # lazy: bokeh is heavy, for views only
    from bokeh.models import Plot, Tabs

    if isinstance(model, Plot):
        yield model
    elif isinstance(model, Tabs):
        if model.tabs:
            yield from _figures_in(model.tabs[min(model.active, len(model.tabs) - 1)].child)
    else:
        for child in getattr(model, "children", None) or ():
            yield from _figures_in(child[0] if isinstance(child, tuple) else child)  # a GridBox's (child, row, col)


def _panel(plot: Any) -> Panel:
    # lazy: bokeh is heavy, for views only
    from bokeh.models import CustomJSTickFormatter, GlyphRenderer
    from bokeh.models.glyphs import Line as LineGlyph
    from bokeh.models.glyphs import MultiLine

    lines = []
    renderers = [
        r
        for r in plot.renderers
        if isinstance(r, GlyphRenderer) and isinstance(r.glyph, (LineGlyph, MultiLine)) and r.visible
    ]
    # a faint line under an opaque one of the same source (the raw points under the smoothed curve) is left
    # out: half the bytes, and the picture reads the same at its size
    opaque = {id(r.data_source) for r in renderers if r.glyph.line_alpha >= FAINT}
    for renderer in renderers:
        if renderer.glyph.line_alpha < FAINT and id(renderer.data_source) in opaque:
            continue
        glyph, data = renderer.glyph, renderer.data_source.data
        if isinstance(glyph, MultiLine):
            lines.extend(_multi_line(glyph, data))
            continue
        xs, ys = data.get(_field(glyph.x)), data.get(_field(glyph.y))
        if xs is None or ys is None:
            continue
        line = _line(xs, ys, str(glyph.line_color), float(glyph.line_alpha), float(glyph.line_width), renderer.name)
        lines.append(replace(line, dash=_dash(glyph.line_dash)))
    start = getattr(plot.y_range, "start", None)
    return Panel(
        title=str(plot.title.text if plot.title is not None else ""),
        lines=tuple(lines),
        elapsed_x=any(isinstance(axis.formatter, CustomJSTickFormatter) for axis in plot.xaxis),
        y_from_zero=isinstance(start, (int, float)) and start == 0,
    )


def _multi_line(glyph: Any, data: dict[str, Any]) -> list[Line]:
    """The lines of a ``multi_line`` (a comparison's runs): a colour per row where ``line_color`` names a column,
    each row's "name" as its label; together at most ``PANEL_POINTS`` points (at least 30 a line)."""
    xs, ys = data.get(_field(glyph.xs)), data.get(_field(glyph.ys))
    if xs is None or ys is None:
        return []
    rows = min(len(xs), len(ys))
    colours = data.get(glyph.line_color) if isinstance(glyph.line_color, str) else None
    colours = colours if colours is not None else [str(glyph.line_color)] * rows
    names = data.get("name") or [""] * rows
    most = max(30, min(MOST_POINTS, PANEL_POINTS // max(1, rows)))
    alpha, width, dash = float(glyph.line_alpha), float(glyph.line_width), _dash(glyph.line_dash)
    return [replace(_line(xs[i], ys[i], str(colours[i]), alpha, width, names[i], most), dash=dash) for i in range(rows)]


DASHES = {"solid": "", "dashed": "6 4", "dotted": "2 4", "dotdash": "2 4 6 4", "dashdot": "6 4 2 4"}


def _dash(pattern: Any) -> str:
    """Bokeh's ``line_dash`` (a name or a list of lengths) as SVG's stroke-dasharray."""
    if isinstance(pattern, str):
        return DASHES.get(pattern, pattern if all(part.isdigit() for part in pattern.split()) else "")
    return " ".join(str(int(length)) for length in pattern or ())


def _field(spec: Any) -> Any:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, dict):
        return spec.get("field")
    return getattr(spec, "field", None)


def _line(
    xs: Sequence[Any], ys: Sequence[Any], colour: str, alpha: float, width: float, label: Any, most: int = MOST_POINTS
) -> Line:
    """A line's finite points, at most ``most`` of them (evenly spaced, its last one kept)."""
    count = min(len(xs), len(ys))
    step = max(1, -(-count // most))
    indices = list(range(0, count, step))
    if count and indices[-1] != count - 1:
        indices.append(count - 1)
    points = [(float(xs[i]), float(ys[i])) for i in indices]
    kept = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
    return Line(tuple(x for x, _ in kept), tuple(y for _, y in kept), colour, alpha, width, str(label or ""))


# --- drawing --------------------------------------------------------------------------------------------------


def _panel_svg(panel: Panel) -> str:
    inner_w, inner_h = PANEL_WIDTH - _LEFT - _RIGHT, PANEL_HEIGHT - _TOP - _BOTTOM
    title = panel.title if len(panel.title) <= TITLE_CHARACTERS else panel.title[: TITLE_CHARACTERS - 1] + "…"
    parts = [
        f'<text x="{_LEFT}" y="14" fill="{MUTED}"><title>{html.escape(panel.title)}</title>{html.escape(title)}</text>'
    ]
    parts.append(
        f'<rect x="{_LEFT}" y="{_TOP}" width="{inner_w}" height="{inner_h}" fill="none" stroke="{MUTED}" '
        'stroke-opacity="0.4"/>'
    )
    drawn = [line for line in panel.lines if line.xs]
    if not drawn:
        parts.append(f'<text x="{_LEFT + 8}" y="{_TOP + 18}" fill="{MUTED}">no points yet</text>')
        return "".join(parts)
    x_low = min(min(line.xs) for line in drawn)
    x_high = max(max(line.xs) for line in drawn)
    y_low = min(min(line.ys) for line in drawn)
    y_high = max(max(line.ys) for line in drawn)
    if panel.y_from_zero:
        y_low = min(0.0, y_low)
    if x_high <= x_low:
        x_high = x_low + 1
    if y_high <= y_low:
        y_low, y_high = y_low - 0.5, y_high + 0.5

    def place(x: float, y: float) -> str:  # whole pixels: a short text per point
        px = _LEFT + (x - x_low) / (x_high - x_low) * inner_w
        py = _TOP + inner_h - (y - y_low) / (y_high - y_low) * inner_h
        return f"{px:.0f},{py:.0f}"

    for line in drawn:
        points = " ".join(place(x, y) for x, y in zip(line.xs, line.ys, strict=True))
        dash = f' stroke-dasharray="{line.dash}"' if line.dash else ""
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{html.escape(line.colour)}" '
            f'stroke-opacity="{line.alpha:g}" stroke-width="{line.width:g}" stroke-linejoin="round"{dash}/>'
        )
    legend = list(dict.fromkeys((line.label, line.colour) for line in drawn if line.label))[:LEGEND_ENTRIES]
    for number, (label, colour) in enumerate(legend):  # the lines' names, top right inside the plot
        y = _TOP + 12 + 12 * number
        parts.append(
            f'<text x="{_LEFT + inner_w - 6}" y="{y}" text-anchor="end" font-size="9" '
            f'fill="{html.escape(colour)}">{html.escape(label)}</text>'
        )
    bottom = _TOP + inner_h
    labels = (
        (_LEFT - 4, _TOP + 10, "end", _number(y_high)),
        (_LEFT - 4, bottom, "end", _number(y_low)),
        (_LEFT, bottom + 14, "start", _x_label(x_low, panel.elapsed_x)),
        (_LEFT + inner_w, bottom + 14, "end", _x_label(x_high, panel.elapsed_x)),
    )
    for x, y, anchor, text in labels:
        parts.append(f'<text x="{x}" y="{y}" text-anchor="{anchor}" fill="{MUTED}">{html.escape(text)}</text>')
    return "".join(parts)


def _number(value: float) -> str:
    return f"{value:.4g}"


def _x_label(value: float, elapsed: bool) -> str:
    if not elapsed:
        return _number(value) if abs(value) < 1e4 else f"{value / 1000:.4g}k"
    whole = max(0, round(value))
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"

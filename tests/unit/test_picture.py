"""The still picture of a dashboard's plots (``widgets.picture``), drawn from the Bokeh sources the live view
streams, and the static copy that keeps it for where no script runs."""

import math
import re
import threading

from gpumagic.widgets import plots
from gpumagic.widgets.live import embedded, still_beside
from gpumagic.widgets.picture import MOST_POINTS, panels_of, picture_of, svg_of


def a_dashboard():
    """A layout like the launch dashboard's: a resources column, then a loss with a log-y tab."""
    from bokeh.layouts import column, row
    from bokeh.models import ColumnDataSource

    tabs, linear, log = plots.log_tabs("loss", 200)
    memory = plots.styled_figure("memory", 150, elapsed_x=True, y_from_zero=True, legend=False)
    for rank in range(2):
        steps = list(range(5000))
        values = [1.0 / (step + 1) + rank for step in steps]
        values[10] = math.nan  # a diverged step
        source = ColumnDataSource({"step": steps, "value": values, "smooth": values})
        for figure in (linear, log):
            plots.curve(
                figure, source, "step", "value", label=f"rank {rank}", color=plots.PALETTE[rank], smooth="smooth"
            )
        used = ColumnDataSource({"time": [0.0, 90.0], "memory": [100.0, 300.0 + rank]})
        plots.curve(memory, used, "time", "memory", label=f"rank {rank}", color=plots.PALETTE[rank])
    empty = plots.styled_figure("lr", 100)
    return row(column(memory), column(tabs, empty))


def test_the_figures_are_read_in_layout_order_of_a_tabs_only_the_shown_one():
    panels = panels_of(a_dashboard(), threading.RLock())
    assert [p.title for p in panels] == ["memory", "loss", "lr"]  # not "loss (log)": its tab is not shown
    memory, loss, empty = panels
    assert memory.elapsed_x and memory.y_from_zero and not loss.elapsed_x
    assert [line.label for line in loss.lines] == ["rank 0", "rank 1"]  # smoothed; not the faint raw lines
    assert [line.alpha for line in loss.lines] == [1.0, 1.0]
    assert all(len(line.xs) <= MOST_POINTS + 1 for line in loss.lines)  # a picture's worth of points
    assert all(line.xs[-1] == 4999 for line in loss.lines)  # the latest point is always drawn
    assert all(math.isfinite(y) for line in loss.lines for y in line.ys)  # the NaN is left out
    assert empty.lines == ()


def test_the_svg_draws_a_polyline_per_line_with_its_colour_labels_and_ranges():
    picture = picture_of(a_dashboard(), threading.RLock())
    assert picture.startswith("<svg") and picture.endswith("</svg>")
    assert picture.count("<polyline") == 2 + 2  # memory's two, loss's two; none for the empty figure
    assert plots.PALETTE[0] in picture and plots.PALETTE[1] in picture
    assert "no points yet" in picture  # the empty figure says so
    assert ">1:30<" in picture  # the elapsed axis ends at 1:30, in the dashboards' format
    assert ">rank 1<" in picture  # the legend
    assert len(picture) < 15_000  # light: 15 kB for 20,000 points


def test_dashes_and_a_long_title():
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource

    figure = plots.styled_figure("GPUs: memory used, GiB (solid: all users, dashed: this kernel, dotted: total)", 100)
    source = ColumnDataSource({"t": [0, 1], "a": [1, 2], "b": [0, 1]})
    figure.line("t", "a", source=source, line_dash="dashed")
    figure.line("t", "b", source=source, line_dash=[3, 1])
    picture = picture_of(column(figure), threading.RLock())
    assert re.findall(r'stroke-dasharray="([^"]+)"', picture) == ["6", "3 1"]  # bokeh keeps "dashed" as [6]
    assert "…" in picture and "dotted: total)</title>" in picture  # cut, whole in its tooltip


def test_no_figure_no_picture():
    assert svg_of([]) == "" and picture_of(None, threading.RLock()) == ""


def test_a_static_copy_keeps_the_picture_before_bokehs_copy_and_hides_it_where_bokeh_draws():
    layout = a_dashboard()
    copy = embedded(layout, threading.RLock())
    still, rest = copy.split("</svg></div>", 1)
    assert "class='gpumagic-still'" in still and "<polyline" in still
    assert "Bokeh" in rest and "still.style.display = 'none'" in rest  # hidden once BokehJS drew the copy
    assert still_beside("", "<div>copy</div>") == "<div>copy</div>"


def test_a_comparisons_multi_line_is_a_line_per_run_in_its_colour_within_a_budget_of_points():
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource

    from gpumagic.widgets.picture import PANEL_POINTS

    runs = 300
    figure = plots.styled_figure("loss", 100)
    source = ColumnDataSource(
        {
            "xs": [list(range(1000))] * runs,
            "ys": [[run + 1.0 / (step + 1) for step in range(1000)] for run in range(runs)],
            "color": [plots.PALETTE[run % 20] for run in range(runs)],
            "name": [f"run-{run}" for run in range(runs)],
        }
    )
    figure.multi_line("xs", "ys", source=source, line_color="color", line_alpha=0.2)
    (panel,) = panels_of(column(figure), threading.RLock())
    assert len(panel.lines) == runs and panel.lines[1].colour == plots.PALETTE[1] and panel.lines[7].label == "run-7"
    assert sum(len(line.xs) for line in panel.lines) <= PANEL_POINTS + runs  # each line's last point kept

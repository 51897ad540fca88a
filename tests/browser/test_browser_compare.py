"""The comparison of runs in a real JupyterLab in headless Chromium, looked at as a user would: four sweep jobs
compared in a new kernel; three hundred runs drawn as a polyline each over the hyperparameters' axes, rows
picked in the table highlighting the same runs' polylines and curves, a box over the axes picking rows in the
table, the smoothing slider redrawing the curves (all in the browser, with a busy kernel), on the light and the
dark theme. Screenshots go to artifacts/."""

import io
import json
import time

import pytest

from tests.browser.pages import PLOTTED, WHERE_BACKWARDS, bokeh_trouble, notebook_page

pytestmark = pytest.mark.kernel

RUNS = 300
POINTS = 60
# the comparison's models in the page: its table's source (the runs), the curves' sources, the slider
MODELS = """() => {
    const found = {runs: null, curves: [], slider: null, points: null, lines: null, filter: null, texts: []};
    for (const doc of window.Bokeh.documents)
        for (const model of doc.all_models) {
            if (model.type === "DataTable") { found.runs = model.source; found.filter = model.view.filter; }
            if (model.type === "Slider" && model.title === "smoothing") found.slider = model;
            if (model.type === "Div") found.texts.push(model.text.replace(/<[^>]*>/g, ""));
            if (model.type === "GlyphRenderer" && model.glyph.type === "MultiLine") {
                if (model.glyph.xs.field === "axes_x") found.lines = model;
                else if (!found.curves.includes(model.data_source)) found.curves.push(model.data_source);
            }
            if (model.type === "GlyphRenderer" && model.glyph.type === "Scatter") found.points = model.data_source;
        }
    return found;
}"""
SEEN = f"""() => {{
    const found = ({MODELS})();
    const col = (s, k) => (s.data instanceof Map ? s.data.get(k) : s.data[k]);
    return {{
        runs: col(found.runs, "name").length,
        polylines: col(found.lines.data_source, "axes_y").length,
        axes: col(found.lines.data_source, "axes_y")[0].length,
        curves: found.curves.map((s) => col(s, "xs").length),
        selected: Array.from(found.runs.selected.indices),
        curves_selected: found.curves.map((s) => Array.from(s.selected.indices)),
        smoothing: found.slider.value,
        first_curve: Array.from(col(found.curves[0], "ys")[0].slice(0, 12)),
        first_raw: Array.from(col(found.curves[0], "raw")[0].slice(0, 12)),
        texts: found.texts.join(" | "),
        shown: found.filter.booleans ? Array.from(found.filter.booleans).filter((b) => b).length : -1,
    }};
}}"""
SET = f"""([what, value]) => {{
    const found = ({MODELS})();
    if (what === "slider") found.slider.value = value;
    if (what === "box") found.points.selected.indices = value;
}}"""


def sweep_train(width, lr, seed=0):
    import gpumagic

    for step in range(40):
        gpumagic.log(step=step, loss=(1.0 + seed * 0.01) / (1 + lr * width * step / 10))
    return width


def test_the_comparison_view_of_four_finished_sweep_jobs_in_a_new_kernel(jupyterlab, artifacts):
    """Monday: a new kernel compares the weekend's four sweep jobs from disk: a curve per job, the table with
    the grid's values as columns and each job's last and best loss, an axis per grid key and one for the loss."""
    import gpumagic

    jobs = gpumagic.sweep(sweep_train, {"width": [32, 128], "lr": [0.01, 0.003]}, gpus_per_job=0, name="A")
    for job in jobs:
        assert job.wait(timeout=120) == "finished"
    url = jupyterlab(["%load_ext gpumagic", "%jobs compare A-*"])
    console: list[str] = []
    with notebook_page(url, 2, console) as page:
        page.wait_for_selector(".jp-Cell >> nth=1 >> .slick-row", timeout=60_000)
        page.wait_for_timeout(1500)
        page.screenshot(path=str(artifacts / "browser-compare.png"), full_page=True)
        page.locator(".jp-Cell >> nth=1").screenshot(path=str(artifacts / "cell-compare.png"))
        seen = page.evaluate(PLOTTED)
        assert seen["backwards"] == 0, (seen, page.evaluate(WHERE_BACKWARDS))
        models = page.evaluate(SEEN)
        assert (models["runs"], models["polylines"], models["axes"]) == (4, 4, 3), models  # width, lr, loss
        assert models["curves"] == [4], "a curve per job"
        table = page.locator(".jp-Cell >> nth=1 >> .slick-row")
        assert table.count() == 4
        rows = "\n".join(table.all_inner_texts())
        for job in jobs:
            assert job.name in rows
        header = " ".join(page.locator(".jp-Cell >> nth=1 >> .slick-header-column").all_inner_texts())
        assert all(word in header for word in ("width", "lr", "loss last", "loss best", "GPU hours"))
        assert not bokeh_trouble(console), bokeh_trouble(console)[:5]


def write_runs(count: int, points: int) -> None:
    """``count`` finished runs of a grid (lr x width x opt; epochs=10 for all), written as a training process
    writes them."""
    from gpumagic.run_dirs import store
    from gpumagic.telemetry.log import Recorder

    now = time.time()
    for i in range(count):
        lr, width = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2][i % 5], [32, 64, 128][(i // 5) % 3]
        params = {"lr": str(lr), "width": str(width), "opt": ["adam", "sgd"][(i // 15) % 2], "epochs": "10"}
        path = store.new_run("kernel", params=params)
        recorder = Recorder(path, 0)
        loss = recorder.name_id("loss")
        for step in range(points):
            noise = ((i * 7919 + step * 104729) % 1000) / 1000 - 0.5  # a deterministic wiggle to smooth away
            value = (1 + i % 13) * lr * width / (step + 1) + 0.05 * noise + i / 3000
            recorder.points.extend((now + step, step, loss, value))
        recorder.close()
        store.finish_run(path, "finished")


CELLS = [
    "%load_ext gpumagic\nimport gpumagic",
    "comparison = gpumagic.compare(gpumagic.runs(), sort_by='loss')\ncomparison",
    "import time\ntime.sleep(600)",  # a busy kernel: the view works in the browser alone
]


def _canvas_pixels(page, locator) -> bytes:
    from io import BytesIO

    from PIL import Image

    return Image.open(BytesIO(locator.screenshot())).convert("RGB").tobytes()


def test_hundreds_of_runs_selected_in_the_table_are_highlighted_everywhere_and_smoothing_redraws(jupyterlab, artifacts):
    import pandas

    write_runs(RUNS, POINTS)
    url = jupyterlab(CELLS)
    console: list[str] = []
    with notebook_page(url, 3, console) as page:
        page.wait_for_selector(".jp-Cell >> nth=1 >> .slick-row", timeout=60_000)
        page.wait_for_timeout(1500)
        seen = page.evaluate(SEEN)
        assert (seen["runs"], seen["polylines"], seen["axes"]) == (RUNS, RUNS, 4), seen  # lr, width, opt, loss
        assert seen["curves"] == [RUNS] and seen["selected"] == [], seen
        assert seen["smoothing"] == 0.5, "60 points a run: 1 - 30/60"
        assert seen["first_curve"] != seen["first_raw"]
        cell = page.locator(".jp-Cell >> nth=1")
        axes = cell.locator("canvas").nth(0)
        before = _canvas_pixels(page, axes)
        page.screenshot(path=str(artifacts / "browser-compare-many.png"), full_page=True)

        # rows picked in the table: those runs' polylines and curves highlighted, the others dimmed
        rows = cell.locator(".slick-row")
        rows.nth(0).locator(".slick-cell").nth(0).click()
        rows.nth(2).locator(".slick-cell").nth(0).click(modifiers=["Control"])
        page.wait_for_timeout(500)
        seen = page.evaluate(SEEN)
        assert len(seen["selected"]) == 2 and seen["curves_selected"] == [sorted(seen["selected"])], seen
        assert _canvas_pixels(page, axes) != before, "the polylines are drawn again, the others dimmed"
        assert "300 runs · 2 selected: " in seen["texts"], seen["texts"]
        cell.screenshot(path=str(artifacts / "browser-compare-selected.png"))
        page.mouse.move(320, 500)  # over the prompts: the notebook scrolls, not a plot or the table
        page.mouse.wheel(0, 650)
        page.wait_for_timeout(500)
        page.screenshot(path=str(artifacts / "browser-compare-curves.png"))

        # a box over the axes' points: the runs it holds are selected in the table
        page.evaluate(SET, ["box", list(range(10))])  # the first axis' points of runs 0..9
        page.wait_for_timeout(500)
        seen = page.evaluate(SEEN)
        assert seen["selected"] == list(range(10)) and seen["curves_selected"] == [list(range(10))]
        assert cell.locator(".slick-cell.selected").count() >= 10, "the table shows the rows selected"

        # the smoothing slider redraws the curves, in the browser (the kernel is busy sleeping)
        page.evaluate(SET, ["slider", 0])
        page.wait_for_timeout(300)
        raw = page.evaluate(SEEN)
        assert raw["first_curve"] == pytest.approx(raw["first_raw"], rel=1e-6), "0: the raw values"
        page.evaluate(SET, ["slider", 0.9])
        page.wait_for_timeout(300)
        smooth = page.evaluate(SEEN)
        assert smooth["first_curve"] != pytest.approx(smooth["first_raw"], rel=1e-3)
        assert smooth["first_curve"][0] == pytest.approx(smooth["first_raw"][0], rel=1e-6), "debiased start"

        # the filter box keeps the rows that pass
        cell.locator("input[type=text]").fill("lr<=0.0003, opt=adam")
        page.wait_for_timeout(500)
        seen = page.evaluate(SEEN)
        assert seen["shown"] == 60 and "60 of 300 runs" in seen["texts"], seen["texts"]

        # the CSV button: the rows shown, the columns and values of to_csv
        with page.expect_download() as download:
            cell.locator("button:has-text('CSV')").click()
        import gpumagic

        expected = gpumagic.compare(gpumagic.runs(), sort_by="loss").filter("lr<=0.0003", opt="adam")
        got = pandas.read_csv(download.value.path())
        assert list(got.columns) == expected.export_columns() and len(got) == 60
        pandas.testing.assert_frame_equal(got, pandas.read_csv(io.StringIO(expected.to_csv())), check_dtype=False)
        assert not bokeh_trouble(console), bokeh_trouble(console)[:5]


def test_the_comparison_reads_on_the_dark_theme(jupyterlab, artifacts):
    write_runs(RUNS, POINTS)
    url = jupyterlab(CELLS[:2], theme="JupyterLab Dark")
    console: list[str] = []
    with notebook_page(url, 2, console) as page:
        page.wait_for_selector(".jp-Cell >> nth=1 >> .slick-row", timeout=60_000)
        page.wait_for_timeout(1500)
        page.screenshot(path=str(artifacts / "browser-compare-dark.png"), full_page=True)
        cell = page.locator(".jp-Cell >> nth=1")
        colours = (
            cell.locator(".slick-cell")
            .nth(1)
            .evaluate("(e) => [getComputedStyle(e).color, getComputedStyle(e).backgroundColor]")
        )
        text, background = (_rgb(c) for c in colours)
        assert _contrast(text, background) >= 4.5, colours
        assert sum(background) / 3 < 80, f"the table is dark on the dark theme: {colours}"
        header = cell.locator(".slick-header-column").nth(0)
        colours = header.evaluate("(e) => [getComputedStyle(e).color, getComputedStyle(e).backgroundColor]")
        assert _contrast(*(_rgb(c) for c in colours)) >= 4.5, colours
        assert not bokeh_trouble(console), bokeh_trouble(console)[:5]


def _rgb(css: str) -> tuple[float, ...]:
    return tuple(float(part) for part in json.loads("[" + css[css.index("(") + 1 : css.index(")")] + "]")[:3])


def _contrast(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """WCAG's contrast ratio of two sRGB colours."""

    def luminance(rgb):
        linear = [c / 255 / 12.92 if c / 255 <= 0.03928 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)

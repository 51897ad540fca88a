"""Live views in the front ends users have, in headless Chromium, judged by the pixels drawn while the cell runs:
a JupyterLab whose server environment lacks jupyter_bokeh's front end (a JupyterHub's, with the kernel in the
project's environment) shows the curves as a still picture, no error box; Jupyter Notebook 7 draws the rich
view; a saved notebook read with JavaScript off (nbconvert's HTML) shows each finished dashboard's curves.
Screenshots go to artifacts/."""

import subprocess
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from tests.browser.pages import CHROMIUM, CHROMIUM_FLAGS, bokeh_trouble, notebook_page
from tests.browser.test_browser_live import curve_pixels

pytestmark = pytest.mark.kernel

LAUNCH = (
    "%%launch_ddp -n 2 --gpus none\nimport time\ntime.sleep(1)\n"
    "for step in range(500):\n    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n    time.sleep(0.02)"
)


def palette_pixels(path, colours: int = 2) -> int:
    """Pixels of the first ``colours`` of the plots' palette (the ranks' curves) in a screenshot."""
    from PIL import Image

    from gpumagic.widgets.plots import PALETTE

    wanted = [tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in PALETTE[:colours]]
    area = Image.open(path).convert("RGB")
    return sum(
        1
        for pixel in area.get_flattened_data()
        if any(sum(abs(p - w) for p, w in zip(pixel, colour, strict=True)) < 60 for colour in wanted)
    )


def still_pixels(page, cell: int, path) -> int:
    """Curve pixels in the still picture of cell ``cell``'s frame (0 while it is hidden or empty). The picture
    is replaced at each redraw: one replaced or hidden between finding it and its screenshot ("not attached",
    "not visible", seen in fresh-clone runs) counts as not seen yet."""
    from playwright.sync_api import Error

    still = page.locator(f".jp-Cell >> nth={cell} >> .gpumagic-still-view svg")
    try:
        if not still.count() or not still.first.is_visible():
            return 0
        still.first.screenshot(path=str(path), timeout=5_000)
    except Error as error:
        if any(race in str(error) for race in ("not attached", "not visible", "Timeout")):
            return 0
        raise
    return palette_pixels(path)


def pixels_after_the_first_step(page, measure, path) -> tuple[int, float]:
    """Once the second cell's status line shows a step (its first point reached the kernel): ``measure(page, 1,
    path)`` every 250 ms until it finds 300 pixels of curve or 30 s passed; (pixels, seconds it took)."""
    page.wait_for_selector(".jp-Cell >> nth=1 >> text=steps/s", timeout=60_000)
    first_point = time.monotonic()
    pixels = 0
    while pixels < 300 and time.monotonic() - first_point < 30:
        page.wait_for_timeout(250)
        pixels = measure(page, 1, path)
    return pixels, time.monotonic() - first_point


def test_without_jupyter_bokeh_in_the_server_the_curves_show_as_a_picture_while_the_cell_runs(jupyterlab, artifacts):
    url = jupyterlab(["%load_ext gpumagic", LAUNCH], front_end="hub")
    console: list[str] = []
    with notebook_page(url, 2, console) as page:
        pixels, waited = pixels_after_the_first_step(page, still_pixels, artifacts / "front-end-hub-running.png")
        status = page.locator(".jp-Cell >> nth=1 >> text=steps/s").first.inner_text()
        page.screenshot(path=str(artifacts / "front-end-hub-page.png"))
        assert pixels >= 300, f"the still picture drew {pixels} pixels of curve while running"
        assert "running" in status, status
        print(f"hub: the picture of the curves {waited:.1f} s after the status showed the first step")
        errors = page.locator(".jp-Cell >> nth=1 >> .jupyter-widgets-error-widget")
        assert all(not errors.nth(i).is_visible() for i in range(errors.count()))  # no error box
        assert page.locator(".jp-Cell >> nth=1 >> text=pip install jupyter_bokeh").first.is_visible()
        # finished: the static copy, drawn by BokehJS (no extension needed), its picture hidden
        page.wait_for_selector(".jp-Cell >> nth=1 >> text=finished", timeout=60_000)
        page.wait_for_timeout(1500)
        assert curve_pixels(page, 1, artifacts / "front-end-hub-finished.png") >= 300
        page.screenshot(path=str(artifacts / "front-end-hub-page-finished.png"))
        copies = page.locator(".jp-Cell >> nth=1 >> .gpumagic-still")  # the copy's picture, behind BokehJS's
        assert copies.count() and all(not copies.nth(i).is_visible() for i in range(copies.count()))
        frame_picture = page.locator(".jp-Cell >> nth=1 >> .gpumagic-still-view")  # closed with the live view
        assert all(not frame_picture.nth(i).is_visible() for i in range(frame_picture.count()))
    assert not [line for line in bokeh_trouble(console) if "jupyter_bokeh" not in line]


def test_without_jupyter_bokeh_in_the_server_gpu_watch_shows_its_history_as_a_picture(jupyterlab, artifacts):
    cells = [
        "%load_ext gpumagic",
        "watch = %gpu watch --interval 0.2\nwatch",
        "print('heard:', watch._frames.shown[0].heard)",
    ]
    url = jupyterlab(cells, front_end="hub", GPUMAGIC_SIMULATE="2xA100-80GB")
    with notebook_page(url, 2) as page:
        page.wait_for_selector(".jp-Cell >> nth=1 >> .gpumagic-gpu-bar", timeout=60_000)
        picture = page.locator(".jp-Cell >> nth=1 >> .gpumagic-still-view svg")
        lines = picture.locator("polyline")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (lines.count() and picture.first.is_visible()):
            page.wait_for_timeout(250)
        page.screenshot(path=str(artifacts / "front-end-hub-gpu-watch.png"))
        assert lines.count() >= 2 and picture.first.is_visible(), lines.count()
        page.keyboard.press("Shift+Enter")  # the kernel is free: it heard the page say its plots failed
        page.wait_for_selector(".jp-Cell >> nth=2 >> text=heard: plain", timeout=60_000)


def test_where_the_plots_draw_the_page_says_so_and_the_kernel_stops_drawing_pictures(jupyterlab, artifacts):
    """JupyterLab with jupyter_bokeh: a free kernel hears "rich" from the page and draws no picture after."""
    cells = [
        "%load_ext gpumagic",
        "watch = %gpu watch --interval 0.2\nwatch",
        "import time\nframe = watch._frames.shown[0]\ndrawn = frame.stills\ntime.sleep(3)\n"
        "print('heard:', frame.heard, '· pictures since:', frame.stills - drawn, '· still:', repr(frame.still.value))",
    ]
    url = jupyterlab(cells, GPUMAGIC_SIMULATE="2xA100-80GB")
    with notebook_page(url, 2) as page:
        page.wait_for_selector(".jp-Cell >> nth=1 >> .bk-Figure", timeout=60_000)
        page.keyboard.press("Shift+Enter")
        said = page.wait_for_selector(".jp-Cell >> nth=2 >> .jp-OutputArea-output", timeout=60_000).inner_text()
        page.screenshot(path=str(artifacts / "front-end-lab-rich.png"))
        assert said.strip() == "heard: rich · pictures since: 0 · still: ''", said
        still = page.locator(".jp-Cell >> nth=1 >> .gpumagic-still-view")
        assert all(not still.nth(i).is_visible() for i in range(still.count()))


def test_notebook_7_draws_the_launch_dashboard_live(jupyterlab, artifacts):
    url = jupyterlab(["%load_ext gpumagic", LAUNCH], front_end="notebook")
    console: list[str] = []
    with notebook_page(url, 2, console) as page:
        path = artifacts / "front-end-notebook7-running.png"
        pixels, waited = pixels_after_the_first_step(page, curve_pixels, path)
        assert pixels >= 300, f"the loss plot drew {pixels} pixels of curve while running"
        assert "running" in page.locator(".jp-Cell >> nth=1 >> text=steps/s").first.inner_text()
        print(f"notebook 7: curves {waited:.1f} s after the status showed the first step")
        still = page.locator(".jp-Cell >> nth=1 >> .gpumagic-still-view")
        assert all(not still.nth(i).is_visible() for i in range(still.count()))  # the rich view, alone
    # Notebook 7.6's own error as it loads any notebook (a notebook of print(1) too; from notebook_core.js)
    trouble = [line for line in bokeh_trouble(console) if "(reading 'schema')" not in line]
    assert not trouble, trouble[:5]


def test_a_saved_notebook_read_with_javascript_off_shows_each_dashboards_curves(tmp_path, artifacts):
    """Run by nbclient, exported by nbconvert, read in Chromium with JavaScript disabled (as GitHub, nbviewer or
    an untrusted notebook show it): the finished launch dashboard's picture is there."""
    from playwright.sync_api import sync_playwright

    cells = ["%load_ext gpumagic", LAUNCH.replace("range(500)", "range(120)")]
    notebook = new_notebook(cells=[new_code_cell(cell) for cell in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    nbformat.write(notebook, tmp_path / "saved.ipynb")
    subprocess.run(
        [sys.executable, "-m", "nbconvert", "--to", "html", str(tmp_path / "saved.ipynb")], check=True, timeout=120
    )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            context = browser.new_context(java_script_enabled=False, viewport={"width": 1300, "height": 1000})
            page = context.new_page()
            page.goto(f"file://{tmp_path / 'saved.html'}")
            still = page.locator(".gpumagic-still svg")
            assert still.count() == 1, still.count()
            still.first.screenshot(path=str(artifacts / "front-end-saved-no-javascript.png"))
            page.screenshot(path=str(artifacts / "front-end-saved-no-javascript-page.png"), full_page=True)
        finally:
            browser.close()
    assert palette_pixels(artifacts / "front-end-saved-no-javascript.png") >= 300

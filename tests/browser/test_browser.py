"""A real JupyterLab in headless Chromium, looked at as a user would: the launch dashboard streams while its
cell runs; a reloaded page draws the running dashboard and new ones. Screenshots go to artifacts/.
(%gpu watch and %jobs watch: tests/browser/test_browser_watch.py.)"""

import time

import pytest

from tests.browser.pages import (
    PLOT_TITLES,
    PLOTTED,
    WHERE_BACKWARDS,
    bokeh_trouble,
    notebook_page,
    points_grow,
    save_and_reload,
)

pytestmark = pytest.mark.kernel

LAUNCH_CELLS = [
    "%load_ext gpumagic",
    "%%launch_ddp -n 2 --gpus none\nimport time\nfor step in range(500):\n"
    "    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n    time.sleep(0.02)",
]


def test_the_launch_dashboard_streams_in_a_real_browser(jupyterlab, artifacts):
    url = jupyterlab(LAUNCH_CELLS)
    with notebook_page(url, 2) as page:
        page.wait_for_selector("text=ranks alive", timeout=60_000)
        seen = points_grow(page)
        running = page.locator("text=running").count() > 0
        page.screenshot(path=str(artifacts / "browser-launch-dashboard.png"), full_page=True)
        page.locator(".jp-Cell >> nth=1").screenshot(path=str(artifacts / "cell-launch-dashboard.png"))
        assert len(seen) >= 3 and seen[-1] > seen[-3] > 0, f"loss points seen over time: {seen}"
        assert running, "the points grew while the cell was still running"
        titles = page.evaluate(PLOT_TITLES)
        assert {"loss", "resident memory per rank, MiB", "CPU use per rank, %"} <= set(titles)
        assert page.locator(".jp-Cell >> nth=1 >> canvas").count() >= 3  # loss, memory and CPU plots drawn
        # finished, the dashboard is a static copy of its last state (its widgets closed): still drawn
        page.wait_for_selector(".jp-Cell >> nth=1 >> text=finished", timeout=60_000)
        finished = time.monotonic()
        # the cell is done (its prompt numbered, not [*]) as soon as its dashboard says finished
        page.wait_for_selector(".jp-Cell >> nth=1 >> .jp-InputPrompt:has-text('[2]')", timeout=10_000)
        print(f"cell idle {time.monotonic() - finished:.2f} s after its dashboard said finished")
        assert page.evaluate(PLOTTED)["backwards"] == 0, page.evaluate(WHERE_BACKWARDS)
        page.wait_for_timeout(1500)
        page.screenshot(path=str(artifacts / "browser-launch-dashboard-finished.png"), full_page=True)
        assert page.locator(".jp-Cell >> nth=1 >> .gpumagic-launch-dashboard").count() == 1
        assert page.locator(".jp-Cell >> nth=1 >> canvas").count() >= 3


RELOAD_CELLS = [
    "%load_ext gpumagic",
    "%%launch_ddp -n 2 --gpus none\nimport time\nfor step in range(100):\n"
    "    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n    time.sleep(0.02)",
    "%gpu watch --interval 0.5s",
]


def test_a_reloaded_page_draws_finished_running_and_new_dashboards(jupyterlab, artifacts):
    """BokehJS reaches every page. After a reload: a finished launch's static copy, alone on the page, draws
    (BokehJS shown once per kernel as plain output; no widget error where its loader was); a new %gpu watch
    draws; after a second reload the running watch, saved in the notebook with its kernel alive, draws its
    history."""
    url = jupyterlab(RELOAD_CELLS, GPUMAGIC_SIMULATE="4xA100-80GB")
    console: list[str] = []
    with notebook_page(url, 2, console) as page:
        page.wait_for_selector(".jp-Cell >> nth=1 >> text=finished", timeout=90_000)
        page.wait_for_timeout(1500)
        save_and_reload(page)
        page.wait_for_selector(".jp-Cell >> nth=1 >> canvas", timeout=30_000)  # the static copy
        assert page.locator(".jp-Cell >> nth=1 >> canvas").count() >= 2  # the loss and resources, drawn
        assert page.locator("text=Error displaying widget").count() == 0
        page.locator(".jp-Cell >> nth=2 >> .jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")  # a new dashboard on the reloaded page
        page.wait_for_selector(".jp-Cell >> nth=2 >> canvas", timeout=60_000)
        page.wait_for_timeout(3000)
        before = page.evaluate(PLOTTED)["points"]
        save_and_reload(page)
        try:  # the running one, redrawn
            page.wait_for_selector(".jp-Cell >> nth=2 >> canvas", timeout=60_000)
        except Exception:
            page.screenshot(path=str(artifacts / "browser-after-reload-not-drawn.png"), full_page=True)
            print("the page's console:", *console[-60:], sep="\n  ")
            raise
        page.wait_for_timeout(1500)
        page.screenshot(path=str(artifacts / "browser-after-reload.png"), full_page=True)
        assert page.evaluate(PLOTTED)["points"] >= before  # with its history, not empty plots
        assert page.locator(".jp-Cell >> nth=1 >> canvas").count() >= 2
        assert page.locator(".jp-Cell >> nth=2 >> canvas").count() >= 3
        assert page.locator("text=Failed to create view").count() == 0
        assert not bokeh_trouble(console), bokeh_trouble(console)[:5]

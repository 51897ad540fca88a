"""A real JupyterLab in headless Chromium, looked at as a user would: the launch dashboard streams while its
cell runs; %gpu watch keeps updating for a minute with no Bokeh error, no new Bokeh document and no line going
back in time; a reloaded page draws the running dashboard and new ones; the dark theme leaves no white plot
boxes; %jobs watch streams and its Kill button works. Screenshots go to artifacts/."""

import itertools
import time

import pytest

from tests.browser import (
    PLOT_TITLES,
    PLOTTED,
    WHERE_BACKWARDS,
    bokeh_trouble,
    near_white,
    open_and_run,
    points_grow,
    save_and_reload,
)

pytestmark = pytest.mark.kernel

LAUNCH_CELLS = [
    "%load_ext gpumagic",
    "%%launch_ddp -n 2 --gpus none\nimport time\nfor step in range(500):\n"
    "    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n    time.sleep(0.02)",
]
JOB_CELLS = [
    "%load_ext gpumagic\nimport gpumagic",
    "def train(k):\n    import time\n    for step in range(100000):\n"
    "        gpumagic.log(step=step, loss=k + 1.0 / (step + 1))\n        time.sleep(0.05)\n"
    "jobs = [gpumagic.submit(train, k, gpus=0, name=f'variant{k}') for k in range(2)]",
    "%jobs watch --interval 0.5",
]


def test_the_launch_dashboard_streams_in_a_real_browser(jupyterlab, artifacts):
    from playwright.sync_api import sync_playwright

    url = jupyterlab(LAUNCH_CELLS)
    with sync_playwright() as playwright:
        browser, page = open_and_run(playwright, url, 2)
        try:
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
        finally:
            browser.close()


def test_jobs_watch_streams_and_its_kill_button_works_in_a_real_browser(jupyterlab, artifacts):
    from playwright.sync_api import sync_playwright

    import gpumagic

    url = jupyterlab(JOB_CELLS)
    with sync_playwright() as playwright:
        browser, page = open_and_run(playwright, url, 3)
        try:
            page.wait_for_selector("text=2 background jobs", timeout=60_000)
            seen = points_grow(page, within_s=20)  # well before the 30 s full re-save: the streams arrive
            assert len(seen) >= 3 and seen[-1] > seen[-3] > 0, f"loss points seen over time: {seen}"
            assert "loss per job" in page.evaluate(PLOT_TITLES)
            page.screenshot(path=str(artifacts / "browser-jobs-watch.png"), full_page=True)
            page.locator("button:has-text('Kill')").first.click()
            page.wait_for_selector("text=variant0: killed (killed with %jobs kill)", timeout=30_000)
            assert gpumagic.job("variant0").status == "killed"
            assert gpumagic.job("variant1").status == "running"
        finally:
            browser.close()
            for job in gpumagic.list_jobs():
                if job.status == "running":
                    job.kill(grace_s=1)


GPU_WATCH_CELLS = ["%load_ext gpumagic", "%gpu use 1,3\n%gpu watch --interval 0.5s"]


def test_gpu_watch_keeps_updating_for_a_minute_with_no_bokeh_error_and_reads_on_the_dark_theme(jupyterlab, artifacts):
    """8 simulated GPUs sampled at 2 Hz for a minute, on JupyterLab's dark theme: the points grow at every
    look, the page keeps the same Bokeh documents, the console shows no Bokeh error, no plotted x series goes
    back, and the plots leave no white box on the dark page."""
    from playwright.sync_api import sync_playwright

    url = jupyterlab(GPU_WATCH_CELLS, theme="JupyterLab Dark", GPUMAGIC_SIMULATE="8xH100-80GB")
    console: list[str] = []
    with sync_playwright() as playwright:
        browser, page = open_and_run(playwright, url, 2, console)
        try:
            page.wait_for_selector(".jp-Cell >> nth=1 >> canvas", timeout=60_000)
            page.wait_for_timeout(3000)  # past the one catch-up re-send
            looks = [page.evaluate(PLOTTED)]
            for _ in range(12):
                page.wait_for_timeout(5000)
                looks.append(page.evaluate(PLOTTED))
            shot = artifacts / "browser-gpu-watch-dark.png"
            page.screenshot(path=str(shot), full_page=True)
            page.locator(".jp-Cell >> nth=1").screenshot(path=str(artifacts / "cell-gpu-watch-dark.png"))
            points = [look["points"] for look in looks]
            assert all(b > a for a, b in itertools.pairwise(points)), f"points at each look: {points}"
            assert len({look["documents"] for look in looks}) == 1, f"documents: {[x['documents'] for x in looks]}"
            assert all(look["backwards"] == 0 for look in looks), (looks, page.evaluate(WHERE_BACKWARDS))
            assert looks[-1]["series"] >= 8 * 3  # every GPU on the memory, utilization and temperature plots
            assert page.locator(".jp-Cell >> nth=1 >> text=live").count() > 0
            assert page.locator(".jp-Cell >> nth=1 >> .gpumagic-gpu-bar").count() == 8
            assert not bokeh_trouble(console), bokeh_trouble(console)[:5]
            assert near_white(shot, page.locator(".jp-Cell >> nth=1 >> canvas").first.bounding_box()) < 0.2
        finally:
            browser.close()


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
    from playwright.sync_api import sync_playwright

    url = jupyterlab(RELOAD_CELLS, GPUMAGIC_SIMULATE="4xA100-80GB")
    console: list[str] = []
    with sync_playwright() as playwright:
        browser, page = open_and_run(playwright, url, 2, console)
        try:
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
            page.wait_for_selector(".jp-Cell >> nth=2 >> canvas", timeout=30_000)  # the running one, redrawn
            page.wait_for_timeout(1500)
            page.screenshot(path=str(artifacts / "browser-after-reload.png"), full_page=True)
            assert page.evaluate(PLOTTED)["points"] >= before  # with its history, not empty plots
            assert page.locator(".jp-Cell >> nth=1 >> canvas").count() >= 2
            assert page.locator(".jp-Cell >> nth=2 >> canvas").count() >= 3
            assert page.locator("text=Failed to create view").count() == 0
            assert not bokeh_trouble(console), bokeh_trouble(console)[:5]
        finally:
            browser.close()


def sweep_train(width, lr, seed=0):
    import gpumagic

    for step in range(40):
        gpumagic.log(step=step, loss=(1.0 + seed * 0.01) / (1 + lr * width * step / 10))
    return width


def test_the_comparison_view_of_four_finished_sweep_jobs_in_a_new_kernel(jupyterlab, artifacts):
    """Monday: a new kernel compares the weekend's four sweep jobs from disk: a curve per job, the table with
    the grid's values as columns and each job's last and best loss."""
    from playwright.sync_api import sync_playwright

    import gpumagic

    jobs = gpumagic.sweep(sweep_train, {"width": [32, 128], "lr": [0.01, 0.003]}, gpus_per_job=0, name="A")
    for job in jobs:
        assert job.wait(timeout=120) == "finished"
    url = jupyterlab(["%load_ext gpumagic", "%jobs compare A-*"])
    console: list[str] = []
    with sync_playwright() as playwright:
        browser, page = open_and_run(playwright, url, 2, console)
        try:
            page.wait_for_selector(".jp-Cell >> nth=1 >> canvas", timeout=60_000)
            page.wait_for_timeout(2000)
            page.screenshot(path=str(artifacts / "browser-compare.png"), full_page=True)
            page.locator(".jp-Cell >> nth=1").screenshot(path=str(artifacts / "cell-compare.png"))
            seen = page.evaluate(PLOTTED)
            assert seen["series"] >= 4 and seen["backwards"] == 0, (seen, page.evaluate(WHERE_BACKWARDS))
            output = page.locator(".jp-Cell >> nth=1 >> .jp-Cell-outputArea").inner_text()
            for job in jobs:
                assert job.name in output
            assert "width" in output and "lr" in output and "loss" in output
            assert not bokeh_trouble(console), bokeh_trouble(console)[:5]
        finally:
            browser.close()

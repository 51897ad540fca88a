"""A real JupyterLab in headless Chromium, looked at as a user would: the launch dashboard streams while its
cell runs; %gpu watch keeps updating for a minute with no Bokeh error, no new Bokeh document and no line going
back in time; a reloaded page draws the running dashboard and new ones; the dark theme leaves no white plot
boxes; %jobs watch streams and its Kill button works. Screenshots go to artifacts/."""

import itertools
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import nbformat
import pytest
from conftest import ROOT
from nbformat.v4 import new_code_cell, new_notebook

pytestmark = pytest.mark.kernel
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
LOGGED_POINTS = """() => {
    const bokeh = window.Bokeh;
    if (!bokeh || !bokeh.documents) return -1;
    let points = 0;
    for (const doc of bokeh.documents)
        for (const model of doc.all_models)
            if (model.data && model.data.value) points += model.data.value.length;
    return points;
}"""


PLOTTED = """() => {
    const seen = {documents: 0, series: 0, points: 0, backwards: 0};
    if (!window.Bokeh || !window.Bokeh.documents) return seen;
    seen.documents = window.Bokeh.documents.length;
    for (const doc of window.Bokeh.documents)
        for (const model of doc.all_models) {
            if (model.type !== "GlyphRenderer") continue;
            const x = model.glyph.x, data = model.data_source && model.data_source.data;
            if (!data || !x || typeof x !== "object" || !("field" in x)) continue;
            const xs = data instanceof Map ? data.get(x.field) : data[x.field];
            if (!xs) continue;
            seen.series += 1;
            seen.points += xs.length;
            for (let i = 1; i < xs.length; i++) if (xs[i] < xs[i - 1]) seen.backwards += 1;
        }
    return seen;
}"""
WHERE_BACKWARDS = """() => {
    const found = [];
    window.Bokeh.documents.forEach((doc, number) => {
        for (const model of doc.all_models) {
            if (model.type !== "GlyphRenderer" || !model.data_source) continue;
            const x = model.glyph.x, data = model.data_source.data;
            const xs = data instanceof Map ? data.get(x.field) : data[x.field];
            if (!xs) continue;
            for (let i = 1; i < xs.length; i++)
                if (xs[i] < xs[i - 1])
                    found.push({document: number, x: x.field, y: model.glyph.y.field, at: i, of: xs.length,
                                around: Array.from(xs.slice(Math.max(0, i - 3), i + 3))});
        }
    });
    return found.slice(0, 8);
}"""
BOKEH_TROUBLE = ("inconsistent lengths", "Failed to create view", "Bokeh", "bokeh", "Cannot read properties")


PLOT_TITLES = """() => {
    const titles = [];
    for (const doc of window.Bokeh.documents)
        for (const model of doc.all_models)
            if (model.type === "Title") titles.push(model.text);
    return titles;
}"""


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


@pytest.fixture
def jupyterlab(tmp_path):
    """Start JupyterLab on 127.0.0.1 serving a notebook of the given cells; returns its URL."""
    servers = []

    def start(cells: list[str], theme: str | None = None, **env_extra: str) -> str:
        notebook = new_notebook(
            cells=[new_code_cell(cell) for cell in cells],
            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        )
        nbformat.write(notebook, tmp_path / "live.ipynb")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        token = secrets.token_hex(16)
        env = dict(
            os.environ,
            JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
            JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
            **env_extra,
        )
        settings = tmp_path / "config/lab/user-settings/@jupyterlab/apputils-extension"
        settings.mkdir(parents=True, exist_ok=True)
        (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
        if theme is not None:
            (settings / "themes.jupyterlab-settings").write_text(f'{{"theme": "{theme}"}}')
        log = open(tmp_path / "server.log", "w")
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--allow-root",
                "--ip",
                "127.0.0.1",
                "--port",
                str(port),
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={tmp_path}",
                "--LabApp.news_url=",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        servers.append((server, log))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=1)
                break
            except OSError:
                time.sleep(0.3)
        return f"http://127.0.0.1:{port}/lab/tree/live.ipynb?token={token}"

    yield start
    for server, log in servers:
        server.terminate()
        server.wait(15)
        log.close()


@pytest.fixture
def artifacts():
    """Where screenshots go (kept by CI)."""
    folder = ROOT / "artifacts"
    folder.mkdir(exist_ok=True)
    return folder


def save_and_reload(page) -> None:
    """Save the notebook (outputs included), reload the page and wait for its kernel."""
    page.keyboard.press("Control+s")
    page.wait_for_timeout(1500)
    page.reload()
    page.wait_for_selector("text=Python 3 (ipykernel) | Idle", timeout=60_000)


def open_and_run(playwright, url: str, cells: int, console: list[str] | None = None) -> tuple:
    """Chromium on the notebook; run its first ``cells`` cells in order. Returns (browser, page). The page's
    console messages and errors are appended to ``console``."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    if console is not None:
        page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
        page.on("pageerror", lambda error: console.append(f"pageerror: {error}"))
    page.goto(url)
    page.wait_for_selector(".jp-Notebook .jp-Cell .jp-InputArea-editor", timeout=60_000)
    page.wait_for_selector("text=Python 3 (ipykernel) | Idle", timeout=60_000)
    page.click(".jp-Cell .jp-InputArea-editor")
    for number in range(cells):
        page.keyboard.press("Shift+Enter")
        if number < cells - 1:
            page.wait_for_selector(
                f".jp-Cell >> nth={number} >> .jp-InputPrompt:has-text('[{number + 1}]')", timeout=60_000
            )
    return browser, page


def points_grow(page, within_s: float = 60) -> list[int]:
    """The number of points in the page's Bokeh documents, sampled until it grew twice (or ``within_s``)."""
    seen: list[int] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not (len(seen) >= 3 and seen[-1] > seen[-3] > 0):
        seen.append(page.evaluate(LOGGED_POINTS))
        time.sleep(0.7)
    return seen


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


def bokeh_trouble(console: list[str]) -> list[str]:
    """Errors of Bokeh or of its views, and Bokeh's warning about sources with columns of different lengths."""
    return [
        line
        for line in console
        if (line.startswith(("error:", "pageerror:")) and any(word in line for word in BOKEH_TROUBLE))
        or "inconsistent lengths" in line
    ]


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


def near_white(screenshot, box) -> float:
    """The share of a screenshot's pixels in ``box`` that are near white."""
    from PIL import Image

    area = (int(box["x"]), int(box["y"]), int(box["x"] + box["width"]), int(box["y"] + box["height"]))
    histogram = Image.open(screenshot).convert("L").crop(area).histogram()
    return sum(histogram[200:]) / max(1, sum(histogram))


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

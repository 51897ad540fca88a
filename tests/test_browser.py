"""A real JupyterLab in headless Chromium: a cell launches 2 ranks logging a loss; the loss plot's data grows
while the cell runs, and the per-rank resource panel renders. Saves a screenshot to artifacts/."""

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

    def start(cells: list[str]) -> str:
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
            os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime")
        )
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


def open_and_run(playwright, url: str, cells: int) -> tuple:
    """Chromium on the notebook; run its first ``cells`` cells in order. Returns (browser, page)."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
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


def test_the_launch_dashboard_streams_in_a_real_browser(jupyterlab):
    from playwright.sync_api import sync_playwright

    artifacts = ROOT / "artifacts"
    artifacts.mkdir(exist_ok=True)
    url = jupyterlab(LAUNCH_CELLS)
    with sync_playwright() as playwright:
        browser, page = open_and_run(playwright, url, 2)
        try:
            page.wait_for_selector("text=ranks alive", timeout=60_000)
            seen = points_grow(page)
            running = page.locator("text=running").count() > 0
            page.screenshot(path=str(artifacts / "browser-launch-dashboard.png"), full_page=True)
            assert len(seen) >= 3 and seen[-1] > seen[-3] > 0, f"loss points seen over time: {seen}"
            assert running, "the points grew while the cell was still running"
            titles = page.evaluate(PLOT_TITLES)
            assert {"loss", "resident memory per rank (CPU ranks), MiB", "CPU use per rank, %"} <= set(titles)
            assert page.locator(".jp-Cell >> nth=1 >> canvas").count() >= 3  # loss, memory and CPU plots drawn
            # finished, the dashboard is a static copy of its last state (its widgets closed): still drawn
            page.wait_for_selector(".jp-Cell >> nth=1 >> text=finished", timeout=60_000)
            page.wait_for_timeout(1500)
            page.screenshot(path=str(artifacts / "browser-launch-dashboard-finished.png"), full_page=True)
            assert page.locator(".jp-Cell >> nth=1 >> .gpumagic-launch-dashboard").count() == 1
            assert page.locator(".jp-Cell >> nth=1 >> canvas").count() >= 3
        finally:
            browser.close()


def test_jobs_watch_streams_and_its_kill_button_works_in_a_real_browser(jupyterlab):
    from playwright.sync_api import sync_playwright

    import gpumagic

    artifacts = ROOT / "artifacts"
    artifacts.mkdir(exist_ok=True)
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

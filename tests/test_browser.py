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


@pytest.fixture
def jupyterlab(tmp_path):
    notebook = new_notebook(
        cells=[
            new_code_cell("%load_ext gpumagic"),
            new_code_cell(
                "%%launch_ddp -n 2\nimport time\nfor step in range(500):\n"
                "    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n    time.sleep(0.02)"
            ),
        ],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    nbformat.write(notebook, tmp_path / "live.ipynb")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
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
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=1)
            break
        except OSError:
            time.sleep(0.3)
    yield f"http://127.0.0.1:{port}/lab/tree/live.ipynb?token={token}"
    server.terminate()
    server.wait(15)
    log.close()


def test_the_launch_dashboard_streams_in_a_real_browser(jupyterlab):
    from playwright.sync_api import sync_playwright

    artifacts = ROOT / "artifacts"
    artifacts.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.goto(jupyterlab)
            page.wait_for_selector(".jp-Notebook .jp-Cell .jp-InputArea-editor", timeout=60_000)
            page.wait_for_selector("text=Python 3 (ipykernel) | Idle", timeout=60_000)
            page.click(".jp-Cell .jp-InputArea-editor")
            page.keyboard.press("Shift+Enter")
            page.wait_for_selector(".jp-Cell >> nth=0 >> .jp-InputPrompt:has-text('[1]')", timeout=60_000)
            page.keyboard.press("Shift+Enter")
            page.wait_for_selector("text=ranks alive", timeout=60_000)
            seen = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (len(seen) >= 3 and seen[-1] > seen[-3] > 0):
                seen.append(page.evaluate(LOGGED_POINTS))
                time.sleep(0.7)
            running = page.locator("text=running").count() > 0
            page.screenshot(path=str(artifacts / "browser-launch-dashboard.png"), full_page=True)
            assert len(seen) >= 3 and seen[-1] > seen[-3] > 0, f"loss points seen over time: {seen}"
            assert running, "the points grew while the cell was still running"
            titles = page.evaluate(PLOT_TITLES)
            assert {"loss", "resident memory per rank (CPU ranks), MiB", "CPU use per rank, %"} <= set(titles)
            assert page.locator(".jp-Cell >> nth=1 >> canvas").count() >= 3  # loss, memory and CPU plots drawn
        finally:
            browser.close()

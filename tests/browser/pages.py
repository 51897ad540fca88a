"""Shared parts of the browser tests: a real JupyterLab (``JupyterServers``, the ``jupyterlab`` fixture),
headless Chromium on it (``open_and_run``), and what to read from the page's BokehJS (``PLOTTED``, ...)."""

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

ROOT = Path(__file__).resolve().parents[2]

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


# WCAG's contrast in the page, for the functions below that start with it: ``contrast(colour, element)`` is the
# ratio of a CSS colour (its alpha blended) to what is behind ``element``: the backgrounds up the tree (across
# shadow roots) blended over the page's own
WCAG_JS = """
const parse = (text) => {
    const parts = text.match(/[\\d.]+/g).map(Number);
    return [parts[0], parts[1], parts[2], parts.length > 3 ? parts[3] : 1];
};
const over = (top, bottom) => top.slice(0, 3).map((c, i) => c * top[3] + bottom[i] * (1 - top[3]));
const luminance = (rgb) => rgb.map((c) => {
    c /= 255;
    return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
}).reduce((sum, c, i) => sum + c * [0.2126, 0.7152, 0.0722][i], 0);
const contrast = (colour, element) => {
    const layers = [];
    for (let node = element; node; node = node.parentElement || (node.parentNode && node.parentNode.host)) {
        if (node.nodeType !== 1) continue;
        const layer = parse(getComputedStyle(node).backgroundColor);
        if (layer[3] > 0) layers.push(layer);
        if (layer[3] >= 1) break;
    }
    let behind = parse(getComputedStyle(document.body).backgroundColor).slice(0, 3);
    for (const layer of layers.reverse()) behind = over(layer, behind);
    const [a, b] = [luminance(over(parse(colour), behind)), luminance(behind)].sort((x, y) => y - x);
    return (a + 0.05) / (b + 0.05);
};
"""


def server_environment_without_jupyter_bokeh(folder: Path) -> Path:
    """A Jupyter server's environment as a JupyterHub administrator keeps it: JupyterLab and ipywidgets'
    front-end extension, but not jupyter_bokeh's; its one kernel runs this project's Python (the user's
    environment, with gpumagic and jupyter_bokeh installed). Made of links to this environment's files (a
    fresh install would need the network). Returns the server environment's Python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    # the server's Python modules come from here; its front-end files only from its own share/jupyter
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (folder / "lib" / version / "site-packages" / "project.pth").write_text(f"{site}\n")
    ours, theirs = Path(sys.prefix) / "share" / "jupyter", folder / "share" / "jupyter"
    (theirs / "labextensions").mkdir(parents=True)
    (theirs / "lab").symlink_to(ours / "lab")
    for extension in (ours / "labextensions").iterdir():
        if extension.name == "@bokeh":
            continue  # jupyter_bokeh's front end: the administrator never installed it
        (theirs / "labextensions" / extension.name).symlink_to(extension)
    spec = theirs / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "Python 3 (ipykernel)", "language": "python"})
    )
    return folder / "bin" / "python"


class JupyterServers:
    """The Jupyter servers of one test module (the ``jupyter_servers`` fixture): one per front end, started when a
    test first asks for it, each test's notebook then served beside the others'. A test's kernel runs with the
    environment the test had when it asked (``kernel_launcher.py`` sets it from the test's kernelspec), as if the
    server had been started for it alone."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.servers: dict[str, tuple[subprocess.Popen, object, str, str]] = {}  # front end: process, log, base, token
        self.count = 0

    def notebook_url(self, cells: list[str], theme: str | None, front_end: str, env_extra: dict[str, str]) -> str:
        """Serve a notebook of ``cells`` whose kernel sees this process's environment now plus ``env_extra``;
        its URL. ``front_end``: "lab" (this environment's JupyterLab, jupyter_bokeh included), "hub" (a server
        environment without jupyter_bokeh's front end: ``server_environment_without_jupyter_bokeh``) or
        "notebook" (Jupyter Notebook 7)."""
        self.count += 1
        name = f"test-{self.count}"
        kernel_dir = self.folder / "data" / "kernels" / name
        kernel_dir.mkdir(parents=True)
        (kernel_dir / "env.json").write_text(json.dumps({**os.environ, **env_extra}))
        argv = [sys.executable, str(Path(__file__).with_name("kernel_launcher.py")), str(kernel_dir / "env.json")]
        spec = {"argv": [*argv, "-f", "{connection_file}"], "display_name": "Python 3 (ipykernel)"}
        (kernel_dir / "kernel.json").write_text(json.dumps({**spec, "language": "python"}))
        notebook = new_notebook(
            cells=[new_code_cell(cell) for cell in cells],
            metadata={"kernelspec": {"name": name, "display_name": "Python 3 (ipykernel)", "language": "python"}},
        )
        nbformat.write(notebook, self.folder / f"{name}.ipynb")
        settings = self.folder / "config/lab/user-settings/@jupyterlab/apputils-extension"
        settings.mkdir(parents=True, exist_ok=True)
        (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
        (settings / "themes.jupyterlab-settings").write_text(json.dumps({"theme": theme or "JupyterLab Light"}))
        if front_end not in self.servers:
            self.servers[front_end] = self._start(front_end)
        _, _, base, token = self.servers[front_end]
        # JupyterLab: a workspace of the test's own, or the page restores the earlier tests' notebooks beside it
        page = "notebooks" if front_end == "notebook" else f"lab/workspaces/{name}/tree"
        return f"{base}/{page}/{name}.ipynb?token={token}"

    def _start(self, front_end: str) -> tuple[subprocess.Popen, object, str, str]:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        token = secrets.token_hex(16)
        quiet_servers(self.folder / "config")
        env = dict(
            os.environ,
            JUPYTER_CONFIG_DIR=str(self.folder / "config"),
            JUPYTER_RUNTIME_DIR=str(self.folder / f"runtime-{front_end}"),
            JUPYTER_DATA_DIR=str(self.folder / "data"),  # the tests' kernelspecs; no extension from there
        )
        python, app = sys.executable, "jupyterlab"
        if front_end == "hub":
            python = str(server_environment_without_jupyter_bokeh(self.folder / "server-env"))
        elif front_end == "notebook":
            app = "notebook"
        log = open(self.folder / f"server-{front_end}.log", "w")
        server = subprocess.Popen(
            [
                python,
                "-m",
                app,
                "--no-browser",
                "--allow-root",
                "--ip",
                "127.0.0.1",
                "--port",
                str(port),
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={self.folder}",
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
        return server, log, f"http://127.0.0.1:{port}", token

    def shut_down_kernels(self) -> None:
        """End every kernel the servers run (a finished test's), so the next test has the machine to itself."""
        for _, _, base, token in self.servers.values():
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=10) as answer:
                    kernels = json.load(answer)
                for kernel in kernels:
                    request = urllib.request.Request(
                        f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE"
                    )
                    with contextlib.suppress(OSError):
                        urllib.request.urlopen(request, timeout=30).close()

    def stop(self) -> None:
        for server, log, _, _ in self.servers.values():
            server.terminate()
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            log.close()


def quiet_servers(config: Path) -> None:
    """Leave out the servers' work no test looks at: JupyterLab's build check (each page load ran ``node`` twice,
    about 0.35 s of CPU) and jupyter_lsp's search for language servers (``npm prefix``, ``node``)."""
    (config / "labconfig").mkdir(parents=True, exist_ok=True)
    (config / "labconfig" / "page_config.json").write_text(json.dumps({"buildCheck": False, "buildAvailable": False}))
    server = {"ServerApp": {"jpserver_extensions": {"jupyter_lsp": False}}}
    (config / "jupyter_server_config.json").write_text(json.dumps(server))


def artifacts_folder():
    """Where screenshots go (kept by CI)."""
    folder = ROOT / "artifacts"
    folder.mkdir(exist_ok=True)
    return folder


def save(page) -> None:
    """Save the notebook and wait until the server has it: its answer to the page's ``PUT`` of the notebook.
    (A fixed 1.5 s wait was too short on a busy machine: the page reloaded from the earlier save, without the
    newest cell's output. Waiting for the tab's unsaved-changes mark to go timed out once in a fresh-clone run
    under load: a running launch's dashboard marks the notebook changed again about 0.4 s after a save, and on a
    starved page the mark can come back before the tab is redrawn without it.)"""
    from playwright.sync_api import TimeoutError as NoAnswer

    page.wait_for_selector(".lm-TabBar-tab.jp-mod-current.jp-mod-dirty", timeout=10_000)  # it has changes to save
    started = time.monotonic()
    for press in range(3):  # a key press a starved page lost is pressed again (saving twice does no harm)
        try:
            with page.expect_response(_saves_a_notebook, timeout=20_000) as answer:
                page.keyboard.press("Control+s")
            break
        except NoAnswer:
            if press == 2:
                raise
            print(f"no save answered {time.monotonic() - started:.1f} s after Ctrl+S; pressing it again")
    assert answer.value.ok, f"the server refused the save: {answer.value.status} {answer.value.status_text}"
    print(f"saved in {time.monotonic() - started:.2f} s")


def _saves_a_notebook(response) -> bool:
    return response.request.method == "PUT" and "/api/contents/" in response.url


def save_and_reload(page) -> None:
    """Save the notebook (outputs included), reload the page and wait for its kernel."""
    save(page)
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
    if "/notebooks/" in url:  # Notebook 7: its kernel's name in the top bar, idle once connected
        page.wait_for_selector(".jp-Toolbar >> text=Python 3 (ipykernel)", timeout=60_000)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
    else:
        page.wait_for_selector("text=Python 3 (ipykernel) | Idle", timeout=60_000)
    page.click(".jp-Cell .jp-InputArea-editor")
    for number in range(cells):
        page.keyboard.press("Shift+Enter")
        if number < cells - 1:
            page.wait_for_selector(
                f".jp-Cell >> nth={number} >> .jp-InputPrompt:has-text('[{number + 1}]')", timeout=60_000
            )
    return browser, page


@contextlib.contextmanager
def notebook_page(url: str, cells: int, console: list[str] | None = None):
    """Headless Chromium on the notebook at ``url`` with its first ``cells`` cells run (``open_and_run``);
    yields the page, and closes the browser after."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser, page = open_and_run(playwright, url, cells, console)
        try:
            yield page
        finally:
            browser.close()


def points_grow(page, within_s: float = 60) -> list[int]:
    """The number of points in the page's Bokeh documents, sampled until it grew twice (or ``within_s``)."""
    seen: list[int] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not (len(seen) >= 3 and seen[-1] > seen[-3] > 0):
        seen.append(page.evaluate(LOGGED_POINTS))
        time.sleep(0.7)
    return seen


def bokeh_trouble(console: list[str]) -> list[str]:
    """Errors of Bokeh or of its views, and Bokeh's warning about sources with columns of different lengths."""
    return [
        line
        for line in console
        if (line.startswith(("error:", "pageerror:")) and any(word in line for word in BOKEH_TROUBLE))
        or "inconsistent lengths" in line
    ]


def near_white(screenshot, box) -> float:
    """The share of a screenshot's pixels in ``box`` that are near white."""
    from PIL import Image

    area = (int(box["x"]), int(box["y"]), int(box["x"] + box["width"]), int(box["y"] + box["height"]))
    histogram = Image.open(screenshot).convert("L").crop(area).histogram()
    return sum(histogram[200:]) / max(1, sum(histogram))

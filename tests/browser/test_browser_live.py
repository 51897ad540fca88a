"""Live dashboards in a real JupyterLab and headless Chromium, judged by what the page draws: the pixels of the
curves in the loss plot and BokehJS's own models. The curves are drawn from the first logged point whenever it
comes (4 s after the start, in a %ddp group's second cell); a page reloaded during a launch, blocking or
--no-wait, shows the dashboard again and its final state once the launch ends; a notebook reopened and run
again draws; a superseded dashboard keeps its last picture; the dark theme's text has 4.5:1 contrast.
Screenshots go to artifacts/."""

import time
from pathlib import Path

import pytest

from tests.browser.pages import PLOTTED, WCAG_JS, bokeh_trouble, notebook_page, save, save_and_reload

pytestmark = pytest.mark.kernel

LATE_FIRST_LOG = (
    "%%launch_ddp -n 2 --gpus none\nimport time\ntime.sleep(4)  # data loading, the first forward\n"
    "for step in range(600):\n    gpumagic.log(step=step, total_steps=600, loss=1.0 / (step + 1) + rank)\n"
    "    time.sleep(0.02)"
)
# BokehJS's figures whose title starts with a name, with their ranges: a range BokehJS could not set is NaN
RANGES = """(name) => {
    const found = [];
    for (const doc of window.Bokeh.documents || [])
        for (const model of doc.all_models)
            if (model.type === "Figure" && model.title && String(model.title.text).startsWith(name))
                found.push([model.title.text, model.x_range.start, model.x_range.end, model.y_range.start,
                            model.y_range.end]);
    return found;
}"""
# WCAG contrast (WCAG_JS) of the first element matching a selector inside the notebook (across shadow roots):
# of its text colour, or of a CSS variable as BokehJS reads it on a figure
CONTRAST = (
    """([selector, property]) => {
"""
    + WCAG_JS
    + """
    let element = null;
    const walk = (root) => { for (const e of root.querySelectorAll("*")) { if (element) return;
        if (e.matches(selector)) { element = e; return; } if (e.shadowRoot) walk(e.shadowRoot); } };
    walk(document.querySelector(".jp-Notebook"));
    if (!element) return null;
    const style = getComputedStyle(element);
    const colour = property ? style.getPropertyValue(property) : style.color;
    return {ratio: contrast(colour, element), colour};
}"""
)


def contrast_of(page, selector: str, variable: str | None, timeout: float = 10_000) -> dict:
    """The contrast of the first element matching ``selector`` (its colour, or its CSS ``variable``) against what
    is behind it, waiting up to ``timeout`` ms for the element: a view redrawn at a tick leaves the page for a frame."""
    return page.wait_for_function(CONTRAST, arg=[selector, variable], timeout=timeout).json_value()


LIGHT_TEXT = (
    ("tick labels", ".bk-Figure", "--bk-major-label-text-color"),
    ("titles", ".bk-Figure", "--bk-text-color"),
    ("legend", ".bk-Figure", "--bk-label-text-color"),
    ("status line", ".widget-html-content", None),
)


def curve_pixels(page, cell: int, path) -> int:
    """Pixels of the two ranks' colours in the widest plot of cell ``cell``'s output (the loss plot), in a
    screenshot saved at ``path``: 0 where the plot is drawn empty. A canvas replaced between finding it and
    its screenshot (the page built the view again: the one catch-up re-send, a static copy taking the live
    view's place), or hidden meanwhile (Notebook 7, a fresh-clone run under load), is found again, up to 9 times
    over 2 s."""
    from playwright.sync_api import Error

    for _ in range(8):
        try:
            return _curve_pixels(page, cell, path)
        except Error as error:
            if "not attached" not in str(error) and "not visible" not in str(error):
                raise
        page.wait_for_timeout(250)  # the page builds the view again: give it a moment
    return _curve_pixels(page, cell, path)


def _curve_pixels(page, cell: int, path) -> int:
    from PIL import Image

    from gpumagic.widgets.plots import PALETTE

    boxes = [
        canvas.bounding_box() or {"width": 0} for canvas in page.locator(f".jp-Cell >> nth={cell} >> canvas").all()
    ]
    if not any(box["width"] for box in boxes):
        return 0
    widest = max(range(len(boxes)), key=lambda i: boxes[i]["width"])
    page.locator(f".jp-Cell >> nth={cell} >> canvas").nth(widest).screenshot(path=str(path), timeout=10_000)
    area = Image.open(path).convert("RGB")
    wanted = [tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in PALETTE[:2]]
    return sum(
        1
        for pixel in area.get_flattened_data()
        if any(sum(abs(p - w) for p, w in zip(pixel, colour, strict=True)) < 60 for colour in wanted)
    )


def wait_for_pixels(page, cell: int, path, within_s: float = 30) -> int:
    """The curve's pixels (``curve_pixels``) once there are 300, or after ``within_s``; where none were drawn the
    whole page goes to ``path`` with ``-page`` added, to see what it showed instead."""
    deadline = time.monotonic() + within_s
    pixels = 0
    while time.monotonic() < deadline and pixels < 300:
        page.wait_for_timeout(1000)
        pixels = curve_pixels(page, cell, path)
    if not pixels:
        page.screenshot(path=str(Path(path).with_name(f"{Path(path).stem}-page.png")), full_page=True)
    return pixels


def test_curves_draw_live_when_the_first_log_comes_4_s_after_the_start(jupyterlab, artifacts):
    """The ranks log first 4 s in (after the dashboard went live with their resources): the loss curves are
    drawn while the cell runs, the status line gives a true step rate and an ETA, and no range is NaN."""
    url = jupyterlab(["%load_ext gpumagic", LATE_FIRST_LOG])
    console: list[str] = []
    with notebook_page(url, 2, console) as page:
        page.wait_for_selector(".jp-Cell >> nth=1 >> text=steps/s", timeout=60_000)
        pixels = wait_for_pixels(page, 1, artifacts / "browser-first-log-late.png")
        status = page.locator(".jp-Cell >> nth=1 >> text=steps/s").first.inner_text()
        running = "running" in status
        assert pixels >= 300, f"the loss plot drew {pixels} pixels of curve while running"
        assert running, status
        ranges = page.evaluate(RANGES, "loss")
        assert ranges and all(value == value for found in ranges for value in found[1:]), ranges  # no NaN
        rate = float(status.split(" steps/s")[0].rsplit("·", 1)[1].replace(",", ""))
        assert 20 < rate < 60, status  # 50 steps/s at most (a 20 ms sleep a step), not 0.0
        assert "of 600" in status and "ETA" in status, status
        for name, selector, variable in LIGHT_TEXT:  # JupyterLab Light: text at least 4.5:1 too
            found = contrast_of(page, selector, variable)
            assert found is not None and found["ratio"] >= 4.5, (name, found)
        page.wait_for_selector(".jp-Cell >> nth=1 >> text=finished", timeout=60_000)
        page.wait_for_timeout(1500)
        assert curve_pixels(page, 1, artifacts / "browser-first-log-late-finished.png") >= 300
        assert not bokeh_trouble(console), bokeh_trouble(console)[:5]


DDP_CELLS = [
    "%load_ext gpumagic",
    "%ddp start -n 2 --gpus none",
    "%%ddp\nimport time\ntime.sleep(3)\nx = 0",
    "%%ddp\nfor step in range(150):\n    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n    time.sleep(0.02)",
    "%ddp watch",
]


def test_a_ddp_group_draws_curves_first_logged_in_a_later_cell_and_a_superseded_dashboard_keeps_them(
    jupyterlab, artifacts
):
    """The group's dashboard goes live at %ddp start; the first point comes two cells later. Its curves are
    drawn; %ddp watch shows a new dashboard and the first keeps its last picture."""
    url = jupyterlab(DDP_CELLS)
    console: list[str] = []
    with notebook_page(url, 4, console) as page:
        page.wait_for_selector(".jp-Cell >> nth=3 >> .jp-InputPrompt:has-text('[4]')", timeout=90_000)
        pixels = wait_for_pixels(page, 1, artifacts / "browser-ddp-group.png")
        assert pixels >= 300, f"the group's loss plot drew {pixels} pixels of curve"
        page.keyboard.press("Shift+Enter")  # %ddp watch: a new dashboard; the first one frozen
        page.wait_for_selector(".jp-Cell >> nth=4 >> canvas", timeout=60_000)
        page.wait_for_timeout(2000)
        assert curve_pixels(page, 1, artifacts / "browser-ddp-superseded.png") >= 300
        assert page.locator(".jp-Cell >> nth=1 >> text=superseded").count() == 1
        assert curve_pixels(page, 4, artifacts / "browser-ddp-watch.png") >= 300  # its history, drawn again
        assert not bokeh_trouble(console), bokeh_trouble(console)[:5]


def launch_for(seconds: float, flags: str = "") -> str:
    steps = int(seconds / 0.02)
    return (
        f"%%launch_ddp -n 2 --gpus none {flags}\nimport time\nfor step in range({steps}):\n"
        "    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n    time.sleep(0.02)"
    )


def launch_until(flag: Path, flags: str) -> str:
    """A launch whose ranks log until ``flag`` exists: it runs until the test has seen what it runs for."""
    return (
        f"%%launch_ddp -n 2 --gpus none {flags}\nimport os, time\nfor step in range(100000):\n"
        "    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n"
        f"    if os.path.exists({str(flag)!r}):\n        break\n    time.sleep(0.02)"
    )


@pytest.mark.parametrize("flags", ["--no-wait", ""], ids=["no-wait", "blocking"])
def test_a_page_reloaded_during_a_launch_shows_its_dashboard_and_then_its_final_state(
    jupyterlab, artifacts, flags, tmp_path
):
    """Saved and reloaded while the launch runs: a --no-wait launch's dashboard draws again at once (the
    kernel is free) and turns into its static copy when the launch ends; a blocking launch's shows its final
    state when the cell ends (the kernel answers the page then). Never "model not found", never blank. The
    --no-wait launch runs until the test has seen it running after the reload: an 18 s one had ended by then on
    a busy machine (a fresh-clone CI run, one core kept busy)."""
    done = tmp_path / "may-end"  # a name without "running", which the page is searched for
    url = jupyterlab(["%load_ext gpumagic", launch_until(done, flags) if flags else launch_for(14, flags)])
    console: list[str] = []
    name = flags.strip("-") or "blocking"
    with notebook_page(url, 2, console) as page:
        page.wait_for_selector(".jp-Cell >> nth=1 >> text=steps/s", timeout=60_000)
        assert wait_for_pixels(page, 1, artifacts / f"browser-reload-{name}-before.png") >= 300
        save_and_reload(page) if flags else _save_and_reload_busy(page)
        if flags:  # the kernel is free: the live dashboard again, from where the run is
            try:
                # the page builds the view from the kernel's state once JupyterLab is up again; in one fresh-clone
                # run under load it had drawn no canvas 30 s after the reload (no page picture then: one is kept now)
                assert wait_for_pixels(page, 1, artifacts / f"browser-reload-{name}-live.png", within_s=60) >= 300
                assert page.locator(".jp-Cell >> nth=1 >> text=running >> visible=true").count() == 1
            finally:
                done.touch()  # the ranks end their loop: the launch finishes
        page.screenshot(path=str(artifacts / f"browser-reload-{name}-after.png"))
        try:
            page.wait_for_selector(".jp-Cell >> nth=1 >> text=finished", timeout=60_000)
        finally:
            page.screenshot(path=str(artifacts / f"browser-reload-{name}-end.png"))
        page.wait_for_timeout(2000)
        pixels = curve_pixels(page, 1, artifacts / f"browser-reload-{name}-finished.png")
        assert pixels >= 300, f"after the launch ended the reloaded page drew {pixels} pixels of curve"
        assert page.locator("text=model not found").count() == 0
        assert page.evaluate(PLOTTED)["backwards"] == 0
        assert not bokeh_trouble(console), bokeh_trouble(console)[:5]


def _save_and_reload_busy(page) -> None:
    """Save and reload while the kernel is busy (its status reads Busy, not Idle)."""
    save(page)
    page.reload()
    page.wait_for_selector(".jp-Notebook .jp-Cell .jp-InputArea-editor", timeout=60_000)


REOPEN_CELLS = ["%load_ext gpumagic", launch_for(1.2), "%gpu watch --interval 0.5s"]


def test_a_reopened_notebook_run_again_draws_every_dashboard(jupyterlab, artifacts):
    """A notebook with a finished launch and a running %gpu watch, saved and reopened, then run again: with Run
    All in the same kernel, then again with Restart Kernel and Run All. BokehJS is there before every plot,
    every dashboard draws, and the page shows no Bokeh error and no "model not found"."""
    url = jupyterlab(REOPEN_CELLS, GPUMAGIC_SIMULATE="2xA100-80GB")
    console: list[str] = []
    with notebook_page(url, 3, console) as page:
        page.wait_for_selector(".jp-Cell >> nth=1 >> text=finished", timeout=90_000)
        page.wait_for_selector(".jp-Cell >> nth=2 >> canvas", timeout=60_000)
        # the launch cell's prompt once run again: [5] in the same kernel (after [1]-[3]), [2] after a restart
        for name, menu, item, prompt in (
            ("run-all", "Run", "Run All Cells", "[5]"),
            ("restart-run-all", "Kernel", "Restart Kernel and Run All Cells…", "[2]"),
        ):
            save_and_reload(page)
            mark = f"---- reopened: {name} ----"
            console.append(mark)
            page.click(f"text={menu} >> nth=0")
            page.click(f"text={item}")
            if menu == "Kernel":
                page.locator(".jp-Dialog button.jp-mod-accept").click()
            page.wait_for_selector(f".jp-Cell >> nth=1 >> .jp-InputPrompt:has-text('{prompt}')", timeout=90_000)
            page.wait_for_selector(".jp-Cell >> nth=1 >> text=finished", timeout=90_000)
            page.wait_for_selector(".jp-Cell >> nth=2 >> canvas", timeout=60_000)
            page.wait_for_timeout(2000)
            assert curve_pixels(page, 1, artifacts / f"browser-reopen-{name}.png") >= 300, name
            assert page.locator(".jp-Cell >> nth=2 >> canvas").count() >= 3, name
            after = console[console.index(mark) :]
            assert not [line for line in after if "reading 'require'" in line], after
            assert not bokeh_trouble(after), bokeh_trouble(after)[:5]
            assert page.locator("text=model not found").count() == 0, name


# every message of the page's to the kernel, counted by kind; the page's one answer to a frame (FRAME_JS: "rich",
# its plots drew) counted apart
COUNT_COMMS = (
    "%load_ext gpumagic\nimport collections\ncomms = collections.Counter()\n"
    "kernel = get_ipython().kernel\n"
    "def counting(kind, handler):\n    def counted(*args, **kwargs):\n"
    "        state = args[-1]['content'].get('data', {}).get('state', {})\n"
    "        if list(state) == ['value'] and state['value'] in ('rich', 'plain'):  # a frame's answer (maybe closed)\n"
    "            answers[state['value']] += 1\n"
    "            return handler(*args, **kwargs)\n"
    "        comms[kind] += 1\n"
    "        data = args[-1]['content'].get('data', {})\n"
    "        comms[str(data.get('method')) + ':' + str(data.get('event', data.get('content', {})))[:80]] += 1\n"
    "        return handler(*args, **kwargs)\n    return counted\n"
    "answers = collections.Counter()\n"
    "for kind in ('comm_msg', 'comm_open', 'comm_close'):\n"
    "    kernel.shell_handlers[kind] = counting(kind, kernel.shell_handlers[kind])"
)


def test_the_dark_theme_reads_at_4_5_to_1_and_reading_a_plot_sends_nothing(jupyterlab, artifacts):
    """In JupyterLab Dark: the plots' tick labels, titles and legend, the tabs and the status line have at least
    4.5:1 contrast against what is behind them. Moving the smoothing slider, switching tabs and hovering send
    the kernel no message (docs/telemetry.md says so)."""
    url = jupyterlab(
        [COUNT_COMMS, launch_for(6), "print(sum(comms.values()), dict(comms), dict(answers))"], theme="JupyterLab Dark"
    )
    with notebook_page(url, 2) as page:
        page.wait_for_selector(".jp-Cell >> nth=1 >> text=steps/s", timeout=60_000)
        wait_for_pixels(page, 1, artifacts / "browser-dark-theme.png")
        page.locator(".jp-Cell >> nth=1").screenshot(path=str(artifacts / "cell-dark-theme.png"))
        measured = {
            "tick labels": contrast_of(page, ".bk-Figure", "--bk-major-label-text-color"),
            "legend": contrast_of(page, ".bk-Figure", "--bk-label-text-color"),
            "titles": contrast_of(page, ".bk-Figure", "--bk-text-color"),
            "active tab": contrast_of(page, ".bk-tab.bk-active", None),
            "status line": contrast_of(page, ".widget-html-content, .gpumagic-launch-dashboard", None),
        }
        print({name: round(found["ratio"], 2) for name, found in measured.items() if found})
        for name, found in measured.items():
            assert found is not None, f"{name}: not on the page"
            assert found["ratio"] >= 4.5, (name, found)
        # moving the smoothing slider, switching to the log tab, hovering: nothing reaches the kernel
        page.wait_for_selector(".jp-Cell >> nth=1 >> text=finished", timeout=60_000)
        page.wait_for_timeout(1000)
        title = page.locator(".jp-Cell >> nth=1 >> .bk-slider-title").first
        before = float(title.inner_text().rsplit(":", 1)[1])
        page.locator(".jp-Cell >> nth=1 >> .noUi-handle").first.drag_to(
            page.locator(".jp-Cell >> nth=1 >> .noUi-base").first, target_position={"x": 5, "y": 5}
        )
        page.locator(".jp-Cell >> nth=1 >> .bk-tab:has-text('log y')").first.click()
        box = page.locator(".jp-Cell >> nth=1 >> canvas >> visible=true").first.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)  # the hover's tooltip
        page.wait_for_timeout(1000)
        after = float(title.inner_text().rsplit(":", 1)[1])
        assert after < min(before, 0.1), (before, after)  # the slider moved, to about the raw points
        page.locator(".jp-Cell >> nth=2 >> .jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        page.wait_for_selector(".jp-Cell >> nth=2 >> .jp-OutputArea-output", timeout=30_000)
        counted = page.locator(".jp-Cell >> nth=2 >> .jp-OutputArea-output").inner_text()
        assert counted.split()[0] == "0", counted
        assert counted.strip().endswith("{'rich': 1}"), counted  # the page said its plots drew, once


LATE_JOBS = [
    "%load_ext gpumagic\nimport gpumagic",
    "def train(k):\n    import time\n    time.sleep(4)\n    for step in range(100000):\n"
    "        gpumagic.log(step=step, loss=k + 1.0 / (step + 1))\n        time.sleep(0.05)\n"
    "jobs = [gpumagic.jobs_with(gpus=0, name=f'late{k}').submit(train, k) for k in range(2)]",
    "%jobs watch late* --interval 0.5",
]


def test_jobs_watch_draws_curves_first_logged_4_s_after_it_is_shown(jupyterlab, artifacts):
    """%jobs watch shown before its jobs log anything: their curves are drawn once they do."""
    import gpumagic

    url = jupyterlab(LATE_JOBS)
    console: list[str] = []
    try:
        with notebook_page(url, 3, console) as page:
            page.wait_for_selector(".jp-Cell >> nth=2 >> canvas", timeout=60_000)
            pixels = wait_for_pixels(page, 2, artifacts / "browser-jobs-watch-late.png", within_s=40)
            assert pixels >= 300, f"the jobs' loss plot drew {pixels} pixels of curve"
            assert not bokeh_trouble(console), bokeh_trouble(console)[:5]
    finally:
        for job in gpumagic.list_jobs():
            if job.status in ("running", "queued"):
                job.kill(grace_s=1)

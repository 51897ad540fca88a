"""%gpu watch, %jobs watch and the %gpu table in a real JupyterLab in headless Chromium, looked at as a user
would: a watch closed, or replaced by a new one, stays drawn (a static copy of its last state); %jobs watch
shows the jobs its pattern and states choose, streams their curves and its Kill button works; the %gpu table
keeps each GPU on one line in a 900 px output; the text gpumagic draws has at least 4.5:1 contrast on
JupyterLab's light and dark themes. Screenshots go to artifacts/."""

import itertools
import json

import pytest

from tests.browser.pages import (
    PLOT_TITLES,
    PLOTTED,
    WCAG_JS,
    WHERE_BACKWARDS,
    bokeh_trouble,
    near_white,
    notebook_page,
    points_grow,
)

pytestmark = pytest.mark.kernel

# WCAG's contrast of the text of every element under ``root`` that holds text of its own (a mark such as ● is
# a graphic, not text), against what is behind it (WCAG_JS)
CONTRASTS = (
    """(root) => {
"""
    + WCAG_JS
    + """
    const found = [];
    for (const element of [root, ...root.querySelectorAll("*")]) {
        const own = Array.from(element.childNodes).filter((n) => n.nodeType === 3).map((n) => n.textContent);
        const text = own.join("").replace(/[●✖\\s]/g, "");
        if (!text || element.offsetParent === null || element.tagName === "SCRIPT") continue;
        const colour = getComputedStyle(element).color;
        found.push({ratio: contrast(colour, element), text: text.slice(0, 40), colour});
    }
    return found;
}"""
)
# Whether a table's rows keep each cell on one line in a container ``width`` px wide: the table fits, and no row
# is taller than its lines (a process per line in the processes cell)
ONE_LINE_ROWS = """([table, width]) => {
    const output = table.closest('.jp-OutputArea-output');
    output.style.width = width + 'px';
    const line = table.querySelector('thead tr').getBoundingClientRect().height;
    const tall = [];
    for (const row of table.querySelectorAll('tbody tr')) {
        const lines = Math.max(1, row.lastElementChild.querySelectorAll('div').length);
        const height = row.getBoundingClientRect().height;
        if (height > lines * line + 2) tall.push({text: row.innerText.slice(0, 60), height, lines, line});
    }
    const fits = table.getBoundingClientRect().width <= output.getBoundingClientRect().width + 1;
    const result = {fits, tall, width: table.getBoundingClientRect().width, line};
    output.style.width = '';
    return result;
}"""
ONE_LINE = "(e) => e.getBoundingClientRect().height <= parseFloat(getComputedStyle(e).lineHeight) + 1"
BUSY_SERVER = {
    "gpus": [
        {"model": "H100-80GB", "count": 2},
        {
            "model": "H100-80GB",
            "utilization": 97,
            "temperature": 74,
            "processes": [
                {
                    "pid": 31337,
                    "user": "alice",
                    "command": "python -m torch.distributed.run --nproc-per-node 4 train_llm.py "
                    "--config configs/llama-7b-long-context.yaml --output /scratch/alice/runs/7b",
                    "memory": "61GB",
                },
                {"pid": 31338, "user": "alice", "command": "python eval.py", "memory": "9GB"},
            ],
        },
        {"model": "H100-80GB", "used": "40GB", "utilization": 60},
        {"model": "H100-80GB", "count": 4},
    ]
}
GPU_WATCH_CELLS = [
    "%load_ext gpumagic",
    "%gpu use 1,3\nw = %gpu watch --interval 0.5s\nw",
    "%gpu",
    "w.close()",
    "%gpu watch --interval 0.5s",
    "%gpu watch --interval 0.5s",
]


def contrasts(page, selector: str) -> list[dict]:
    """The contrast of every piece of text in the elements ``selector`` matches."""
    return [found for element in page.locator(selector).element_handles() for found in element.evaluate(CONTRASTS)]


def low(measured: list[dict]) -> list[dict]:
    """What reads under WCAG's 4.5:1 for text."""
    return [m for m in measured if m["ratio"] < 4.5]


def ink(screenshot) -> float:
    """The share of a screenshot's pixels that differ from its most common colour (the background): what is
    drawn there."""
    from PIL import Image

    pixels = Image.open(screenshot).convert("L").histogram()
    background = max(range(256), key=lambda level: pixels[level])
    near = sum(pixels[max(0, background - 8) : background + 9])
    return 1 - near / max(1, sum(pixels))


def run_cell(page, number: int) -> None:
    page.locator(f".jp-Cell >> nth={number} >> .jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_selector(f".jp-Cell >> nth={number} >> .jp-InputPrompt:has-text('[{number + 1}]')", timeout=60_000)


def test_gpu_watch_updates_stays_drawn_when_closed_or_replaced_and_reads_on_the_dark_theme(
    jupyterlab, artifacts, tmp_path
):
    """8 simulated GPUs (two of them busy) at 2 Hz on JupyterLab's dark theme: the points grow at every look,
    the page keeps the same Bokeh documents with no Bokeh error, no plotted x series goes back, no white box;
    the text gpumagic draws (status line, bars, the %gpu table) has at least 4.5:1 contrast, and the %gpu table
    keeps each GPU on one line at 900 px. ``w.close()`` leaves the dashboard drawn (its plots, bars and status
    as a static copy), and so does a second %gpu watch to the one it replaces."""
    server = tmp_path / "busy.json"
    server.write_text(json.dumps(BUSY_SERVER))
    url = jupyterlab(GPU_WATCH_CELLS, theme="JupyterLab Dark", GPUMAGIC_SIMULATE=str(server))
    console: list[str] = []
    with notebook_page(url, 3, console) as page:
        watch, table = ".jp-Cell >> nth=1", ".jp-Cell >> nth=2 >> table.gpumagic-status"
        page.wait_for_selector(f"{watch} >> canvas", timeout=60_000)
        page.wait_for_selector(table, timeout=30_000)
        page.wait_for_timeout(2500)  # past the one catch-up re-send
        looks = [page.evaluate(PLOTTED)]
        for _ in range(3):
            page.wait_for_timeout(3000)
            looks.append(page.evaluate(PLOTTED))
        points = [look["points"] for look in looks]
        assert all(b > a for a, b in itertools.pairwise(points)), f"points at each look: {points}"
        assert len({look["documents"] for look in looks}) == 1, f"documents: {[x['documents'] for x in looks]}"
        assert all(look["backwards"] == 0 for look in looks), (looks, page.evaluate(WHERE_BACKWARDS))
        assert looks[-1]["series"] >= 8 * 3  # every GPU on the memory, utilization and temperature plots
        assert page.locator(f"{watch} >> text=live").count() > 0
        assert page.locator(f"{watch} >> .gpumagic-gpu-bar >> visible=true").count() == 8

        shot = artifacts / "browser-gpu-watch-dark.png"
        page.locator(watch).evaluate("(cell) => cell.scrollIntoView()")
        page.screenshot(path=str(shot), full_page=True)
        assert near_white(shot, page.locator(f"{watch} >> canvas").first.bounding_box()) < 0.2
        measured = contrasts(page, f"{watch} >> .jp-OutputArea-output")  # status line, bars, buttons
        measured += contrasts(page, ".jp-Cell >> nth=2 >> .jp-OutputArea-output")  # the %gpu table
        print(f"dark theme: {len(measured)} texts, lowest contrast", min(measured, key=lambda m: m["ratio"]))
        assert len(measured) > 100 and not low(measured), low(measured)
        table_element = page.locator(table).element_handle()
        for width in (900, 1300):
            layout = page.evaluate(ONE_LINE_ROWS, [table_element, width])
            assert layout["fits"] and not layout["tall"], (width, layout)
        page.evaluate("(t) => { t.closest('.jp-OutputArea-output').style.width = '900px'; }", table_element)
        page.locator(".jp-Cell >> nth=2").screenshot(path=str(artifacts / "cell-gpu-table-900px-dark.png"))
        page.evaluate("(t) => { t.closest('.jp-OutputArea-output').style.width = ''; }", table_element)

        before = artifacts / "browser-gpu-watch-before-close.png"
        page.locator(watch).screenshot(path=str(before))
        run_cell(page, 3)  # w.close()
        page.wait_for_selector(f"{watch} >> .gpumagic-gpu-watch >> text=closed at", timeout=30_000)
        page.wait_for_selector(f"{watch} >> canvas", timeout=30_000)
        page.wait_for_timeout(1500)
        after = artifacts / "browser-gpu-watch-closed.png"
        page.locator(watch).screenshot(path=str(after))
        assert page.locator(f"{watch} >> canvas").count() >= 3  # memory, utilization, temperature
        assert page.locator(f"{watch} >> .gpumagic-gpu-bar >> visible=true").count() == 8
        assert page.locator(f"{watch} >> .jupyter-widgets").count() == 0  # no live widget left
        drawn_before, drawn_after = ink(before), ink(after)
        assert drawn_after > 0.05 and drawn_after > 0.5 * drawn_before, (drawn_before, drawn_after)
        measured = contrasts(page, f"{watch} >> .jp-OutputArea-output")  # the static copy
        assert len(measured) > 30 and not low(measured), low(measured)

        run_cell(page, 4)  # a new watch...
        page.wait_for_selector(".jp-Cell >> nth=4 >> .gpumagic-gpu-bar", timeout=30_000)
        page.wait_for_selector(".jp-Cell >> nth=4 >> canvas", timeout=30_000)
        run_cell(page, 5)  # ...replaced by another: the first stays drawn
        page.wait_for_selector(".jp-Cell >> nth=4 >> .gpumagic-gpu-watch >> text=closed at", timeout=30_000)
        page.wait_for_selector(".jp-Cell >> nth=5 >> canvas", timeout=30_000)
        page.wait_for_timeout(1500)
        page.locator(".jp-Cell >> nth=4").screenshot(path=str(artifacts / "browser-gpu-watch-replaced.png"))
        assert page.locator(".jp-Cell >> nth=4 >> canvas").count() >= 3
        assert page.locator(".jp-Cell >> nth=5 >> text=live").count() > 0
        assert not bokeh_trouble(console), bokeh_trouble(console)[:5]


JOB_CELLS = [
    "%load_ext gpumagic\nimport gpumagic",
    "def train(k):\n    import time\n    for step in range(100000):\n"
    "        gpumagic.log(step=step, loss=k + 1.0 / (step + 1))\n        time.sleep(0.05)\n"
    "jobs = [gpumagic.jobs_with(gpus=0, name=f'variant{k}').submit(train, k) for k in range(2)]\n"
    "other = gpumagic.jobs_with(gpus=0, name='other').submit(train, 9)\n"
    "gpumagic.use('GPU:*')  # every GPU held by this kernel: the next job waits\n"
    "waiting = gpumagic.jobs_with(gpus=2, name='variant2').submit(train, 2)",
    "%jobs watch 'variant*' --state running,queued --interval 0.5",
    "%gpu",
    "%jobs",
]


def test_jobs_watch_with_a_filter_streams_reads_on_the_light_theme_and_its_kill_button_works(jupyterlab, artifacts):
    """%jobs watch 'variant*' --state running,queued: the three variants (not 'other'), the running ones' curves
    streaming in their own colours, the waiting one's why in one line (in full under the mouse), text at 4.5:1
    or more on the light theme (the %gpu table's too); Kill stops a job, which then leaves the table (no longer
    running or queued)."""
    import gpumagic

    url = jupyterlab(JOB_CELLS, GPUMAGIC_SIMULATE="4xA100-80GB")
    try:
        with notebook_page(url, 5) as page:
            cell = ".jp-Cell >> nth=2"
            page.wait_for_selector(f"{cell} >> text=3 background jobs", timeout=60_000)
            seen = points_grow(page, within_s=20)  # well before the 30 s full re-save: the streams arrive
            assert len(seen) >= 3 and seen[-1] > seen[-3] > 0, f"loss points seen over time: {seen}"
            assert "loss per job" in page.evaluate(PLOT_TITLES)
            output = page.locator(f"{cell} >> .jp-Cell-outputArea").inner_text()
            assert "variant0" in output and "variant1" in output and "other" not in output
            assert "(variant* · queued, running)" in output
            why = page.locator(f"{cell} >> text=waiting for 2 GPUs (next in the queue) >> visible=true")
            why.wait_for(timeout=10_000)  # why the job waits, in one line; in full under the mouse
            assert "GPU 0:" in why.get_attribute("title")
            assert why.evaluate(ONE_LINE), "the why takes more than one line"
            page.wait_for_selector(".jp-Cell >> nth=3 >> table.gpumagic-status", timeout=30_000)
            page.wait_for_selector(".jp-Cell >> nth=4 >> table.gpumagic-jobs", timeout=30_000)
            page.locator(cell).evaluate("(element) => element.scrollIntoView()")
            page.screenshot(path=str(artifacts / "browser-jobs-watch.png"), full_page=True)
            page.locator(cell).screenshot(path=str(artifacts / "cell-jobs-watch.png"))
            for theme in ("light", "dark"):  # the watch, the %gpu table and the %jobs list
                measured = contrasts(page, ".jp-Cell >> .jp-OutputArea-output")
                print(f"{theme} theme: {len(measured)} texts, lowest contrast", min(measured, key=lambda m: m["ratio"]))
                assert len(measured) > 60 and not low(measured), (theme, low(measured))
                if theme == "light":
                    page.locator(".lm-MenuBar-itemLabel:text-is('Settings')").click()
                    page.locator(".lm-Menu-itemLabel:text-is('Theme')").hover()
                    page.locator(".lm-Menu-itemLabel:text-is('JupyterLab Dark')").click()
                    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
                    page.wait_for_timeout(1000)
            page.locator(cell).screenshot(path=str(artifacts / "cell-jobs-watch-dark.png"))
            page.locator(f"{cell} >> button:has-text('Kill')").first.click()
            page.wait_for_selector("text=variant0: killed (killed with %jobs kill)", timeout=30_000)
            page.wait_for_selector(f"{cell} >> text=2 background jobs", timeout=10_000)  # it left the table
            assert gpumagic.job("variant0").status == "killed"
            assert gpumagic.job("variant1").status == "running"
    finally:
        for job in gpumagic.list_jobs():
            if job.status in ("running", "queued"):
                job.kill(grace_s=1)

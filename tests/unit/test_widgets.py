"""The GPU dashboard: what its bokeh sources receive, how often, within what bounds, and its threads' end."""

import subprocess
import sys
import threading
import time

import pytest

import gpumagic
from gpumagic.telemetry.samplers import GpuSampler
from gpumagic.widgets.gpu_watch import GpuWatch, text_view

GIB = 1 << 30


@pytest.fixture
def watch_factory():
    made = []

    def make(**options):
        watch = GpuWatch(**options)
        made.append(watch)
        return watch

    yield make
    for watch in made:
        watch.close()


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_sources_receive_samples_within_the_history_bound(simulated, watch_factory):
    watch = watch_factory(interval=0.02, history=15, push_interval=0.1)
    assert watch.indices == [0, 1, 2, 3] and watch.simulated
    assert wait_for(lambda: len(watch.series(2, "time")) == 15)
    time.sleep(0.5)
    assert len(watch.series(2, "time")) == 15 and len(watch.series(2, "used")) == 15  # rollover bounds it
    assert watch.series(2, "total")[-1] == 80.0 and watch.series(2, "used")[-1] == 0.0
    assert watch.series(0, "time") == sorted(watch.series(0, "time"))


def test_one_stream_per_push_for_all_gpus_whatever_the_sampling_rate(simulated, watch_factory):
    from bokeh.document.events import ColumnsStreamedEvent

    events = []
    watch = watch_factory(interval=0.01, history=1000, push_interval=0.25)
    watch.layout.document.on_change(
        lambda event: events.append(event) if isinstance(event, ColumnsStreamedEvent) else None
    )
    started = time.monotonic()
    time.sleep(1.6)
    elapsed = time.monotonic() - started
    assert len(events) <= elapsed / 0.25 + 1, f"{len(events)} streams in {elapsed:.1f}s"
    assert len(watch.series(0, "time")) > 2 * len(events)  # each stream carried a batch of samples


def test_this_kernels_share_is_told_apart_from_other_users(simulated, watch_factory):
    gpumagic.pick(1)  # GPU 0: children of this process now count against it
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(300 * 2**20)\nimport time\ntime.sleep(30)"])
    try:
        watch = watch_factory(interval=0.05, history=100, push_interval=0.1)
        assert wait_for(lambda: watch.series(0, "mine") and watch.series(0, "mine")[-1] > 0.25)
        assert watch.series(0, "others")[-1] == pytest.approx(0.0, abs=0.01)
        assert watch.series(0, "used")[-1] >= watch.series(0, "mine")[-1]
        assert watch.series(1, "mine")[-1] == 0.0
    finally:
        child.kill()
        child.wait()


def test_pause_stops_sampling_and_close_ends_the_threads(simulated, watch_factory):
    baseline = threading.active_count()
    watch = watch_factory(interval=0.02, history=10_000, push_interval=0.05)
    assert threading.active_count() == baseline + 2
    assert wait_for(lambda: len(watch.series(0, "time")) > 5)
    watch.pause(True)
    time.sleep(0.2)  # let an in-flight sample land
    before = len(watch.series(0, "time"))
    time.sleep(0.5)
    assert len(watch.series(0, "time")) == before
    assert "paused" in watch.header.value
    watch.pause(False)
    assert wait_for(lambda: len(watch.series(0, "time")) > before)
    watch.close()
    watch.close()
    assert not watch.running and threading.active_count() == baseline
    assert "stopped" in watch.header.value


def test_the_stop_button_or_closing_the_widget_ends_it(simulated, watch_factory):
    watch = watch_factory(interval=0.05, history=10, push_interval=0.05)
    watch.pause_button.value = True
    watch.stop_button.click()
    assert not watch.running
    assert "stopped" in watch.header.value and "paused" not in watch.header.value
    assert watch.plots.comm is not None and watch.series(0, "used")  # the plots stay, with what they drew
    assert watch.stop_button.disabled and watch.pause_button.disabled
    other = watch_factory(interval=0.05, history=10, push_interval=0.05)
    other.widget.close()
    assert not other.running


def test_the_gpus_this_kernel_sees_stand_out(simulated, watch_factory):
    gpumagic.use("1,3")
    watch = watch_factory(interval=0.05, history=10, push_interval=0.05)
    assert watch.kernel_gpus == {1: 0, 3: 1}
    labels = [item.label.value for item in watch.layout.children[0].legend[0].items]
    assert "GPU 1 (this kernel: cuda:0)" in labels and "GPU 0" in labels
    assert [f.title.text for f in watch.layout.children][1:] == ["utilization, %", "temperature, °C"]


def test_lost_gpus_are_left_out(fake_nvml, watch_factory):
    watch = watch_factory(interval=0.05, history=10, push_interval=0.05)
    assert watch.indices == [0, 1, 2] and not watch.simulated
    assert wait_for(lambda: watch.series(1, "used") and watch.series(1, "used")[-1] == 60.0)


def test_text_view_for_terminals(simulated):
    _, samples = GpuSampler().sample()
    line = text_view(samples, True)
    assert "[simulated]" in line and "GPU 3:   0.0/80 GiB (mine 0.0)   0%" in line


def test_bad_options(simulated):
    with pytest.raises(ValueError):
        GpuWatch(interval=0)
    with pytest.raises(ValueError):
        GpuWatch(history=1)


def outputs(kernel, code, timeout=60):
    """Run ``code`` in ``kernel``: its display messages in order, as (type, display id, data)."""
    seen = []

    def hook(message):
        if message["msg_type"] in ("display_data", "update_display_data", "execute_result"):
            content = message["content"]
            seen.append((message["msg_type"], content.get("transient", {}).get("display_id"), content["data"]))

    reply = kernel.client.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok", reply["content"]
    return seen


WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.mark.kernel
def test_gpu_watch_in_a_kernel_shows_a_widget_and_a_replaced_or_closed_one_keeps_its_last_picture(start_kernel):
    """A second %gpu watch, or close(), turns the dashboard into a static copy of its last state where it was
    shown: its last update is HTML with the status line, the bars and the plots (BokehJS's embed), its widgets
    closed; its frame holds the same copy for a page reloaded later."""
    kernel = start_kernel(GPUMAGIC_SIMULATE="4xA100-80GB")
    kernel.ok("%load_ext gpumagic\nimport threading")
    first = outputs(kernel, "%gpu watch --interval 0.2 --history 50")
    # BokehJS itself as plain output only the first time in a kernel (for static copies in a notebook reopened
    # after its kernel ended), then the frame: an Output widget holding BokehJS, then the dashboard; then its
    # plain copy, for a front end with no widgets
    assert [WIDGET in data for _, _, data in first] == [False, True, False]
    assert "application/javascript" in first[0][2]
    frame_id, copy_id = first[1][1], first[2][1]
    assert frame_id and copy_id and "gpumagic-plain-copy" in first[2][2]["text/html"]
    count = kernel.ok("print(threading.active_count())").stdout
    inside = kernel.ok(
        "from gpumagic.magics.gpu import _WATCHES\nf = _WATCHES[-1]._frames.shown[0].frame\n"
        "print([sorted(o['data']) for o in f.outputs])"
    ).stdout.strip()
    # BokehJS and FRAME_JS before the plots, then the still picture and the page's answer (widgets)
    assert inside == (
        f"[['application/javascript'], ['application/javascript'], [{WIDGET!r}, 'text/plain'], "
        f"[{WIDGET!r}, 'text/plain'], [{WIDGET!r}, 'text/plain']]"
    )
    second = outputs(kernel, "%gpu watch --interval 0.2")
    updates = {display_id: data for kind, display_id, data in second if kind == "update_display_data"}
    frozen = updates[frame_id]["text/html"]
    assert WIDGET not in updates[frame_id]  # a static copy: no widget left to draw
    assert "closed at" in frozen and frozen.count("gpumagic-gpu-bar") == 4
    assert "Bokeh.embed.embed_items" in frozen and "memory used, GiB" in frozen  # the plots, as HTML
    assert "gpumagic-still" in frozen and "<polyline" in frozen  # and as a picture, for where no script runs
    assert updates[copy_id] == {"text/html": ""}  # the plain copy is emptied: the static copy says it all
    kept = kernel.ok("print(f.comm is not None, f.outputs[1]['data']['text/html'] == " + repr(frozen) + ")")
    assert kept.stdout.split() == ["True", "True"]  # for a page that reloads later
    shown = [(display_id, data) for kind, display_id, data in second if kind == "display_data"]
    assert [WIDGET in data for _, data in shown] == [True, False]  # the new frame, its plain copy
    assert kernel.ok("print(threading.active_count())").stdout == count  # the first dashboard's threads ended
    closing = outputs(kernel, "from gpumagic.magics.gpu import _WATCHES\nw = _WATCHES[-1]\nw.close()")
    last = [data for kind, display_id, data in closing if display_id == shown[0][0] and kind == "update_display_data"]
    assert len(closing) == 2 and sorted(last[-1]) == ["text/html"]  # the frame's static copy, the plain copy
    assert "Bokeh.embed.embed_items" in last[-1]["text/html"] and "closed at" in last[-1]["text/html"]
    closed = kernel.ok("print(w.running, w.plots.comm, w.widget.comm, w.pause_button.comm)").stdout.split()
    assert closed == ["False", "None", "None", "None"]  # every widget closed
    error = kernel.run("%gpu watch --interval 0s").error
    assert error[0] == "UsageError" and "at least 50ms" in error[1]


def test_a_closed_gpu_watch_that_was_never_shown_keeps_its_state_without_plots(simulated, watch_factory):
    watch = watch_factory(interval=0.05, push_interval=0.05)
    assert wait_for(lambda: watch.pushes >= 1)
    watch.close()
    assert "closed at" in watch.snapshot and watch.snapshot.count("gpumagic-gpu-bar") == 4
    assert "<script" not in watch.snapshot  # shown nowhere: no plots to embed
    assert watch.series(0, "used")  # what it drew stays readable
    assert "var(--jp-content-font-color1)" in watch.snapshot and "#888" not in watch.snapshot


@pytest.mark.slow
def test_a_page_that_connects_later_gets_the_plots_as_they_are_now(simulated, watch_factory):
    """A reload asks the kernel for the widget's state: it is the plots now, read whole under the plots' lock
    while the pusher streams (every column of the source the same length), with no periodic re-send."""
    import json

    watch = watch_factory(interval=0.01, history=400, push_interval=0.02)
    assert wait_for(lambda: len(watch.series(0, "time")) > 50)
    for _ in range(100):  # what ipywidgets does for a page's request_states, while the pusher streams
        bundle = json.loads(watch.plots.get_state()["render_bundle"])
        sources = [
            model["attributes"]["data"]
            for doc in bundle["docs_json"].values()
            for model in _models(doc)
            if model.get("name") == "ColumnDataSource"
        ]
        lengths = {len(column) for data in sources for column in _columns_of(data)}
        assert len(lengths) == 1 and lengths.pop() > 50, "a column was read while it grew"
    assert watch.plots.refreshes <= 1  # one catch-up after the start, not a re-send every 30 s
    assert all(not model.syncable for model in watch.layout.references())  # the browser sends nothing back


def _models(node):
    """Every serialized bokeh model in a document's JSON."""
    if isinstance(node, dict):
        if node.get("type") == "object" and "name" in node:
            yield node
        for value in node.values():
            yield from _models(value)
    elif isinstance(node, list):
        for value in node:
            yield from _models(value)


def _columns_of(data):
    entries = data.get("entries", []) if isinstance(data, dict) else []
    for _, column in entries:
        yield column if isinstance(column, list) else column.get("array", column.get("data", []))


def test_what_the_browser_changes_never_overwrites_the_kernels_plots(simulated, watch_factory):
    """A page that changed a source (the forward-only guard drops points there) sends the change when it is
    synced; the kernel's copy stays as the kernel made it (jupyter_bokeh alone would replace it)."""
    watch = watch_factory(interval=0.05, push_interval=0.05)
    assert wait_for(lambda: len(watch.series(0, "time")) >= 3)
    watch.stop()
    before = watch.series(0, "time")
    change = {"kind": "ModelChanged", "model": {"id": watch.source.id}, "attr": "data"}
    change["new"] = {"type": "map", "entries": [["time", [1.0]]]}
    watch.plots._sync_model(watch.plots, {"event": "jsevent", **change}, [])
    assert watch.series(0, "time") == before and len(watch.source.data) > 1


@pytest.mark.slow
def test_one_catch_up_soon_after_start_for_a_view_that_missed_the_first_pushes(simulated, watch_factory):
    from gpumagic.widgets.live import FIRST_REFRESH_S

    watch = watch_factory(interval=0.05, push_interval=0.05)
    assert wait_for(lambda: watch.plots.refreshes >= 1, timeout=FIRST_REFRESH_S + 3)
    time.sleep(1.0)
    assert watch.plots.refreshes == 1


def test_every_live_view_catches_up_once_after_its_widget_is_made_whatever_the_wall_clock(monkeypatch):
    """The GPU watch, the job watch and the launch dashboard share one catch-up (``catch_up_once``): a single
    full send ``FIRST_REFRESH_S`` after their plots' widget was made, on the monotonic clock (the GPU watch timed
    its own by the wall clock, from its first sample's time)."""
    from bokeh.layouts import column

    from gpumagic.widgets import live
    from gpumagic.widgets.plots import styled_figure

    model = live.live_model(column(styled_figure("loss", 100)), threading.RLock())
    sent = []
    monkeypatch.setattr(model, "catch_up", lambda: sent.append(time.monotonic()))
    monkeypatch.setattr(live.time, "time", lambda: time.monotonic() + 1e9)  # a wall clock set far ahead
    assert not model.catch_up_once() and not sent and model.refreshes == 0
    later = time.monotonic() + live.FIRST_REFRESH_S
    monkeypatch.setattr(live.time, "monotonic", lambda: later)
    assert model.catch_up_once() and len(sent) == 1 and model.refreshes == 1
    assert not model.catch_up_once() and len(sent) == 1  # once: later patches keep the view in step


def contrast(colour: str, background: str) -> float:
    """WCAG's contrast ratio of two ``#rrggbb`` colours."""

    def luminance(hex_colour: str) -> float:
        channels = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    high, low = sorted((luminance(colour), luminance(background)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_a_status_word_keeps_the_themes_text_colour_and_only_its_dot_has_the_hue():
    """No fixed colour is 4.5:1 against both JupyterLab backgrounds, white and #111111 (a mid grey, the best,
    reaches 4.35:1; the comparison's grey status word had 2.9:1 on the dark theme): a status word, in the job
    table, the job watch and the comparison alike, is in the theme's text colour, and its hue is on a dot
    beside it, at least 3:1 on both themes (WCAG's contrast for graphics)."""
    from gpumagic.widgets.job_table import STATUS_HUES, status_html

    greys = ["#" + f"{g:02x}" * 3 for g in range(256)]
    assert max(min(contrast(grey, "#ffffff"), contrast(grey, "#111111")) for grey in greys) < 4.5
    for status, hue in STATUS_HUES.items():
        assert min(contrast(hue, "#ffffff"), contrast(hue, "#111111"), contrast(hue, "#212121")) >= 3, status
        assert status_html(status).startswith("<b style='color:var(--jp-content-font-color1)'>")


@pytest.mark.slow
def test_samples_come_at_the_interval_and_never_go_back_in_time(simulated, watch_factory):
    watch = watch_factory(interval=0.1, history=1000, push_interval=0.05)
    time.sleep(2.0)
    watch.stop()
    assert 8 <= watch.samples <= 22, f"{watch.samples} samples in 2 s at 0.1 s"  # one per interval, not two
    assert watch._forward.dropped == 0 and watch.series(0, "elapsed")[0] >= 0  # time only goes forward


def test_bars_show_each_gpu_now_coloured_by_load_with_this_kernels_marked(fake_nvml, watch_factory):
    gpumagic.use("0")
    watch = watch_factory(interval=0.05, history=10, push_interval=0.05)
    rows = watch.bars.value.split("gpumagic-gpu-bar")[1:]
    assert len(rows) == len(watch.indices) == 3
    assert "97%" in rows[1] and "#cf222e" in rows[1]  # GPU 1 at 97%: red, as in %gpu status
    assert "3%" in rows[0] and "#cf222e" not in rows[0]
    assert "60.0 / 80 GiB" in rows[1] and "2.0 / 80 GiB" in rows[0]
    assert "this kernel (cuda:0)" in rows[0] and "this kernel" not in rows[1]


def test_legends_sit_outside_the_plots_and_the_toolbar_shows_on_hover(simulated, watch_factory):
    watch = watch_factory(interval=0.05, history=10, push_interval=0.05)
    for plot in watch.layout.children:
        assert [type(item).__name__ for item in plot.right] == ["Legend"] and not any(
            type(item).__name__ == "Legend" for item in plot.center
        )
        assert plot.toolbar.autohide and plot.toolbar.logo is None
        assert plot.background_fill_alpha == 0 and plot.border_fill_alpha == 0  # dark theme: no white box
        assert any(type(tool).__name__ == "HoverTool" for tool in plot.tools)


def test_smoothing_is_debiased_and_does_not_change_as_the_run_grows():
    from gpumagic.widgets.plots import Smoother

    assert Smoother().feed([4.0, 4.0, 4.0]) == pytest.approx([4.0, 4.0, 4.0])  # no pull towards 0
    first = Smoother().feed([1.0, 2.0, 3.0])
    longer = Smoother().feed([1.0, 2.0, 3.0, 10.0, 20.0])
    assert longer[:3] == first
    split = Smoother()
    assert split.feed([1.0, 2.0]) + split.feed([3.0, 10.0, 20.0]) == longer  # fed in batches: the same
    assert Smoother().feed([1.0, float("nan"), 1.0])[2] == pytest.approx(1.0)


def test_forward_keeps_a_plotted_x_series_non_decreasing():
    from gpumagic.widgets.plots import Forward

    forward = Forward()
    assert forward.keep([0, 1, 2]) == [0, 1, 2]
    assert forward.keep([2, 3, 1, 0, 4]) == [0, 1, 4]  # a step logged again is kept; earlier ones are not
    assert forward.dropped == 2


WATCH_IN_A_TERMINAL = """
ip = get_ipython()
ip.run_line_magic('load_ext', 'gpumagic')
ip.run_line_magic('gpu', 'watch --interval 0.2')
"""


def test_gpu_watch_in_a_terminal_prints_a_text_line_per_sample(simulated):
    import os
    import signal

    terminal = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "IPython",
            "--no-banner",
            "--colors=NoColor",
            "--HistoryManager.enabled=False",  # no history database to write (and wait for) at exit
            "-c",
            WATCH_IN_A_TERMINAL,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),  # SIGINT as from a terminal: tests/conftest.py hear_sigint_as_from_a_terminal
    )
    lines = [terminal.stdout.readline() for _ in range(3)]
    terminal.send_signal(signal.SIGINT)
    rest, _ = terminal.communicate(timeout=60)
    assert all("[simulated]" in line and "GPU 0:   0.0/80 GiB" in line for line in lines), lines
    assert "stopped watching" in rest, f"{rest[-500:]}\nthis process's SIGINT: {sigint_state()}"


def sigint_state() -> str:
    import signal

    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    return f"handler {signal.getsignal(signal.SIGINT)!r}, {'blocked' if blocked else 'not blocked'}"


def test_the_launch_dashboard_shows_each_ranks_own_gpu_memory(fake_nvml, tmp_path):
    """On a GPU other users share, a rank's memory is its own process's where NVML lists it (3 GiB on a GPU
    with 60 GiB used), else its GPU's (2 GiB used, the rank's process not listed)."""
    import copy

    from gpumagic.widgets.launch_dashboard import LaunchDashboard

    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        scenario = copy.deepcopy(fake_nvml.DEFAULT_SCENARIO)
        scenario["gpus"][1]["processes"] = [{"pid": ranks[0].pid, "usedGpuMemory": 3 * GIB}]
        fake_nvml.configure(scenario)
        uuids = [scenario["gpus"][1]["uuid"], scenario["gpus"][0]["uuid"]]
        (tmp_path / "metrics").mkdir()
        dashboard = LaunchDashboard(push_interval=0.1)
        pids = [rank.pid for rank in ranks]
        dashboard.attach(tmp_path, pids, rank_gpus=((uuids[0],), (uuids[1],)), use_gpus=True)
        sources = dashboard.resource_sources  # made by the dashboard's thread, then filled
        assert wait_for(lambda: all(r in sources and sources[r].data["memory"] for r in (0, 1)))
        dashboard.finish("finished")
        dashboard.join()  # its last update and the release of its widgets happen on its thread
        assert dashboard.resource_sources[0].data["memory"][0] == 3 * 1024
        assert dashboard.resource_sources[1].data["memory"][0] == 2 * 1024
        assert dashboard.resource_figures[0].title.text == "GPU memory per rank, MiB"
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_ranks_that_end_right_after_they_start_still_have_their_resources_drawn(tmp_path):
    """A launch shorter than the dashboard's first tick (150 steps of a small model: well under 0.1 s) is sampled
    when the dashboard attaches, while its ranks surely live."""
    from gpumagic.widgets.launch_dashboard import LaunchDashboard

    rank = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert rank.stdout.readline() == b"up\n"  # running Python, no longer a process between fork and exec
        (tmp_path / "metrics").mkdir()
        dashboard = LaunchDashboard(push_interval=5.0)  # its thread's first sample comes 0.1 s after attach
        dashboard.attach(tmp_path, [rank.pid], use_gpus=False)
        rank.stdin.close()  # the rank ends at once
        rank.wait()
        dashboard.finish("finished")
        dashboard.join()
        assert len(dashboard.resource_sources[0].data["memory"]) >= 1
        assert dashboard.resource_sources[0].data["memory"][0] > 1  # MiB: the live process's own memory
    finally:
        rank.kill()
        rank.wait()


def test_a_flat_metric_is_not_magnified_and_the_axis_changes_rarely():
    from gpumagic.widgets.plots import SteadySpan, styled_figure

    plot = styled_figure("lr", 200)
    span = SteadySpan(plot)
    span.feed([0.001] * 50)  # a constant learning rate: at least 0.0001 of axis, not -1..1 around it
    assert plot.y_range.min_interval == pytest.approx(0.0001)
    changes = []
    plot.y_range.on_change("min_interval", lambda attr, old, new: changes.append(new))
    for step in range(1000):  # a loss from 2 down to 0.002: a change per halving at most
        span.feed([2.0 / (step + 1)])
    assert 1 <= len(changes) <= 12


def test_the_status_table_keeps_each_gpu_on_one_line_in_the_themes_colours(fake_nvml):
    """Every cell left-aligned on one line (JupyterLab right-aligns and wraps table cells); the processes take
    the width left and end in an ellipsis, in full under the mouse; text in the theme's colours, load as
    coloured marks (GPU 1 at 97%: red); this kernel's row marked for light and dark themes."""
    import re

    gpumagic.use("0")
    html = gpumagic.status()._repr_html_()
    cells = re.findall(r"<t[dh] (?:colspan='\d+' )?style='([^']*)'", html)
    assert len(cells) == 9 + 3 * 9 + 4  # the headings, 3 healthy GPUs, a lost one (index, cuda, name, problem)
    assert all("text-align:left" in c and "white-space:nowrap" in c for c in cells)
    assert all("color:var(--jp-content-font-color1)" in c for c in cells)
    assert "table-layout:auto;width:100%" in html and "max-width:0;width:100%" in html  # processes fill the rest
    assert not re.search(r"color:#[0-9a-f]{3,6}'>[^●]", html), "text in a fixed colour"
    rows = html.split("<tr")
    assert "<span style='color:#cf222e'>●</span> 97%" in rows[3]  # GPU 1
    assert "<span style='color:#2ea043'>●</span> 3%" in rows[2]  # GPU 0
    assert "box-shadow:inset 4px 0 #2ea043" in rows[2]  # this kernel's GPU 0


def test_a_long_process_command_is_cut_in_the_cell_and_whole_under_the_mouse():
    from gpumagic.devices.model import GpuProcess
    from gpumagic.widgets.status_table import _process

    command = "python train.py " + " ".join(f"--option-{n}=value" for n in range(10))
    process = GpuProcess(pid=12, user="bob", command=command, gpu_memory=GIB, alive=True)
    assert len(_process(process)) < 90 and _process(process).endswith("... (1.0 GiB)")
    assert command in _process(process, cut=False)

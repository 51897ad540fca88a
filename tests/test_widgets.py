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
    watch.stop_button.click()
    assert not watch.running
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


@pytest.mark.kernel
def test_gpu_watch_in_a_kernel_shows_a_widget_and_replaces_the_previous_one(start_kernel):
    kernel = start_kernel(GPUMAGIC_SIMULATE="4xA100-80GB")
    kernel.ok("%load_ext gpumagic\nimport threading")
    first = kernel.run("%gpu watch --interval 0.2 --history 50")
    assert first.error is None
    assert "application/vnd.jupyter.widget-view+json" in first.mimetypes
    assert "application/javascript" in first.mimetypes  # BokehJS, inline, the first time
    count = kernel.ok("print(threading.active_count())").stdout
    second = kernel.ok("%gpu watch --interval 0.2")
    assert "application/javascript" not in second.mimetypes  # loaded once per kernel
    assert "application/vnd.jupyter.widget-view+json" in second.mimetypes
    assert kernel.ok("print(threading.active_count())").stdout == count  # the first dashboard's threads ended
    error = kernel.run("%gpu watch --interval 0s").error
    assert error[0] == "UsageError" and "at least 50ms" in error[1]
    kernel.ok("from gpumagic.magics import _close_previous_watch\n_close_previous_watch()")


def test_the_saved_state_catches_up_so_a_browser_reload_shows_the_history(simulated, watch_factory):
    import json

    watch = watch_factory(interval=0.02, history=500, push_interval=0.05, refresh_every=0.3)
    empty = len(json.dumps(watch.plots.render_bundle))
    assert wait_for(lambda: watch.refreshes >= 2)
    assert len(json.dumps(watch.plots.render_bundle)) > empty + 1000  # the samples are in the saved state


def test_the_saved_state_catches_up_soon_after_start_for_a_view_that_missed_the_first_pushes(simulated, watch_factory):
    from gpumagic.widgets.plots import FIRST_REFRESH_S

    watch = watch_factory(interval=0.05, push_interval=0.05)  # the default 30 s between full re-saves
    assert wait_for(lambda: watch.refreshes >= 1, timeout=FIRST_REFRESH_S + 3)
    assert watch.refreshes == 1


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
            "-c",
            WATCH_IN_A_TERMINAL,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    lines = [terminal.stdout.readline() for _ in range(3)]
    terminal.send_signal(signal.SIGINT)
    rest, _ = terminal.communicate(timeout=20)
    assert all("[simulated]" in line and "GPU 0:   0.0/80 GiB" in line for line in lines), lines
    assert "stopped watching" in rest


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

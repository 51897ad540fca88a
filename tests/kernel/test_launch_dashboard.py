"""The dashboard under %%launch_ddp, in a real kernel: per-rank curves of logged metrics, per-rank resources,
updates while the ranks run, --no-dashboard, --no-wait with its Stop button. In this process: a curve holds a
bounded number of points and keeps its whole shape, and a group's dashboard stays the same size and quiet over
hundreds of cells (issue 25; tests/kernel/test_long_session.py runs such a session in a kernel)."""

import math
import time
from array import array

import pytest

from gpumagic.run_dirs import store

TRAIN = (
    "import time\n"
    "for step in range(STEPS):\n"
    "    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n"
    "    time.sleep(0.01)\n"
    "bytes(1)\n"
)


# what a kernel that looks at its launches' dashboards runs first (``inspect`` reads SESSION.last_dashboard)
DASHBOARD_KERNEL_SETUP = "%load_ext gpumagic\nimport gpumagic\nfrom gpumagic.launch.kernel_side.session import SESSION"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    from conftest import cpu_kernel

    with cpu_kernel(tmp_path_factory, DASHBOARD_KERNEL_SETUP) as k:
        yield k


def inspect(kernel, expression):
    return kernel.ok(f"d = SESSION.last_dashboard\nprint({expression})").stdout.strip()


@pytest.mark.kernel
def test_the_dashboard_shows_each_ranks_metrics_and_resources(kernel):
    out = kernel.ok("STEPS = 150\n", timeout=60)
    out = kernel.ok("%%launch_ddp -n 2\n" + TRAIN, timeout=120)
    assert "application/vnd.jupyter.widget-view+json" in out.mimetypes
    kernel.ok("SESSION.last_dashboard.join()")  # its last update, made after the cell returned
    keys = inspect(kernel, "sorted(d.metric_sources)")
    assert keys == "[('loss', 0), ('loss', 1)]"
    counts = inspect(kernel, "[len(d.metric_sources[('loss', r)].data['value']) for r in (0, 1)]")
    assert counts == "[150, 150]"
    first = inspect(kernel, "[d.metric_sources[('loss', r)].data['value'][0] for r in (0, 1)]")
    assert first == "[1.0, 2.0]"
    rss = inspect(kernel, "min(min(d.resource_sources[r].data['memory']) for r in (0, 1)) > 10")
    assert rss == "True", inspect(kernel, "{r: dict(d.resource_sources[r].data) for r in (0, 1)}")
    assert inspect(kernel, "d.running, d.state, d.stop_button") == "False finished None"  # Stop: --no-wait
    # finished, it is a static copy of itself (kept on reload) and its widgets are closed
    assert inspect(kernel, "'loss' in d.snapshot and 'Bokeh' in d.snapshot, d.widget.comm is None") == "True True"
    status = inspect(kernel, "d.snapshot")
    assert "0/2 ranks alive" in status and "step 149 ·" in status and "steps/s" in status
    # the frame it showed in holds the copy too (a page reloaded later draws it), BokehJS's loader first
    outputs = inspect(kernel, "[sorted(o['data']) for o in d._frame.frame.outputs], d._frame.frame.comm is not None")
    assert outputs == "[['application/vnd.jupyter.widget-view+json', 'text/plain'], ['text/html']] True"


@pytest.mark.kernel
def test_no_dashboard(kernel):
    kernel.ok("SESSION.last_dashboard = None")
    out = kernel.ok("%%launch_ddp -n 2 --no-dashboard\npass")
    assert "application/vnd.jupyter.widget-view+json" not in out.mimetypes
    assert inspect(kernel, "d") == "None"


@pytest.mark.kernel
def test_no_wait_returns_at_once_streams_while_running_and_sets_the_variable(kernel):
    kernel.ok("STEPS = 400\nresult = 'not yet'")
    started = time.monotonic()
    kernel.ok("%%launch_ddp -n 2 --no-wait -o result\n" + TRAIN)
    assert time.monotonic() - started < 3
    time.sleep(2.0)
    during = inspect(kernel, "d.running, len(d.metric_sources[('loss', 0)].data['value']) > 0, result")
    assert during == "True True not yet"
    deadline = time.monotonic() + 60
    while inspect(kernel, "d.running") == "True" and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(0.5)
    assert inspect(kernel, "result") == "{0: b'\\x00', 1: b'\\x00'}"
    assert inspect(kernel, "d.state") == "finished"


@pytest.mark.kernel
def test_the_stop_button_stops_a_background_launch(kernel):
    kernel.ok("result = None")
    kernel.ok("%%launch_ddp -n 2 --no-wait -o result\nimport time\ntime.sleep(60)")
    time.sleep(2.0)
    started = time.monotonic()
    kernel.ok("SESSION.last_dashboard.stop_button.click()")
    deadline = time.monotonic() + 15
    while inspect(kernel, "type(result).__name__") != "LaunchInterrupted" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert inspect(kernel, "type(result).__name__") == "LaunchInterrupted"
    assert time.monotonic() - started < 6
    assert "stopped from the dashboard" in inspect(kernel, "result")
    assert inspect(kernel, "d.state") == "interrupted"


def test_a_curve_holds_at_most_its_limit_points_and_keeps_its_whole_shape():
    from gpumagic.widgets.plots import StepCurve

    line = StepCurve(limit=400)
    values = [1.0 / (step + 1) + 0.1 * math.sin(step / 300) for step in range(10_000)]
    values[1234] = 50.0  # a spike, long ago
    values[2345] = float("nan")  # a diverged step: passed over where its span has numbers
    for first in range(0, 10_000, 97):  # batches as a push reads them
        line.stream(list(range(first, min(first + 97, 10_000))), values[first : first + 97])
        assert len(line.source.data["step"]) <= 400
    steps, kept = line.source.data["step"], line.source.data["value"]
    assert steps[0] == 0 and steps[-1] == 9_999 and steps == sorted(steps)
    assert steps[-200:] == list(range(9_800, 10_000))  # the latest half as logged
    assert 50.0 in kept  # the spike is not thinned away
    lowest = min(v for v in kept if not math.isnan(v))
    assert lowest == pytest.approx(min(v for v in values if not math.isnan(v)), rel=0.01)
    old = [v for s, v in zip(steps, kept, strict=True) if 3_000 <= s < 4_000]
    assert old and max(old) - min(old) > 0.1  # the slow wave is still drawn there


def write_cell(run_dir, step: int, count: int) -> None:
    """Rank 0's and rank 1's points of one cell: ``loss`` and ``lr`` from ``step`` on, as ``gpumagic.log`` writes."""
    metrics = run_dir / "metrics"
    for rank in (0, 1):
        (metrics / f"rank-{rank}.names").write_text("loss\nlr\n")
        points = array("d")
        for at in range(step, step + count):
            points.extend((time.time(), at, 0, 1.0 / (at + 1) + rank, time.time(), at, 1, 0.1))
        with open(metrics / f"rank-{rank}.bin", "ab") as handle:
            handle.write(store.encode_batch(points))


def wait_for(condition, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_groups_dashboard_stays_the_same_size_over_hundreds_of_cells_and_is_quiet_between_them(tmp_path):
    from gpumagic.widgets.launch_dashboard import LaunchDashboard

    (tmp_path / "metrics").mkdir()
    dashboard = LaunchDashboard(history=300, push_interval=0.05, live_after=0.0, title="%ddp group")
    dashboard.attach(tmp_path, [None, None])  # ranks elsewhere: their metrics only
    try:
        sizes = {}
        for cell in range(1, 401):
            dashboard.mark(f"In[{cell}]")
            write_cell(tmp_path, 13 * (cell - 1), 13)
            if cell in (20, 400):
                assert wait_for(lambda cell=cell: dashboard.points == 2 * 2 * 13 * cell)
                assert wait_for(lambda cell=cell: len(dashboard.cell_marks) == cell)
                sizes[cell] = len(dashboard.layout.document.models)
            time.sleep(0.002)
        assert sizes[400] == sizes[20]  # the marks are rows of one source, not models per cell
        assert [step for _, step in list(dashboard.cell_marks)[:3]] == [0, 12, 25]  # the last step before each
        assert len(dashboard.marks.data["step"]) == 400
        assert all(len(source.data["step"]) <= 300 for source in dashboard.metric_sources.values())
        assert dashboard.metric_sources[("loss", 0)].data["step"][-1] == 13 * 400 - 1

        # nothing changes: nothing is sent, not even the status line's clock
        changes: list = []
        dashboard.layout.document.on_change(changes.append)
        dashboard.status.observe(changes.append, "value")
        assert wait_for(lambda: "idle since" in dashboard.status.value)
        changes.clear()
        time.sleep(1.0)
        assert changes == []
        write_cell(tmp_path, 13 * 400, 13)  # the next cell: drawn at once
        assert wait_for(lambda: changes and "idle" not in dashboard.status.value, within=2.0)
    finally:
        dashboard.finish("finished")
        dashboard.join()
    assert not dashboard.running and "%ddp group" in dashboard.snapshot


def test_a_new_metric_reaches_the_page_with_its_first_points():
    """BokehJS draws nothing in a figure that came to the page empty (its ranges stay NaN): the document change
    that adds a metric's figure, or a rank's curve, already holds the points."""
    from gpumagic.widgets.launch_dashboard import LaunchDashboard
    from gpumagic.widgets.live import live_model

    dashboard = LaunchDashboard()
    dashboard.nprocs = 2
    dashboard._build_figures()
    dashboard.plots = live_model(dashboard.layout, dashboard._plots_lock)
    seen = []

    def on_change(event):  # when the figure or the line joins the document: how many points its source holds
        for model in dashboard.layout.document.models:
            if model.__class__.__name__ == "ColumnDataSource" and "value" in model.data:
                seen.append(len(model.data["value"]))

    dashboard.layout.document.on_change(on_change)
    dashboard._add_metric("loss", 0, [0, 1, 2], [1.0, 0.5, 0.25])
    dashboard._add_metric("loss", 1, [0, 1], [2.0, 1.5])
    assert seen and 0 not in seen, f"sources on the page when it changed: {seen}"
    assert list(dashboard.metric_sources[("loss", 1)].data["value"]) == [2.0, 1.5]


def test_the_step_rate_is_of_the_latest_steps_and_the_eta_comes_from_total_steps():
    """Steps/s over rank 0's points of the last 10 s (an idle hour before them does not count), none while idle;
    with total_steps, the ETA."""
    from gpumagic.widgets.launch_dashboard import LaunchDashboard

    dashboard = LaunchDashboard()
    dashboard.state, dashboard.nprocs = "running", 2
    now = time.time()
    dashboard._rank0_points.extend([(now - 3600, 0), (now - 3599, 10)])  # a cell an hour ago
    assert dashboard.step_rate() is None  # idle since: no rate, and never "0.0 steps/s"
    assert "steps/s" not in dashboard._status_text()
    dashboard._rank0_points.extend((now - 4 + i * 0.1, 10 + i * 5) for i in range(40))  # 50 steps/s now
    assert dashboard.step_rate() == pytest.approx(50, rel=0.01)
    dashboard.total_steps = 1210.0
    status = dashboard._status_text()
    assert "step 205 of 1,210 · 50 steps/s · ETA 20s" in status, status
    fast = LaunchDashboard()
    fast.state = "running"
    fast._rank0_points.extend((now - 1 + i * 0.01, i * 15) for i in range(100))  # 1,500 steps/s: no 1.5e+03
    assert "step 1,485 · 1,500 steps/s" in fast._status_text()


def test_total_steps_is_recorded_once_and_not_drawn(tmp_path, monkeypatch):
    from gpumagic.run_dirs.store import RankReader
    from gpumagic.telemetry import log as log_module
    from gpumagic.widgets.launch_dashboard import LaunchDashboard

    run_dir = store.new_run("total")
    recorder = log_module.Recorder(run_dir, 0)
    monkeypatch.setattr(log_module, "_recorder", recorder)
    for step in range(5):
        log_module.log(step=step, total_steps=100, loss=1.0 / (step + 1))
    recorder.flush()
    series = RankReader(run_dir / "metrics", 0).read()
    assert list(series[log_module.TOTAL_STEPS].values) == [100.0]  # once, not at every step
    dashboard = LaunchDashboard()
    dashboard.nprocs = 1
    dashboard._build_figures()
    dashboard._readers = [RankReader(run_dir / "metrics", 0)]
    dashboard._push_metrics()
    assert dashboard.total_steps == 100 and set(dashboard.metric_figures) == {"loss"}
    recorder.close()


def test_smoothing_suits_the_density_and_the_slider_starts_there():
    from gpumagic.telemetry.metric_kinds import smoothing_default
    from gpumagic.widgets.plots import Smoothing, StepCurve

    assert [smoothing_default(n) for n in (10, 29, 60, 100, 100_000)] == [0.0, 0.0, 0.5, 0.7, 0.9]
    smoothing = Smoothing()
    sparse = StepCurve()
    sparse.stream(list(range(20)), [float(v % 2) for v in range(20)])  # an eval metric: 20 points
    smoothing.follow(sparse.source)
    assert smoothing.slider.value == 0.0
    assert list(sparse.source.data["smooth"]) == list(sparse.source.data["value"])  # raw: no lag
    dense = StepCurve()
    dense.stream(list(range(1000)), [float(v % 2) for v in range(1000)])
    smoothing.follow(dense.source)
    assert smoothing.slider.value == 0.9
    assert 0.4 < dense.source.data["smooth"][-1] < 0.6  # the noise averaged out
    assert smoothing._callback.args["sources"] == [sparse.source, dense.source]


def test_elapsed_ticks_are_whole_round_times_and_step_ticks_are_short():
    from gpumagic.widgets.plots import elapsed_ticker, styled_figure

    ticker = elapsed_ticker(3)
    assert ticker.min_interval == 1 and ticker.base == 60 and ticker.desired_num_ticks == 3
    assert list(ticker.mantissas) == [1, 2, 5, 10, 15, 30]  # 1 s .. 30 s, 1 min .. 30 min, 1 h ..
    steps = styled_figure("loss", 200, x_label="step")
    assert steps.xaxis[0].formatter.format == "0.[0]a"  # 950, 12k, 1.5m


def test_frozen_frames_keep_their_copy_and_only_the_latest_stay_alive():
    import ipywidgets

    from gpumagic.widgets import live

    frames = []
    for number in range(live.KEPT_FRAMES + 3):
        frame = live.LiveFrame(ipywidgets.HTML(f"live {number}"))
        data = frame.frame.outputs[0]["data"]
        assert "application/javascript" in data and "window.Bokeh" in data["application/javascript"]  # first
        frame.freeze(f"<div>copy {number}</div>")
        frames.append(frame)
    assert frames[-1].frame.outputs[1]["data"]["text/html"] == f"<div>copy {live.KEPT_FRAMES + 2}</div>"
    alive = [frame.frame.comm is not None for frame in frames]
    assert alive == [False] * 3 + [True] * live.KEPT_FRAMES

"""The dashboard under %%launch_ddp, in a real kernel: per-rank curves of logged metrics, per-rank resources,
updates while the ranks run, --no-dashboard, --no-wait with its Stop button."""

import time

import pytest

pytestmark = pytest.mark.kernel

TRAIN = (
    "import time\n"
    "for step in range(STEPS):\n"
    "    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n"
    "    time.sleep(0.01)\n"
    "bytes(1)\n"
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    from conftest import cpu_kernel

    setup = "%load_ext gpumagic\nimport gpumagic\nfrom gpumagic.magics import LaunchMagics"
    with cpu_kernel(tmp_path_factory, setup) as k:
        yield k


def inspect(kernel, expression):
    return kernel.ok(f"d = LaunchMagics.last_dashboard\nprint({expression})").stdout.strip()


def test_the_dashboard_shows_each_ranks_metrics_and_resources(kernel):
    out = kernel.ok("STEPS = 150\n", timeout=60)
    out = kernel.ok("%%launch_ddp -n 2\n" + TRAIN, timeout=120)
    assert "application/vnd.jupyter.widget-view+json" in out.mimetypes
    kernel.ok("LaunchMagics.last_dashboard.join()")  # its last update, made after the cell returned
    keys = inspect(kernel, "sorted(d.metric_sources)")
    assert keys == "[('loss', 0), ('loss', 1)]"
    counts = inspect(kernel, "[len(d.metric_sources[('loss', r)].data['value']) for r in (0, 1)]")
    assert counts == "[150, 150]"
    first = inspect(kernel, "[d.metric_sources[('loss', r)].data['value'][0] for r in (0, 1)]")
    assert first == "[1.0, 2.0]"
    rss = inspect(kernel, "min(min(d.resource_sources[r].data['memory']) for r in (0, 1)) > 10")
    assert rss == "True"  # resident memory of each rank, MiB
    assert inspect(kernel, "d.running, d.state, d.stop_button") == "False finished None"  # Stop: --no-wait
    # finished, it is a static copy of itself (kept on reload) and its widgets are closed
    assert inspect(kernel, "'loss' in d.snapshot and 'Bokeh' in d.snapshot, d.widget.comm is None") == "True True"
    status = inspect(kernel, "d.snapshot")
    assert "0/2 ranks alive" in status and "step 149 (" in status and "steps/s)" in status


def test_no_dashboard(kernel):
    kernel.ok("LaunchMagics.last_dashboard = None")
    out = kernel.ok("%%launch_ddp -n 2 --no-dashboard\npass")
    assert "application/vnd.jupyter.widget-view+json" not in out.mimetypes
    assert inspect(kernel, "d") == "None"


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


def test_the_stop_button_stops_a_background_launch(kernel):
    kernel.ok("result = None")
    kernel.ok("%%launch_ddp -n 2 --no-wait -o result\nimport time\ntime.sleep(60)")
    time.sleep(2.0)
    started = time.monotonic()
    kernel.ok("LaunchMagics.last_dashboard.stop_button.click()")
    deadline = time.monotonic() + 15
    while inspect(kernel, "type(result).__name__") != "LaunchInterrupted" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert inspect(kernel, "type(result).__name__") == "LaunchInterrupted"
    assert time.monotonic() - started < 6
    assert "stopped from the dashboard" in inspect(kernel, "result")
    assert inspect(kernel, "d.state") == "interrupted"

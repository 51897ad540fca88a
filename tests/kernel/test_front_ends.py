"""What a live dashboard sends where its rich view cannot draw, in a real kernel, told apart by the messages a
front end really sends: until a page says anything (nbclient, a renderer without ipywidgets, a blocking cell
that cannot hear it) a plain HTML output after the frame carries the status and a still picture of the curves,
at most once a second, and the frame its own picture; once the page says its Bokeh view drew ("rich") neither
is drawn any more; once it says "plain" (the view failed: no jupyter_bokeh) the frame's picture goes on.
The browser tests (tests/browser/test_browser_front_ends.py) look at the pixels."""

import time

import pytest

from tests.kernel.test_launch_dashboard import DASHBOARD_KERNEL_SETUP, inspect

pytestmark = pytest.mark.kernel

TRAIN = (
    "%%launch_ddp -n 2 {flags}\n"
    "import time\n"
    "for step in range({steps}):\n"
    "    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n"
    "    time.sleep(0.02)\n"
)


@pytest.fixture
def kernel(tmp_path_factory):
    """A fresh kernel per test: what the page said to one frame must not carry over."""
    from conftest import cpu_kernel

    with cpu_kernel(tmp_path_factory, DASHBOARD_KERNEL_SETUP) as k:
        yield k


def send(kernel, kind: str, content: dict, metadata: dict | None = None) -> None:
    """A message as a page's widget manager sends it (a comm opened, a widget's value changed)."""
    kernel.client.shell_channel.send(kernel.client.session.msg(kind, content, metadata=metadata or {}))


def page_says(kernel, word: str) -> None:
    """What FRAME_JS makes the page send: the frame's answer widget set to ``word``."""
    model_id = inspect(kernel, "d._frame.answer.model_id")
    data = {"method": "update", "state": {"value": word}, "buffer_paths": []}
    send(kernel, "comm_msg", {"comm_id": model_id, "data": data})


def wait_until(kernel, expression: str, within: float = 30.0) -> str:
    deadline = time.monotonic() + within
    while (seen := inspect(kernel, expression)) != "True" and time.monotonic() < deadline:
        time.sleep(0.2)
    return seen


def test_with_no_word_from_a_page_a_plain_copy_shows_the_status_and_a_picture_of_the_curves(kernel):
    updates: list[tuple[float, dict]] = []

    def collect(message: dict) -> None:
        if message["msg_type"] == "update_display_data":
            updates.append((time.monotonic(), message["content"]["data"]))

    started = time.monotonic()
    reply = kernel.client.execute_interactive(TRAIN.format(flags="", steps=250), timeout=120, output_hook=collect)
    took = time.monotonic() - started
    assert reply["content"]["status"] == "ok"
    copies = [data["text/html"] for _, data in updates if "gpumagic-plain-copy" in data.get("text/html", "")]
    pictures = [html for html in copies if "<polyline" in html]
    assert pictures, f"{len(copies)} updates of the plain copy, none with a picture of the curves"
    assert any("running" in html and "loss" in html for html in pictures)  # the status line, the loss plot
    assert len(pictures) <= took + 2  # at most one a second
    # finished: the frame's display is the static copy, with the picture beside BokehJS's copy for where no
    # script runs; the plain copy is emptied
    final = [data["text/html"] for _, data in updates if "gpumagic-still" in data.get("text/html", "")]
    assert len(final) == 1 and "<polyline" in final[0] and "finished" in final[0]
    assert updates[-1][1] == {"text/html": ""}
    assert inspect(kernel, "d._frame.stills > 0, d._frame.still.comm is None") == "True True"  # then closed


def test_the_pictures_stop_once_the_page_says_its_plots_drew(kernel):
    kernel.ok(TRAIN.format(flags="--no-wait", steps=600))
    assert wait_until(kernel, "d.plots is not None and '<polyline' in d._frame.still.value") == "True"
    assert "jupyter_bokeh" in inspect(kernel, "d._frame.still.value")  # what to install where
    kernel.ok("sent = []\nd._frame.plain_copy.update = lambda *a, **k: sent.append(a)")  # no plain copy now
    page_says(kernel, "rich")
    assert wait_until(kernel, "d._frame.heard == 'rich'") == "True"
    assert inspect(kernel, "d._frame.still.value") == ""
    drawn, points = inspect(kernel, "d._frame.stills, d.points").split()
    assert wait_until(kernel, f"d.points > {points} + 50") == "True"  # the launch goes on drawing ...
    assert inspect(kernel, "d._frame.stills") == drawn  # ... and no picture is made any more
    assert inspect(kernel, "sent") == "[]"
    kernel.ok("SESSION.last_dashboard.cancel.set()")
    assert wait_until(kernel, "not d.running") == "True"


def test_in_a_page_without_jupyter_bokeh_the_frames_picture_goes_on_alone(kernel):
    kernel.ok(TRAIN.format(flags="--no-wait", steps=600))
    assert wait_until(kernel, "d.plots is not None and d._frame.stills > 0") == "True"
    page_says(kernel, "plain")
    assert wait_until(kernel, "d._frame.heard == 'plain'") == "True"
    kernel.ok("sent = []\nd._frame.plain_copy.update = lambda *a, **k: sent.append(a)")  # widgets render there
    drawn = int(inspect(kernel, "d._frame.stills"))
    assert wait_until(kernel, f"d._frame.stills >= {drawn + 2}") == "True"
    assert "<polyline" in inspect(kernel, "d._frame.still.value")
    assert inspect(kernel, "sent") == "[]"
    kernel.ok("SESSION.last_dashboard.cancel.set()")
    assert wait_until(kernel, "not d.running") == "True"


def test_an_idle_groups_dashboard_draws_no_picture_between_cells(kernel):
    """A %ddp group between cells changes nothing: no picture is drawn (nor sent) until the next cell logs."""
    kernel.ok("%ddp start -n 2 --gpus none")
    kernel.ok("from gpumagic.launch.kernel_side.session import SESSION\nd = SESSION.group_dashboard")
    try:
        kernel.ok("%%ddp\nfor step in range(60):\n    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)")
        group = "SESSION.group_dashboard"
        assert wait_until(kernel, f"{group}._frame.stills > 0 and 'idle since' in {group}.status.value") == "True"
        drawn = inspect(kernel, f"{group}._frame.stills")
        time.sleep(3)  # three times the picture's period
        assert inspect(kernel, f"{group}._frame.stills") == drawn
        kernel.ok("%%ddp\nfor step in range(60, 120):\n    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)")
        assert wait_until(kernel, f"{group}._frame.stills > {drawn}") == "True"  # the next cell's points: drawn
    finally:
        kernel.ok("%ddp stop")

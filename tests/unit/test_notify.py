"""Notifications of background jobs (issue #42): an http(s) target gets a POST of JSON and a cmd: target the same
JSON on its stdin, once per event; a sweep sends one summary; a slow or dead target costs the job nothing."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time

import pytest

import gpumagic
from gpumagic.errors import InvalidArgument
from gpumagic.jobs import notify
from gpumagic.jobs.local import runner_alive

pytestmark = pytest.mark.usefixtures("no_job_left_running")


class Receiver:
    """A local HTTP server that keeps every JSON body POSTed to it; ``hold`` keeps each request waiting."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.release.set()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.bodies.append(body)
                receiver.arrived.set()
                receiver.release.wait(60)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    running = Receiver()
    yield running
    running.close()


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def learn(steps):
    import gpumagic

    for step in range(steps):
        gpumagic.log(step, loss=1.0 / (step + 1) + (0.3 if step == 2 else 0.0), accuracy=step / 10)
    return steps


def lines_of(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.slow
def test_an_ending_job_tells_each_target_once_with_its_status_duration_and_metrics(receiver, tmp_path, monkeypatch):
    told = tmp_path / "told.jsonl"
    monkeypatch.setenv(notify.VARIABLE, f"{receiver.url} cmd:cat>>{told};echo>>{told}")  # every job's default
    done = gpumagic.jobs_with(gpus=0, name="N1").submit(learn, 4)
    broken = gpumagic.jobs_with(gpus=0, name="N2", notify=f"cmd:cat>>{told};echo>>{told}").submit(divide)
    assert done.wait("2m") == "finished" and broken.wait("2m") == "failed"
    wait_until(lambda: len(receiver.bodies) == 1 and len(lines_of(told)) == 2)
    posted = receiver.bodies[0]
    assert posted["job"] == "N1" and posted["event"] == "finished" and posted["status"] == "finished"
    assert posted["duration_s"] > 0 and posted["attempt"] == 1 and posted["directory"] == str(done.path)
    assert posted["metrics"]["loss"] == {"last": [3, 0.25], "best": [3, 0.25]}
    assert posted["metrics"]["accuracy"] == {"last": [3, 0.3], "best": [3, 0.3]}
    by_job = {message["job"]: message for message in lines_of(told)}
    assert by_job["N1"] == posted, "the command reads the same JSON on its stdin"
    assert by_job["N2"]["event"] == "failed" and "ZeroDivisionError" in by_job["N2"]["error"]
    assert notify.notify(done.path, "finished") is False, "an event is told once, whoever sees it again"
    assert len(receiver.bodies) == 1 and len(lines_of(told)) == 2


def divide():
    return 1 / 0


@pytest.mark.slow
def test_a_slow_target_never_holds_the_jobs_end_and_a_dead_one_is_named_once(receiver):
    receiver.release.clear()  # the target takes the request and does not answer
    held = gpumagic.jobs_with(gpus=0, name="N3", notify=receiver.url).submit(learn, 2)
    assert receiver.arrived.wait(60), "the target was asked"
    assert held.status == "finished" and held.result() == 2, "the end was recorded before anyone was told"
    receiver.release.set()

    with contextlib.closing(__import__("socket").socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}/hook"  # bound, never listening: refused
        job = gpumagic.jobs_with(gpus=0, name="N4", notify=dead).submit(learn, 2)
        assert job.wait("2m") == "finished" and job.result() == 2
        wait_until(lambda: "notify_problem" in job.info)
    shown = job.describe()
    assert f"notify {dead}: unreachable" in shown and "(3 tries)" in shown
    assert shown.count("notify") == 1


@pytest.mark.slow
def test_a_sweep_tells_one_summary_best_run_first_when_all_its_jobs_have_ended(receiver):
    jobs = gpumagic.sweep(scaled, {"factor": [3.0, 1.0, 2.0]}, 0, name="S", notify=receiver.url)
    assert [j.wait("2m") for j in jobs] == ["finished"] * 3
    wait_until(lambda: receiver.bodies)
    wait_until(lambda: not any(runner_alive(j.info) for j in jobs))  # every job's runner has told what it would
    assert len(receiver.bodies) == 1
    summary = receiver.bodies[0]
    assert summary["event"] == "sweep ended" and summary["jobs_total"] == 3
    assert summary["by_status"] == {"finished": 3} and summary["ranked_by"] == "loss"
    assert [j["params"] for j in summary["jobs"]] == [{"factor": "1"}, {"factor": "2"}, {"factor": "3"}]


def scaled(factor):
    import gpumagic

    gpumagic.log(0, loss=factor)
    return factor


@pytest.mark.slow
def test_a_job_that_waits_for_gpus_past_its_threshold_tells_once(receiver, simulated):
    holder = gpumagic.jobs_with(gpus=4, name="N5").submit(time.sleep, 600)
    wait_until(lambda: holder.status == "running")
    waiting = gpumagic.jobs_with(gpus=1, name="N6", notify=receiver.url, notify_wait="1s").submit(learn, 1)
    wait_until(lambda: receiver.bodies)
    message = receiver.bodies[0]
    assert message["job"] == "N6" and message["event"] == "waiting" and message["waited_s"] == 1.0
    assert waiting.status == "queued" and message["status"] == "queued"
    holder.kill(grace_s=1)
    assert waiting.wait("2m") == "finished"
    wait_until(lambda: len(receiver.bodies) == 2)
    assert [b["event"] for b in receiver.bodies] == ["waiting", "finished"]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("ftp://example.org/x", "neither an http"),
        ("https://", "neither an http"),
        ("cmd:", "cmd: needs a command"),
        (["https://example.org/ok", 3], "notify takes an http"),
    ],
)
def test_a_bad_target_is_one_line_and_submits_nothing(target, message):
    before = len(gpumagic.list_jobs())
    with pytest.raises(InvalidArgument, match=message):
        gpumagic.jobs_with(gpus=0, notify=target).submit(print)
    assert len(gpumagic.list_jobs()) == before


def test_a_bad_default_in_the_environment_is_named_too(monkeypatch):
    monkeypatch.setenv(notify.VARIABLE, "mailto:me@lab.org")
    with pytest.raises(InvalidArgument, match=r"'mailto:me@lab\.org' is neither an http"):
        gpumagic.jobs_with(gpus=0).submit(print)


@pytest.mark.slow
def test_a_lost_job_is_told_by_whoever_sees_it_lost_once(receiver):
    import os
    import signal

    job = gpumagic.jobs_with(gpus=0, name="N7", notify=receiver.url).submit(time.sleep, 600)
    wait_until(lambda: job.status == "running" and job.info.get("pids"))
    for pid in (*job.info["pids"], job.info["runner_pid"]):  # the runner and its rank die without a word
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: job.status == "lost")
    wait_until(lambda: receiver.bodies)
    assert [(b["job"], b["event"], b["status"]) for b in receiver.bodies] == [("N7", "lost", "lost")]
    assert "is gone without recording an end" in receiver.bodies[0]["why"]
    for _ in range(3):
        assert job.status == "lost"
    assert len(receiver.bodies) == 1

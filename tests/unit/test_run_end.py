"""One reader of a run's end (``run_dirs.run_end``): a launch's run, a kernel's own run and a background job answer
"how did it end, or is it still running" the same way, whichever reader asks (``Run``, ``load_run``, the local
executor, ``Job``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from gpumagic.jobs import executors, local
from gpumagic.jobs.api import Job
from gpumagic.run_dirs import records, store
from gpumagic.run_dirs.launch_files import make_launch_directories
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.run_end import RunEnd, run_end


def exited_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def make_run(kind: str):
    """A run of ``kind`` as its launcher makes it: a job through ``records``, the others through ``store``."""
    if kind == "job":
        return records.create("train", b"code", reserve=False, request={"count": 0}, after=[])
    return store.new_run(kind, ranks=2 if kind == "ddp" else 1)


def info_of(path) -> dict:
    return json.loads(RunFiles(path).record.read_text())


def readers(path) -> list[RunEnd]:
    """What every reader of a run's end answers for the run at ``path``."""
    info = info_of(path)
    found = [run_end(info), store.Run(path, info).end, store.load_run(path.name).end]
    if info["kind"] == "job":
        job = Job(path)
        found += [local.end(info), RunEnd(job.status, job.reason, info.get("ended"))]
    return found


@pytest.mark.parametrize("kind", ["ddp", "job", "kernel"])
def test_every_reader_gives_one_answer_for_a_recorded_end(kind):
    path = make_run(kind)
    before = time.time()
    store.record_end(path, "failed", "rank 1 raised ValueError: bad lr")
    answers = readers(path)
    assert answers[0].status == "failed" and answers[0].why == "rank 1 raised ValueError: bad lr"
    assert before <= answers[0].ended <= time.time() and not answers[0].active
    assert all(answer == answers[0] for answer in answers), answers


@pytest.mark.parametrize("kind", ["ddp", "kernel"])
def test_a_run_of_a_live_kernel_is_running_and_one_whose_kernel_died_is_lost(kind):
    path = make_run(kind)
    assert all(answer == RunEnd("running") and answer.active for answer in readers(path))
    gone = exited_pid()
    store.update_run(path, pid=gone, pid_start=None)
    make_launch_directories(RunFiles(path))
    unsettled = store.Run(path, info_of(path))
    assert unsettled.status == "lost", "a run read without load_run knows its kernel is gone too"
    assert unsettled.end.why == f"its kernel (pid {gone}) is gone without recording an end"
    settled = store.load_run(path.name)
    assert (settled.status, settled.info["exit"]) == ("lost", unsettled.end.why), "the why is recorded with it"
    assert settled.end.ended is not None and not RunFiles(path).launch.exists(), "its ranks' code is gone"


def test_a_job_whose_runner_died_is_lost_with_its_why_and_a_brief_one():
    path = make_run("job")
    gone = exited_pid()
    store.update_run(path, status="running", runner_pid=gone, runner_start=None)
    end = local.end(info_of(path))
    why, brief = f"its runner (pid {gone}) is gone without recording an end", f"runner (pid {gone}) gone"
    assert end == RunEnd("lost", why, brief=brief)
    assert (executors.status(info_of(path)), executors.why(info_of(path), brief=True)) == ("lost", end.short)
    assert store.Run(path, info_of(path)).status == "running", "a run's reader leaves a job to its executor"


@pytest.mark.parametrize("kind", ["ddp", "job"])
def test_a_run_made_on_another_machine_is_not_judged_lost_here(kind):
    """A runs directory shared between machines: a PID here says nothing of a kernel or runner there (a job's
    reader lacked this, and read another machine's running job as lost)."""
    path = make_run(kind)
    store.update_run(path, status="running", pid=exited_pid(), runner_pid=exited_pid(), pid_space="another-boot:1")
    assert [answer.status for answer in readers(path)] == ["running"] * (5 if kind == "job" else 3)


def test_two_processes_changing_one_record_lose_none_of_each_others_changes():
    """A job's runner writes its pid while the kernel that submitted it writes why it waits: a change made between
    the other's read and write was lost (the runner's pid lost so, the job read ``lost`` 30 s later)."""
    path = make_run("job")
    writer = (
        "import sys\nfrom pathlib import Path\nfrom gpumagic.run_dirs import store\n"
        "path, prefix = Path(sys.argv[1]), sys.argv[2]\n"
        "for i in range(150):\n    store.update_run(path, **{f'{prefix}{i}': i})\n"
    )
    processes = [subprocess.Popen([sys.executable, "-c", writer, str(path), prefix]) for prefix in ("a", "b")]
    assert [process.wait(timeout=120) for process in processes] == [0, 0]
    info = info_of(path)
    lost = [f"{prefix}{i}" for prefix in "ab" for i in range(150) if f"{prefix}{i}" not in info]
    assert not lost, f"{len(lost)} of 300 changes lost, e.g. {lost[:5]}"

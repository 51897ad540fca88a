"""A full disk (issue #12): runs on a real 2 MB tmpfs that fills while jobs and ranks write to it.

A job is recorded ``failed: disk full (...)`` with what it saved, never ``lost``; metric files stay readable up
to the last whole batch; ``submit``, ``%%launch_bg``, ``%%launch_ddp`` and ``gpumagic.log`` say so in one
line, and training that logs goes on (its points are dropped, with one warning, until there is space).
"""

import ast
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError

import gpumagic
from gpumagic.devices import leases
from gpumagic.errors import DiskFull
from gpumagic.run_dirs import store
from gpumagic.run_dirs.layout import RunFiles

pytestmark = pytest.mark.usefixtures("no_job_left_running")

CHECKOUT = str(Path(__file__).resolve().parents[2])
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 2 MB tmpfs holding the runs directory (``GPUMAGIC_RUNS_DIR``)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a 2 MB tmpfs (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=700", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    monkeypatch.setenv("GPUMAGIC_RUNS_DIR", str(disk / "runs"))
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path) -> Path:
    """Take every byte left on ``disk``."""
    filler = disk / "filler"
    with open(filler, "ab", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def points(job) -> int:
    return len(job.metrics().get(0, {}).get("loss", []))


def train(stop_file, result_bytes=0):
    import os
    import time

    step = 0
    while not os.path.exists(stop_file):
        gpumagic.log(loss=float(step))
        if step % 10 == 0:
            print(f"step {step:6d} " + "." * 80, flush=True)
        step += 1
        time.sleep(0.001)
    return b"r" * result_bytes


@pytest.mark.slow
def test_a_job_whose_output_fills_the_disk_fails_saying_so_and_keeps_what_it_wrote(small_disk, tmp_path):
    job = gpumagic.jobs_with(gpus=0, name="filler").submit(train, str(tmp_path / "never"))
    wait_until(lambda: points(job) >= 2000)
    fill(small_disk)
    assert job.wait("60s") == "failed"
    reason = job.reason
    saved = reason.split("; saved: ")[1].split("; ")[0]
    assert reason.startswith(f"disk full: {job.path / 'output.log'} (No space left on device); saved: output.log (")
    assert re.fullmatch(r"output\.log \([\d,]+ bytes\), metrics \([\d,]+ points\)", saved) and reason.endswith(
        "; free space or set GPUMAGIC_RUNS_DIR"
    ), reason
    loss = job.metrics()[0]["loss"]
    assert len(loss) >= 2000 and loss.values == loss.steps == sorted(set(loss.steps)), "none torn, none twice"
    assert loss.steps[:2000] == [float(s) for s in range(2000)]
    assert f"metrics ({len(loss):,} points)" in saved
    assert (job.path / "error.txt").read_text().startswith(f"The job was stopped: {reason}")
    log = (job.path / "output.log").read_text()
    assert log.endswith("\n"), "the line the full disk cut is not kept in part"
    steps = [int(line.split()[1]) for line in log.splitlines() if line.startswith("step ")]
    assert len(steps) >= 200 and steps == list(range(0, 10 * len(steps), 10)), "every step line, whole, in order"
    dropped = f"gpumagic.log: points are dropped until they can be written: disk full: {job.path / 'metrics'} "
    others = [line for line in log.splitlines() if not re.fullmatch(r"step +\d+ \.{80}", line)]
    assert all(line.startswith(dropped) and line.endswith("; free space or set GPUMAGIC_RUNS_DIR") for line in others)
    assert not RunFiles(job.path).reserve.exists(), "the space held for the record is given back"
    assert not any(psutil.pid_exists(pid) for pid in job.info["pids"]), "the job was stopped"


def long_lines(go_file):
    """Lines of 3,001 bytes, each one write to the pipe (under PIPE_BUF): output.log's size is never a whole number
    of pages, so once the disk is full the next line that does not fit is written in part, never not at all."""
    import os
    import sys
    import time

    count = 0
    while True:
        sys.stdout.write(f"{count:08d} " + "x" * 2991 + "\n")
        sys.stdout.flush()
        count += 1
        time.sleep(0.001 if os.path.exists(go_file) else 0.05)


def test_output_log_keeps_whole_lines_when_the_disk_fills_in_the_middle_of_one(small_disk, tmp_path):
    go = tmp_path / "go"
    job = gpumagic.jobs_with(gpus=0, name="long-lines").submit(long_lines, str(go))
    wait_until(lambda: job.path.joinpath("output.log").exists() and job.path.joinpath("output.log").stat().st_size)
    fill(small_disk)
    go.touch()
    assert job.wait("60s") == "failed" and job.reason.startswith("disk full: ")
    log = (job.path / "output.log").read_bytes()
    lines = log.split(b"\n")
    assert lines[-1] == b"", f"output.log ends in part of a line: {lines[-1][:40]!r}... ({len(lines[-1])} bytes)"
    assert [int(line.split()[0]) for line in lines[:-1]] == list(range(len(lines) - 1))
    assert all(len(line) == 3000 for line in lines[:-1])


def test_a_result_that_does_not_fit_fails_the_job_saying_so(small_disk, tmp_path):
    stop = tmp_path / "stop"
    job = gpumagic.jobs_with(gpus=0, name="big").submit(train, str(stop), 3 << 20)  # 3 MB on a 2 MB disk
    wait_until(lambda: points(job) >= 100)
    stop.touch()
    assert job.wait("60s") == "failed"
    assert job.reason.startswith(f"disk full: {job.path / 'launch'} (No space left on device); saved: output.log (")
    assert "metrics (" in job.reason and not (job.path / "result.pkl").exists()
    assert "rank 0" in (job.path / "error.txt").read_text()
    with pytest.raises(gpumagic.JobFailed, match="disk full"):
        job.result()


def test_a_result_that_fits_on_the_disk_once_is_kept(small_disk, tmp_path):
    """The rank's copy of the value is gone before the job's is written: a disk with room for one keeps it."""
    stop = tmp_path / "stop"
    job = gpumagic.jobs_with(gpus=0, name="fits").submit(train, str(stop), 600 << 10)
    wait_until(lambda: points(job) >= 100)
    filler = fill(small_disk)
    os.truncate(filler, filler.stat().st_size - (900 << 10))  # 900 KiB free: one copy, not two
    stop.touch()
    assert job.wait("60s") == "finished", job.reason
    assert job.result() == b"r" * (600 << 10)


def fill_it(disk):
    with open(f"{disk}/filler", "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            return "written"


def test_a_job_that_fills_the_disk_itself_keeps_its_report(small_disk):
    """Its rank can write neither its value nor its report, nor the runner its output; the space the job held
    gives its record room."""
    job = gpumagic.jobs_with(gpus=0, name="checkpoints").submit(fill_it, str(small_disk))
    assert job.wait("60s") == "failed"
    assert job.reason.startswith(f"disk full: {job.path}/") and "(No space left on device); saved: " in job.reason
    assert (job.path / "error.txt").read_text().startswith(f"The job was stopped: {job.reason}\n")


def nothing():
    return 1


def test_a_queued_job_that_starts_on_a_full_disk_is_recorded_whole(small_disk, simulated):
    """Nothing of it is on disk to give back; the space it held since its submission gives its record room."""
    gpumagic.use("0")  # leased by this process: the job waits for it
    job = gpumagic.jobs_with(gpus="GPU:0", name="waits").submit(nothing)
    wait_until(lambda: job.reason.startswith("waiting"))
    fill(small_disk)
    gpumagic.release()
    assert job.wait("60s") == "failed"
    first = job.path / "launch" / "store.key"  # the first file its launch writes: the run's store secret
    assert job.reason == (
        f"disk full: {first} (No space left on device); saved: nothing; free space or set GPUMAGIC_RUNS_DIR"
    )
    assert (job.path / "error.txt").read_text() == f"The job was stopped: {job.reason}\n"


def test_a_launch_whose_ranks_fill_the_disk_says_so(small_disk):
    with pytest.raises(gpumagic.LaunchError) as failed:
        gpumagic.launch_ddp(fill_it, 1, args=(str(small_disk),), gpus="none", output="none")
    (run,) = store.list_runs()
    assert failed.value.note == (
        f"disk full: {run.path} has no space left, so a rank may have failed writing its result or its "
        "report; free space or set GPUMAGIC_RUNS_DIR"
    )
    assert run.status == "failed"


def test_a_process_that_logged_records_its_end_on_a_full_disk(small_disk):
    """run.json is rewritten where it is when there is no room for a new copy."""
    code = (
        "import gpumagic, gpumagic.telemetry.log as log\n"
        "gpumagic.log(loss=1.0)\nlog.flush()\n"
        f"handle = open({str(small_disk / 'filler')!r}, 'wb', buffering=0)\n"
        "try:\n    while True:\n        handle.write(bytes(4096))\nexcept OSError:\n    pass\n"
    )
    env = {**ENV, "GPUMAGIC_RUNS_DIR": os.environ["GPUMAGIC_RUNS_DIR"]}
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert ended.returncode == 0 and ended.stderr == "", ended.stderr
    (run,) = store.list_runs()
    assert run.status == "finished" and run.metrics()[0]["loss"].values == [1.0]


def test_submit_launch_and_log_on_a_full_disk_say_so_in_one_line(small_disk, shell):
    (small_disk / "runs").mkdir(mode=0o700)
    fill(small_disk)
    said = f"disk full: {small_disk / 'runs'} (No space left on device); free space or set GPUMAGIC_RUNS_DIR"
    with pytest.raises(DiskFull) as refused:
        gpumagic.jobs_with(gpus=0).submit(nothing)
    assert str(refused.value) == said and refused.value._render_traceback_() == [f"DiskFull: {said}"]
    with pytest.raises(UsageError, match=f"^%%launch_bg: {re.escape(said)}$"):
        shell.run_cell_magic("launch_bg", "--gpus 0", "1")
    with pytest.raises(UsageError, match=f"^{re.escape(said)}$"):
        shell.run_cell_magic("launch_ddp", "-n 1 --gpus none", "1")
    assert os.listdir(small_disk / "runs") == [], "nothing half written is left"
    logged = subprocess.run(
        [sys.executable, "-c", "import gpumagic\nfor i in range(1000):\n    gpumagic.log(loss=i)\nprint('trained')"],
        capture_output=True,
        text=True,
        env={**ENV, "GPUMAGIC_RUNS_DIR": os.environ["GPUMAGIC_RUNS_DIR"]},
    )
    assert logged.returncode == 0 and logged.stdout == "trained\n"
    assert logged.stderr == f"gpumagic.log: points are dropped until they can be written: {said}\n"


@pytest.mark.slow
def test_ranks_that_log_on_a_full_disk_train_on_and_their_metrics_stay_whole(small_disk, tmp_path):
    """While the disk is full, each rank's points are dropped with one warning (a batch never half written);
    once there is space again they are written again, and the file reads whole: every point before, none torn."""
    flags = {name: tmp_path / name for name in ("full", "freed", "stop")}
    script = textwrap.dedent(
        f"""
        import os, time, gpumagic

        def train():
            step = 0
            while not os.path.exists({str(flags["stop"])!r}):
                gpumagic.log(step=step, loss=float(step))
                step += 1
                time.sleep(0.0005)
            return step

        if __name__ == "__main__":
            print(gpumagic.launch_ddp(train, 2, gpus="none", output="all"))
        """
    )
    launch = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**ENV, "GPUMAGIC_RUNS_DIR": os.environ["GPUMAGIC_RUNS_DIR"]},
    )
    try:
        wait_until(lambda: store.list_runs() and len(store.list_runs()[0].metrics().get(1, {}).get("loss", [])) > 2000)
        (run,) = store.list_runs()
        filler = fill(small_disk)
        before = {rank: len(m["loss"]) for rank, m in run.metrics().items()}
        time.sleep(1.0)
        filler.unlink()
        time.sleep(1.0)
        flags["stop"].touch()
        output, _ = launch.communicate(timeout=60)
    finally:
        launch.kill()
    assert launch.returncode == 0, output
    steps = ast.literal_eval(output.strip().splitlines()[-1])  # {rank: how many points it logged}
    for rank in (0, 1):
        warned = [line for line in output.splitlines() if "gpumagic.log" in line and line.startswith(f"[rank {rank}]")]
        # one warning when it fills and one when there is room again: the two ranks share the last bytes of the
        # disk, so a rank may write again for a moment (the other cut a torn batch off) and fill it once more
        assert 2 <= len(warned) <= 8 and len(warned) % 2 == 0, output
        dropped = 0
        for full, again in zip(warned[::2], warned[1::2], strict=True):
            assert full.startswith(
                f"[rank {rank}] gpumagic.log: points are dropped until they can be written: disk full"
            ), output
            so_far = int(again.split("; ")[1].split()[0])  # dropped since the launch began
            assert again == f"[rank {rank}] gpumagic.log: writing points again; {so_far} were dropped", output
            assert so_far > dropped, output
            dropped = so_far
        reader = store.RankReader(run.path / "metrics", rank)
        loss = reader.read()["loss"]
        assert reader.skipped == 0, "a batch that could not be written whole was cut off again"
        assert loss.values == loss.steps, "no point is torn or shifted"
        assert loss.steps[: before[rank]] == [float(s) for s in range(before[rank])], "every point before is there"
        assert len(loss) == steps[rank] - dropped > before[rank] and loss.steps[-1] == steps[rank] - 1


def test_a_sweep_that_does_not_fit_leaves_no_job_and_no_ticket(small_disk, simulated):
    """All or none: a sweep whose third job has no room removes the two written before it, and their tickets."""
    (small_disk / "runs").mkdir(mode=0o700)
    filler = fill(small_disk)
    os.truncate(filler, filler.stat().st_size - (160 << 10))  # room for about two jobs (64 KiB reserve each)
    with pytest.raises(DiskFull):
        gpumagic.sweep(nothing_with, {"x": [1, 2, 3, 4]}, gpus_per_job=1)
    assert os.listdir(small_disk / "runs") == []
    assert gpumagic.list_jobs() == []
    assert not list(Path(os.environ["GPUMAGIC_LEASE_DIR"]).glob("queue.*"))


def nothing_with(x):
    return x


def test_a_launch_refused_for_a_full_disk_takes_no_gpu(small_disk, simulated, shell):
    (small_disk / "runs").mkdir(mode=0o700)
    fill(small_disk)
    before = (leases.book().held(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    with pytest.raises(UsageError, match=r"^disk full: "):
        shell.run_cell_magic("launch_ddp", "-n 2 --gpus 0,1", "1")
    assert (leases.book().held(), os.environ.get("CUDA_VISIBLE_DEVICES")) == before
    assert os.listdir(small_disk / "runs") == []

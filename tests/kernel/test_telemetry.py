"""gpumagic.log and the run store: exact on normal exit, at most 0.1 s lost on SIGKILL, tailable, reopenable."""

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest

import gpumagic
from gpumagic.errors import InvalidArgument
from gpumagic.run_dirs import store

pytestmark = pytest.mark.kernel


def run_python(code: str, **kwargs):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, **kwargs)


def test_a_process_logs_into_its_own_run_and_nothing_is_lost_at_exit():
    result = run_python(
        """
        import gpumagic, torch
        for i in range(20000):
            gpumagic.log(loss=1.0 / (i + 1), acc=i % 7)
        gpumagic.log(step=99999, loss=torch.tensor(0.5))
        """
    )
    assert result.returncode == 0, result.stderr
    (run,) = gpumagic.runs()
    assert run.info["kind"] == "kernel" and run.status == "finished"
    metrics = run.metrics()[0]
    assert len(metrics["loss"]) == 20001 and len(metrics["acc"]) == 20000
    assert metrics["loss"].steps[:3] == [0.0, 1.0, 2.0] and metrics["loss"].values[:2] == [1.0, 0.5]
    assert metrics["loss"].steps[-1] == 99999 and metrics["loss"].values[-1] == 0.5
    assert gpumagic.load_run(run.id[:20]).id == run.id


def test_sigkill_loses_at_most_a_fraction_of_a_second():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
        import gpumagic, time
        print("go", flush=True)
        while True:
            gpumagic.log(t=time.time())
            time.sleep(0.0005)
        """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "go"
    time.sleep(1.5)
    killed_at = time.time()
    child.send_signal(signal.SIGKILL)
    child.wait()
    (run,) = gpumagic.runs()
    last = run.metrics()[0]["t"].values[-1]
    assert killed_at - last < 0.3, f"lost {killed_at - last:.2f}s of points"


def test_a_reader_tails_only_new_complete_batches(tmp_path):
    directory = tmp_path / "metrics"
    directory.mkdir()
    (directory / "rank-0.names").write_text("loss\n")
    reader = store.RankReader(directory, 0)
    batch = struct.pack("<I", 2) + struct.pack("<8d", 1.0, 0, 0, 0.5, 2.0, 1, 0, 0.25)
    (directory / "rank-0.bin").write_bytes(batch + batch[:20])  # the second batch is half written
    first = reader.read()
    assert first["loss"].values == [0.5, 0.25] and first["loss"].steps == [0.0, 1.0]
    assert reader.read() == {}
    with open(directory / "rank-0.bin", "ab") as handle:
        handle.write(batch[20:])
    assert reader.read()["loss"].values == [0.5, 0.25]


def batch(first: int, count: int, start: float) -> bytes:
    """A batch of ``rank-N.bin`` as a writer writes it: points ``first`` .. ``first + count - 1``, two metrics."""
    rows = [x for i in range(first, first + count) for x in (start + i * 1e-3, i, i % 2, i / 10)]
    return struct.pack("<I", count) + struct.pack(f"<{len(rows)}d", *rows)


def steps_read(metrics):
    return sorted(step for series in metrics.values() for step in series.steps)


def test_a_torn_batch_hides_neither_the_points_before_it_nor_those_after_it(tmp_path):
    """A writer that died (or ran out of disk) in the middle of a batch leaves part of it; when the rank's next
    attempt appends to the same file, the reader passes over the torn bytes: the 1,956 points before them and
    every point after are read, none made up from the torn part, wherever the batch was cut."""
    directory = tmp_path / "metrics"
    directory.mkdir()
    (directory / "rank-0.names").write_text("loss\nacc\n")
    now = time.time()
    before = b"".join(batch(k * 163, 163, now) for k in range(12))  # 1,956 points
    whole = batch(1956, 100, now)
    after = b"".join(batch(2056 + k * 100, 100, now + 60) for k in range(5))
    torn = whole[: 4 + 37 * 32 + 11]  # 37 points and 11 bytes of the 38th were written
    (directory / "rank-0.bin").write_bytes(before + torn)
    reader = store.RankReader(directory, 0)
    assert steps_read(reader.read()) == list(range(1956))
    with open(directory / "rank-0.bin", "ab") as handle:
        handle.write(after)
    assert steps_read(reader.read()) == list(range(2056, 2556)) and reader.skipped == len(torn)
    for cut in [*range(1, 40), *range(40, len(whole), 29)]:
        (directory / "rank-0.bin").write_bytes(before + whole[:cut] + after)
        read = steps_read(store.RankReader(directory, 0).read())
        assert read == [*range(1956), *range(2056, 2556)], f"cut after {cut} bytes: {len(read)} points read"
    (directory / "rank-0.bin").write_bytes(before + whole + after)
    assert steps_read(store.RankReader(directory, 0).read()) == list(range(2556))


def test_runs_are_listed_oldest_first_also_within_one_second():
    """Run names carry the second and a random part: several launches in one second must still be in order."""
    created = [store.new_run("ddp", order=k) for k in range(20)]
    assert [run.path for run in gpumagic.runs()] == created
    assert gpumagic.runs()[-1].info["order"] == 19


def test_bad_values_and_unknown_runs():
    with pytest.raises(TypeError, match=r"gpumagic.log\(loss=...\) needs a number, got str"):
        gpumagic.log(loss="low")
    with pytest.raises(InvalidArgument, match="no run 'nope'"):
        gpumagic.load_run("nope")


def test_every_rank_of_a_launch_logs_into_the_launch_run():
    result = run_python(
        """
        import gpumagic
        def train(steps):
            import torch.distributed as dist
            for step in range(steps):
                gpumagic.log(step=step, loss=1.0 / (step + 1) + dist.get_rank())
        if __name__ == "__main__":
            gpumagic.launch_ddp(train, 2, args=(500,), gpus="none", output="none")
            def boom():
                raise ValueError("x")
            try:
                gpumagic.launch_ddp(boom, 2, gpus="none", output="none")
            except gpumagic.LaunchError:
                pass
        """
    )
    assert result.returncode == 0, result.stderr
    done, failed = [r for r in gpumagic.runs() if r.info["kind"] == "ddp"]
    assert done.status == "finished" and failed.status == "failed"
    metrics = done.metrics()
    assert sorted(metrics) == [0, 1]
    assert len(metrics[0]["loss"]) == 500 and metrics[1]["loss"].values[0] == 2.0
    assert not (done.path / "launch").exists()  # payload and results are removed, metrics stay
    assert os.stat(done.path).st_mode & 0o077 == 0  # private to the user


def test_a_finished_run_can_be_plotted_later():
    result = run_python(
        """
        import gpumagic
        for i in range(50):
            gpumagic.log(step=i, loss=1.0 / (i + 1), acc=i / 50)
        """
    )
    assert result.returncode == 0, result.stderr
    (run,) = gpumagic.runs()
    plot = gpumagic.plot_run(run.id)
    assert sorted(plot.figures) == ["acc", "loss"]
    source = plot.figures["loss"].renderers[0].data_source
    assert source.data["step"][:3] == [0.0, 1.0, 2.0] and source.data["value"][-1] == pytest.approx(1 / 50)
    with pytest.raises(InvalidArgument, match="has no metric lr"):
        gpumagic.plot_run(run, metrics=["lr"])

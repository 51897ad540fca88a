"""Real launches, ``%ddp`` groups and background jobs tracked to TensorBoard, MLflow and W&B at once (issue #43):
each is exactly one run in every tracker, with each rank's series and its options, and ``%jobs``, the dashboard and
``compare`` say what it was exported as. Read back with each tracker's own reader (``tests/tracker_readers.py``)."""

from __future__ import annotations

import glob
import os
import socket
import time

import pytest

import gpumagic
from gpumagic.telemetry import tracking
from gpumagic.widgets.job_table import JobTable
from tests.tracker_readers import (
    as_float32,
    mlflow_runs,
    mlflow_series,
    offline_trackers,
    tensorboard_series,
    wandb_run,
)

pytest.importorskip("tensorboard", reason="the tracking tests need the test extras: pip install -e '.[test]'")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_job_left_running")]


@pytest.fixture(autouse=True)
def every_tracker(monkeypatch, tmp_path):
    """TensorBoard, an MLflow file store and offline W&B, all under ``tmp_path``; nothing tracked afterwards."""
    offline_trackers(monkeypatch, tmp_path)
    monkeypatch.setenv("GPUMAGIC_TRACK_TIMEOUT", "60")  # a busy machine's first import of mlflow and wandb
    gpumagic.track("tensorboard", logdir=str(tmp_path / "tb"))
    gpumagic.track("mlflow", tracking_uri=str(tmp_path / "mlruns"), experiment="exp")
    gpumagic.track("wandb", project="proj", mode="offline", dir=str(tmp_path / "wb"))
    yield
    tracking._chosen = None


def train(steps, start=0):
    import torch.distributed as dist

    import gpumagic

    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(start, start + steps):
        gpumagic.log(step, loss=1.0 / (step + 1) + rank)
    return rank


def scaled(factor, steps=3):
    import gpumagic

    for step in range(steps):
        gpumagic.log(step, loss=factor / (step + 1))
    return factor


def losses(steps: int, rank: int, factor: float = 1.0) -> list[tuple[int, float]]:
    return [(step, factor / (step + 1) + rank) for step in range(steps)]


def exported(job, kinds=("tensorboard", "mlflow", "wandb")) -> dict:
    """The job's ``tracking`` once its exporter (a process of its own) ended every tracker run."""
    deadline = time.monotonic() + 120
    while True:
        tracking_entries = job.info.get("tracking") or {}
        if all("closed" in tracking_entries.get(kind, {}) for kind in kinds):
            return tracking_entries
        assert time.monotonic() < deadline, f"the job's exporter ended its tracker runs: {tracking_entries}"
        time.sleep(0.1)


def test_a_launch_and_a_ddp_group_are_one_run_each_in_every_tracker(tmp_path, capfd):
    from gpumagic.widgets.launch_dashboard import LaunchDashboard

    dashboard = LaunchDashboard(push_interval=0.1)
    assert gpumagic.launch_ddp(train, 2, (4,), gpus="none", output="none", dashboard=dashboard) == {0: 0, 1: 1}
    dashboard.join()
    with gpumagic.ranks(2, gpus="none", output="none") as group:
        group.run(train, 3)
        group.run(train, 3, 3)  # the next cell: the same series go on
    assert "gpumagic:" not in capfd.readouterr().out, "no tracker was named: all answered"

    launch, grouped = (next(r for r in gpumagic.runs() if r.info["kind"] == kind) for kind in ("ddp", "ddp-group"))
    assert f"tracked: tensorboard tb/{launch.id} · mlflow " in dashboard.snapshot, "the dashboard's status line"
    for run, steps in ((launch, 4), (grouped, 6)):
        recorded = run.info["tracking"]
        series, hparams = tensorboard_series(recorded["tensorboard"]["logdir"])
        assert sorted(series) == ["loss/rank0", "loss/rank1"]
        assert series["loss/rank1"] == as_float32(losses(steps, 1))
        assert hparams["nprocs"] == 2 and hparams["backend"] == "gloo"
        assert mlflow_series(tmp_path, recorded["mlflow"]["run_id"], "loss/rank0") == losses(steps, 0)
        _, ended, logged = wandb_run(recorded["wandb"]["dir"])
        assert logged["loss/rank1"] == losses(steps, 1) and ended == {"exit_code": 0}
    ran = {r.info.run_name: r for r in mlflow_runs(tmp_path)}
    assert sorted(ran) == sorted([launch.id, grouped.id]), "exactly one MLflow run per launch and per group"
    assert ran[launch.id].data.params["nprocs"] == "2" and ran[grouped.id].info.status == "FINISHED"
    assert len(glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))) == 2


def test_a_sweeps_jobs_are_one_run_each_with_their_values_and_jobs_and_compare_show_them(tmp_path):
    jobs = gpumagic.sweep(scaled, {"factor": [1.0, 2.0]}, 0, name="T")
    assert [j.wait("2m") for j in jobs] == ["finished", "finished"]

    for job, factor in zip(jobs, (1.0, 2.0), strict=True):
        recorded = exported(job)
        assert recorded["mlflow"]["closed"] == "finished"
        sweep = job.info["sweep"]  # the sweep's id: its name and its own part
        assert recorded["tensorboard"]["logdir"] == str(tmp_path / "tb" / sweep / job.name), "a sweep's together"
        series, hparams = tensorboard_series(recorded["tensorboard"]["logdir"])
        assert series == {"loss/rank0": as_float32(losses(3, 0, factor))}
        assert hparams["factor"] == factor, "the sweep's value is the run's parameter"
        config, _, logged = wandb_run(recorded["wandb"]["dir"])
        assert config["factor"] == factor and logged["loss/rank0"] == losses(3, 0, factor)
        assert f"tracked: tensorboard {sweep}/{job.name} · mlflow {recorded['mlflow']['run_id'][:8]}" in job.describe()
    ran = {r.info.run_name: r for r in mlflow_runs(tmp_path)}
    assert sorted(ran) == sorted(j.name for j in jobs), "exactly one MLflow run per job"
    assert {r.data.params["factor"] for r in ran.values()} == {"1", "2"}
    assert {r.data.tags["gpumagic.sweep"] for r in ran.values()} == {sweep}

    table = repr(JobTable(jobs))
    assert table.splitlines()[0].split() == ["name", "status", "GPUs", "elapsed", "latest", "tracked", "why"]
    assert all(f"tensorboard {sweep}/{job.name} · mlflow" in table for job in jobs), "%jobs shows each job's"

    from_tensorboard = gpumagic.compare(str(tmp_path / "tb"))  # the other way round: TensorBoard's runs, compared
    assert [row["name"] for row in from_tensorboard.rows] == [f"tb/{sweep}/{job.name}" for job in jobs]
    beside = gpumagic.compare(["T-*", tmp_path / "tb"])  # old runs line up beside new ones
    names = [job.name for job in jobs] + [f"tb/{sweep}/{job.name}" for job in jobs]
    assert [row["name"] for row in beside.rows] == names
    assert beside.curves["loss"][names[3]] == ([0, 1, 2], [v for _, v in as_float32(losses(3, 0, 2.0))])
    assert [row["tracked"] for row in beside.rows] == [tracking.tracked_summary(j.info) for j in jobs] + [None, None]


def fails_once(steps, marker):
    """Logs ``steps`` steps from where it got; the first attempt fails after its first two."""

    import gpumagic

    start = 2 if os.path.exists(marker) else 0
    for step in range(start, steps if start else 2):
        gpumagic.log(step, loss=1.0 / (step + 1))
    if not start:
        open(marker, "w").close()
        raise RuntimeError("the first attempt fails")
    return start


def test_a_resumed_job_goes_on_in_the_same_tracker_runs(tmp_path):
    job = gpumagic.jobs_with(gpus=0, name="R1").submit(fails_once, 5, str(tmp_path / "failed-once"))
    assert job.wait("2m") == "failed"
    first = exported(job)
    assert first["mlflow"]["closed"] == "failed"
    assert job.resume() is job and job.wait("2m") == "finished"
    second = exported(job)
    for kind, key in (("mlflow", "run_id"), ("wandb", "id"), ("tensorboard", "logdir")):
        assert second[kind][key] == first[kind][key], f"{kind}: the same run, attempt after attempt"
    (ran,) = mlflow_runs(tmp_path)
    assert ran.info.status == "FINISHED"
    assert mlflow_series(tmp_path, ran.info.run_id, "loss/rank0") == losses(5, 0), "both attempts' steps"
    series, _ = tensorboard_series(second["tensorboard"]["logdir"])
    assert series["loss/rank0"] == as_float32(losses(5, 0))


def sleeps_after_logging(steps):
    import time

    import gpumagic

    for step in range(steps):
        gpumagic.log(step, loss=1.0 / (step + 1))
    time.sleep(600)


def test_a_killed_job_still_sends_what_it_logged_and_ends_its_tracker_runs_killed(tmp_path):
    """%jobs kill signals the job's whole process tree: the exporter, and W&B's service with it, are not in it."""
    job = gpumagic.jobs_with(gpus=0, name="K1").submit(sleeps_after_logging, 3)
    points = job.path / "metrics" / "rank-0.bin"  # a batch: a 4-byte count, then 32 bytes a point
    deadline = time.monotonic() + 120
    while not (points.exists() and points.stat().st_size >= 4 + 3 * 32 and "wandb" in job.info.get("tracking", {})):
        assert time.monotonic() < deadline, "the job logged and its exporter opened its W&B run"
        time.sleep(0.1)
    job.kill()
    recorded = exported(job)
    assert {kind: entry["closed"] for kind, entry in recorded.items()} == dict.fromkeys(recorded, "killed")
    _, ended, logged = wandb_run(recorded["wandb"]["dir"])
    assert logged["loss/rank0"] == losses(3, 0) and ended == {"exit_code": 1}
    (ran,) = mlflow_runs(tmp_path)
    assert ran.info.status == "KILLED" and mlflow_series(tmp_path, ran.info.run_id, "loss/rank0") == losses(3, 0)


def test_a_launch_tracked_to_an_unreachable_mlflow_says_so_in_one_line(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("GPUMAGIC_TRACK_TIMEOUT", "3")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))  # bound, never listening: refused
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
        gpumagic.track("mlflow", tracking_uri=url, experiment="exp")
        assert gpumagic.launch_ddp(train, 2, (3,), gpus="none", output="none") == {0: 0, 1: 1}
    said = [line for line in capfd.readouterr().out.splitlines() if line.startswith("gpumagic:")]
    (launch,) = [r for r in gpumagic.runs() if r.info["kind"] == "ddp"]
    assert said == [
        f"gpumagic: mlflow at {url} (experiment exp): Unreachable: unreachable (Connection refused within 2 s); "
        f"run {launch.id} was not exported there (its metrics stay in the run directory: "
        f"gpumagic.export({launch.id!r}) sends them again)"
    ], "one line for the tracker that failed, none for those that answered"
    series, _ = tensorboard_series(launch.info["tracking"]["tensorboard"]["logdir"])
    assert series["loss/rank1"] == as_float32(losses(3, 1))

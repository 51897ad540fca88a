"""Metrics where the team already looks (issue #43): TensorBoard, MLflow (a file store) and Weights & Biases
(offline), each run read back with the tracker's own reader, never a stand-in; an unreachable or silent MLflow
server named once and never holding a run's end beyond its deadline."""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gpumagic
from gpumagic.errors import InvalidArgument
from gpumagic.run_dirs import store
from gpumagic.telemetry import exporting, tracking
from gpumagic.telemetry.log import TOTAL_STEPS, Recorder
from gpumagic.telemetry.tracking import Tracker
from tests.tracker_readers import (
    as_float32,
    mlflow_runs,
    mlflow_series,
    offline_trackers,
    tensorboard_series,
    wandb_history,
    wandb_run,
)

pytest.importorskip("tensorboard", reason="the tracking tests need the test extras: pip install -e '.[test]'")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def nothing_tracked(monkeypatch, tmp_path):
    """No tracker chosen before the test or left after it; W&B and MLflow keep their files in ``tmp_path``."""
    offline_trackers(monkeypatch, tmp_path)
    yield
    tracking._chosen = None


def every_tracker(tmp_path: Path) -> tuple[Tracker, ...]:
    gpumagic.track("tensorboard", logdir=str(tmp_path / "tb"))
    gpumagic.track("mlflow", tracking_uri=str(tmp_path / "mlruns"), experiment="exp")
    return gpumagic.track("wandb", project="proj", mode="offline", dir=str(tmp_path / "wb"))


def logged_run(steps: int = 6, ranks: int = 2, kind: str = "ddp", **details) -> tuple[Path, list[Recorder]]:
    """A run whose ranks logged ``loss`` (and rank 0 ``acc`` and ``total_steps``) at each step, as ranks do."""
    run = store.new_run(kind, ranks=ranks, **details)
    recorders = [Recorder(run, rank) for rank in range(ranks)]
    for step in range(steps):
        for rank, recorder in enumerate(recorders):
            now = time.time()
            recorder.points.extend((now, step, recorder.name_id("loss"), 1.0 / (step + 1) + rank))
            if rank == 0:
                recorder.points.extend((now, step, recorder.name_id("acc"), step / 10))
                recorder.points.extend((now, step, recorder.name_id(TOTAL_STEPS), steps))
    for recorder in recorders:
        recorder.close()
    return run, recorders


def expected(steps: int, rank: int) -> list[tuple[int, float]]:
    return [(step, 1.0 / (step + 1) + rank) for step in range(steps)]


# --- choosing trackers -------------------------------------------------------------------------------------


def test_track_fills_in_defaults_replaces_a_kind_and_stops_one_or_all(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    chosen = gpumagic.track("tensorboard")
    assert chosen == (Tracker("tensorboard", logdir=str(tmp_path / "runs")),), "torch's SummaryWriter's ./runs"
    gpumagic.track("mlflow")
    assert tracking.trackers()[-1].tracking_uri == f"file://{tmp_path / 'mlruns'}", "MLflow's own default, whole"
    assert tracking.trackers()[-1].experiment == "gpumagic"
    gpumagic.track("mlflow", tracking_uri="http://mlflow.example:5000", experiment="e2")
    kinds = [(t.kind, t.tracking_uri) for t in tracking.trackers()]
    assert kinds == [("tensorboard", None), ("mlflow", "http://mlflow.example:5000")], "chosen again: replaced"
    assert [t.kind for t in gpumagic.track("tensorboard", stop=True)] == ["mlflow"]
    assert gpumagic.track(None) == ()
    assert tracking.trackers() == ()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gpumagic.track("neptune"), r"one of tensorboard, mlflow, wandb \(or None to stop\), got 'neptune'"),
        (lambda: gpumagic.track("tensorboard", project="p"), r"takes logdir, not project \(project is wandb's\)"),
        (lambda: gpumagic.track("wandb", mode="online-ish"), r"mode=...\) is one of online, offline, disabled"),
        (lambda: gpumagic.track("mlflow", experiment=""), r"experiment=...\) needs a non-empty string"),
        (lambda: gpumagic.track("neptune", stop=True), r"takes one of tensorboard, mlflow, wandb, got 'neptune'"),
    ],
)
def test_bad_choices_are_one_line(call, message):
    with pytest.raises(InvalidArgument, match=message) as raised:
        call()
    assert "\n" not in str(raised.value)
    assert tracking.trackers() == (), "nothing chosen by a refused call"


def test_a_tracker_whose_package_is_missing_names_the_extra_that_installs_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # Python's own way to make an import fail
    with pytest.raises(
        InvalidArgument, match=r"^tracking to mlflow needs its package: pip install 'gpumagic\[mlflow\]'"
    ):
        gpumagic.track("mlflow")


def test_gpumagic_track_variable_names_trackers_for_processes_started_elsewhere(tmp_path, monkeypatch, caplog):
    chosen = (Tracker.of("tensorboard", logdir=str(tmp_path)), Tracker.of("wandb", project="p", mode="offline"))
    monkeypatch.setenv(tracking.TRACK_VARIABLE, tracking.to_environment(chosen))
    assert tracking.trackers() == chosen, "read back as written"
    monkeypatch.setenv(tracking.TRACK_VARIABLE, "tensorboard, wandb")
    assert [t.kind for t in tracking.trackers()] == ["tensorboard", "wandb"], "kinds' names: their defaults"
    monkeypatch.setenv(tracking.TRACK_VARIABLE, '[{"kind": "neptune"}]')
    assert tracking.trackers() == (), "a typo tracks nothing"
    assert 'GPUMAGIC_TRACK=\'[{"kind": "neptune"}]\' tracks nothing' in caplog.text
    gpumagic.track(None)
    monkeypatch.setenv(tracking.TRACK_VARIABLE, "tensorboard")
    assert tracking.trackers() == (), "a choice made in the process wins over the variable"


def test_choosing_or_not_imports_no_tracker_until_a_tracked_run_starts(tmp_path):
    code = textwrap.dedent(f"""
        import sys, gpumagic
        gpumagic.track("tensorboard", logdir={str(tmp_path / "tb")!r})
        gpumagic.track("mlflow", tracking_uri={str(tmp_path / "m")!r})
        gpumagic.track("wandb", mode="offline")
        from gpumagic.run_dirs import store
        from gpumagic.telemetry import exporting
        gpumagic.log(loss=1.0)
        loaded = sorted(m for m in ("tensorboard", "mlflow", "wandb") if m in sys.modules)
        print("before", loaded)
        export = exporting.start_export(store.new_run("ddp"), "ddp", chosen=gpumagic.track("wandb", stop=True)[:1])
        export.finish("finished", 60)
        print("after", sorted(m for m in ("tensorboard", "mlflow", "wandb") if m in sys.modules))
    """)
    env = {**os.environ, "GPUMAGIC_RUNS_DIR": str(tmp_path / "runs")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "before []" in out.stdout, "track() and an untracked run import none of them"
    assert "after ['tensorboard']" in out.stdout, "a run tracked to TensorBoard imports TensorBoard alone"


# --- exporting a run ---------------------------------------------------------------------------------------


def test_a_run_is_one_run_in_each_tracker_with_every_ranks_series_and_its_parameters(tmp_path):
    every_tracker(tmp_path)
    run, _ = logged_run(steps=6, sweep="S", params={"lr": 0.1})
    export = exporting.start_export(run, "ddp", {"nprocs": 2, "backend": "gloo"}, name="my-run")
    assert export.finish("finished", 60) == []
    recorded = json.loads((run / "run.json").read_text())["tracking"]

    tensorboard, hparams = tensorboard_series(recorded["tensorboard"]["logdir"])
    assert recorded["tensorboard"]["logdir"] == str(tmp_path / "tb" / "S" / "my-run"), "a sweep's runs together"
    assert sorted(tensorboard) == ["acc/rank0", "loss/rank0", "loss/rank1"], "total_steps is the dashboards'"
    for rank in (0, 1):
        assert tensorboard[f"loss/rank{rank}"] == as_float32(expected(6, rank)), "float32 there"
    assert hparams == {"nprocs": 2, "backend": "gloo", "lr": 0.1}

    (ran,) = mlflow_runs(tmp_path)
    assert ran.info.run_id == recorded["mlflow"]["run_id"] and ran.info.run_name == "my-run"
    assert ran.info.status == "FINISHED"
    assert ran.data.params == {"nprocs": "2", "backend": "gloo", "lr": "0.1"}
    assert ran.data.tags["gpumagic.run_id"] == run.name and ran.data.tags["gpumagic.sweep"] == "S"
    for rank in (0, 1):
        assert mlflow_series(tmp_path, ran.info.run_id, f"loss/rank{rank}") == expected(6, rank), "exact"

    (offline,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    assert recorded["wandb"]["dir"] == offline and recorded["wandb"]["id"] == run.name
    config, ended, series = wandb_run(offline)
    assert {k: config[k] for k in ("nprocs", "backend", "lr")} == {"nprocs": 2, "backend": "gloo", "lr": 0.1}
    assert ended == {"exit_code": 0}
    assert series["loss/rank0"] == expected(6, 0) and series["loss/rank1"] == expected(6, 1)
    assert series["acc/rank0"] == [(step, step / 10) for step in range(6)]

    assert tracking.tracked_summary({"tracking": recorded}).startswith("tensorboard S/my-run · mlflow ")


def test_points_logged_while_it_runs_are_sent_as_they_come_and_a_failure_is_the_tracker_runs_status(tmp_path):
    gpumagic.track("mlflow", tracking_uri=str(tmp_path / "mlruns"), experiment="exp")
    run = store.new_run("ddp", ranks=1)
    recorder = Recorder(run, 0)
    export = exporting.start_export(run, "ddp")
    for step in range(3):
        recorder.points.extend((time.time(), step, recorder.name_id("loss"), float(step)))
    recorder.flush()
    deadline = time.monotonic() + 60
    while not (mlflow_runs(tmp_path) and mlflow_runs(tmp_path)[0].data.metrics):
        assert time.monotonic() < deadline, "the points reached MLflow while the run ran"
        time.sleep(0.2)
    assert mlflow_runs(tmp_path)[0].info.status == "RUNNING"
    recorder.points.extend((time.time(), 3, recorder.name_id("loss"), 3.0))
    recorder.close()
    assert export.finish("failed", 60) == []
    (ran,) = mlflow_runs(tmp_path)
    assert ran.info.status == "FAILED"
    assert mlflow_series(tmp_path, ran.info.run_id, "loss/rank0") == [(s, float(s)) for s in range(4)]


def test_a_resumed_run_goes_on_in_the_same_tracker_runs(tmp_path):
    every_tracker(tmp_path)
    run, _ = logged_run(steps=3, ranks=1)
    assert exporting.start_export(run, "job", {"gpus": 1}, name="J").finish("killed", 60) == []
    first = json.loads((run / "run.json").read_text())["tracking"]
    (ran,) = mlflow_runs(tmp_path)
    assert ran.info.status == "KILLED"
    # the next attempt: its metrics start again in metrics/ (the earlier attempt's moved to attempts/1/)
    for path in (run / "metrics").iterdir():
        path.unlink()
    again = Recorder(run, 0)
    for step in range(3, 5):
        again.points.extend((time.time(), step, again.name_id("loss"), 1.0 / (step + 1)))
    again.close()
    assert exporting.start_export(run, "job", {"gpus": 1}, name="J").finish("finished", 60) == []
    second = json.loads((run / "run.json").read_text())["tracking"]
    assert second["mlflow"]["run_id"] == first["mlflow"]["run_id"] and second["wandb"]["id"] == first["wandb"]["id"]
    assert second["tensorboard"]["logdir"] == first["tensorboard"]["logdir"]
    (ran,) = mlflow_runs(tmp_path)
    assert ran.info.status == "FINISHED"
    assert mlflow_series(tmp_path, ran.info.run_id, "loss/rank0") == expected(5, 0)
    tensorboard, _ = tensorboard_series(first["tensorboard"]["logdir"])
    assert tensorboard["loss/rank0"] == as_float32(expected(5, 0))


def test_an_unreachable_mlflow_is_named_once_and_the_others_get_the_run(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))  # bound, never listening: refused
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
        gpumagic.track("mlflow", tracking_uri=url, experiment="exp")
        gpumagic.track("tensorboard", logdir=str(tmp_path / "tb"))
        run, _ = logged_run(steps=4)
        lines = exporting.start_export(run, "ddp").finish("finished", 60)
        store.finish_run(run, "finished")
    assert lines == [
        f"gpumagic: mlflow at {url} (experiment exp): Unreachable: unreachable (Connection refused within 2 s); "
        f"run {run.name} was not exported there (its metrics stay in the run directory: "
        f"gpumagic.export({run.name!r}) sends them again)"
    ]
    recorded = json.loads((run / "run.json").read_text())["tracking"]
    assert recorded["mlflow"] == {"problem": "Unreachable: unreachable (Connection refused within 2 s)"}
    tensorboard, _ = tensorboard_series(recorded["tensorboard"]["logdir"])
    assert tensorboard["loss/rank1"] == as_float32(expected(4, 1))
    assert tracking.tracked_summary({"tracking": recorded}).startswith("tensorboard ")
    assert "mlflow: Unreachable" in tracking.tracked_summary({"tracking": recorded})

    gpumagic.track("mlflow", tracking_uri=str(tmp_path / "mlruns"), experiment="exp")  # the server is back
    gpumagic.track("tensorboard", stop=True)
    assert gpumagic.export(run.name) == []
    (ran,) = mlflow_runs(tmp_path)
    assert mlflow_series(tmp_path, ran.info.run_id, "loss/rank1") == expected(4, 1), "sent again, every point"


@pytest.mark.slow  # a process waits out its deadline
def test_a_server_that_takes_the_connection_and_never_answers_holds_the_end_only_until_the_deadline(tmp_path):
    code = textwrap.dedent("""
        import json, socket, sys, time
        import gpumagic
        from gpumagic.run_dirs import store
        from gpumagic.telemetry import exporting
        from gpumagic.telemetry.log import Recorder
        silent = socket.socket(); silent.bind(("127.0.0.1", 0)); silent.listen(16)  # never accepts, never answers
        gpumagic.track("mlflow", tracking_uri=f"http://127.0.0.1:{silent.getsockname()[1]}")
        run = store.new_run("ddp")
        recorder = Recorder(run, 0)
        recorder.points.extend((time.time(), 0, recorder.name_id("loss"), 1.0))
        recorder.close()
        export = exporting.start_export(run, "ddp")
        lines = export.finish("finished", 1.5)
        print(json.dumps({"lines": lines, "record": (run / "run.json").read_text()}))
    """)
    env = {**os.environ, "GPUMAGIC_RUNS_DIR": str(tmp_path / "runs")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout.strip().splitlines()[-1])
    (line,) = said["lines"]
    assert "did not answer within 1.5 s; run " in line and "may not be fully exported there" in line
    recorded = json.loads(said["record"])["tracking"]["mlflow"]
    assert recorded["problem"] == "did not answer within 1.5 s; may be incomplete", "kept for %jobs and compare"


def test_the_notebooks_own_wandb_run_and_mlflow_setting_are_left_as_they_were(tmp_path):
    import wandb

    quiet = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True, disable_git=True)
    own = tmp_path / "own"
    mine = wandb.init(project="own", mode="offline", dir=str(own), reinit="create_new", settings=quiet)
    every_tracker(tmp_path)
    run, _ = logged_run(steps=3)
    assert exporting.start_export(run, "ddp").finish("finished", 60) == []
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ, "set only while MLflow made its file store"
    mine.log({"mine": 1.5})  # the user's own run goes on after gpumagic's ended
    mine.finish()
    (directory,) = glob.glob(str(own / "wandb" / "offline-run-*"))
    _, ended, rows = wandb_history(directory)
    assert ended == {"exit_code": 0} and [row["mine"] for row in rows if "mine" in row] == [1.5]


def test_mlflow_uris_without_a_scheme_stay_uris_and_paths_become_file_stores(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Tracker.of("mlflow", tracking_uri="databricks").tracking_uri == "databricks"
    assert Tracker.of("mlflow", tracking_uri="databricks-uc").tracking_uri == "databricks-uc"
    assert Tracker.of("mlflow", tracking_uri="sub/dir").tracking_uri == f"file://{tmp_path / 'sub' / 'dir'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert Tracker.of("mlflow").tracking_uri == "http://mlflow.example:5000", "MLflow's own variable"


def test_export_refuses_what_it_cannot_send_in_one_line(tmp_path):
    run, _ = logged_run(steps=1)
    with pytest.raises(InvalidArgument, match=r"^no tracker chosen: gpumagic.track\("):
        gpumagic.export(run.name)
    gpumagic.track("tensorboard", logdir=str(tmp_path / "tb"))
    running = store.new_run("ddp")
    with pytest.raises(InvalidArgument, match=r"is running: it is exported as it runs; export it once it ended$"):
        gpumagic.export(running.name)
    with pytest.raises(InvalidArgument, match=r"^no run 'nothing-such'"):
        gpumagic.export("nothing-such")
    with pytest.raises(InvalidArgument, match=r"^export takes a job's name, a run id, a Job or a Run, got int$"):
        gpumagic.export(3)


def test_jobs_track_and_export_are_the_api_behind_a_magic(shell, tmp_path):
    assert "No tracker chosen" in str(shell.run_line_magic("jobs", "track"))
    shown = str(shell.run_line_magic("jobs", f"track tensorboard --logdir {tmp_path / 'tb'}"))
    assert shown == f"Metrics of what starts from now on go to:\n  tensorboard at {tmp_path / 'tb'}"
    assert [t.kind for t in tracking.trackers()] == ["tensorboard"]
    from IPython.core.error import UsageError

    for line, message in [
        ("track tensorboard --project p", "takes logdir, not project (project is wandb's)"),
        ("track --logdir x", "--logdir needs a tracker first: tensorboard, mlflow or wandb"),
        ("track wandb --stop --dir x", "--stop takes no other option: it stops sending to wandb"),
        ("track neptune", "takes one of tensorboard, mlflow, wandb"),
    ]:
        with pytest.raises(UsageError, match=re.escape(message)):
            shell.run_line_magic("jobs", line)
    run, _ = logged_run(steps=2)
    store.finish_run(run, "finished")
    assert str(shell.run_line_magic("jobs", f"export {run.name}")) == f"{run.name}: exported to tensorboard"
    assert "No tracker chosen" in str(shell.run_line_magic("jobs", "track none"))
    assert "%jobs track [KIND] [opts]" in str(shell.run_line_magic("jobs", "help"))


@pytest.mark.slow
def test_in_a_shared_logdir_a_neighbours_link_or_directory_never_receives_a_run(two_users, shared_tmp):
    """Alice's runs go to a TensorBoard logdir everyone can write (0777, not sticky). Bob planted a link and a
    directory of his under the names her runs would take, and after her first attempt of a job swapped its
    directory for a link to his: nothing of hers is ever written where Bob reads."""
    from tests.two_users import shared_directory

    alice, bob = two_users
    logdir = shared_directory(shared_tmp / "tb", 0o777)
    bob.json(f"""
        import json, os
        os.makedirs(os.path.expanduser("~/stolen"), mode=0o777)
        os.chmod(os.path.expanduser("~/stolen"), 0o777)
        os.chmod(os.path.expanduser("~"), 0o755)
        os.symlink(os.path.expanduser("~/stolen"), "{logdir}/planted-link")
        os.mkdir("{logdir}/planted-dir")
        os.chmod("{logdir}/planted-dir", 0o777)
        print(json.dumps({{}}))
    """)
    said = alice.json(f"""
        import json, os, time
        os.environ["GPUMAGIC_RUNS_DIR"] = os.path.expanduser("~/runs")
        from gpumagic.run_dirs import store
        from gpumagic.telemetry import exporting, tracking
        from gpumagic.telemetry.log import Recorder
        chosen = (tracking.Tracker.of("tensorboard", logdir="{logdir}"),)
        def export(name):
            run = store.new_run("job", name=name)
            recorder = Recorder(run, 0)
            recorder.points.extend((time.time(), 0, recorder.name_id("loss"), 1.0))
            recorder.close()
            return run, exporting.start_export(run, "job", chosen=chosen).finish("finished", 60)
        kept = {{}}
        for name in ("planted-link", "planted-dir", "mine"):
            run, lines = export(name)
            kept[name] = [json.load(open(run / "run.json"))["tracking"]["tensorboard"], lines]
        print(json.dumps(kept))
    """)
    for name in ("planted-link", "planted-dir"):
        entry, lines = said[name]
        assert lines == [] and entry["logdir"].startswith(f"{logdir}/{name}-"), "another name, of her own"
        assert os.stat(entry["logdir"]).st_uid == alice.uid
    assert os.listdir(bob.home / "stolen") == [] and os.listdir(logdir / "planted-dir") == []

    first = said["mine"][0]["logdir"]  # Bob swaps her run's directory for a link to his, between two attempts
    bob.json(f"""
        import json, os
        os.rename("{first}", "{logdir}/moved")
        os.symlink(os.path.expanduser("~/stolen"), "{first}")
        print(json.dumps({{}}))
    """)
    again = alice.json(f"""
        import json, os, time
        os.environ["GPUMAGIC_RUNS_DIR"] = os.path.expanduser("~/runs")
        from gpumagic.run_dirs import store
        from gpumagic.telemetry import exporting, tracking
        from gpumagic.telemetry.log import Recorder
        (run,) = [r for r in store.list_runs() if r.info.get("name") == "mine"]
        recorder = Recorder(run.path, 0)
        recorder.points.extend((time.time(), 1, recorder.name_id("loss"), 0.5))
        recorder.close()
        chosen = (tracking.Tracker.of("tensorboard", logdir="{logdir}"),)
        lines = exporting.start_export(run.path, "job", chosen=chosen).finish("finished", 60)
        print(json.dumps(lines))
    """)
    (line,) = again
    assert f"{first} is not a directory of yours (another user's, or a link)" in line
    assert os.listdir(bob.home / "stolen") == [], "not one event file where Bob reads"

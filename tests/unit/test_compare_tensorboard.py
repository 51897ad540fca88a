"""``gpumagic.compare`` reads TensorBoard event directories beside gpumagic's runs and jobs: event files written
with TensorBoard's own writer, read back with its reader (rank 0's tags without their rank, foreign tags as they
are, HParams as configuration, every point); and a ``tracked`` column for runs that were exported to a tracker."""

import json
import subprocess
import sys
import textwrap
import time

import numpy
import pytest
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams.summary_v2 import hparams_pb
from tensorboard.summary.writer.event_file_writer import EventFileWriter

import gpumagic
from gpumagic.jobs.comparison import RunComparison
from gpumagic.run_dirs import store
from gpumagic.telemetry.log import Recorder

START = 1_700_000_000.0


def write_events(directory, points, hparams=None):
    """An event file in ``directory`` (made if missing): ``points`` are ``(step, tag, value)``, one second
    apart from START; ``hparams`` an HParams session start, as gpumagic's exporter writes it."""
    writer = EventFileWriter(str(directory), max_queue_size=len(points) + 1)
    if hparams is not None:
        writer.add_event(Event(wall_time=START, summary=hparams_pb(hparams, start_time_secs=int(START))))
    for index, (step, tag, value) in enumerate(points):
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
        writer.add_event(Event(wall_time=START + index, step=step, summary=summary))
    writer.close()


def as_float32(values):
    return [float(numpy.float32(v)) for v in values]


def losses(count, scale=1.0):
    return [scale / (step + 1) + 0.01 * (step % 3) for step in range(count)]


def gpumagic_run(count=5, scale=1.0, **details):
    """A finished kernel run of gpumagic's own, its rank 0 logging ``loss`` at steps 0..count-1."""
    path = store.new_run("kernel", **details)
    recorder = Recorder(path, 0)
    loss = recorder.name_id("loss")
    for step, value in enumerate(losses(count, scale)):
        recorder.points.extend((START + step, step, loss, value))
    recorder.close()
    store.finish_run(path, "finished")
    return path


def test_a_directory_holding_event_files_is_one_run_named_after_it(tmp_path):
    folder = tmp_path / "old-run"
    write_events(folder, [(step, "loss", value) for step, value in enumerate(losses(6))])
    comparison = gpumagic.compare(str(folder))
    assert [row["name"] for row in comparison.rows] == ["old-run"] and comparison.metrics == ["loss"]
    row = comparison.rows[0]
    assert (row["status"], row["GPUs"], row["GPU hours"], row["duration"]) == ("finished", "-", 0.0, 5.0)
    assert comparison.members[0].path == folder and comparison.members[0].params == {}
    assert row["loss last"] == as_float32(losses(6))[-1] and row["loss best"] == min(as_float32(losses(6)))
    assert comparison.curves["loss"]["old-run"] == ([0, 1, 2, 3, 4, 5], as_float32(losses(6)))


def test_a_tree_of_runs_is_a_run_per_folder_of_event_files(tmp_path, shell):
    tree = tmp_path / "tb"
    write_events(tree / "lr-0.1", [(0, "loss", 1.0), (1, "loss", 0.5)])
    write_events(tree / "more" / "lr-0.01", [(0, "loss", 2.0), (1, "loss", 1.5), (2, "loss", 1.25)])
    (tree / "empty").mkdir()
    (tree / "notes.txt").write_text("not a run")
    comparison = gpumagic.compare(tree)  # a Path does as well as its text
    assert [row["name"] for row in comparison.rows] == ["tb/lr-0.1", "tb/more/lr-0.01"]
    assert [m.path for m in comparison.members] == [tree / "lr-0.1", tree / "more" / "lr-0.01"]
    assert [row["loss last"] for row in comparison.rows] == [0.5, 1.25]
    shown = shell.run_line_magic("jobs", f"compare {tree} --sort-by loss")
    assert [row["name"] for row in shown.rows] == ["tb/lr-0.1", "tb/more/lr-0.01"]


def test_looking_for_runs_under_a_path_typed_by_mistake_is_bounded(tmp_path, monkeypatch):
    """``%jobs compare ..`` (or ``/``) looks into a bounded number of folders, not the whole disk (a random test
    line ``..`` once took 216 s of a CI run walking the runner's home)."""
    from gpumagic.jobs import tensorboard_runs

    tree = tmp_path / "tb"
    write_events(tree / "a" / "b" / "c" / "d" / "e" / "f" / "too-deep", [(0, "loss", 1.0)])
    write_events(tree / "a" / "shallow", [(0, "loss", 1.0)])
    write_events(tree / ".hidden" / "run", [(0, "loss", 1.0)])
    assert [run.name for run in tensorboard_runs.find_runs(tree)] == ["tb/a/shallow"]
    for n in range(30):
        (tree / f"z{n:02}").mkdir()
    monkeypatch.setattr(tensorboard_runs, "MAX_FOLDERS", 20)
    assert [run.name for run in tensorboard_runs.find_runs(tree)] == ["tb/a/shallow"]  # found before the bound
    started = time.monotonic()
    tensorboard_runs.find_runs("/")
    assert time.monotonic() - started < 5  # 20 folders of the whole disk


def test_rank_0s_tags_stand_for_the_run_and_foreign_tags_stay_as_they_are(tmp_path):
    points = []
    for step in range(4):
        points += [(step, "loss/rank0", 1.0 / (step + 1)), (step, "loss/rank1", 9.0), (step, "acc/rank1", 0.3)]
        points += [(step, "train/loss", 2.0 / (step + 1)), (step, "lr/rank0", 0.1)]
    write_events(tmp_path / "ddp", points)
    comparison = RunComparison(str(tmp_path / "ddp"))
    metrics = comparison.members[0].metrics
    assert sorted(metrics) == ["loss", "lr", "train/loss"] == comparison.metrics, "rank 1's tags are left out"
    assert metrics["loss"].values == as_float32([1.0 / (s + 1) for s in range(4)])
    assert metrics["train/loss"].values == as_float32([2.0 / (s + 1) for s in range(4)])
    assert metrics["loss"].steps == [0, 1, 2, 3] and metrics["lr"].values == as_float32([0.1] * 4)
    assert metrics["loss"].times == [START + 5 * s for s in range(4)], "each point's own wall time"


def test_hparams_are_the_runs_configuration(tmp_path):
    common = {"width": 32, "opt": "adam", "amp": True}
    write_events(tmp_path / "runs" / "a", [(0, "loss/rank0", 1.0)], hparams={"lr": 0.1, **common})
    write_events(tmp_path / "runs" / "b", [(0, "loss/rank0", 2.0)], hparams={"lr": 0.01, **common})
    comparison = gpumagic.compare(str(tmp_path / "runs"), sort_by="lr")
    assert [m.params for m in comparison.members] == [{"lr": 0.1, **common}, {"lr": 0.01, **common}]
    assert list(comparison.members[0].params) == ["amp", "lr", "opt", "width"], "in the order of their names"
    assert comparison.shared == {"amp": True, "opt": "adam", "width": 32} and "lr" in comparison.columns
    assert [(row["name"], row["lr"]) for row in comparison.rows] == [("runs/b", 0.01), ("runs/a", 0.1)]
    assert comparison.filter("lr>0.05").rows[0]["name"] == "runs/a"
    assert comparison.records()[0]["width"] == 32, "a whole number reads as an int"


def test_every_point_is_kept_not_tensorboards_sample_of_10000(tmp_path):
    values = [1.0 / (step + 1) + (step % 7) / 1000 for step in range(12_000)]
    write_events(tmp_path / "long", [(step, "loss/rank0", value) for step, value in enumerate(values)])
    began = time.perf_counter()
    comparison = RunComparison(str(tmp_path / "long"))
    took = time.perf_counter() - began
    series = comparison.members[0].metrics["loss"]
    assert len(series) == 12_000 and series.steps == list(range(12_000)) and series.values == as_float32(values)
    assert took < 10, f"12,000 points read in {took:.2f} s"


def test_a_tensorboard_run_lines_up_beside_a_gpumagic_run_and_refresh_reads_both_again(tmp_path):
    path = gpumagic_run(params={"lr": "0.1"})
    board = tmp_path / "board" / "20261129-ddp-ab12"
    write_events(board, [(step, "loss/rank0", value) for step, value in enumerate(losses(3, 2.0))], {"lr": 0.01})
    comparison = gpumagic.compare([path.name, str(tmp_path / "board"), str(path)])
    assert [row["name"] for row in comparison.rows] == [path.name, "board/20261129-ddp-ab12"], "each run once"
    assert [row["lr"] for row in comparison.rows] == ["0.1", 0.01] and comparison.metrics == ["loss"]
    assert [row["GPUs"] for row in comparison.rows] == ["cpu", "-"]
    assert comparison.curves["loss"][path.name] == ([0.0, 1.0, 2.0, 3.0, 4.0], losses(5))
    assert comparison.curves["loss"]["board/20261129-ddp-ab12"][1] == as_float32(losses(3, 2.0))
    assert list(comparison.to_pandas()["name"]) == [path.name, "board/20261129-ddp-ab12"]
    comparison.switch_x("elapsed")
    assert comparison.curves["loss"]["board/20261129-ddp-ab12"][0] == [0.0, 1.0, 2.0]

    write_events(board, [(3, "loss/rank0", 0.125), (4, "loss/rank0", 0.0625)])  # a second event file, later
    comparison.refresh()
    assert comparison.members[1].metrics["loss"].steps == [0, 1, 2, 3, 4]
    assert comparison.rows[1]["loss last"] == 0.0625


def test_the_tracked_column_shows_only_where_a_run_was_exported(tmp_path):
    first, second = gpumagic_run(params={"lr": "0.1"}), gpumagic_run(scale=2.0, params={"lr": "0.2"})
    write_events(tmp_path / "tb", [(0, "loss", 1.0)])
    plain = gpumagic.compare([first.name, second.name, str(tmp_path / "tb")])
    assert "tracked" not in plain.columns and "tracked" not in plain.export_columns()
    assert "tracked" not in plain.rows[0] and "tracked" not in plain.to_csv().splitlines()[0]

    store.update_run(first, tracking={"mlflow": {"run_id": "3f9c1a2b77", "uri": "file:///m"}})
    tracked = gpumagic.compare([first.name, second.name, str(tmp_path / "tb")])
    assert tracked.columns[-1] == "tracked" and tracked.export_columns()[-1] == "tracked"
    assert [row["tracked"] for row in tracked.rows] == ["mlflow 3f9c1a2b", None, None]
    assert repr(tracked).splitlines()[1].endswith("mlflow 3f9c1a2b") and repr(tracked).splitlines()[2].endswith("–")
    assert tracked.to_csv().splitlines()[1].endswith(",mlflow 3f9c1a2b") and tracked.to_csv().splitlines()[2][-1] == ","
    frame = tracked.to_pandas()
    assert frame["tracked"].iloc[0] == "mlflow 3f9c1a2b" and frame["tracked"].isna().tolist() == [False, True, True]
    assert tracked.filter("tracked~mlflow").rows[0]["name"] == first.name
    tracked.filter()
    tracked.layout()  # the table draws it as text, and the CSV button exports it
    assert "tracked" in [column.field for column in tracked.table.columns]
    assert ["tracked", "tracked", ""] in tracked._csv_columns()


def test_a_directory_without_event_files_is_the_one_line_invalid_argument(tmp_path):
    folder = tmp_path / "nothing-here"
    (folder / "inside").mkdir(parents=True)
    (folder / "inside" / "events.txt").write_text("not an event file")
    with pytest.raises(gpumagic.InvalidArgument) as caught:
        gpumagic.compare(str(folder))
    message = str(caught.value)
    assert message.startswith(f"no job or run named {str(folder)!r}; %jobs lists jobs, gpumagic.runs() lists runs")
    assert "TensorBoard" in message and "(this one holds none)" in message and "\n" not in message


def child(code):
    """Run ``code`` in a new Python (this test's runs directory), return what it printed."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_tensorboard_is_imported_only_to_read_a_tensorboard_run(tmp_path):
    path = gpumagic_run()
    write_events(tmp_path / "tb", [(0, "loss", 1.0)])
    printed = child(
        f"""
        import sys, gpumagic
        mine = gpumagic.compare([{path.name!r}])
        print(mine.metrics, "tensorboard" in sys.modules)
        both = gpumagic.compare([{path.name!r}, {str(tmp_path / "tb")!r}])
        print(len(both.rows), "tensorboard" in sys.modules)
        """
    )
    assert printed.splitlines() == ["['loss'] False", "2 True"]


def test_without_tensorboard_installed_reading_one_says_how_to_install_it(tmp_path):
    write_events(tmp_path / "tb", [(0, "loss", 1.0)])
    printed = child(
        f"""
        import sys
        sys.modules["tensorboard"] = None  # as if it were not installed: importing it raises ImportError
        import gpumagic
        try:
            gpumagic.compare({str(tmp_path / "tb")!r})
        except gpumagic.InvalidArgument as err:
            print(err)
        """
    )
    assert printed == "reading TensorBoard runs needs its package: pip install 'gpumagic[tensorboard]'\n"


def test_a_run_exported_to_tensorboard_shows_its_directorys_last_parts(tmp_path):
    path = gpumagic_run()
    store.update_run(path, tracking={"tensorboard": {"logdir": str(tmp_path / "runs" / "20261129-ddp-ab12")}})
    assert json.loads((path / "run.json").read_text())["tracking"]["tensorboard"]
    comparison = gpumagic.compare(path.name)
    assert comparison.rows[0]["tracked"] == "tensorboard runs/20261129-ddp-ab12"

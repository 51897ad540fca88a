"""Comparing runs and jobs (``gpumagic.compare``, ``%jobs compare``): a sweep of CPU jobs and a pair that
differs only by its seed, read back from disk: the table's columns and values, sorting, seed groups' mean and
band, the x axes, the notebook controls, a live job refreshed, and a new kernel comparing what an old one ran."""

import json
import re
import statistics
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

import gpumagic
from gpumagic.widgets.compare import Comparison

pytestmark = pytest.mark.usefixtures("no_job_left_running")

A_NAMES = ["A-width=32,lr=0.01", "A-width=32,lr=0.003", "A-width=128,lr=0.01", "A-width=128,lr=0.003"]
B_NAMES = ["B-width=32,lr=0.01,seed=1", "B-width=32,lr=0.01,seed=2"]


def loss_at(width, lr, seed, step, steps):
    """Falls as 1/(step+1), with a bump at the last step: the last value is not the best one."""
    return width * lr * (1 / (step + 1) + (0.5 if step == steps - 1 else 0.0)) + seed / 10


def acc_at(seed, step):
    return step / 10 + seed / 100


def steps_of(seed):
    return 4 + seed  # seed 2 logs one step more than seed 1: a group's mean is over the steps both logged


def train(width, lr, seed=0):
    import time

    steps = steps_of(seed)
    for step in range(steps):
        gpumagic.log(step=step, loss=loss_at(width, lr, seed, step, steps), acc=acc_at(seed, step))
        time.sleep(0.02)


def losses(width, lr, seed=0):
    steps = steps_of(seed)
    return [loss_at(width, lr, seed, step, steps) for step in range(steps)]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compare-runs")


@pytest.fixture(autouse=True)
def shared_runs(runs_dir, isolated_leases, monkeypatch):
    """Every test reads the module's jobs (a test that needs its own runs directory sets it again)."""
    monkeypatch.setenv("GPUMAGIC_RUNS_DIR", str(runs_dir))


@pytest.fixture(scope="module")
def sweep(runs_dir, tmp_path_factory):
    """Four jobs of a 2x2 sweep (A) and two that differ only by their seed (B), CPU only, all finished."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPUMAGIC_RUNS_DIR", str(runs_dir))
        patch.setenv("GPUMAGIC_LEASE_DIR", str(tmp_path_factory.mktemp("leases")))
        jobs = gpumagic.sweep(train, {"width": [32, 128], "lr": [0.01, 0.003]}, 0, name="A")
        jobs += gpumagic.sweep(train, {"width": [32], "lr": [0.01], "seed": [1, 2]}, 0, name="B")
        assert [j.wait("2m") for j in jobs] == ["finished"] * 6
    return jobs


def names(comparison):
    return [row["name"] for row in comparison.rows]


@pytest.mark.slow
def test_the_table_shows_what_differs_and_each_metrics_last_and_best_value(sweep):
    comparison = gpumagic.compare("A-*")
    assert names(comparison) == A_NAMES  # the order the jobs were submitted
    config = ["width", "lr"]
    assert comparison.columns == [
        "name",
        "status",
        "duration",
        "GPUs",
        "GPU hours",
        *config,
        "acc last",
        "acc best",
        "loss last",
        "loss best",
    ]
    for row, (width, lr) in zip(comparison.rows, [(32, 0.01), (32, 0.003), (128, 0.01), (128, 0.003)], strict=True):
        assert (row["status"], row["GPUs"], row["width"], row["lr"]) == ("finished", "cpu", str(width), str(lr))
        logged = losses(width, lr)
        assert row["loss last"] == logged[-1] and row["loss best"] == min(logged) != logged[-1]
        assert row["acc last"] == row["acc best"] == acc_at(0, 3)  # acc: the best is the highest
        assert 0 < row["duration"] < 60
    two = gpumagic.compare(["A-width=32,lr=0.01", gpumagic.job("A-width=32,lr=0.003")])
    assert [c for c in two.columns if c in ("width", "lr")] == ["lr"]  # width is 32 for both
    assert [row["width"] for row in two.rows] == ["32", "32"] and two.shared == {"width": "32"}
    assert repr(two).splitlines()[-1] == "same in every run: width=32", "a shared value is shown, not a dash"
    every = gpumagic.compare(["A-width=32,lr=0.01", "A-width=32,lr=0.003"], all_columns=True)
    assert [c for c in every.columns if c in ("width", "lr")] == ["width", "lr"]

    text = repr(comparison).splitlines()
    assert re.split(r"\s{2,}", text[0]) == comparison.columns
    assert text[1].split()[:7] == ["A-width=32,lr=0.01", "finished", text[1].split()[2], "cpu", "0", "32", "0.01"]
    assert text[1].split()[-2:] == [f"{losses(32, 0.01)[-1]:.4g}", f"{min(losses(32, 0.01)):.4g}"]
    assert text[0].endswith("loss best") and text[1].endswith(f"{min(losses(32, 0.01)):.4g}"), "numbers align right"
    page = comparison._repr_html_()
    assert (
        "<th style='text-align:left;padding:1px 8px'>name</th>" in page
        and "<th style='text-align:right;padding:1px 8px'>width</th>" in page
    )
    assert "<th style='text-align:right;padding:1px 8px' title='lowest value logged'>loss best</th>" in page
    assert "<b style='color:var(--jp-content-font-color1)'><span style='color:#8a8a8a'>●</span> finished</b>" in page
    assert f"<td style='text-align:right;padding:1px 8px'>{min(losses(128, 0.003)):.4g}</td>" in page


def test_rows_sort_by_a_metric_best_first_or_by_any_column(sweep):
    by_loss = gpumagic.compare("A-*", sort_by="loss")
    assert by_loss.sort_by == "loss best" and not by_loss.descending
    best = {name: min(losses(int(w), float(lr))) for name, w, lr in [(n, *_point(n)) for n in A_NAMES]}
    assert names(by_loss) == sorted(A_NAMES, key=best.get)
    assert names(gpumagic.compare("A-*", sort_by="loss", descending=True)) == sorted(A_NAMES, key=best.get)[::-1]
    assert gpumagic.compare("A-*", sort_by="acc").descending, "the highest accuracy is the best: it comes first"
    # numbers sort as numbers (32 before 128), equal values keep the order given
    assert names(gpumagic.compare("A-*", sort_by="width", descending=True)) == [A_NAMES[i] for i in (2, 3, 0, 1)]
    assert names(gpumagic.compare("A-*", sort_by="lr")) == [A_NAMES[i] for i in (1, 3, 0, 2)]
    assert names(gpumagic.compare("A-*", sort_by="loss last")) == sorted(A_NAMES, key=lambda n: losses(*_point(n))[-1])
    seeds = gpumagic.compare(["B-*", "A-width=32,lr=0.01"], sort_by="seed", descending=True)
    assert names(seeds) == [B_NAMES[1], B_NAMES[0], "A-width=32,lr=0.01"], "a missing value sorts last"
    assert repr(by_loss).splitlines()[-1] == "sorted by loss best (ascending)"
    assert "loss best ▲</th>" in by_loss._repr_html_()


def _point(name):
    width, lr = (part.split("=")[1] for part in name.split("-", 1)[1].split(",")[:2])
    return int(width), float(lr)


def test_runs_differing_only_by_seed_are_one_mean_curve_with_a_band(sweep):
    comparison = gpumagic.compare(["A-width=32,lr=0.01", "A-width=128,lr=0.01", "B-*"])
    assert [c for c in comparison.columns if c in ("width", "lr", "seed")] == ["width", "seed"]
    assert [row["seed"] for row in comparison.rows] == [None, None, "1", "2"]
    group = "width=32 (2 seeds, mean ± std)"
    assert list(comparison.curves["loss"]) == [*A_NAMES[::2], group]
    runs = [losses(32, 0.01, seed) for seed in (1, 2)]
    common = min(len(r) for r in runs)  # steps 0-4: the second seed's step 5 has no partner
    mean = [statistics.mean(r[s] for r in runs) for s in range(common)]
    spread = [statistics.stdev(r[s] for r in runs) for s in range(common)]
    xs, ys = comparison.curves["loss"][group]
    assert xs == list(range(common)) and ys == pytest.approx(mean)
    band_xs, lower, upper = comparison.bands["loss"][group]
    assert band_xs == xs
    assert lower == pytest.approx([m - s for m, s in zip(mean, spread, strict=True)])
    assert upper == pytest.approx([m + s for m, s in zip(mean, spread, strict=True)])
    assert comparison.curves["loss"][A_NAMES[0]] == (list(range(4)), losses(32, 0.01))
    assert repr(comparison).splitlines()[-1] == f"seed groups: {group}"
    comparison.layout()
    items = comparison.figures["acc"].right[0].items
    assert [item.label.value for item in items] == [group] and len(items[0].renderers) == 2, "band and mean"
    assert [list(xs) for xs in comparison.curve_sources["acc"].data["xs"]] == [list(range(4))] * 2 + [
        list(range(5)),
        list(range(6)),
    ]

    apart = gpumagic.compare(["A-width=32,lr=0.01", "A-width=128,lr=0.01", "B-*"], group_seeds=False)
    assert list(apart.curves["loss"]) == [*A_NAMES[::2], *B_NAMES] and apart.bands == {}
    alone = gpumagic.compare("B-*")  # nothing else differs: the group is named by its configuration
    assert list(alone.curves["loss"]) == ["width=32,lr=0.01 (2 seeds, mean ± std)"]


def test_x_is_the_step_the_seconds_since_each_runs_first_point_or_the_wall_clock(sweep):
    logged = {job.name: job.metrics()[0] for job in sweep[:4]}
    elapsed = gpumagic.compare("A-*", metrics="loss", x="elapsed")
    assert list(elapsed.curves) == ["loss"] and elapsed.metrics == ["loss"]
    for name, (xs, ys) in elapsed.curves["loss"].items():
        first = min(series.times[0] for series in logged[name].values())
        assert xs[0] == 0 and xs == [t - first for t in logged[name]["loss"].times] and xs == sorted(xs)
        assert xs[-1] >= 0.05 and ys == logged[name]["loss"].values  # 4 points 20 ms apart
    wall = gpumagic.compare("A-*", x="time")
    assert wall.curves["acc"][A_NAMES[1]][0] == [t * 1000 for t in logged[A_NAMES[1]]["acc"].times]

    from bokeh.models import CustomJSTickFormatter, DatetimeAxis

    wall.widget  # noqa: B018 - builds the figures
    assert isinstance(wall.figures["acc"].xaxis[0], DatetimeAxis)
    x_buttons = wall.widget.children[0].children[0]
    assert x_buttons.options == ("step", "elapsed", "time")
    x_buttons.value = "elapsed"
    assert wall.x == "elapsed" and wall.curves["acc"][A_NAMES[1]][0][0] == 0
    assert isinstance(wall.figures["acc"].xaxis[0].formatter, CustomJSTickFormatter)
    assert wall.figures["loss"].xaxis[0].axis_label == "elapsed"
    x_buttons.value = "step"
    assert wall.curves["acc"][A_NAMES[1]][0] == [0, 1, 2, 3]
    from bokeh.models import Tabs

    tabs = wall.layout().select_one({"type": Tabs})  # loss-like: a linear and a log-y tab
    assert [panel.title for panel in tabs.tabs] == ["linear", "log y"]
    wall.close()


def test_sorting_and_filtering_redraw_the_view_in_that_order(sweep):
    comparison = gpumagic.compare("A-*")
    controls, plots = comparison.widget.children
    assert controls.children[0].options == ("step", "elapsed", "time")
    assert len(plots.children) == 1 and type(plots.children[0]).__name__ == "StaticBokehModel"
    by_loss = sorted(A_NAMES, key=lambda n: min(losses(*_point(n))))
    assert list(comparison.sort("loss").runs.data["name"]) == by_loss
    assert list(comparison.filter("width=128").runs.data["name"]) == [n for n in by_loss if "width=128" in n]
    assert list(comparison.filter().sort(None).runs.data["name"]) == A_NAMES
    comparison.close()


def gated(gate):
    import os
    import time

    for step in range(2):
        gpumagic.log(step=step, loss=1.0 / (step + 1))
    while not os.path.exists(gate):
        time.sleep(0.02)
    gpumagic.log(step=2, loss=0.1)


@pytest.mark.slow
def test_a_live_job_is_shown_as_far_as_it_got_and_refresh_reads_on(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMAGIC_RUNS_DIR", str(tmp_path / "runs"))
    with pytest.raises(gpumagic.InvalidArgument, match=r"^no runs or jobs to compare: you have no background jobs"):
        gpumagic.compare()
    gate = tmp_path / "gate"
    job = gpumagic.jobs_with(gpus=0, name="live").submit(gated, str(gate))
    deadline = time.monotonic() + 30
    while len(job.metrics().get(0, {}).get("loss", ())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    comparison = gpumagic.compare()
    assert [(r["name"], r["status"], r["loss last"], r["loss best"]) for r in comparison.rows] == [
        ("live", "running", 0.5, 0.5)
    ]
    comparison.widget  # noqa: B018 - builds the view
    assert list(comparison.runs.data["status"]) == ["running"]
    gate.touch()
    assert job.wait("30s") == "finished"
    comparison.refresh()
    assert [(r["status"], r["loss last"], r["loss best"]) for r in comparison.rows] == [("finished", 0.1, 0.1)]
    assert comparison.curves["loss"]["live"] == ([0, 1, 2], [1.0, 0.5, 0.1])
    assert list(comparison.runs.data["status"]) == ["finished"], "the view is drawn again"
    comparison.close()


def test_runs_and_run_ids_compare_as_jobs_do(sweep, runs_dir):
    code = "import gpumagic\nfor s in range(3):\n    gpumagic.log(step=s, loss=1.0 / (s + 1), acc=0.5)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)  # a process's own run, of kind kernel
    run = next(r for r in gpumagic.runs() if r.info["kind"] == "kernel")
    comparison = gpumagic.compare([run, run.id, "A-width=32,lr=0.01", sweep[1].path.name])
    assert names(comparison) == [run.id, "A-width=32,lr=0.01", "A-width=32,lr=0.003"], "each run once"
    row = comparison.rows[0]
    assert (row["status"], row["GPUs"], row["lr"], row["loss last"], row["loss best"]) == (
        "finished",
        "cpu",
        None,
        1 / 3,
        1 / 3,
    )
    assert "  –  " in repr(comparison).splitlines()[1], "a run without configuration shows a dash"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"runs_or_jobs": "nobody"}, "no job or run named 'nobody'; %jobs lists jobs, gpumagic.runs() lists runs"),
        ({"runs_or_jobs": "Z-*"}, "no job name matches 'Z-*' (jobs: A-width=32,lr=0.01, "),
        ({"runs_or_jobs": [7]}, "compare takes jobs, job names, runs or run ids, got int 7"),
        ({"runs_or_jobs": 7}, "compare takes jobs, job names, runs or run ids (or a list of them), got int"),
        ({"runs_or_jobs": []}, "no runs or jobs to compare: name jobs (A-*), runs"),
        ({"metrics": ["loss", "nope"]}, "no run here logged 'nope'; the metrics are: acc, loss"),
        ({"x": "sideways"}, "x is one of step, elapsed (seconds since each run's first point) or time"),
        (
            {"sort_by": "nope"},
            "cannot sort by 'nope'; sort by a column: name, status, duration, GPUs, GPU hours, width, lr",
        ),
    ],
)
def test_bad_input_is_a_one_line_invalid_argument(sweep, arguments, message):
    with pytest.raises(gpumagic.InvalidArgument) as caught:
        gpumagic.compare(**{"runs_or_jobs": "A-*", **arguments})
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_jobs_compare_magic(sweep, shell):
    comparison = shell.run_line_magic("jobs", "compare A-* --metric loss --sort-by loss")
    assert isinstance(comparison, Comparison) and comparison.metrics == ["loss"]
    assert names(comparison) == sorted(A_NAMES, key=lambda n: min(losses(*_point(n))))
    both = shell.run_line_magic(
        "jobs", "compare A-width=32,lr=0.01 A-width=32,lr=0.003 --all-columns --metric acc,loss"
    )
    assert both.metrics == ["acc", "loss"] and "width" in both.columns
    apart = shell.run_line_magic("jobs", "compare B-* --no-seed-groups --x elapsed --sort-by seed --descending")
    assert list(apart.curves["acc"]) == B_NAMES and apart.x == "elapsed" and names(apart) == B_NAMES[::-1]
    everything = shell.run_line_magic("jobs", "compare")
    assert names(everything) == A_NAMES + B_NAMES
    narrow = shell.run_line_magic("jobs", "compare A-* --filter width=32 --filter lr<=0.005")
    assert names(narrow) == ["A-width=32,lr=0.003"]
    assert "%jobs compare [NAME...]" in str(shell.run_line_magic("jobs", "help"))
    assert "--sort-by COL" in str(shell.run_line_magic("jobs", "help compare"))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("compare nobody", "%jobs compare: no job or run named 'nobody'"),
        ("compare Z-*", "%jobs compare: no job name matches 'Z-*'"),
        ("compare A-* --metric nope", "%jobs compare: no run here logged 'nope'; the metrics are: acc, loss"),
        ("compare A-* --metric ,", "%jobs compare: --metric needs a metric name"),
        ("compare A-* --x sideways", "%jobs compare: x is one of step, elapsed"),
        ("compare A-* --sort-by nope", "%jobs compare: cannot sort by 'nope'"),
        ("compare A-* --descending --ascending", "%jobs compare: argument --ascending: not allowed with"),
        ("compare A-* --bogus", "%jobs compare: unrecognized arguments: --bogus"),
        ("compare A-* --filter depth=3", "%jobs compare: cannot filter by 'depth'"),
    ],
)
def test_jobs_compare_bad_input_is_a_one_line_usage_error(sweep, shell, line, message):
    with pytest.raises(UsageError) as caught:
        shell.run_line_magic("jobs", line)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_importing_gpumagic_imports_no_plotting():
    heavy = ("bokeh", "ipywidgets", "torch", "pandas", "gpumagic.widgets.compare", "gpumagic.jobs.comparison")
    code = f"import gpumagic, sys; print(sorted(m for m in {heavy} if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


@pytest.mark.slow
@pytest.mark.kernel
def test_a_new_kernel_compares_what_an_earlier_one_ran(sweep, start_kernel):
    kernel = start_kernel()
    kernel.ok("%load_ext gpumagic\nimport gpumagic, json")
    shown = kernel.ok("%jobs compare A-* --sort-by loss")
    assert shown.mimetypes.count("application/vnd.jupyter.widget-view+json") == 1  # a frame: BokehJS, the view
    # the frame also holds the curves as a picture, for a page whose front end lacks jupyter_bokeh
    still = kernel.ok(
        "c = gpumagic.compare('A-*')\ndisplay(c)\nstill = c._frames[-1].still.value\n"
        "print(still.count('<polyline') >= 8, 'pip install jupyter_bokeh' in still, still.count('<polyline'))"
    )
    assert still.stdout.split()[:2] == ["True", "True"], still.stdout
    rows = kernel.ok(
        "c = gpumagic.compare('A-*', sort_by='loss')\n"
        "print(json.dumps([[r['name'], r['lr'], r['loss last'], r['loss best']] for r in c.rows]))"
    )
    expected = [[n, str(_point(n)[1]), losses(*_point(n))[-1], min(losses(*_point(n)))] for n in A_NAMES]
    assert json.loads(rows.stdout) == sorted(expected, key=lambda row: row[3])
    bad = kernel.run("%jobs compare A-* --x sideways")
    assert bad.error[0] == "UsageError" and "x is one of step, elapsed" in bad.error[1]
    wrong = kernel.run("gpumagic.compare('A-*', metrics=['nope'])")
    assert wrong.error == ("InvalidArgument", "no run here logged 'nope'; the metrics are: acc, loss")


COMPARE_WORDS = st.one_of(
    st.sampled_from(["A-*", "B-*", "*", "A-width=32,lr=0.01", "nobody", "[", "..", "--metric", "loss", "acc,loss"]),
    st.sampled_from(["--x", "step", "time", "elapsed", "--sort-by", "seed", "lr", "loss best", "--descending"]),
    st.sampled_from(
        ["--ascending", "--all-columns", "--no-seed-groups", "--bogus", "-h", "'", ",", "x?", "/x", "../x"]
    ),
    st.text(max_size=8),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(COMPARE_WORDS, max_size=6))
def test_random_compare_lines_work_or_raise_a_one_line_usage_error(sweep, shell, words):
    try:
        shown = shell.run_line_magic("jobs", " ".join(["compare", *words]))
    except UsageError as err:
        assert str(err).strip() and "\n" not in str(err)
        return
    assert isinstance(shown, Comparison) or "%jobs compare" in str(shown)


def member(name, params, steps, values):
    from pathlib import Path

    from gpumagic.jobs.comparison import Member
    from gpumagic.run_dirs.store import Series

    series = Series(list(steps), list(values), [1000.0 + s for s in steps])
    return Member(name, "finished", 1.0, "cpu", params, {"loss": series}, Path(name))


def test_seed_groups_keep_to_one_sweep_and_a_short_seed_cuts_nothing_short():
    from gpumagic.jobs.comparison import group_points as _group_points
    from gpumagic.jobs.comparison import seed_groups

    runs = [
        member("A-lr=1,seed=1", {"lr": 1, "seed": 1}, range(4), [4, 3, 2, 1]),
        member("B-lr=1,seed=1", {"lr": 1, "seed": 1}, range(4), [8, 6, 4, 2]),
        member("A-lr=1,seed=2", {"lr": 1, "seed": 2}, range(4), [6, 5, 4, 3]),
        member("B-lr=1,seed=2", {"lr": 1, "seed": 2}, range(4), [9, 7, 5, 3]),
        member("A-lr=1,seed=3", {"lr": 1, "seed": 3}, range(2), [5, 4]),  # crashed after two steps
    ]
    assert seed_groups(runs) == [[0, 2, 4], [1, 3]]  # two sweeps with the same grid: two groups
    points = _group_points([runs[0], runs[2], runs[4]], "loss", "step")
    assert points.x == [0, 1, 2, 3] and points.runs == 3
    assert points.value == pytest.approx([5, 4, 3, 2])  # steps 2 and 3: the two seeds that got there
    assert points.upper[3] - points.value[3] == pytest.approx(statistics.stdev([1, 3]))


def test_a_step_logged_again_from_0_is_not_drawn_back_to_the_start():
    from gpumagic.jobs.comparison import _forward
    from gpumagic.run_dirs.store import Series

    restarted = _forward(Series([0, 1, 2, 0, 1, 3], [5, 4, 3, 9, 8, 2], [1, 2, 3, 4, 5, 6]))
    assert (restarted.steps, restarted.values) == ([0, 1, 2, 3], [5, 4, 3, 2])


def test_a_launch_run_shows_its_gpus_as_indices_not_uuids(simulated):
    from gpumagic.devices.inventory import read_inventory
    from gpumagic.jobs.comparison import _run_gpus

    uuids = [gpu.uuid for gpu in read_inventory().gpus]
    assert _run_gpus([[uuids[2]], [uuids[3]]], "finished") == "2,3"
    assert _run_gpus([["GPU-elsewhere-1"], ["GPU-elsewhere-2"]], "finished") == "2 GPUs"
    assert _run_gpus([[], []], "finished") == "cpu"


# A few hundred runs, written with the real writers (a run directory, a Recorder), read back from disk.
LRS = ["0.0001", "0.0003", "0.001", "0.003", "0.01"]
MANY = 300


def many_params(i):
    return {"lr": LRS[i % 5], "width": str([32, 64, 128][(i // 5) % 3]), "opt": ["adam", "sgd"][(i // 15) % 2],
            "epochs": "10", "seed": str(i // 30)}  # fmt: skip


def many_points(i):
    return 40 + (i % 4) * 60  # 40, 100, 160 or 220 points


def many_loss(i, step):
    count = many_points(i)
    return (1 + i % 13) / (step + 1) + (0.5 if step == count - 1 else 0.0)  # the last is not the best


def many_acc(i, step):
    return step / many_points(i) + (i % 11) / 100  # the highest at the last step


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """300 finished kernel runs of a grid (lr x width x opt, epochs=10 for all, 10 seeds); every 50th ran on 2
    GPUs for half an hour."""
    from gpumagic.run_dirs import store
    from gpumagic.telemetry.log import Recorder

    root = tmp_path_factory.mktemp("many-runs")
    now = time.time()
    runs = []
    for i in range(MANY):
        extra = {"gpus": [["GPU-x-1"], ["GPU-x-2"]], "created": now - 1800} if i % 50 == 0 else {}
        path = store.new_run("kernel", root=root, params=many_params(i), **extra)
        recorder = Recorder(path, 0)
        loss, acc = recorder.name_id("loss"), recorder.name_id("acc")
        for step in range(many_points(i)):
            recorder.points.extend(
                (now + step, step, loss, many_loss(i, step), now + step, step, acc, many_acc(i, step))
            )
        recorder.close()
        store.finish_run(path, "finished")
        runs.append(store.Run(path, json.loads((path / "run.json").read_text())))
    return runs


def test_hundreds_of_runs_each_metrics_best_and_last_value_and_gpu_hours(simulated, many):
    comparison = gpumagic.compare(many)
    assert len(comparison.rows) == MANY and comparison.shared == {"epochs": "10"}
    assert [c for c in comparison.columns if c in many_params(0)] == ["lr", "width", "opt", "seed"]
    for i, row in enumerate(comparison.rows):
        n = many_points(i)
        assert row["loss last"] == many_loss(i, n - 1) and row["loss best"] == many_loss(i, n - 2), "lowest"
        assert row["acc last"] == row["acc best"] == many_acc(i, n - 1), "accuracy: the highest is the best"
        assert row["epochs"] == "10" and row["lr"] == LRS[i % 5]
        if i % 50 == 0:
            assert row["GPUs"] == "2 GPUs" and row["GPU hours"] == pytest.approx(1.0, abs=0.01)
        else:
            assert row["GPUs"] == "cpu" and row["GPU hours"] == 0
    every = gpumagic.compare(many[1:4], all_columns=True)
    assert "epochs" in every.columns and [r["epochs"] for r in every.rows] == ["10"] * 3
    assert all(line.split()[every.columns.index("epochs")] == "10" for line in repr(every).splitlines()[1:4])


def _expected_order(comparison, column, descending):
    from gpumagic.jobs.comparison import sort_key

    keys = [(sort_key(r[column]), r["name"]) for r in comparison._unsorted]
    present = [(k, n) for k, n in keys if k is not None]
    numbers = all(isinstance(k, float) for k, _ in present)
    present.sort(key=lambda item: item[0] if numbers else str(item[0]), reverse=descending)
    return [n for _, n in present] + [n for k, n in keys if k is None]


def test_hundreds_of_runs_sort_by_any_column_either_way(simulated, many):
    comparison = gpumagic.compare(many)
    for column in comparison.columns:
        for descending in (False, True):
            comparison.sort(column, descending)
            assert names(comparison) == _expected_order(comparison, column, descending), column
    assert names(comparison.sort("lr"))[:60] == [r["name"] for r in comparison._unsorted if r["lr"] == "0.0001"]
    assert comparison.sort("epochs").sort_by == "epochs", "a shared hyperparameter sorts too"
    assert comparison.sort("acc").descending and not comparison.sort("loss").descending


def test_hundreds_of_runs_filter_by_any_column(simulated, many):
    comparison = gpumagic.compare(many)
    assert len(comparison.filter("lr <= 0.001").rows) == 180, "numbers compare as numbers"
    assert {r["lr"] for r in comparison.rows} == {"0.0001", "0.0003", "0.001"}
    both = comparison.filter("lr<=0.001", width=128, opt="sgd")
    assert len(both.rows) == 30 and {(r["width"], r["opt"]) for r in both.rows} == {("128", "sgd")}
    assert repr(both).splitlines()[-2] == "filtered by lr<=0.001, width=128, opt=sgd: 30 of 300 runs"
    assert len(comparison.filter("loss best < 1").rows) == sum(
        many_loss(i, many_points(i) - 2) < 1 for i in range(MANY)
    )
    assert len(comparison.filter("loss < 1").rows) == len(comparison.rows), "a metric is its best value"
    assert len(comparison.filter("name ~ KERNEL").rows) == MANY and comparison.filter(epochs=10).rows
    assert len(comparison.filter("GPUs != cpu").rows) == 6 and len(comparison.filter("GPU hours > 0.5").rows) == 6
    sorted_and_filtered = comparison.sort("loss").filter("opt = adam")
    losses_shown = [r["loss best"] for r in sorted_and_filtered.rows]
    assert losses_shown == sorted(losses_shown) and {r["opt"] for r in sorted_and_filtered.rows} == {"adam"}
    assert len(comparison.filter().rows) == MANY


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda c: c.sort("nope"),
            "cannot sort by 'nope'; sort by a column: name, status, duration, GPUs, GPU hours, lr",
        ),
        (lambda c: c.filter("nope > 1"), "cannot filter by 'nope'; filter by a column: name, status, duration, GPUs"),
        (lambda c: c.filter(nope=1), "cannot filter by 'nope'; filter by a column: name, status, duration, GPUs"),
        (lambda c: c.filter("lr"), "a filter is 'COLUMN OP VALUE' with OP one of <= >= == != < > = ~"),
    ],
)
def test_an_unknown_column_to_sort_or_filter_by_names_the_known_ones(simulated, many, call, message):
    with pytest.raises(gpumagic.InvalidArgument) as caught:
        call(gpumagic.compare(many[:20]))
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    if "cannot" in message:
        assert "epochs" in str(caught.value) and "; or a metric: acc, loss" in str(caught.value)


def test_to_pandas_has_a_row_per_run_and_a_column_per_hyperparameter_and_metric(simulated, many):
    comparison = gpumagic.compare(many).sort("loss")
    frame = comparison.to_pandas()
    assert list(frame.columns) == ["name", "status", "lr", "width", "opt", "epochs", "seed", "duration_s",
                                   "gpu_hours", "gpus", "acc_best", "acc_last", "loss_best", "loss_last"]  # fmt: skip
    assert len(frame) == MANY and list(frame["name"]) == names(comparison), "the table's order"
    assert str(frame["lr"].dtype) == "float64" and str(frame["width"].dtype) == "int64", "numbers as numbers"
    assert set(frame["epochs"]) == {10} and set(frame["opt"]) == {"adam", "sgd"}
    first = comparison.rows[0]
    assert frame.iloc[0]["loss_best"] == first["loss best"] and frame.iloc[0]["acc_last"] == first["acc last"]
    assert frame["gpu_hours"].sum() == pytest.approx(6.0, abs=0.05) and (frame["status"] == "finished").all()
    assert len(comparison.filter(opt="sgd").to_pandas()) == 150


def test_to_csv_round_trips_through_pandas(simulated, many, tmp_path):
    import pandas

    comparison = gpumagic.compare(many).filter("width=64")
    path = tmp_path / "runs.csv"
    text = comparison.to_csv(path)
    assert path.read_text() == text and text.splitlines()[0].startswith("name,status,lr,width,opt,epochs,seed,")
    assert len(text.splitlines()) == 1 + 100
    again = pandas.read_csv(path)
    pandas.testing.assert_frame_equal(again, comparison.to_pandas(), check_dtype=False)
    assert comparison.to_csv() == text


def test_the_smoothing_default_grows_with_the_density_of_the_points():
    from gpumagic.telemetry.metric_kinds import smoothing_default

    assert [smoothing_default(n) for n in (0, 5, 29)] == [0, 0, 0], "a sparse metric is drawn raw"
    assert [smoothing_default(n) for n in (30, 60, 100, 300, 10_000)] == [0, 0.5, 0.7, 0.9, 0.9]


def test_the_view_draws_a_polyline_and_a_thinned_curve_per_run(simulated, many, sweep):
    import numpy

    from gpumagic.telemetry.metric_kinds import smoothing_default
    from gpumagic.widgets.compare import FULL_POINTS, FULL_RUNS, THIN_POINTS

    comparison = gpumagic.compare(many).sort("loss")
    comparison.layout()
    assert len(comparison.runs.data["name"]) == MANY and list(comparison.runs.data["name"]) == names(comparison)
    assert len(comparison.runs.data["axes_y"]) == MANY and {len(y) for y in comparison.runs.data["axes_y"]} == {4}
    ticks = comparison.axes.xaxis[0].major_label_overrides
    assert list(ticks.values()) == ["lr", "width", "opt", "loss best"], "an axis per differing key, then the metric"
    # colours follow the metric: the best run blue (PALETTE[0]), the worst orange (PALETTE[1])
    assert comparison.runs.data["color"][0] == "#468de5" and comparison.runs.data["color"][-1] == "#d6673f"
    source = comparison.curve_sources["loss"]
    drawn = [len(xs) for xs in source.data["xs"]]
    logged = [many_points(i) for i in range(MANY)]
    assert max(drawn[FULL_RUNS:]) <= THIN_POINTS < max(logged) and max(drawn[:FULL_RUNS]) <= FULL_POINTS
    full = [len(comparison.arrays("loss", r)[0]) for r in comparison.rows[:FULL_RUNS]]
    assert drawn[:FULL_RUNS] == full, "the best runs' curves are drawn whole"
    reference = float(numpy.median(drawn))
    assert comparison.slider.value == comparison.smoothing == smoothing_default(reference) and reference > 80
    assert 0.6 < comparison.smoothing < 0.9
    sparse = gpumagic.compare("A-*")
    sparse.layout()
    assert sparse.slider.value == 0.0, "4 points a run: drawn raw"


def test_thinning_keeps_each_spans_extremes_and_smoothing_is_tensorboards():
    import numpy

    from gpumagic.widgets.compare import smoothed, thin_indices
    from gpumagic.widgets.plots import Smoother

    values = numpy.sin(numpy.arange(1000) / 30.0)
    values[537] = 9.0  # a spike
    kept, short, other = thin_indices([values, values[:80], values * 2], [100, 100, 10])
    assert len(kept) <= 100 and 537 in kept and kept[0] == 0 and kept[-1] == 999
    assert short.tolist() == list(range(80)) and len(other) <= 10 and 537 in other, "a limit per row"
    assert [k.tolist() for k in thin_indices([values[:300]] * 2, [60, 60])] == [
        thin_indices([values[:300]], [60])[0].tolist()
    ] * 2
    rows = [values[:50], values[:50] * 2, values[:200]]
    smooth = smoothed(rows, 0.6, 50)
    assert smooth[0] == pytest.approx(Smoother(0.6).feed(values[:50].tolist()))
    assert smooth[1] == pytest.approx(Smoother(0.6).feed((values[:50] * 2).tolist()))
    assert smooth[2] == pytest.approx(Smoother(1 - 0.4 * 50 / 200).feed(values[:200].tolist())), "same span of x"
    assert smoothed(rows, 0.0, 50)[2] is rows[2]


def test_a_sparse_metric_beside_a_dense_one_is_not_smoothed_into_lag(tmp_path):
    """The slider's weight suits the densest metric; a metric logged once an epoch is drawn raw beside it."""
    import numpy

    from gpumagic.run_dirs import store
    from gpumagic.telemetry.log import Recorder
    from gpumagic.telemetry.metric_kinds import smoothing_default

    runs = []
    for k in range(2):
        path = store.new_run("kernel", root=tmp_path, params={"lr": str(0.1 * (k + 1))})
        recorder = Recorder(path, 0)
        loss, val = recorder.name_id("loss"), recorder.name_id("val_acc")
        for step in range(300):
            recorder.points.extend((1e9 + step, step, loss, 1 / (step + 1) + (step % 3) / 100))
            if step % 60 == 59:
                recorder.points.extend((1e9 + step, step, val, step / 300 + k / 10))
        recorder.close()
        store.finish_run(path, "finished")
        runs.append(str(path))
    comparison = gpumagic.compare(runs)
    comparison.layout()
    assert comparison.smoothing == smoothing_default(comparison.reference) > 0.6, "the loss: 100 points a curve"
    sparse = comparison.curve_sources["val_acc"].data
    assert [list(ys) for ys in sparse["ys"]] == [list(raw) for raw in sparse["raw"]], "5 points: raw"
    dense = comparison.curve_sources["loss"].data
    assert not numpy.allclose(dense["ys"][0], dense["raw"][0]) and comparison.slider.value == comparison.smoothing

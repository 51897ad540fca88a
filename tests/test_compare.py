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


def test_the_table_shows_what_differs_and_each_metrics_last_and_best_value(sweep):
    comparison = gpumagic.compare("A-*")
    assert names(comparison) == A_NAMES  # the order the jobs were submitted
    config = ["width", "lr"]
    assert comparison.columns == [
        "name",
        "status",
        "duration",
        "GPUs",
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
    every = gpumagic.compare(["A-width=32,lr=0.01", "A-width=32,lr=0.003"], all_columns=True)
    assert [c for c in every.columns if c in ("width", "lr")] == ["width", "lr"]

    text = repr(comparison).splitlines()
    assert re.split(r"\s{2,}", text[0]) == comparison.columns
    assert text[1].split()[:6] == ["A-width=32,lr=0.01", "finished", text[1].split()[2], "cpu", "32", "0.01"]
    assert text[1].split()[-2:] == [f"{losses(32, 0.01)[-1]:.4g}", f"{min(losses(32, 0.01)):.4g}"]
    assert text[0].endswith("loss best") and text[1].endswith(f"{min(losses(32, 0.01)):.4g}"), "numbers align right"
    page = comparison._repr_html_()
    assert (
        "<th style='text-align:left;padding:1px 8px'>name</th>" in page
        and "<th style='text-align:right;padding:1px 8px'>width</th>" in page
    )
    assert "<th style='text-align:right;padding:1px 8px' title='lowest value logged'>loss best</th>" in page
    assert "<td style='text-align:left;padding:1px 8px'><b style='color:#57606a'>finished</b></td>" in page
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
    legend = [item.label.value for item in comparison.figures["acc"].right[0].items]
    assert legend == list(comparison.curves["acc"])

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
    tabs = wall.layout().children[1]  # loss-like: a linear and a log-y tab
    assert [panel.title for panel in tabs.tabs] == ["linear", "log y"]
    wall.close()


def test_the_sort_menu_re_renders_the_table(sweep):
    comparison = gpumagic.compare("A-*")
    controls, table, plots = comparison.widget.children
    _, sort_menu, descending, _ = controls.children
    assert sort_menu.options[0] == ("order given", "") and ("loss best", "loss best") in sort_menu.options
    assert len(plots.children) == 1 and type(plots.children[0]).__name__ == "LiveBokehModel"

    def order():
        return sorted(A_NAMES, key=lambda name: table.value.index(f">{name}<"))

    sort_menu.value = "loss best"
    assert order() == names(comparison) == sorted(A_NAMES, key=lambda n: min(losses(*_point(n))))
    assert descending.value is False
    descending.value = True
    assert order() == sorted(A_NAMES, key=lambda n: min(losses(*_point(n))))[::-1] and comparison.descending
    sort_menu.value = "acc best"
    assert descending.value is True, "a new column starts best first"
    sort_menu.value = ""
    assert order() == A_NAMES and comparison.sort_by is None
    comparison.close()


def gated(gate):
    import os
    import time

    for step in range(2):
        gpumagic.log(step=step, loss=1.0 / (step + 1))
    while not os.path.exists(gate):
        time.sleep(0.02)
    gpumagic.log(step=2, loss=0.1)


def test_a_live_job_is_shown_as_far_as_it_got_and_refresh_reads_on(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMAGIC_RUNS_DIR", str(tmp_path / "runs"))
    with pytest.raises(gpumagic.InvalidArgument, match=r"^no runs or jobs to compare: you have no background jobs"):
        gpumagic.compare()
    gate = tmp_path / "gate"
    job = gpumagic.submit(gated, str(gate), gpus=0, name="live")
    deadline = time.monotonic() + 30
    while len(job.metrics().get(0, {}).get("loss", ())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    comparison = gpumagic.compare()
    assert [(r["name"], r["status"], r["loss last"], r["loss best"]) for r in comparison.rows] == [
        ("live", "running", 0.5, 0.5)
    ]
    table = comparison.widget.children[1]
    assert "running" in table.value
    gate.touch()
    assert job.wait("30s") == "finished"
    comparison.refresh()
    assert [(r["status"], r["loss last"], r["loss best"]) for r in comparison.rows] == [("finished", 0.1, 0.1)]
    assert comparison.curves["loss"]["live"] == ([0, 1, 2], [1.0, 0.5, 0.1])
    assert "finished" in table.value and "running" not in table.value
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
        ({"sort_by": "nope"}, "cannot sort by 'nope'; sort by a column: name, status, duration, GPUs, width, lr"),
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
    ],
)
def test_jobs_compare_bad_input_is_a_one_line_usage_error(sweep, shell, line, message):
    with pytest.raises(UsageError) as caught:
        shell.run_line_magic("jobs", line)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_importing_gpumagic_imports_no_plotting():
    heavy = ("bokeh", "ipywidgets", "torch", "gpumagic.widgets.compare")
    code = f"import gpumagic, sys; print(sorted(m for m in {heavy} if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


@pytest.mark.kernel
def test_a_new_kernel_compares_what_an_earlier_one_ran(sweep, start_kernel):
    kernel = start_kernel()
    kernel.ok("%load_ext gpumagic\nimport gpumagic, json")
    shown = kernel.ok("%jobs compare A-* --sort-by loss")
    assert shown.mimetypes.count("application/vnd.jupyter.widget-view+json") == 2  # BokehJS's loader, the view
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

    from gpumagic.telemetry.store import Series
    from gpumagic.widgets.compare import Member

    series = Series(list(steps), list(values), [1000.0 + s for s in steps])
    return Member(name, "finished", 1.0, "cpu", params, {"loss": series}, Path(name))


def test_seed_groups_keep_to_one_sweep_and_a_short_seed_cuts_nothing_short():
    from gpumagic.widgets.compare import _group_points, seed_groups

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
    from gpumagic.telemetry.store import Series
    from gpumagic.widgets.compare import _forward

    restarted = _forward(Series([0, 1, 2, 0, 1, 3], [5, 4, 3, 9, 8, 2], [1, 2, 3, 4, 5, 6]))
    assert (restarted.steps, restarted.values) == ([0, 1, 2, 3], [5, 4, 3, 2])


def test_a_launch_run_shows_its_gpus_as_indices_not_uuids(simulated):
    from gpumagic.devices.inventory import read_inventory
    from gpumagic.widgets.compare import _run_gpus

    uuids = [gpu.uuid for gpu in read_inventory().gpus]
    assert _run_gpus([[uuids[2]], [uuids[3]]], "finished") == "2,3"
    assert _run_gpus([["GPU-elsewhere-1"], ["GPU-elsewhere-2"]], "finished") == "2 GPUs"
    assert _run_gpus([[], []], "finished") == "cpu"

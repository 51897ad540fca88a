"""%%launch_bg and %jobs on one IPython shell: every form, help, and random input that must either work or
raise a one-line UsageError."""

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

import gpumagic
from gpumagic.devices.processes import is_same_process, process_start_time
from gpumagic.run_dirs import records

pytestmark = pytest.mark.usefixtures("no_job_left_running")


def jobs(shell, line):
    return shell.run_line_magic("jobs", line)


def launch_bg(shell, line, cell="x = 1\nx + 1"):
    return shell.run_cell_magic("launch_bg", line, cell)


def test_a_cell_becomes_a_job_with_the_notebook_names_it_uses(shell, simulated):
    shell.user_ns["offset"] = 40
    assert str(launch_bg(shell, "--name cell1 --gpus 0", "offset + 2")).startswith("Submitted job cell1")
    assert str(jobs(shell, "wait cell1")).startswith("cell1: finished on the CPU")
    assert jobs(shell, "result cell1") == 42
    assert "cell1" in repr(jobs(shell, "")) and "finished" in repr(jobs(shell, "list"))
    assert "Removed cell1" in jobs(shell, "rm cell1") and gpumagic.list_jobs() == []


def test_memory_limit_caps_a_cell_job_at_its_declared_memory(shell, simulated):
    cell = "import os\nos.environ.get('GPUMAGIC_MEMORY_LIMIT')"
    launch_bg(shell, "--name capped --min-free 3GB --memory-limit", cell)
    jobs(shell, "wait capped --timeout 60s")
    assert jobs(shell, "result capped") == str(3 << 30)
    with pytest.raises(UsageError, match="%%launch_bg: memory_limit caps a job at the memory it declares"):
        launch_bg(shell, "--name nothing --memory-limit", cell)


def test_a_failed_cells_result_is_its_traceback(shell, simulated):
    launch_bg(shell, "--name broken --gpus 0", "def step():\n    return 1 / 0\nstep()")
    jobs(shell, "wait broken")
    with pytest.raises(gpumagic.JobFailed) as caught:
        jobs(shell, "result broken")
    text = caught.value._render_traceback_()[0]
    assert "ZeroDivisionError: division by zero" in text and "return 1 / 0" in text


def test_logs_kill_and_the_errors_a_user_meets(shell, simulated, capsys):
    gpumagic.use("GPU:*")  # every GPU held here: the job stays queued
    launch_bg(shell, "--name waiting --gpus 2 --min-free 10GB")
    with pytest.raises(UsageError, match="job waiting is queued; %jobs wait waiting first"):
        jobs(shell, "result waiting")
    with pytest.raises(UsageError, match="still queued after 100ms"):
        jobs(shell, "wait waiting --timeout 0.1s")
    with pytest.raises(UsageError, match="waiting still active; %jobs kill them first"):
        jobs(shell, "rm waiting")
    with pytest.raises(UsageError, match="a job named 'waiting' exists already"):
        launch_bg(shell, "--name waiting")
    with pytest.raises(UsageError, match="no job named 'nobody' \\(jobs: waiting\\)"):
        jobs(shell, "kill waiting nobody")
    assert gpumagic.job("waiting").status == "queued", "no job is touched when one name is wrong"
    assert "waiting: killed (killed with %jobs kill while queued)" in jobs(shell, "kill waiting")
    jobs(shell, "logs waiting --tail 5")
    assert capsys.readouterr().out == ""
    with pytest.raises(UsageError, match="magics and !shell commands do not run in launched cells"):
        launch_bg(shell, "--gpus 0", "!ls")


def test_a_name_given_twice_counts_once(shell, simulated):
    for name in ("twice", "again"):
        launch_bg(shell, f"--name {name} --gpus 0")
    jobs(shell, "wait twice again")
    assert jobs(shell, "rm twice twice") == "Removed twice"
    gpumagic.use("GPU:*")
    launch_bg(shell, "--name held --gpus 1")  # stays queued: every GPU is held here
    assert str(jobs(shell, "kill held held")) == "held: killed (killed with %jobs kill while queued)"
    assert str(jobs(shell, "rm again held again")) == "Removed again, held" and gpumagic.list_jobs() == []


@pytest.fixture
def zombie():
    """A child process that has exited and that nobody reaped: (pid, when it started)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    process = psutil.Process(child.pid)
    started = process.create_time()
    deadline = time.monotonic() + 10
    while process.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process.status() == psutil.STATUS_ZOMBIE
    yield child.pid, started
    child.wait()


def test_a_zombie_runner_reads_as_dead_at_once(shell, zombie):
    pid, started = zombie
    assert process_start_time(pid) is None and not is_same_process(pid, started)
    launch_bg(shell, "--name undead --gpus 0")
    jobs(shell, "wait undead")
    job = gpumagic.job("undead")  # as if its runner had died, unreaped, before recording the end
    records.update(job.path, status="running", runner_pid=pid, runner_start=started, ended=None)
    assert job.status == "lost"
    assert jobs(shell, "rm undead") == "Removed undead"


def forever():
    import time

    while True:
        time.sleep(0.1)


def wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_jobs_watch_chooses_jobs_by_name_pattern_and_state(shell, simulated):
    """`%jobs watch 'A-*' --state running` (and gpumagic.watch_jobs, which it calls) shows only the running jobs
    whose name matches; a job that leaves the state leaves the table and the plot; a colour per job."""
    a1, b1 = (gpumagic.jobs_with(gpus=0, name=name).submit(forever) for name in ("A-1", "B-1"))
    a2 = gpumagic.jobs_with(gpus=0, name="A-2").submit(sum, [1, 2])
    assert a2.wait("30s") == "finished"
    assert wait_until(lambda: a1.status == b1.status == "running")
    table = jobs(shell, "watch 'A-*' --state running")  # no kernel: a table
    assert [row.name for row in table.rows] == ["A-1"]
    html = table._repr_html_()  # the status in the theme's text colour after a dot of its hue; one line a cell
    assert "<span style='color:#2ea043'>●</span> running</b>" in html and "color:#1a7f37" not in html
    assert html.count("white-space:nowrap") == len(table.rows[0].cells()) * 2  # headings and the row
    assert [j.name for j in gpumagic.select_jobs("A-*", "running,queued")] == ["A-1"]
    assert [j.name for j in gpumagic.select_jobs(["A-*", "B-1"])] == ["A-1", "B-1", "A-2"]  # submission order
    watch = gpumagic.watch_jobs("A-*", "running", interval=0.2)
    try:
        assert [p.name for p in watch.shown] == [a1.path.name] and list(watch.rows) == [a1.path]
        assert "1 background job</b> (A-* · running)" in watch.header.value
        everyone = gpumagic.watch_jobs(interval=0.2)
        assert len(set(everyone.colours.values())) == 3  # a colour per job (PALETTE: 20 before any repeats)
        assert [everyone.rows[p]["box"].children[0].layout.border_left for p in everyone.rows] == [
            f"4px solid {c}" for c in everyone.colours.values()
        ]  # the job's colour in the plot, beside its name in the table
        everyone.close()
        a1.kill(grace_s=1)
        watch.update()
        assert watch.shown == [] and watch.rows[a1.path]["box"].layout.display == "none"
        assert not any(r.visible for r in watch.rows[a1.path]["renderers"])  # its curve hidden with its row
        assert "no job matches A-* · running yet" in watch.header.value
    finally:
        watch.close()


def test_the_watch_says_why_a_job_waits_in_one_line_with_its_place_in_the_queue(shell, simulated):
    gpumagic.use("GPU:*")  # every GPU held here: the jobs wait, in submission order
    queued = [gpumagic.jobs_with(gpus=2, name=f"Q{n}").submit(sum, [1]) for n in range(3)]
    watch = gpumagic.watch_jobs("Q*", interval=0.2)
    try:

        def lines():
            watch.update()
            return [watch._texts[job.path][4] for job in queued]

        assert wait_until(lambda: "GPU 0:" in queued[2].reason and lines()[2].endswith("(2 jobs ahead)")), lines()
        assert lines() == [
            "waiting for 2 GPUs (next in the queue)",
            "waiting for 2 GPUs (1 job ahead)",
            "waiting for 2 GPUs (2 jobs ahead)",
        ]
        why = watch._texts[queued[2].path][5]
        assert why == queued[2].reason and "GPU 0:" in why and "GPU 3:" in why  # whole, under the mouse
        cell = watch.rows[queued[2].path]["box"].children[4].value
        assert "white-space:nowrap" in cell and "text-overflow:ellipsis" in cell and "\n" not in cell
    finally:
        watch.close()


@pytest.mark.kernel
def test_a_replaced_or_closed_jobs_watch_keeps_its_last_picture(start_kernel, simulated):
    """In a kernel, a second %jobs watch turns the first into a static copy of its last state where it was
    shown (the table, each job's status and one-line why, and the plot as HTML), its widgets closed; so does
    close()."""
    from tests.unit.test_widgets import WIDGET, outputs

    kernel = start_kernel(GPUMAGIC_SIMULATE=simulated)
    kernel.ok(
        "%load_ext gpumagic\nimport gpumagic\ngpumagic.jobs_with(gpus=0, name='A-1').submit(sum, [1]).wait('30s')"
    )
    first = outputs(kernel, "%jobs watch 'A-*' --interval 0.2")
    frames = [display_id for kind, display_id, data in first if kind == "display_data" and WIDGET in data]
    assert len(frames) == 1  # the frame (then its plain copy, for a front end with no widgets)
    shown = frames[0]
    second = outputs(kernel, "%jobs watch --state running --interval 0.2")
    frozen = [data for kind, display_id, data in second if kind == "update_display_data" and display_id == shown]
    assert len(frozen) == 1 and WIDGET not in frozen[0]
    copy = frozen[0]["text/html"]
    assert "gpumagic-job-watch" in copy and "<b>A-1</b>" in copy and "●</span> finished" in copy
    assert "closed at" in copy and "Bokeh.embed.embed_items" in copy and "loss per job" in copy
    assert (
        "no job matches running yet"
        in kernel.ok("from gpumagic.magics.jobs import _WATCHES\nw = _WATCHES[-1]\nprint(w.header.value)").stdout
    )
    closing = outputs(kernel, "w.close()\nprint(w.running, w.plots.comm, w.widget.comm)")
    assert any(kind == "update_display_data" and "text/html" in data for kind, _, data in closing)
    assert kernel.ok("print(w.running, w.plots.comm, w.widget.comm)").stdout.split() == ["False", "None", "None"]


def test_one_line_why_is_one_short_line():
    from gpumagic.jobs.queue import one_line_why

    assert one_line_why("ZeroDivisionError: division by zero\n  more\n  lines") == "ZeroDivisionError: division by zero"
    long = one_line_why("x" * 500)
    assert len(long) == 80 and long.endswith("…")
    assert one_line_why("") == ""


def test_help_everywhere(shell):
    assert "%jobs logs NAME [-f]" in jobs(shell, "help") and "%jobs watch" in jobs(shell, "--help")
    assert "--min-free SIZE" in launch_bg(shell, "--help") and "--min-free SIZE" in jobs(shell, "help launch_bg")
    assert "-f, --follow" in jobs(shell, "logs --help") and "--metric" in jobs(shell, "help watch")
    from gpumagic.jobs.api import STATES
    from gpumagic.magics.jobs import WATCH_STATES

    assert WATCH_STATES == ", ".join(STATES) and "--state S[,S]" in jobs(shell, "help watch")
    assert "%%launch_bg" in shell.find_cell_magic("launch_bg").__doc__
    assert "%jobs kill" in shell.find_line_magic("jobs").__doc__


@pytest.mark.parametrize(
    "magic, line, message",
    [
        ("jobs", "bogus", "%jobs has no subcommand 'bogus'"),
        ("jobs", "logs", "the following arguments are required: name"),
        ("jobs", "logs A --tail x", "--tail needs a number of lines"),
        ("jobs", "wait A --timeout soon", "no job named 'A'"),
        ("jobs", "watch --interval 0", "at least 100ms"),
        (
            "jobs",
            "watch A-* --state runing",
            "unknown job state 'runing'; use one of: queued, running, finished, failed",
        ),
        ("jobs", "help nothing", "no subcommand 'nothing'"),
        ("jobs", "logs 'A", "No closing quotation"),
        ("launch_bg", "--ddp two", "--ddp needs a number of ranks"),
        ("launch_bg", "--gpus 9", "asks for 9 GPUs; this machine has 4"),
        ("launch_bg", "--min-free 1000GB", "more than any GPU here has"),
        ("launch_bg", "--after nobody", "no job named 'nobody'"),
        ("launch_bg", "--name 'a b'", "job names are"),
        ("launch_bg", "--bogus", "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_a_one_line_usage_error_and_submits_nothing(shell, simulated, magic, line, message):
    with pytest.raises(UsageError, match=message) as caught:
        jobs(shell, line) if magic == "jobs" else launch_bg(shell, line)
    assert "\n" not in str(caught.value)
    assert gpumagic.list_jobs() == []


WORDS = st.one_of(
    st.sampled_from(
        [
            "A",
            "nobody",
            "-f",
            "--follow",
            "--tail",
            "3",
            "-1",
            "--timeout",
            "0s",
            "1ms",
            "--metric",
            "loss",
            "--interval",
            "--name",
            "--gpus",
            "0",
            "2",
            "99",
            "GPU:1",
            "GPU:*",
            "--min-free",
            "20GB",
            "--ddp",
            "--backend",
            "gloo",
            "'",
            "[",
            "-h",
            "9" * 400,
            "1000000000d",
        ]
    ),
    st.text(max_size=10),
)


@pytest.fixture(scope="module")
def blocker(shell, tmp_path_factory):
    """A job that never starts (its GPU has too little memory free); random valid submissions wait after it.
    Yields the environment the random submissions run in."""
    scenario = tmp_path_factory.mktemp("fuzz") / "full.json"
    scenario.write_text('{"gpus": [{"model": "A100-80GB", "used": "79GB"}, {"count": 3}]}')
    env = {
        "GPUMAGIC_SIMULATE": str(scenario),
        "GPUMAGIC_LEASE_DIR": str(tmp_path_factory.mktemp("fuzz-leases")),
        "GPUMAGIC_RUNS_DIR": str(tmp_path_factory.mktemp("fuzz-runs")),
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        gpumagic.jobs_with(gpus="GPU:0", min_free="5GB", name="blocker").submit(sum, [1])
    yield env
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        submitted = len(gpumagic.list_jobs()) - 1
        assert submitted >= 10, f"only {submitted} random %%launch_bg lines were valid: the strategy is too narrow"
        for each in gpumagic.list_jobs():
            if each.status in records.ACTIVE:
                each.kill(grace_s=1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from(["", "list", "logs", "kill", "wait", "result", "rm", "watch", "help"]),
    st.lists(WORDS, max_size=5),
)
def test_random_jobs_arguments_work_or_raise_usage_error(shell, blocker, subcommand, words):
    with in_environment(blocker):
        try:
            jobs(shell, " ".join([subcommand, *words]))
        except UsageError as err:
            assert str(err).strip()
        assert gpumagic.job("blocker").status == "queued"


@contextlib.contextmanager
def in_environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set for one example only: the test's teardown (no_job_left_running's kill of every active job) must
    not see the module's runs directory, or it kills the blocker the next test waits behind (it did, once pytest
    9 set ``monkeypatch`` up before the marker's fixtures, and so undid it after their teardown)."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield


OPTIONS = st.tuples(
    st.sampled_from(["--name", "--gpus", "--min-free", "--ddp", "--backend", "--timeout", "--bogus"]),
    st.one_of(
        st.sampled_from(["1", "0", "2", "4", "5", "-1", "x", "GPU:1", "GPU:*", "none", "20GB", "79GB", "gloo"]),
        st.sampled_from(["nccl", "1s", "0s", "v1", "v-2", "a b", "'", "", "99999999999", "1.5", "GPU:0,1"]),
        st.sampled_from(["9" * 400, "9" * 400 + "GB", "1000000000d", "8d", "| cat /etc/passwd", "x?", "1e999"]),
        st.text(max_size=8),
    ),
)


@settings(  # derandomized: the same 150 lines every run, so the count of valid ones below cannot dip by chance
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(OPTIONS, max_size=4), st.sampled_from(["x = 1", "offset + 1", "!ls", "def f(:", "%time 1"]))
def test_random_launch_bg_arguments_submit_or_raise_usage_error(shell, blocker, options, cell):
    import shlex

    shell.user_ns["offset"] = 1
    with in_environment(blocker):
        before = len(gpumagic.list_jobs())
        line = " ".join(f"{flag} {shlex.quote(value)}" for flag, value in options)
        try:
            submitted = launch_bg(shell, line + " --after blocker")  # a valid job waits behind the blocker
        except UsageError as err:
            assert str(err).strip() and "\n" not in str(err)
            assert len(gpumagic.list_jobs()) == before, "a refused cell submits nothing"
        else:
            assert str(submitted).startswith("Submitted job ")
            job = gpumagic.list_jobs()[-1]
            assert job.info["after"] == ["blocker"] and job.status == "queued", (job.status, job.reason)

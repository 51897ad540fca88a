"""The launcher's process-free parts: the plan's environment, GPU assignment, output routing, failures; and the
process set every launcher and the persistent group watch their processes with."""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import gpumagic
from gpumagic.devices.processes import is_running
from gpumagic.errors import InvalidArgument
from gpumagic.launch.failures import LaunchError
from gpumagic.launch.kernel_side.group import _outcome as group_outcome
from gpumagic.launch.kernel_side.group_members import Member
from gpumagic.launch.kernel_side.local import ended_outcome
from gpumagic.launch.kernel_side.output import RankOutput
from gpumagic.launch.plan import (
    MAX_TIMEOUT_S,
    LaunchPlan,
    Placement,
    assign_gpus,
    check_timeout,
    choose_backend,
    launch_environment,
    place_on,
    threads_per_rank,
)
from gpumagic.launch.process_set import Exit, ProcessSet
from gpumagic.launch.rank_side.starter import RankStarter
from gpumagic.run_dirs.launch_files import make_launch_directories
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.outcomes import ProcessEnd, RankOutcome, read_outcome, root_cause
from gpumagic.run_dirs.signing import write_sealed


def plan(**changes):
    values = dict(
        run_dir="/tmp/gpumagic-launch-x",
        nprocs=2,
        master_port=4242,
        backend="gloo",
        rank_gpus=(("GPU-a",), ("GPU-b",)),
        use_cuda=True,
        threads_per_rank=4,
        timeout_s=60,
        launcher_pid=1,
    )
    values.update(changes)
    return LaunchPlan(**values)


def test_the_environment_is_torchruns():
    env = plan().environment(1)
    assert {
        k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    } == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "4242",
    }
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-b" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["OMP_NUM_THREADS"] == "4" and env["GLOO_SOCKET_IFNAME"] == "lo"
    cpu_rank = plan(rank_gpus=((), ())).environment(0)
    assert cpu_rank["CUDA_VISIBLE_DEVICES"] == "" and "CUDA_DEVICE_ORDER" not in cpu_rank  # sees no GPU
    assert plan(node_rank=1, nnodes=2).environment(1)["RANK"] == "3"


def test_one_default_backend_nccl_on_real_gpus_gloo_on_the_cpu_or_simulated_ones():
    assert choose_backend(None, use_cuda=True) == "nccl" and choose_backend(None, use_cuda=False) == "gloo"
    assert choose_backend("gloo", use_cuda=True) == "gloo" and choose_backend("nccl", use_cuda=False) == "nccl"
    on = dict(per_rank=1, backend=None, process_group=True)
    assert place_on(["a", "b"], 2, simulated=False, **on) == Placement((("a",), ("b",)), True, "nccl")
    assert place_on(["a", "b"], 2, simulated=True, **on) == Placement((("a",), ("b",)), False, "gloo")
    assert place_on([], 3, simulated=False, **on) == Placement(((), (), ()), False, "gloo")
    assert place_on(["a", "b"], 2, 1, simulated=False, backend="gloo", process_group=False).backend is None


def test_ranks_start_and_their_backend_is_chosen_in_one_place_each():
    """A launch, a group and a job start their ranks through ``rank_start`` and take ``choose_backend``'s default:
    each was written three or four times, and a copy that drifts starts ranks that differ."""
    package = Path(gpumagic.__file__).parent
    written = {
        marker: sorted(str(path.relative_to(package)) for path in package.rglob("*.py") if marker in path.read_text())
        for marker in ('"nccl" if', "context.Process(", "import forkserver_context")
    }
    assert written == {
        '"nccl" if': ["launch/plan.py"],
        "context.Process(": ["launch/rank_side/starter.py"],
        "import forkserver_context": ["launch/rank_side/starter.py"],
    }


def test_ranks_get_their_share_of_the_gpus_or_all_of_them_as_under_mp_spawn():
    on = dict(simulated=False, backend=None, process_group=False)
    assert place_on(["a", "b", "c", "d"], 2, 2, **on).rank_gpus == (("a", "b"), ("c", "d"))
    assert place_on(["a", "b"], 3, 1, every_rank_sees_all=True, **on).rank_gpus == (("a", "b"),) * 3
    with pytest.raises(InvalidArgument, match="need 4 GPUs but 3 are available"):
        place_on(["a", "b", "c"], 2, 2, **on)


def test_a_spawn_rank_starts_with_its_gpus_and_a_forked_one_with_nothing_but_its_own_environment_later():
    """The rank sets its whole environment itself (``plan.environment``); a ``spawn`` rank also starts with its GPUs,
    the environment ``/proc`` shows (the simulated inventory counts it on them), taken from that same environment."""
    launch, group, job = (
        RankStarter(plan(), None, target=print, name="rank-{}"),
        RankStarter(plan(), None, target=print, name="ddp-rank-{}"),
        RankStarter(plan(), None, target=print, name="rank-{}", start_method="spawn"),
    )
    assert [starter.environment(1) for starter in (launch, group, job)] == [plan().environment(1)] * 3
    assert job.initial_environment(1) == {"CUDA_VISIBLE_DEVICES": "GPU-b", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert launch.initial_environment(1) == group.initial_environment(1) == {}
    cpu_job = RankStarter(plan(rank_gpus=((), ())), None, target=print, name="rank-{}", start_method="spawn")
    assert cpu_job.initial_environment(0) == {}  # it starts as the runner is; CUDA_VISIBLE_DEVICES="" comes next


def test_a_plans_extra_environment_reaches_every_rank(tmp_path):
    """A job capped at its reservation (``--memory-limit``): its ranks start from the launcher's environment and
    the cap."""
    capped = LaunchPlan.on_this_machine(
        tmp_path, ((), ()), backend="gloo", use_cuda=False, master_port=1, timeout_s=5, extra_env={"CAP": "7"}
    )
    assert [capped.environment(rank)["CAP"] for rank in (0, 1)] == ["7", "7"]
    plain = LaunchPlan.on_this_machine(tmp_path, ((),), backend="gloo", use_cuda=False, master_port=1, timeout_s=5)
    assert "CAP" not in plain.environment(0) and plain.base_env == launch_environment()


def test_gpu_assignment_and_threads():
    assert assign_gpus(["a", "b", "c", "d"], 2, 2) == (("a", "b"), ("c", "d"))
    assert assign_gpus([], 3, 1) == ((), (), ())
    with pytest.raises(InvalidArgument, match="need 4 GPUs but 3 are available"):
        assign_gpus(["a", "b", "c"], 2, 2)
    assert threads_per_rank(2, cpus=2) == 1 and threads_per_rank(4, cpus=2) == 1 and threads_per_rank(2, cpus=16) == 8


def test_the_process_group_timeout_is_at_most_a_week():
    assert check_timeout("30m") == 1800 and check_timeout("7d") == MAX_TIMEOUT_S == 7 * 86400
    for timeout in ("1000000000d", "8d", 604801, 10**400, float("inf")):
        with pytest.raises(InvalidArgument, match="too long for a process group timeout: at most 7d"):
            check_timeout(timeout)
    with pytest.raises(InvalidArgument, match="more than 0 seconds"):
        check_timeout("0s")


def test_output_lines_are_prefixed_and_partial_lines_wait():
    written = []
    out = RankOutput(written.append, "all", nprocs=12)
    out.feed(3, b"hel")
    out.feed(3, b"lo\nwor")
    out.feed(10, "é\n".encode()[:1])  # a character split across reads
    out.feed(10, "é\n".encode()[1:])
    out.feed(3, b"ld\n")
    assert written == ["[rank  3] hello\n", "[rank 10] é\n", "[rank  3] world\n"]


def test_progress_bars_show_their_latest_state():
    written = []
    out = RankOutput(written.append, "all", nprocs=2)
    out.feed(0, b"\r 10%|#   |\r 20%|##  |")
    out.feed(0, b"\r100%|####|\n")
    assert written == ["\r[rank 0]  20%|##  |", "\r[rank 0] 100%|####|\n"]


def test_a_bar_ended_by_a_newline_of_its_own_keeps_its_final_state():
    """tqdm's last redraw and its newline may arrive apart."""
    written, bars = [], Bars()
    out = RankOutput(written.append, "all", nprocs=1, bars=bars)
    out.feed(0, b"\r 88%|#  |\r100%|###| 40/40")
    out.feed(0, b"\nrank 0 finished\n")
    assert written == ["[rank 0] 100%|###| 40/40\n[rank 0] rank 0 finished\n"] and bars.lines == {}


def test_a_finished_line_never_joins_another_ranks_open_bar():
    written = []
    out = RankOutput(written.append, "all", nprocs=2)
    out.feed(0, b"\r 38/40 [00:01<00:00, 19.89it/s]")
    out.feed(1, b"rank 1 finished\n")
    assert "".join(written).split("\n")[-2] == "[rank 1] rank 1 finished"


class Bars:
    """Where RankOutput puts open bars in a notebook (``ProgressLines``' interface), recorded."""

    def __init__(self):
        self.lines, self.closed = {}, False

    def set(self, rank, line):
        self.lines[rank] = line

    def done(self, rank):
        self.lines.pop(rank, None)

    def close(self):
        self.closed = True


def test_in_a_notebook_open_bars_stay_out_of_the_stream():
    written, bars = [], Bars()
    out = RankOutput(written.append, "all", nprocs=2, bars=bars)
    out.feed(0, b"\r 10%|#   |\r 20%|##  |")
    out.feed(1, b"\r 50%|##  |")
    assert bars.lines == {0: "[rank 0]  20%|##  |", 1: "[rank 1]  50%|##  |"} and written == []
    out.feed(0, b"\r100%|####|\nrank 0 finished\n")
    assert written == ["[rank 0] 100%|####|\n[rank 0] rank 0 finished\n"] and list(bars.lines) == [1]
    out.flush()
    assert bars.closed and not any("\r" in text for text in written)


def test_a_crlf_line_keeps_its_text():
    written = []
    RankOutput(written.append, "all", nprocs=1).feed(0, b"hello\r\n")
    assert written == ["[rank 0] hello\n"]


def test_output_modes():
    written = []
    rank0 = RankOutput(written.append, "rank0", nprocs=2)
    rank0.feed(1, b"no\n")
    rank0.feed(0, b"yes\n")
    RankOutput(written.append, "none", nprocs=2).feed(0, b"never\n")
    assert written == ["[rank 0] yes\n"]


def test_the_root_cause_is_the_earliest_own_failure():
    outcomes = [
        RankOutcome(0, 10, -15, stopped_by_launcher=True, timestamp=5.0),
        RankOutcome(1, 11, 1, "user code", "RuntimeError", "gloo connection reset", "tb1", timestamp=3.0),
        RankOutcome(2, 12, 1, "user code", "ValueError", "bad batch", "tb2", timestamp=2.0),
        RankOutcome(3, 13, 0),
    ]
    cause = root_cause(outcomes)
    assert cause.rank == 2
    report = str(LaunchError(outcomes, cause))
    assert report.startswith("rank 2 failed: raised ValueError: bad batch (in user code)")
    assert "rank 0: stopped by gpumagic after the failure (SIGTERM)" in report and "rank 3: finished" in report
    assert "rank 1: raised RuntimeError: gloo connection reset (in user code), after rank 2 failed" in report
    assert root_cause([RankOutcome(0, 1, 0)]) is None


GROUP_RANK = """
import sys
from gpumagic.launch.rank_side.group_rank import GroupRank
from gpumagic.launch.rank_side.runtime import RankSetup
from gpumagic.run_dirs.layout import RunFiles

rank = GroupRank(RankSetup(RunFiles(sys.argv[1]), rank=1, local_rank=1, world_size=2, backend="gloo"), None, None)
rank.set_up()
rank._open_namespace()
"""


def run_group_rank(tmp_path, then: str) -> subprocess.CompletedProcess:
    """A persistent group's rank, set up as the kernel's rank server starts one (without its process group), then
    ``then`` in its process."""
    files = RunFiles(tmp_path)
    make_launch_directories(files)
    script = tmp_path / "group_rank.py"
    script.write_text(GROUP_RANK + textwrap.dedent(then))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)


def test_a_group_rank_that_crashes_leaves_its_python_stack_as_a_launchs_rank_does(tmp_path):
    """One set-up for every rank: a fatal signal in a persistent group's rank leaves the Python stack where it
    died, read as its outcome the way a launch's is."""
    ended = run_group_rank(
        tmp_path,
        """
        def crash_in_the_users_code():
            import ctypes
            ctypes.string_at(0)

        crash_in_the_users_code()
        """,
    )
    assert ended.returncode == -11, ended.stderr
    outcome = read_outcome(RunFiles(tmp_path), 1, 0, ProcessEnd(None, ended.returncode, time.time()))
    assert outcome.signal_name == "SIGSEGV" and outcome.phase == "process"
    assert "in crash_in_the_users_code" in outcome.traceback, outcome.traceback
    assert "gpumagic" not in outcome.traceback.split("crash_in_the_users_code")[-1]  # nothing under the user's code


def test_a_local_rank_that_left_no_word_and_no_exit_code_failed_unless_its_launch_stopped_it(tmp_path):
    """A local rank with no result, error report or fatal-signal stack, whose exit code could not be read, failed:
    the launch (or the job) must not read as finished with a None value. One the launch stopped was stopped."""
    files = RunFiles(tmp_path)
    make_launch_directories(files)
    unread = ended_outcome(files, Exit(0, 4242, None, time.time(), stopped=False))
    assert not unread.ok and not unread.stopped_by_launcher and unread.pid == 4242
    assert root_cause([unread]) == unread
    assert "its exit code could not be read (pid 4242)" in unread.describe(), unread.describe()
    assert unread.exitcode is None and unread.signal_name is None  # none guessed: a job records no signal
    stopped = ended_outcome(files, Exit(0, 4242, None, time.time(), stopped=True))
    assert stopped.stopped_by_launcher and root_cause([stopped]) is None and stopped.signal_name is None
    assert stopped.describe() == "rank 0: stopped by gpumagic after the failure"
    write_sealed(files.rank_result(0), b"\x80\x04N.")  # its value (None, pickled) came back: it finished
    assert ended_outcome(files, Exit(0, 4242, None, time.time(), stopped=False)).ok


def test_a_ddp_rank_dead_before_its_exit_code_was_collected_is_read_as_a_launchs_rank(tmp_path):
    """A ``%ddp`` rank that died without a reply, its exit code not collected yet: its own report if it left one,
    else lost, as ``read_outcome`` reads a launch's rank (it read "exited with code None without an error report",
    its report unread)."""
    files = RunFiles(tmp_path)
    make_launch_directories(files)
    dead = Member(1, None, 4243, None, None, end=Exit(1, 4243, None, time.time(), stopped=False))
    lost = group_outcome(dead, None, files)
    assert lost.describe() == (
        "rank 1: lost: it ended without a result or an error report, and its exit code could not be read (pid 4243)"
    )
    assert lost.phase == "process" and lost.exitcode is None and root_cause([lost]) == lost
    assert dead.death() == "ended; its exit code could not be read (pid 4243)"  # a note's words (it read "code None")
    report = {"pid": 4243, "exitcode": 1, "phase": "user code", "type": "MemoryError", "message": "", "traceback": ""}
    files.rank_error(1, 0).write_text(json.dumps(report))
    assert group_outcome(dead, None, files).describe() == "rank 1: raised MemoryError:  (in user code)"


def test_a_ranks_failure_report_starts_at_the_users_own_code(tmp_path):
    """The traceback a rank reports starts at the cell: none of gpumagic's frames (the runtime's, shipping's)."""
    ran = run_group_rank(
        tmp_path,
        """
        import json, cloudpickle
        from gpumagic.launch.messages import Exec
        from gpumagic.launch.shipping import CellPayload

        cell = CellPayload("x = 1\\nraise ValueError('bad batch')", "<cell In[1]>")
        reply = rank._handle(Exec(1, "In[1]", cloudpickle.dumps(cell)))
        print(json.dumps([reply.KIND, reply.ident, reply.report]))
        """,
    )
    kind, _, report = json.loads(ran.stdout.splitlines()[-1])
    assert (kind, report["type"], report["message"]) == ("failed", "ValueError", "bad batch"), ran.stderr
    assert report["traceback"].splitlines()[1] == '  File "<cell In[1]>", line 2, in <module>', report
    assert "gpumagic" not in report["traceback"]


def test_only_names_the_cell_reads_before_binding_them_are_shipped():
    from gpumagic.launch.shipping import ship_cell

    namespace = {
        "Net": dict,
        "STEPS": 3,
        "model": __import__("threading").Lock(),
        "np": __import__("math"),
        "total": 1,
        "unused": object(),
        "z": __import__("threading").Lock(),
    }
    source = "import os\nmodel = Net()\nfor step in range(STEPS):\n    total += step\nys = [z for z in range(3)]\nnp.pi"
    payload = ship_cell(source, namespace, "<cell>")
    assert sorted(payload.names) == ["Net", "STEPS", "total"]  # not the cell's own model/z (both unpicklable)
    assert payload.modules == {"np": "math"}


def test_names_that_share_an_object_still_share_it_on_the_ranks():
    import cloudpickle

    from gpumagic.launch.shipping import pack, ship_cell

    weights = [1.0, 2.0]
    namespace = {"weights": weights, "model": {"weights": weights}}
    payload = cloudpickle.loads(pack(ship_cell("model, weights", namespace, "<cell>")))
    assert payload.names["model"]["weights"] is payload.names["weights"]  # one pickle for all names


# --- the process set ---------------------------------------------------------------------------------------


def ended(processes: ProcessSet, within: float = 10.0) -> list:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        exits, _ = processes.poll(0.1)
        if exits:
            return exits
    raise AssertionError("no process of the set ended")


def test_a_process_put_in_place_of_one_that_ended_is_watched_anew():
    processes = ProcessSet([subprocess.Popen(["sh", "-c", "exit 3"])], groups=True)
    try:
        assert [e.exitcode for e in ended(processes)] == [3] and processes.running == []
        started = time.time()
        fresh = subprocess.Popen(["sh", "-c", "sleep 0.3; exit 4"], process_group=0)
        processes.replace(0, fresh)  # a persistent group's fresh rank in a dead one's place
        assert processes.running == [0] and processes.exits == {} and processes.pids == [fresh.pid]
        (exit,) = ended(processes)
        assert (exit.index, exit.pid, exit.exitcode, exit.stopped) == (0, fresh.pid, 4, False)
        assert exit.time >= started + 0.25  # timed when it ended
        quick = subprocess.Popen(["true"])
        processes.replace(0, quick)
        while is_running(quick.pid):  # a zombie now: /proc says it ended
            time.sleep(0.01)
        assert [(e.pid, e.exitcode) for e in processes.gone()] == [(quick.pid, 0)]
    finally:
        processes.close()


def test_killing_a_stuck_process_ends_what_it_started_and_only_that():
    stuck = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], process_group=0)
    other = subprocess.Popen(["sleep", "60"], process_group=0)
    processes = ProcessSet([stuck, other], groups=True)
    try:
        deadline = time.monotonic() + 5
        while not psutil.Process(stuck.pid).children() and time.monotonic() < deadline:
            time.sleep(0.01)
        (child,) = psutil.Process(stuck.pid).children()
        exit = processes.kill(0)
        assert (exit.exitcode, exit.stopped) == (-9, True) and processes.running == [1]
        child.wait(5)  # SIGKILLed with its process group (its parent, the set's process, no longer waits for it)
        assert is_running(other.pid)
        assert processes.stop(grace_s=2.0) == "SIGTERM" and processes.exits[1].exitcode == -15
    finally:
        processes.close()

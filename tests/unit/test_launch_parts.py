"""The launcher's process-free parts: the plan's environment, GPU assignment, output routing, failures."""

import pytest

from gpumagic.errors import InvalidArgument
from gpumagic.launch.failures import LaunchError, RankOutcome, root_cause
from gpumagic.launch.kernel_side.output import RankOutput
from gpumagic.launch.plan import MAX_TIMEOUT_S, LaunchPlan, assign_gpus, check_timeout, threads_per_rank


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

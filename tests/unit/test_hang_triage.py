"""Hang triage outside a kernel: the option everywhere it is taken (one message each), a launch whose ranks are
out of step (a file's frames named by file and line), and a background DDP job writing its report to its log.
Real gloo ranks on the CPU (``gpus="none"``/``gpus=0``)."""

import json
import re
import time

import pytest

import gpumagic
from gpumagic.errors import InvalidArgument
from gpumagic.jobs.api import JobRequest
from gpumagic.launch.hang_reports import compose, find_mismatches, frame_of
from gpumagic.launch.kernel_side.ddp import launch_ddp
from gpumagic.launch.options import LaunchOptions


def test_hang_after_is_10s_by_default_and_checked_alike_everywhere():
    assert LaunchOptions(2, gpus="none").hang_after_s == 10.0
    assert LaunchOptions.for_group(2).hang_after_s == 10.0 and JobRequest.of(ddp=2).launch.hang_after_s == 10.0
    assert LaunchOptions(hang_after=0).hang_after_s == 0.0 and LaunchOptions(hang_after="1m").hang_after_s == 60.0
    for make in (
        lambda: LaunchOptions(hang_after="soon"),
        lambda: LaunchOptions.for_group(2, hang_after="soon"),
        lambda: JobRequest.of(ddp=2, hang_after="soon"),
        lambda: launch_ddp(len, 2, gpus="none", hang_after="soon"),
    ):
        with pytest.raises(InvalidArgument, match=r"^'soon' is not a duration: write it like 30s"):
            make()
    with pytest.raises(InvalidArgument, match=r"too long for --hang-after: at most 7d"):
        LaunchOptions(hang_after="8d")


def test_pdb_is_refused_where_no_prompt_can_be_read():
    with pytest.raises(InvalidArgument, match="--pdb keeps a failed rank of this machine"):
        LaunchOptions(2, pdb=True, nnodes=2, rdzv_endpoint="127.0.0.1:0")
    with pytest.raises(InvalidArgument, match="pdb is True or False, got 'yes'"):
        LaunchOptions(2, pdb="yes")
    with pytest.raises(InvalidArgument, match="pdb=True needs join=True"):
        gpumagic.spawn(print, nprocs=2, join=False, gpus="none", pdb=True)


def test_frames_are_named_as_the_user_knows_them():
    assert frame_of("<%%ddp cell In[12]>", 3, "<module>", "  x = 1 ") == {
        "where": "cell In[12] line 3",
        "code": "x = 1",
    }
    assert frame_of("/home/u/train.py", 40, "step", "loss.backward()")["where"] == "train.py:40 in step"
    calls = {
        0: {"call": {"op": "all_reduce", "seq": 2, "tensor": "float32[4]"}},
        1: {"call": {"op": "barrier", "seq": 1}},
    }
    assert find_mismatches(calls) == [
        "the ranks are at different collectives: rank 0 all_reduce #2 of float32[4], rank 1 barrier #1"
    ]


def one_more_all_reduce():
    """Rank 1 makes a second all_reduce before rank 0 does: rank 1 waits, rank 0 sleeps elsewhere."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        dist.all_reduce(torch.ones(2))
    else:
        time.sleep(4)
        dist.all_reduce(torch.ones(2))
    return rank


@pytest.mark.slow
def test_a_launch_reports_which_rank_waits_and_where_the_other_is():
    shown = []
    assert launch_ddp(one_more_all_reduce, 2, gpus="none", hang_after="1s", write=shown.append) == {0: 0, 1: 1}
    text = "".join(shown)
    assert "rank 1 waited" in text and "in all_reduce #2 of float32[2] (--hang-after 1s)" in text, text
    assert "rank 0: not in a collective (it made 1 so far, the last all_reduce #1)" in text
    assert "test_hang_triage.py:" in text and "in one_more_all_reduce: time.sleep(4)" in text


def stuck_in_a_job():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1:
        time.sleep(4)
    dist.all_reduce(torch.ones(3))
    return rank


@pytest.mark.slow
@pytest.mark.usefixtures("no_job_left_running")
def test_a_ddp_jobs_log_has_the_report_and_its_record_keeps_it():
    job = gpumagic.jobs_with(gpus=0, ddp=2, hang_after="1s", name="stuck").submit(stuck_in_a_job)
    assert job.result(timeout=120) == {0: 0, 1: 1}
    log = job.logs()
    assert "rank 0 waited" in log and "rank 1: not in a collective" in log and "time.sleep(4)" in log, log
    record = json.loads((job.path / "run.json").read_text())
    assert record["hang"]["waiting"] == [0] and "all_reduce #1" in record["hang"]["ranks"]["0"]


@pytest.mark.parametrize(
    ("magic", "line", "cell", "says"),
    [
        ("launch_ddp", "-n 2 --gpus none --hang-after soon", "1", "'soon' is not a duration: write it like 30s"),
        ("launch_ddp", "-n 2 --gpus none --hang-after=-1s", "1", "'-1s' is not a duration"),
        ("launch_ddp", "-n 2 --gpus none --pdb --no-wait", "1", "--pdb reads the debugger's lines while the cell"),
        ("launch_ddp", "-n 1 --nnodes 2 --rdzv-endpoint 127.0.0.1:0 --pdb", "1", "--pdb keeps a failed rank"),
        ("launch_bg", "--ddp 2 --gpus 0 --hang-after soon", "1", "%%launch_bg: 'soon' is not a duration"),
        ("ddp", "start -n 2 --gpus none --hang-after 9d", None, "%ddp start: '9d' is too long for --hang-after"),
        ("ddp", "debug", None, "the following arguments are required: RANK"),
        ("ddp", "debug 1", None, "no group is running; %ddp start"),
    ],
)
def test_bad_hang_and_debug_input_is_a_one_line_usage_error(shell, magic, line, cell, says):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match=re.escape(says)):
        if cell is None:
            shell.run_line_magic(magic, line)
        else:
            shell.run_cell_magic(magic, line, cell)


def test_many_ranks_in_one_state_make_one_entry():
    now = time.time()

    def waits(rank):
        call = {"op": "all_reduce", "seq": 5, "tensor": "float32[4]", "group": "default", "since": now - 10 - rank / 10}
        return {"host": "h", "call": call, "stack": [{"where": "cell In[3] line 2", "code": "dist.all_reduce(t)"}]}

    answers = {rank: waits(rank) for rank in range(64) if rank != 5}
    answers[5] = {"host": "h", "call": None, "count": 4, "stack": [{"where": "cell In[3] line 4", "code": "f()"}]}
    report = compose({0: {"waiting": [{"call": answers[0]["call"]}]}}, answers, 64, 10.0)
    lines = report["text"].splitlines()
    assert lines[1].strip().startswith("ranks 0-4, 6-63: waits in all_reduce #5 of float32[4] for 1")
    assert lines[3].strip() == "rank 5: not in a collective (it made 4 so far)" and len(lines) == 6


def test_ddp_help_is_there_where_the_error_points_and_lists_debug(shell):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match=r"see %ddp help"):
        shell.run_line_magic("ddp", "frobnicate")
    overview = str(shell.run_line_magic("ddp", "help"))
    assert "%ddp debug R" in overview and "[--hang-after D]" in overview

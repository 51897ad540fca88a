"""Hang triage and debugging one rank, in a real kernel on CPU ranks with gloo (no GPU): a collective waiting
past ``--hang-after`` is reported by itself with every rank's line; mismatches are named; ``%ddp debug R``,
``breakpoint()`` in a ``%%ddp`` cell and ``%%launch_ddp --pdb`` give pdb in the cell; the group keeps working."""

import json
import re
import time

import pytest
from conftest import cpu_kernel

pytestmark = pytest.mark.kernel

THRESHOLD_S = 3.0
ALL_REDUCE_WORKS = "%%ddp -o after\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with cpu_kernel(tmp_path_factory, "%load_ext gpumagic\nimport gpumagic, os, json") as k:
        yield k


@pytest.fixture
def group(kernel):
    """A group of 2 CPU ranks reporting hangs after 3 s; stopped after the test."""
    kernel.ok(f"%ddp start -n 2 --no-dashboard --output all --hang-after {THRESHOLD_S:g}s")
    kernel.ok("%%ddp\nimport time, torch")
    yield kernel
    kernel.ok("%ddp stop")


def group_works(kernel) -> None:
    """The group runs a collective on both ranks after what the test did."""
    kernel.ok(ALL_REDUCE_WORKS)
    assert kernel.ok("print(after)").stdout.strip() == "{0: 2.0, 1: 2.0}"


def report_delay(result, marker: str) -> float:
    """Seconds from the stream that carried ``marker`` (printed as a rank entered its collective) to the one
    that carried the hang report."""
    entered = next(t for t, text in result.times if marker in text)
    reported = next(t for t, text in result.times if "waited" in text and "where every rank is" in text)
    return reported - entered


def test_a_rank_waiting_for_a_sleeping_peer_is_reported_with_both_ranks_lines(group):
    cell = """%%ddp
t = torch.ones(1000)
if rank == 0:
    print("entering", flush=True)
    dist.all_reduce(t)
else:
    time.sleep(8)
    dist.all_reduce(t)
"""
    result = group.ok(cell)
    delay = report_delay(result, "entering")
    print(f"report {delay:.2f}s after rank 0 entered all_reduce (threshold {THRESHOLD_S}s)")
    assert delay <= THRESHOLD_S + 2
    text = result.stdout
    assert re.search(r"rank 0: waits in all_reduce #1 of float32\[1000\] for [\d.]+s \(gloo\)", text), text
    assert "cell In[" in text and "line 4: dist.all_reduce(t)" in text
    assert "rank 1: not in a collective (it made 0 so far)" in text and "line 6: time.sleep(8)" in text
    assert text.count("where every rank is") == 1  # one report, not one per look
    status = group.ok("%ddp status").all_text
    assert "the last hang report" in status and "time.sleep(8)" in status
    record = group.ok(
        "print(json.dumps(json.load(open(os.path.join(gpumagic.ddp_group().run_dir, 'run.json')))['hang']['ranks']))"
    ).stdout
    assert "time.sleep(8)" in json.loads(record)["1"]
    group_works(group)


def test_a_cells_own_hang_after_and_zero_turn_it_off(group):
    quiet = group.ok("%%ddp --hang-after 0\nif rank == 1:\n    time.sleep(5)\nt = torch.ones(2)\ndist.all_reduce(t)")
    assert "where every rank is" not in quiet.stdout
    sooner = group.ok(
        "%%ddp --hang-after 1s\nif rank == 1:\n    time.sleep(4)\nprint('entering', flush=True)\n"
        "t = torch.ones(2)\ndist.all_reduce(t)"
    )
    assert "(--hang-after 1s)" in sooner.stdout and report_delay(sooner, "entering") <= 1 + 2
    bad = group.run("%%ddp --hang-after soon\n1")
    assert bad.error is not None and "'soon' is not a duration" in bad.error[1] + bad.stderr
    group_works(group)


def test_ranks_in_different_ops_are_named_as_a_mismatch(group):
    cell = """%%ddp
t = torch.ones(3)
if rank == 0:
    dist.all_reduce(t)
else:
    dist.broadcast(t, 0)
"""
    group.client.execute(cell)
    deadline = time.monotonic() + THRESHOLD_S + 10
    shown = ""
    while "mismatch" not in shown and time.monotonic() < deadline:
        try:
            message = group.client.get_iopub_msg(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty: nothing yet
            continue
        if message["msg_type"] == "stream":
            shown += message["content"]["text"]
    assert (
        "mismatch: different ops at the same collective: rank 0 all_reduce #1 of float32[3], "
        "rank 1 broadcast #1 of float32[3]" in shown
    ), shown
    reply, _ = group.interrupt()
    assert reply["status"] == "error"
    group_works(group)


def test_mismatched_sizes_are_named_when_gloo_ends_a_rank(group):
    failed = group.run("%%ddp\ndist.all_reduce(torch.ones(10 if rank == 0 else 1000))")
    assert failed.error is not None
    text = failed.all_text + failed.stderr + failed.error[1]
    assert (
        "collective mismatch: different sizes in the same collective: rank 0 all_reduce #1 of float32[10], "
        "rank 1 all_reduce #1 of float32[1000]" in text
    ), text
    group_works(group)


def test_ddp_debug_opens_pdb_on_the_failing_rank_and_prints_a_local(group):
    failed = group.run("%%ddp\ndef scaled(x):\n    secret = x * 7\n    return secret / 0\nif rank == 1:\n    scaled(6)")
    assert failed.error is not None
    wrong = group.run("%ddp debug 0")
    assert "rank 0 did not fail in the last cell" in wrong.stderr and "%ddp debug 1" in wrong.stderr
    session = group.run("%ddp debug 1", answers=["p secret", "up", "p rank", "q"])
    assert session.status == "ok", session.stderr
    assert session.prompts == ["(Pdb) "] * 4
    lines = session.stdout.splitlines()
    assert "-> return secret / 0" in lines and "42" in lines and "-> scaled(6)" in lines and "1" in lines
    again = group.run("%ddp debug 1", answers=["p secret + 1", "q"])  # until the next cell, as often as wanted
    assert "43" in again.stdout.splitlines()
    group.ok("%ddp free")  # lets the failed cell's frames go
    assert "rank 1 has no failed cell to debug" in group.run("%ddp debug 1").stderr
    group_works(group)


def test_a_ddp_backward_waiting_for_a_peer_is_reported_from_torchs_flight_recorder(group):
    group.ok("%%ddp\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(torch.nn.Linear(8, 2))")
    cell = """%%ddp
if rank == 1:
    time.sleep(7)
print("entering", flush=True)
model(torch.randn(4, 8)).sum().backward()
"""
    result = group.ok(cell)
    text = result.stdout
    # DDP's own bucket all-reduce is made in C++: only torch's recorder sees it
    assert re.search(r"rank 0: has gloo all_reduce #\d+ of Float\[18\] in flight for [\d.]+s", text), text
    assert "line 4: model(torch.randn(4, 8)).sum().backward()" in text and "line 2: time.sleep(7)" in text
    group_works(group)


def test_ddp_debug_refuses_clearly(kernel, group):
    assert "rank 7 is not in this group: its ranks are 0..1" in group.run("%ddp debug 7").stderr
    group.ok("%%ddp\n1")
    assert (
        "rank 1 has no failed cell to debug (none failed since the last cell or %ddp free)"
        in group.run("%ddp debug 1").stderr
    )
    assert "invalid int value: 'one'" in group.run("%ddp debug one").stderr


def test_ddp_debug_without_a_group(kernel):
    kernel.ok("%ddp stop")
    assert "no group is running" in kernel.run("%ddp debug 1").stderr


def test_breakpoint_on_one_rank_gives_pdb_in_the_cell(group):
    cell = "%%ddp -o out\nx = 3 + rank\nif rank == 1:\n    breakpoint()\n"
    cell += "t = torch.ones(1) * x\ndist.all_reduce(t)\nt.item()"
    result = group.run(cell, answers=["p x", "x = 41", "c"])
    assert result.status == "ok", result.stderr
    assert "4" in result.stdout.splitlines() and len(result.prompts) == 3
    assert group.ok("print(out)").stdout.strip() == "{0: 44.0, 1: 44.0}"  # rank 1 went on with x = 41
    group_works(group)


def test_launch_ddp_reports_a_hang_at_the_default_threshold(kernel):
    cell = """%%launch_ddp -n 2 --gpus none --no-dashboard
import time, torch
t = torch.ones(4, 8)
if rank == 0:
    print("entering", flush=True)
else:
    time.sleep(13)
dist.all_reduce(t)
"""
    result = kernel.ok(cell, timeout=90)
    delay = report_delay(result, "entering")
    print(f"%%launch_ddp: report {delay:.2f}s after rank 0 entered all_reduce (default threshold 10s)")
    assert 10 <= delay <= 12
    assert "(--hang-after 10s)" in result.stdout
    assert re.search(r"rank 0: waits in all_reduce #1 of float32\[4, 8\]", result.stdout)
    assert "line 7: dist.all_reduce(t)" in result.stdout and "line 6: time.sleep(13)" in result.stdout


def test_launch_ddp_pdb_keeps_the_failed_rank_for_a_post_mortem(kernel):
    cell = """%%launch_ddp -n 2 --gpus none --no-dashboard --pdb
import torch
def g(v):
    local_value = v + 100
    return 1 / 0
if rank == 1:
    g(5)
dist.all_reduce(torch.ones(1))
"""
    result = kernel.run(cell, answers=["p local_value", "q"], timeout=90)
    assert result.error is not None and result.error[0] == "LaunchError"
    assert "105" in result.stdout.splitlines() and result.prompts == ["(Pdb) ", "(Pdb) "]
    assert "rank 1 failed; --pdb: its debugger is here" in result.stdout
    refused = kernel.run("%%launch_ddp -n 2 --gpus none --pdb --no-wait\n1")
    assert "--pdb reads the debugger's lines while the cell waits; leave out --no-wait" in refused.stderr
    after = kernel.ok(
        "%%launch_ddp -n 2 --gpus none --no-dashboard -o r\nimport torch\nt = torch.ones(1)\n"
        "dist.all_reduce(t)\nt.item()"
    )
    assert after.status == "ok" and kernel.ok("print(r)").stdout.strip() == "{0: 2.0, 1: 2.0}"


def test_the_stop_button_at_a_ranks_pdb_prompt_interrupts_the_cell_and_the_group_goes_on(group):
    group.client.execute("%%ddp\nif rank == 1:\n    breakpoint()\ndist.barrier()", allow_stdin=True)
    prompt = group.client.get_stdin_msg(timeout=30)
    assert prompt["content"]["prompt"] == "(Pdb) "
    reply, took = group.interrupt()
    print(f"interrupted at rank 1's pdb prompt: the cell ended {took:.2f}s later")
    assert reply["status"] == "error" and reply["ename"] == "CellInterrupted", reply
    group_works(group)

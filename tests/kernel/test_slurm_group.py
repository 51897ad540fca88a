"""A ``%ddp`` group that lives across cells on the nodes of a real Slurm allocation (#41; the two-node cluster of
``tests/slurm_cluster.py``): one host per node started by srun forks that node's ranks and relays them to the
kernel, so every ``%ddp`` feature works across nodes as on one machine."""

from __future__ import annotations

import ast
import os
import signal
import time

import psutil
import pytest

from tests.kernel.test_slurm_cluster import (
    ALL_REDUCE,
    FOREVER,
    MULTI_NODE_MISTAKES,
    on_steps,
    refused_inside,
    run_on_first_node,
    send_until_printed,
    wait_for,
)

pytestmark = pytest.mark.kernel

SETUP = "%load_ext gpumagic\nimport time\nfrom gpumagic.launch.kernel_side.session import SESSION"


def rank_pids(kernel) -> list[int]:
    return ast.literal_eval(kernel.ok("print(SESSION.group.pids)").stdout.strip())


def test_a_group_across_the_allocation_keeps_its_state_and_replaces_a_rank_on_its_own_node(allocation, start_kernel):
    kernel = start_kernel(**allocation)
    kernel.ok(SETUP)
    began = time.monotonic()
    started = kernel.ok("%ddp start -n 1 --nnodes 2 --gpus none --no-dashboard", timeout=180)
    print(f"%ddp start -n 1 --nnodes 2: {time.monotonic() - began:.1f}s")
    assert "2 ranks ready (gloo, CPU; 2 nodes: gmn1, gmn2, 1 ranks each)" in started.stdout, started.stdout
    # output says rank and node; -o gathers every rank's last expression
    cell = kernel.ok("%%ddp -o out\n" + ALL_REDUCE)
    assert "[rank 0 @gmn1] hello from gmn1" in cell.stdout and "[rank 1 @gmn2] hello from gmn2" in cell.stdout
    assert kernel.ok("print(out)").stdout.strip() == "{0: ('gmn1', 3.0), 1: ('gmn2', 3.0)}"
    # the ranks keep their names across cells; the notebook's names travel to them
    kernel.ok("%%ddp\nx = rank * 10")
    kernel.ok("scale = 3")
    kernel.ok("%%ddp -o got\n(x + 1, scale * (rank + 1))")
    assert kernel.ok("print(got)").stdout.strip() == "{0: (1, 3), 1: (11, 6)}"
    status = kernel.ok("%ddp status").all_text
    assert "node" in status and "gmn1" in status and "gmn2" in status, status
    # a trivial cell's round trip through both hosts
    timing = kernel.ok(
        "import statistics, time\ntimes = []\nfor _ in range(30):\n    t = time.perf_counter()\n"
        "    SESSION.group.exec('1')\n    times.append(time.perf_counter() - t)\n"
        "print(statistics.median(times) * 1000)"
    )
    print(f"a trivial cell on 2 nodes: {float(timing.stdout):.2f} ms median of 30 (RankGroup.exec)")
    # a rank killed on the node that is not the kernel's is replaced there at the next cell
    pids = rank_pids(kernel)
    os.kill(pids[1], signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(pids[1]), 10, "rank 1 ended")
    began = time.monotonic()
    cell = kernel.ok("%%ddp -o where\nimport socket\n(socket.gethostname(), scale)", timeout=120)
    print(f"a rank killed on gmn2: the next cell, its replacement included, took {time.monotonic() - began:.1f}s")
    assert "rank 1" in cell.stdout and "replaced" in cell.stdout, cell.stdout
    assert kernel.ok("print(where)").stdout.strip() == "{0: ('gmn1', 3), 1: ('gmn2', 3)}"
    new_pids = rank_pids(kernel)
    assert new_pids[0] == pids[0] and new_pids[1] != pids[1]
    # the kernel killed: nothing is left on any node
    os.kill(kernel.pid, signal.SIGKILL)
    began = time.monotonic()
    wait_for(lambda: not any(psutil.pid_exists(p) for p in new_pids), 10, "every node's rank ended with the kernel")
    print(f"a killed kernel: both nodes' ranks gone {time.monotonic() - began:.1f}s later")
    wait_for(lambda: "gpumagic-host" not in on_steps(), 10, "srun's step ended")


def test_every_ddp_feature_reaches_the_other_node(allocation, start_kernel):
    """The stop button, check and sync, a hang report, breakpoint() and %ddp debug on the rank of the node that is
    not the kernel's, and %ddp free, through its host."""
    kernel = start_kernel(**allocation)
    kernel.ok(SETUP)
    kernel.ok("%ddp start -n 1 --nnodes 2 --gpus none --output all --no-dashboard", timeout=180)
    # the stop button: both nodes stop at one point, the replicas still alike, the group goes on
    forever = "%%ddp\n" + FOREVER.replace("'working'", "'working on', rank")
    send_until_printed(kernel, forever, "working on 0", "working on 1", timeout=60)
    content, took = kernel.interrupt()
    assert content["status"] == "error" and content["ename"] == "CellInterrupted", content
    print(f"the stop button across 2 nodes: the cell returned {took:.2f}s after the interrupt")
    assert "alike" in kernel.ok("%ddp check").all_text
    # a replica that differs on the other node is named, then made like rank 0's
    kernel.ok("%%ddp\nimport gpumagic, torch\ngpumagic.keep(w=torch.ones(3) * (1 + (rank == 1)))")
    differs = kernel.ok("%ddp check").all_text
    assert "w" in differs and "rank 1" in differs, differs
    kernel.ok("%ddp sync")
    assert kernel.ok("%%ddp -o ws\nw.tolist()").stdout == "" and kernel.ok("print(ws)").stdout.strip() == (
        "{0: [1.0, 1.0, 1.0], 1: [1.0, 1.0, 1.0]}"
    )
    # a hang report names each rank's node and what it waits in
    hang = kernel.ok(
        "%%ddp --hang-after 2s\nimport time\nif rank == 1:\n    time.sleep(6)\ndist.all_reduce(torch.ones(5))",
        timeout=60,
    )
    assert "(on gmn1) waits in all_reduce" in hang.stdout and "(on gmn2)" in hang.stdout, hang.stdout
    assert "time.sleep(6)" in hang.stdout, hang.stdout
    # breakpoint() on the other node's rank: its pdb in the cell, answered from the notebook
    stopped = kernel.run(
        "%%ddp -o out\nx = 3 + rank\nif rank == 1:\n    breakpoint()\nt = torch.ones(1) * x\ndist.all_reduce(t)\n"
        "t.item()",
        answers=["p x", "x = 41", "c"],
    )
    assert stopped.status == "ok", stopped.stderr
    assert "4" in stopped.stdout.splitlines() and len(stopped.prompts) == 3, stopped.stdout
    assert kernel.ok("print(out)").stdout.strip() == "{0: 44.0, 1: 44.0}"
    # %ddp debug on the rank that failed there
    failed = kernel.run(
        "%%ddp\ndef scaled(v):\n    secret = v * 7\n    return secret / 0\nif rank == 1:\n    scaled(6)"
    )
    assert failed.error is not None and failed.error[1].startswith("rank 1 (gmn2) failed: raised ZeroDivisionError"), (
        failed
    )
    session = kernel.run("%ddp debug 1", answers=["p secret", "q"])
    assert session.status == "ok" and "42" in session.stdout.splitlines(), session.stdout
    freed = kernel.ok("%ddp free").all_text
    assert "rank 1" in freed, freed
    assert kernel.ok("%%ddp -o last\nrank").stdout == "" and kernel.ok("print(last)").stdout.strip() == "{0: 0, 1: 1}"


def host_on(node: str) -> psutil.Process:
    """The group's host process srun started on ``node`` (the nodes' processes are this machine's)."""
    for process in psutil.process_iter():
        try:
            if "gpumagic.host" in " ".join(process.cmdline()) and process.environ().get("SLURMD_NODENAME") == node:
                return process
        except psutil.Error:
            continue
    raise AssertionError(f"no gpumagic host on {node}")


def test_a_node_that_stops_answering_is_named_and_a_restart_starts_afresh(allocation, start_kernel, monkeypatch):
    kernel = start_kernel(**allocation)
    kernel.ok(SETUP)
    kernel.ok("%ddp start -n 1 --nnodes 2 --gpus none --no-dashboard", timeout=180)
    host = host_on("gmn2")
    host.suspend()  # SIGSTOP: the node's host, and so the node as the kernel sees it, says nothing
    try:
        began = time.monotonic()
        stopped = kernel.run("%%ddp\nimport time\ntime.sleep(30)", timeout=60)
        took = time.monotonic() - began
        print(f"a node that stopped answering: the cell's error {took:.1f}s after it started")
        # the cell ends with one line naming the node; the group's other ranks wait, unharmed
        assert stopped.error is not None and stopped.error[0] == "UsageError", stopped
        assert "node gmn2 stopped answering (nothing for 5s)" in stopped.error[1], stopped.error
        assert "%ddp restart" in stopped.error[1] and "\n" not in stopped.error[1], stopped.error
        assert took <= 10 + 2
        refused = kernel.run("%%ddp\n1")  # and so does every cell until a restart
        assert refused.error is not None and "node gmn2 stopped answering" in refused.error[1], refused.error
    finally:
        host.resume()
    wait_for(lambda: not host.is_running(), 10, "the host of the silent node ended once it ran again")
    kernel.ok("%ddp restart", timeout=180)
    assert kernel.ok("%%ddp -o back\nrank").stdout == "" and kernel.ok("print(back)").stdout.strip() == "{0: 0, 1: 1}"


def test_the_dashboard_draws_both_nodes_and_a_shutdown_leaves_nothing(allocation, start_kernel):
    kernel = start_kernel(**allocation)
    kernel.ok(SETUP)
    kernel.ok("%ddp start -n 1 --nnodes 2 --gpus none", timeout=180)
    kernel.ok(
        "%%ddp\nimport time\nheld = bytearray(200 * 2**20)\nfor step in range(20):\n"
        "    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n    time.sleep(0.2)",
        timeout=60,
    )
    drawn = kernel.ok(
        "d = SESSION.group_dashboard\n"
        "for _ in range(50):  # the dashboard reads the run's files every moment: until it has every point\n"
        "    if all(len(d.metric_sources[('loss', r)].data['value']) == 20 for r in (0, 1)):\n"
        "        break\n"
        "    time.sleep(0.2)\n"
        "print({r: (len(d.resource_sources[r].data['memory']), max(d.resource_sources[r].data['memory']), "
        "len(d.metric_sources[('loss', r)].data['value'])) for r in (0, 1)})"
    ).stdout.strip()
    # {rank: (samples, most MiB, loss points)}: each node's host sampled its rank; each rank's curve came
    samples = ast.literal_eval(drawn)
    assert all(count >= 2 and most > 200 and points == 20 for count, most, points in samples.values()), drawn
    pids = rank_pids(kernel)
    hosts = [host_on("gmn1").pid, host_on("gmn2").pid]
    began = time.monotonic()
    kernel.manager.shutdown_kernel(now=False)  # Jupyter's shutdown: the kernel ends its group first
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids + hosts), 5, "no rank or host left on any node")
    print(f"a kernel shut down: every node's ranks and hosts gone {time.monotonic() - began:.1f}s later")
    wait_for(lambda: "gpumagic-host" not in on_steps(), 5, "srun's step ended")


@pytest.mark.parametrize(
    ("environment", "line", "says"),
    [
        *MULTI_NODE_MISTAKES,
        ({}, "-n 1 --nnodes 2 --gpus none --pdb", "unrecognized arguments: --pdb"),
        ({"SLURM_JOB_ID": "", "SLURM_JOBID": ""}, "-n 1 --nnodes 2 --gpus none", "nodes of a Slurm allocation"),
    ],
)
def test_group_mistakes_across_nodes_are_the_launchs_one_line_errors(allocation, shell, monkeypatch, environment,
                                                                      line, says):  # fmt: skip
    said = refused_inside(allocation, monkeypatch, environment, lambda: shell.run_line_magic("ddp", f"start {line}"))
    assert says in said, said


def test_a_group_from_a_kernel_on_a_node_of_the_allocation_puts_its_rank_0_there(allocation, tmp_path):
    """Open OnDemand and batchspawner start Jupyter on the allocation's first node: srun starts a host there too,
    beside the kernel, and rank 0 runs on the kernel's node."""
    script = tmp_path / "on_node.py"
    script.write_text(
        "import gpumagic, socket\n"
        "print('kernel on', socket.gethostname(), flush=True)\n"
        f"with gpumagic.ranks(1, nnodes=2, gpus='none', output='all') as group:\n"
        "    print(group.nodes, flush=True)\n"
        f"    print(group.exec({ALL_REDUCE!r}), flush=True)\n"
    )
    done = run_on_first_node(allocation, script)
    assert "kernel on gmn1" in done.stdout and "['gmn1', 'gmn2']" in done.stdout, done.stdout
    assert "[rank 0 @gmn1] hello from gmn1" in done.stdout and "[rank 1 @gmn2] hello from gmn2" in done.stdout
    assert "{0: ('gmn1', 3.0), 1: ('gmn2', 3.0)}" in done.stdout, done.stdout


def test_a_rank_that_will_not_stop_on_the_other_node_is_killed_there_and_replaced(allocation, start_kernel):
    kernel = start_kernel(**allocation)
    kernel.ok(SETUP)
    kernel.ok("%ddp start -n 1 --nnodes 2 --gpus none --no-dashboard --grace 1s", timeout=180)
    kernel.ok("%%ddp\nimport signal, torch\nscratch = rank + 100")
    before = rank_pids(kernel)
    stuck = kernel.run(
        "%%ddp --timeout 2s\nif rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    while True:\n"
        "        pass\n'x'",
        timeout=60,
    )
    assert stuck.error is not None and stuck.error[0] == "CellInterrupted", stuck
    assert "rank 1 did not stop and was killed" in stuck.error[1] and "lost on rank 1: scratch" in stuck.error[1]
    after = rank_pids(kernel)
    assert after[0] == before[0] and after[1] != before[1] and not psutil.pid_exists(before[1])
    kernel.ok("%%ddp -o now\nimport socket\nt = torch.ones(1)\ndist.all_reduce(t)\n(socket.gethostname(), t.item())")
    assert kernel.ok("print(now)").stdout.strip() == "{0: ('gmn1', 2.0), 1: ('gmn2', 2.0)}"

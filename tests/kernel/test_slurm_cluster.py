"""Against a real Slurm cluster of two nodes on this machine (#28; ``tests/slurm_cluster.py``, no accounting
daemon, as on most small clusters): background jobs read their state from the controller, are killed and
requeued through Slurm; a kernel inside an allocation runs one DDP group across its nodes, starting the other
nodes' agents with srun."""

from __future__ import annotations

import ast
import json
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError

import gpumagic
from gpumagic.jobs import slurm_state
from gpumagic.jobs.slurm_task import attempt_token
from gpumagic.launch.allocation import parse_fields
from gpumagic.launch.rank_side.agent import AgentError
from gpumagic.run_dirs.launch_files import published_store
from gpumagic.run_dirs.layout import RunFiles

pytestmark = pytest.mark.kernel

ALL_REDUCE = (
    "import socket, torch, torch.distributed as dist\n"
    "print('hello from', socket.gethostname(), flush=True)\n"
    "t = torch.tensor(float(dist.get_rank() + 1))\n"
    "dist.all_reduce(t)\n"
    "(socket.gethostname(), t.item())"
)
FOREVER = "import time\nwhile True:\n    print('working', flush=True)\n    time.sleep(0.5)"


def run_streaming(kernel, code: str, timeout: float = 120) -> tuple[list[tuple[float, str]], dict]:
    """Run ``code`` in a real kernel; each stdout piece with the seconds since the cell was sent, and the reply."""
    sent = time.monotonic()
    msg_id = kernel.client.execute(code)
    pieces: list[tuple[float, str]] = []
    while True:
        message = kernel.client.get_iopub_msg(timeout=timeout)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = message["msg_type"], message["content"]
        if kind == "stream":
            pieces.append((time.monotonic() - sent, content["text"]))
        elif kind == "error":
            pieces.append((time.monotonic() - sent, f"{content['ename']}: {content['evalue']}"))
        elif kind == "status" and content["execution_state"] == "idle":
            break
    reply = kernel.client.get_shell_msg(timeout=timeout)
    return pieces, reply["content"]


def first_line_at(pieces: list[tuple[float, str]], text: str) -> float:
    return next(when for when, piece in pieces if text in piece)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")


def test_a_two_node_job_reads_its_states_from_the_controller_without_accounting(on_cluster, start_kernel):
    assert "accounting storage is disabled" in on_cluster.run("sacct", check=False).stderr  # no sacct here
    kernel = start_kernel()
    kernel.ok("%load_ext gpumagic")
    submitted = kernel.run(
        "%%launch_bg --executor slurm --name C1 --nodes 2 --tasks-per-node 1 --gpus 0 --time 10m\n"
        "import time\ntime.sleep(3)\n" + ALL_REDUCE
    )
    assert submitted.status == "ok", submitted
    job = gpumagic.job("C1")
    reasons = []

    def watch_states() -> None:
        while job.status in ("queued", "running") and len(reasons) < 600:
            reasons.append((job.status, job.reason))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch_states)
    watcher.start()
    followed = kernel.ok("%jobs logs C1 -f", timeout=120)  # follows the job until it ends, as a local one
    watched = kernel.ok("%jobs watch C1")
    watcher.join()
    assert "[rank 0] hello from gmn1" in followed.all_text and "[rank 1] hello from gmn2" in followed.all_text
    assert "application/vnd.jupyter.widget-view+json" in watched.mimetypes
    assert job.status == "finished", (job.status, job.reason, reasons)
    assert not [r for r in reasons if "cannot tell" in r[1]], reasons
    print(f"job states read while it ran: {len(reasons)}, each from Slurm's controller: {sorted(set(reasons))}")
    assert any(status == "running" and "RUNNING on gmn[1-2]" in reason for status, reason in reasons), reasons
    assert job.result() == {0: ("gmn1", 3.0), 1: ("gmn2", 3.0)}
    shown = [kernel.ok(line) for line in ("%jobs", "%jobs logs C1", "%jobs result C1")]
    said = "".join(r.all_text + r.stderr for r in [*shown, submitted])
    assert "slurm 2×1" in said and "finished" in said, said
    assert "[rank 1] hello from gmn2" in said and "('gmn2', 3.0)" in said, said
    assert "sacct" not in said and "WARNING" not in said, said  # submitit's "Bypassing sacct error" is gone
    # issue #37: rank 0 served the group's store on a port it took itself, published in the job's directory (not
    # one derived from the public job id), and Slurm wrote submitit's files and the logs under umask 077
    files = RunFiles(job.path)
    address = published_store(files, attempt_token(1))  # the first attempt's
    derived = random.Random(str(job.info["slurm_job_id"])).randint(20000, 60000)
    assert address is not None and address.startswith("tcp:gmn1:") and address != f"tcp:gmn1:{derived}", address
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (job.path / "slurm").rglob("*") if p.is_file()}
    assert modes and set(modes.values()) == {"0o600"}, modes


def test_killing_a_two_node_job_stops_its_ranks_on_both_nodes(on_cluster, shell):
    shell.run_cell_magic("launch_bg", "--executor slurm --name K2 --nodes 2 --tasks-per-node 1 --gpus 0", FOREVER)
    job = gpumagic.job("K2")
    files = RunFiles(job.path)
    starts = wait_for(lambda: all(files.rank_start(r).exists() for r in (0, 1)), 60, "both ranks started")
    assert starts
    pids = [json.loads(files.rank_start(r).read_text())["pid"] for r in (0, 1)]
    hosts = {json.loads(files.rank_start(r).read_text())["host"] for r in (0, 1)}
    assert hosts == {"gmn1", "gmn2"}
    began = time.monotonic()
    shell.run_line_magic("jobs", "kill K2")
    assert job.status == "killed" and f"scancel {job.info['slurm_job_id']}" in job.info["exit"]
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 30, "both nodes' ranks ended")
    print(f"kill: both nodes' ranks ended {time.monotonic() - began:.1f}s after %jobs kill")
    state = wait_for(
        lambda: (s := slurm_state.ask(job.info["slurm_job_id"], job.info["slurm_folder"])).state != "RUNNING" and s,
        30,
        "Slurm ended the job",
    )
    assert state.state.startswith("CANCELLED") or state.state == "COMPLETING", state
    assert job.status == "killed"


def test_a_requeued_job_says_so_and_keeps_the_earlier_attempts_files(on_cluster):
    def attempts():
        import os
        import time

        attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        print("attempt", attempt, flush=True)
        gpumagic.log(attempt=attempt)
        time.sleep(600 if attempt == 0 else 1)
        return attempt

    job = gpumagic.jobs_with(name="R1", executor="slurm", gpus=0, slurm={"time": "10m"}).submit(attempts)
    wait_for(lambda: "attempt 0" in job.logs(), 60, "the first attempt's output")
    requeue_and_release(on_cluster, job)
    assert job.wait(timeout="90s") == "finished", job.reason
    assert job.result() == 1
    assert "attempt 1" in job.logs() and "attempt 0" not in job.logs()
    kept = Path(job.info["slurm_attempts_kept"]) / "1"  # the first attempt's files
    assert "attempt 0" in (kept / "ranks" / "rank-0.log").read_text()
    assert (kept / "metrics" / "rank-0.bin").exists()
    assert job.last_metrics()["attempt"][1] == 1  # this attempt's curve, not mixed with the earlier one's


def requeue_and_release(cluster, job) -> None:
    """``scontrol requeue`` the running ``job``, check it reads as requeued, and have Slurm start it again now."""
    cluster.run("scontrol", "requeue", job.info["slurm_job_id"])
    release_requeued(cluster, job)


def release_requeued(cluster, job, timeout: float = 30) -> None:
    """Once the ``job`` reads as requeued, have Slurm start it again now."""
    job_id = job.info["slurm_job_id"]
    requeued = wait_for(lambda: "requeued" in job.reason and job.reason, timeout, "the job reads as requeued")
    assert job.status == "queued" and "requeued by Slurm 1 time(s)" in requeued, requeued
    wait_for(lambda: cluster.job_fields(job_id).get("JobState") == "PENDING", 30, "the earlier attempt ended")
    wait_for(lambda: _nodes_idle(cluster), 30, "every node ended its steps")
    # slurmd refuses a job credential made in the second it revoked the job's earlier one (slurmctld.log: "Killing
    # non-startable batch JobId=3: Job credential revoked"; the new attempt then fails at once, 3 full runs of 7)
    revoked_by = int(time.time())
    wait_for(lambda: int(time.time()) > revoked_by + 1, 5, "a later second than the earlier attempt's end")
    cluster.run("scontrol", "update", f"jobid={job_id}", "StartTime=now")  # Slurm holds a requeued job 2 min


def train_linear(steps, stop_at=None, every=1, fail=False):
    """Restore, train a small model with a checkpoint each ``every`` steps. The first attempt (nothing restored)
    at ``stop_at`` raises (``fail``) or keeps calling checkpoint there until Slurm's time limit signal makes it
    save and requeue. Without ``stop_at``, in this process: the run that was never stopped."""
    import time

    import torch

    import gpumagic

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    start = gpumagic.restore(model=model, optimizer=optimizer) if stop_at else 0
    for step in range(start, steps):
        optimizer.zero_grad()
        model(torch.ones(3, 4) * step).pow(2).mean().backward()
        optimizer.step()
        gpumagic.log(step, weight=float(model.weight.detach().sum()))  # for a job that is tracked
        if stop_at:
            gpumagic.checkpoint(step + 1, every=every, model=model, optimizer=optimizer)
        if step + 1 == stop_at and start == 0:
            print("stopping at", stop_at, flush=True)
            if fail:
                raise RuntimeError("the node's disk went away")
            while True:  # until Slurm ends or requeues it; with every > 1 the time limit's signal makes the next
                if every > 1:  # checkpoint save, and the job requeue itself
                    gpumagic.checkpoint(step + 1, every=every, model=model, optimizer=optimizer)
                time.sleep(0.2)
    return start, model.weight.detach().clone()


def test_a_requeued_job_resumes_from_its_checkpoint(on_cluster):
    job = gpumagic.jobs_with(name="C1", executor="slurm", gpus=0, slurm={"time": "10m"}).submit(train_linear, 5, 2)
    wait_for(lambda: "stopping at 2" in job.logs(), 90, "the first attempt's checkpoint of step 2")
    requeue_and_release(on_cluster, job)
    assert job.wait(timeout="90s") == "finished", job.reason
    start, weight = job.result()
    assert start == 2, "the requeued attempt went on from step 2, not from 0"
    assert "resumed from step 2 (attempt 2)" in job.describe()
    assert weight.equal(train_linear(5)[1]), "the weights of a run that was never requeued"


def test_a_tracked_slurm_job_is_one_mlflow_and_tensorboard_run_across_its_requeue(on_cluster, tmp_path, monkeypatch):
    from gpumagic.telemetry import tracking
    from tests.tracker_readers import mlflow_runs, mlflow_series, tensorboard_series

    monkeypatch.setattr(tracking, "_chosen", None)
    monkeypatch.setenv("GPUMAGIC_TRACK_TIMEOUT", "60")  # the job's environment too: a busy machine's imports
    gpumagic.track("tensorboard", logdir=str(tmp_path / "tb"))
    gpumagic.track("mlflow", tracking_uri=str(tmp_path / "mlruns"), experiment="exp")
    try:
        two_nodes = {"time": "10m", "nodes": 2, "tasks_per_node": 1}  # each rank moves its own files at a requeue
        job = gpumagic.jobs_with(name="C5", executor="slurm", gpus=0, slurm=two_nodes).submit(train_linear, 5, 2)
    finally:
        gpumagic.track(None)  # the job carries its trackers, sealed: what the kernel chooses later changes nothing

    def logged(rank=0):
        runs = mlflow_runs(tmp_path)
        return mlflow_series(tmp_path, runs[0].info.run_id, f"weight/rank{rank}") if runs else []

    points = [RunFiles(job.path).metric_points(rank) for rank in (0, 1)]  # a batch: a count, then 32 bytes a point
    wait_for(lambda: all(p.exists() and p.stat().st_size >= 4 + 2 * 32 for p in points), 90, "steps 0, 1 on disk")
    wait_for(lambda: "run_id" in job.info.get("tracking", {}).get("mlflow", {}), 90, "the exporter's MLflow run")
    requeue_and_release(on_cluster, job)  # at once: the exporter sends what is on disk when Slurm's SIGTERM comes
    assert job.wait(timeout="90s") == "finished", job.reason
    wait_for(lambda: mlflow_runs(tmp_path)[0].info.status == "FINISHED", 60, "rank 0's exporter ended the run")
    (ran,) = mlflow_runs(tmp_path)
    assert ran.info.run_name == "C5" and ran.data.params["executor"] == "slurm"
    for rank in (0, 1):  # each step once: the earlier attempt's files are never sent again
        assert [step for step, _ in logged(rank)] == [0, 1, 2, 3, 4], "both attempts' steps, in one MLflow run"
        assert logged(rank)[-1][1] == pytest.approx(float(train_linear(5)[1].sum()), rel=1e-6), "an unbroken run's"
    series, _ = tensorboard_series(job.info["tracking"]["tensorboard"]["logdir"])
    assert [step for step, _ in series["weight/rank1"]] == [0, 1, 2, 3, 4]


def test_a_failed_slurm_job_resumed_with_more_time_goes_on_from_its_checkpoint(on_cluster):
    job = gpumagic.jobs_with(name="C2", executor="slurm", gpus=0, slurm={"time": "10m"}).submit(
        train_linear, 5, 3, 1, True
    )
    assert job.wait(timeout="90s") == "failed", job.reason
    first = job.info["slurm_job_id"]
    assert job.resume(slurm={"time": "20m"}) is job
    assert job.wait(timeout="90s") == "finished", job.reason
    start, weight = job.result()
    assert start == 3 and weight.equal(train_linear(5)[1]), "from step 3, to the weights of an unbroken run"
    info = job.info
    assert info["slurm_job_id"] != first and info["slurm"]["timeout_min"] == 20
    assert "resumed from step 3 (attempt 2)" in job.describe()
    assert "the node's disk went away" in (job.path / "attempts" / "1" / "error.txt").read_text()


@pytest.mark.slow
def test_near_its_time_limit_a_job_saves_and_requeues_itself(on_cluster):
    slurm = {"time": "1m", "signal_delay": 50}  # Slurm's shortest limit; its signal comes 50 s ahead (or sooner)
    job = gpumagic.jobs_with(name="C3", executor="slurm", gpus=0, requeue_on_timeout=1, slurm=slurm).submit(
        train_linear, 6, 3, 100
    )
    release_requeued(on_cluster, job, timeout=90)
    assert job.wait(timeout="90s") == "finished", job.reason
    start, weight = job.result()
    # the signal comes at Slurm's next look at the limit: at step 3 where the first attempt waits for it, or before
    assert 1 <= start <= 3 and weight.equal(train_linear(6)[1]), "from the step it saved, to an unbroken run's end"
    assert job.info["timeout_requeues"] == 1
    # said before the request: Slurm's SIGTERM may end the rank as soon as the requeue is granted
    assert (
        f"time limit near; saved step {start}; asking Slurm to requeue the job"
        in (job.path / "attempts" / "1" / "ranks" / "rank-0.log").read_text()
    )


def _slurm_says(cluster, job_id: str) -> str:
    """The job's state as squeue tells it (COMPLETING while a node still ends its processes)."""
    return cluster.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T", check=False).stdout.strip()


def _nodes_idle(cluster) -> bool:
    """Every node of the cluster is IDLE, with no flag (COMPLETING, DRAIN, ...)."""
    lines = cluster.run("scontrol", "show", "node", "-o", check=False).stdout.splitlines()
    states = [parse_fields(line).get("State", "") for line in lines if line.strip()]
    return bool(states) and all(state == "IDLE" for state in states)


def test_a_job_cancelled_from_a_shell_reads_killed_and_its_end_survives_the_controller(on_cluster):
    job = gpumagic.jobs_with(name="S1", executor="slurm", gpus=0, slurm={"time": "10m"}).submit(time.sleep, 600)
    job_id, folder = job.info["slurm_job_id"], job.info["slurm_folder"]
    # its rank has begun (it records its start), not only the controller's RUNNING
    wait_for(lambda: job.info.get("started"), 60, "the job's rank records its start")
    on_cluster.run("scancel", job_id)
    wait_for(lambda: job.status == "killed", 30, "the job reads killed")
    assert "CANCELLED" in job.reason and "without recording a result" in job.reason, job.reason
    # once the controller forgot the job (MinJobAge) and with no accounting, slurmstepd's line in its output tells.
    # slurmstepd writes it as it signals the job's processes, which the controller asks of the node after it calls
    # the job cancelled: once the job is no longer COMPLETING, every node has ended it (in one fresh-clone CI run the
    # line was not there 10 s after the job read killed)
    wait_for(lambda: _slurm_says(on_cluster, job_id) == "CANCELLED", 90, "the job's node ended it (not COMPLETING)")
    from_output = slurm_state.from_output(job_id, Path(folder))
    assert from_output == slurm_state.SlurmState("CANCELLED", "its Slurm output"), from_output
    assert slurm_state.ask("999999", None).state == "ENDED"  # a job nobody knows: ended, not "cannot tell"


def test_ddp_across_the_allocation_from_a_kernel_on_a_login_node(allocation, start_kernel):
    kernel = start_kernel(**allocation)
    kernel.ok("%load_ext gpumagic")
    pieces, reply = run_streaming(kernel, "%%launch_ddp -n 1 --nnodes 2 --gpus none -o out\n" + ALL_REDUCE)
    said = "".join(text for _, text in pieces)
    assert reply["status"] == "ok", said
    assert "Slurm allocation" in said and "ranks on gmn1, gmn2 (srun --overlap)" in said, said
    assert "[rank 0] hello from gmn1" in said and "[rank 1] hello from gmn2" in said, said
    assert kernel.ok("print(out)").stdout.strip() == "{0: ('gmn1', 3.0), 1: ('gmn2', 3.0)}"
    second_node = first_line_at(pieces, "[rank 1] hello from gmn2")
    print(f"from the cell's start to the second node's first line: {second_node:.1f}s; all_reduce: 1 + 2 = 3.0")
    # the same cell with two ranks per node: one group of four across the nodes
    pieces, reply = run_streaming(kernel, "%%launch_ddp -n 2 --nnodes 2 --gpus none -o out\n" + ALL_REDUCE)
    assert reply["status"] == "ok", pieces
    assert kernel.ok("print(out)").stdout.strip() == (
        "{0: ('gmn1', 10.0), 1: ('gmn1', 10.0), 2: ('gmn2', 10.0), 3: ('gmn2', 10.0)}"
    )


def test_a_hang_across_nodes_is_reported_with_each_nodes_rank_and_line(allocation, start_kernel):
    kernel = start_kernel(**allocation)
    kernel.ok("%load_ext gpumagic")
    cell = (
        "%%launch_ddp -n 1 --nnodes 2 --gpus none --hang-after 3s\nimport socket, time, torch\n"
        "if rank == 0:\n    print('entering on', socket.gethostname(), flush=True)\nelse:\n    time.sleep(9)\n"
        "dist.all_reduce(torch.ones(5))"
    )
    pieces, reply = run_streaming(kernel, cell)
    said = "".join(text for _, text in pieces)
    assert reply["status"] == "ok", said
    delay = first_line_at(pieces, "where every rank is") - first_line_at(pieces, "entering on gmn1")
    print(f"two nodes: the report {delay:.1f}s after rank 0 (gmn1) entered all_reduce (threshold 3s)")
    assert delay <= 3 + 2
    assert "rank 0: (on gmn1) waits in all_reduce #1 of float32[5]" in said, said
    assert "rank 1: (on gmn2) not in a collective" in said and "line 5: time.sleep(9)" in said, said
    assert "line 6: dist.all_reduce(torch.ones(5))" in said, said


def test_the_dashboard_draws_the_resources_of_every_nodes_ranks(allocation, start_kernel):
    """No rank runs on the kernel's machine here: each node's agent samples its ranks into the run directory."""
    kernel = start_kernel(**allocation)
    kernel.ok("%load_ext gpumagic\nfrom gpumagic.launch.kernel_side.session import SESSION")
    cell = kernel.ok(
        "%%launch_ddp -n 1 --nnodes 2 --gpus none\nimport time\nheld = bytearray(200 * 2**20)\ntime.sleep(4)",
        timeout=120,
    )
    assert "application/vnd.jupyter.widget-view+json" in cell.mimetypes
    kernel.ok("SESSION.last_dashboard.join()")
    drawn = kernel.ok(
        "d = SESSION.last_dashboard\n"
        "print({r: (len(d.resource_sources[r].data['memory']), max(d.resource_sources[r].data['memory'])) "
        "for r in (0, 1)})"
    ).stdout.strip()
    samples = ast.literal_eval(drawn)  # {rank: (samples, most MiB)}
    assert all(count >= 2 and most > 200 for count, most in samples.values()), drawn


SAME_CELL = (
    "import torch, torch.distributed as dist\n"
    "t = torch.tensor(float(rank + 1))\n"
    "dist.all_reduce(t)\n"
    "(world_size, t.item())"
)


def test_the_same_cell_runs_on_one_node_across_the_allocation_and_as_a_batch_job(allocation, start_kernel):
    kernel = start_kernel(**allocation)
    kernel.ok("%load_ext gpumagic\nimport gpumagic")
    kernel.ok("%%launch_ddp -n 2 --gpus none -o here\n" + SAME_CELL, timeout=120)
    kernel.ok("%%launch_ddp -n 1 --nnodes 2 --gpus none -o across\n" + SAME_CELL, timeout=120)
    kernel.ok("%%launch_ddp -n 1 --nnodes 2 --gpus none --no-wait -o later\n" + SAME_CELL, timeout=120)
    kernel.ok("%%launch_bg --executor slurm --name B3 --nodes 2 --gpus 0 --time 10m\n" + SAME_CELL)
    kernel.ok("job = gpumagic.job('B3')\nassert job.wait(timeout='120s') == 'finished', job.reason", timeout=150)
    waited = kernel.ok(
        "import time\nfor _ in range(600):\n    if 'later' in globals(): break\n    time.sleep(0.1)\n"
        "print(here == across == later == job.result(), here)",
        timeout=90,
    )
    assert waited.stdout.strip() == "True {0: (2, 3.0), 1: (2, 3.0)}", waited.stdout


def test_a_rank_dying_on_the_other_node_restarts_the_group_across_the_allocation(allocation, start_kernel):
    kernel = start_kernel(**allocation)
    kernel.ok("%load_ext gpumagic")
    cell = kernel.ok(
        "%%launch_ddp -n 1 --nnodes 2 --gpus none --max-restarts 1 -o out\n"
        "import os, socket, torch, torch.distributed as dist\n"
        "attempt = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "if rank == 1 and attempt == 0:\n"
        "    os._exit(3)\n"
        "t = torch.tensor(1.0)\n"
        "dist.all_reduce(t)\n"
        "(socket.gethostname(), attempt, t.item())",
        timeout=180,
    )
    assert "rank 1: exited with code 3" in cell.stdout and "restarting the group (restart 1 of 1)" in cell.stdout, (
        cell.stdout
    )
    assert kernel.ok("print(out)").stdout.strip() == "{0: ('gmn1', 1, 2.0), 1: ('gmn2', 1, 2.0)}"


def send_until_printed(kernel, cell: str, *texts: str, timeout: float = 90) -> str:
    """Send ``cell`` (it runs on) and read its output until it printed each of ``texts``; what it printed."""
    msg_id = kernel.client.execute(cell)
    seen = ""
    deadline = time.monotonic() + timeout
    while not all(text in seen for text in texts):
        assert time.monotonic() < deadline, seen
        message = kernel.client.get_iopub_msg(timeout=timeout)
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
            seen += message["content"]["text"]
    return seen


def start_forever_across_nodes(kernel) -> dict[str, int]:
    """Send a cell whose ranks, one on each node, print forever; once both printed, their pids by node."""
    kernel.ok("%load_ext gpumagic")
    seen = send_until_printed(kernel, "%%launch_ddp -n 1 --nnodes 2 --gpus none\n" + FOREVER, "[rank 0] working",
                              "[rank 1] working")  # fmt: skip
    files = RunFiles(Path(seen.split("run directory ", 1)[1].split()[0]))
    starts = [json.loads(files.rank_start(r).read_text()) for r in (0, 1)]
    return {start["host"]: start["pid"] for start in starts}


def test_an_interrupt_stops_the_ranks_on_every_node(allocation, start_kernel):
    kernel = start_kernel(**allocation)
    pids = start_forever_across_nodes(kernel)
    assert set(pids) == {"gmn1", "gmn2"}
    content, took = kernel.interrupt()
    assert content["status"] == "error" and content["ename"] == "LaunchInterrupted", content
    began = time.monotonic()
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids.values()), 15, "every node's rank ended")
    print(f"interrupt: the cell returned in {took:.1f}s; every node's ranks had ended "
          f"{time.monotonic() - began:.1f}s after that")  # fmt: skip
    assert "gpumagic-agent" not in on_steps()  # srun's step ended too
    assert kernel.ok("print('still here')").stdout.strip() == "still here"


def test_a_killed_kernel_leaves_no_rank_on_any_node(allocation, start_kernel):
    kernel = start_kernel(**allocation)
    pids = start_forever_across_nodes(kernel)
    os.kill(kernel.pid, signal.SIGKILL)
    began = time.monotonic()
    wait_for(
        lambda: not any(psutil.pid_exists(p) for p in pids.values()), 30, "every node's rank ended with the kernel"
    )
    print(f"a killed kernel: both nodes' ranks gone {time.monotonic() - began:.1f}s later")
    wait_for(lambda: "gpumagic-agent" not in on_steps(), 30, "srun's step ended")


def on_steps() -> str:
    return subprocess.run(["squeue", "--steps", "--noheader", "--format=%i %j"], capture_output=True, text=True,
                          check=False).stdout  # fmt: skip


def test_a_kernel_on_a_node_of_the_allocation_runs_ranks_there_and_srun_starts_the_other(allocation, tmp_path):
    """Open OnDemand and batchspawner start Jupyter on the allocation's first node: that node's ranks run beside
    the kernel, the other node's through srun."""
    script = tmp_path / "on_node.py"
    script.write_text(
        "import gpumagic, socket\n"
        "def f():\n"
        "    import socket, torch, torch.distributed as dist\n"
        "    t = torch.tensor(1.0)\n"
        "    dist.all_reduce(t)\n"
        "    return socket.gethostname(), t.item()\n"
        "print('kernel on', socket.gethostname())\n"
        "print(gpumagic.launch_ddp(f, 1, nnodes=2, gpus='none'))\n"
    )
    done = run_on_first_node(allocation, script)
    assert "kernel on gmn1" in done.stdout and "ranks on this node (gmn1) and gmn2" in done.stdout, done.stdout
    assert "{0: ('gmn1', 2.0), 1: ('gmn2', 2.0)}" in done.stdout, done.stdout


def run_on_first_node(allocation: dict, script: Path) -> subprocess.CompletedProcess:
    """Run ``script`` as a step on the allocation's first node (gmn1), as Jupyter runs where Open OnDemand or
    batchspawner start it there; it must succeed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ["PYTHONPATH"]])}
    done = subprocess.run(
        ["srun", "--overlap", f"--jobid={allocation['SLURM_JOB_ID']}", "--nodelist=gmn1", "-N1", "-n1",
         sys.executable, str(script)],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def command_line(process: psutil.Process) -> str:
    """What ``process`` runs; empty once it has ended (a zombie not reaped yet has no command line to read)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_a_node_that_does_not_answer_is_named_and_nothing_is_left(allocation, on_cluster, monkeypatch):
    for name, value in allocation.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GPUMAGIC_NODE_TIMEOUT", "6")
    slurmd = on_cluster.node_pid("gmn2")
    os.kill(slurmd, signal.SIGSTOP)
    try:
        began = time.monotonic()
        with pytest.raises(AgentError) as caught:
            gpumagic.launch_ddp(print, 1, nnodes=2, gpus="none")
        took = time.monotonic() - began
    finally:
        os.kill(slurmd, signal.SIGCONT)
    assert "gmn2" in str(caught.value) and "did not answer within 6s" in str(caught.value), caught.value
    assert "\n" not in str(caught.value)
    print(f"a silent node: named after {took:.1f}s (timeout 6 s)")
    assert not [p for p in psutil.Process().children(recursive=True) if "gpumagic.agent" in command_line(p)]


# (environment, options, what the one-line error says): a launch's and a %ddp group's across the nodes alike
MULTI_NODE_MISTAKES = [
    ({}, "-n 1 --nnodes 3 --gpus none", "--nnodes 3, but Slurm allocation"),
    ({"PATH": "/nonexistent"}, "-n 1 --nnodes 2 --gpus none", "with srun, which is not on PATH"),
    ({}, "-n 1 --nnodes 2 --gpus 0", "names this machine's GPUs, and no rank runs here"),
]


@pytest.mark.parametrize(
    ("environment", "line", "says"),
    [
        *MULTI_NODE_MISTAKES,
        ({}, "-n 1 --nnodes 2 --node-rank 0 --gpus none", "leave out --node-rank"),
        ({"SLURM_JOB_ID": "", "SLURM_JOBID": ""}, "-n 1 --nnodes 2 --gpus none", "notebook inside a Slurm allocation"),
    ],
)
def test_multi_node_mistakes_are_one_line_errors(allocation, shell, monkeypatch, environment, line, says):
    said = refused_inside(allocation, monkeypatch, environment, lambda: shell.run_cell_magic("launch_ddp", line, "1"))
    assert says in said, said


def refused_inside(allocation: dict, monkeypatch, environment: dict, run) -> str:
    """The one-line UsageError ``run()`` raises inside the allocation, with ``environment`` over its variables."""
    for name, value in {**allocation, **environment}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError) as caught:
        run()
    assert "\n" not in str(caught.value), caught.value
    return str(caught.value)

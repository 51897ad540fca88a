"""Multi-node launches (#6): two elastic "nodes" on one machine (two agents, c10d rendezvous on loopback, gloo),
a group restart after a rank is killed, sealed payloads refused when changed, and the bad-input paths."""

from __future__ import annotations

import json
import os
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
from gpumagic.launch.failures import LaunchError
from tests.conftest import ROOT

pytestmark = pytest.mark.kernel


def train(steps: int, pause: float = 0.0):
    """A small DDP regression; every rank returns its attempt, final loss and parameters."""
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 4) + dist.get_rank()  # different data per rank: DDP must average the gradients
    y = x.sum(1, keepdim=True)
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        gpumagic.log(loss=loss.item())
        time.sleep(pause)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} done, loss {loss.item():.2e}")
    parameters = [p.detach().flatten().tolist() for p in model.parameters()]
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"]), loss.item(), parameters


class OtherNodes:
    """Plays the user at the other nodes: runs each agent command the launch prints, as printed."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.agents: list[subprocess.Popen] = []

    def write(self, text: str) -> None:
        self.text.append(text)
        for line in text.splitlines():
            if line.strip().startswith("python -m gpumagic.agent"):
                command = line.strip().split()
                self.agents.append(subprocess.Popen([sys.executable, *command[1:]], cwd=ROOT, env=_env()))

    @property
    def output(self) -> str:
        return "".join(self.text)

    def wait(self) -> list[int]:
        return [agent.wait(60) for agent in self.agents]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}


def test_two_elastic_nodes_train_one_model_and_return_both_results(no_leftover_children):
    nodes = OtherNodes()
    results = gpumagic.launch_ddp(
        train, 1, args=(40,), nnodes=2, rdzv_endpoint="127.0.0.1:0", gpus="none", write=nodes.write
    )
    assert nodes.wait() == [0]
    assert sorted(results) == [0, 1]
    (attempt0, loss0, params0), (attempt1, loss1, params1) = results[0], results[1]
    assert attempt0 == attempt1 == 0
    assert params0 == params1  # one model: DDP kept the replicas identical
    assert loss0 < 0.05 and loss1 < 0.05
    assert "[rank 0] rank 0 of 2 done" in nodes.output and "[rank 1] rank 1 of 2 done" in nodes.output
    assert "c10d rendezvous" in nodes.output
    run = gpumagic.runs()[-1]
    assert run.status == "finished" and sorted(run.metrics()) == [0, 1]
    assert len(run.metrics()[1]["loss"]) == 40  # the other node's curve came back through the run directory


def test_a_killed_rank_restarts_the_group_once_and_the_run_completes(no_leftover_children):
    nodes = OtherNodes()
    killed: list[dict] = []

    def kill_rank_1_mid_run() -> None:
        runs = Path(os.environ["GPUMAGIC_RUNS_DIR"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for path in runs.glob("*/ranks/rank-1.log"):
                if b"step 5" in path.read_bytes():  # it is training
                    record = json.loads(path.with_suffix(".json").read_text())
                    os.kill(record["pid"], signal.SIGKILL)
                    killed.append(record)
                    return
            time.sleep(0.05)

    def steps_then_train():
        import time

        for step in range(20):
            print(f"step {step}", flush=True)
            time.sleep(0.05)
        return train(30)

    killer = threading.Thread(target=kill_rank_1_mid_run, daemon=True)
    killer.start()
    results = gpumagic.launch_ddp(
        steps_then_train, 1, nnodes=2, rdzv_endpoint="127.0.0.1:0", max_restarts=2, gpus="none", write=nodes.write
    )
    killer.join()
    assert nodes.wait() == [0]
    assert killed and killed[0]["attempt"] == 0
    assert f"rank 1: killed by SIGKILL (pid {killed[0]['pid']}); restarting the group (restart 1 of 2)" in nodes.output
    assert nodes.output.count("restarting the group") == 1  # one restart, told once (the peer's failure follows it)
    # the whole group ran again, once: each rank started twice (node 0 restarted its rank for the new round
    # without spending a restart of its own, so only the failed node's restart count is 1)
    assert nodes.output.count("[rank 0] step 0\n") == 2 and nodes.output.count("[rank 1] step 0\n") == 2
    assert results[1][0] == 1
    assert results[0][2] == results[1][2]


def test_a_rank_that_keeps_failing_ends_in_one_error_after_its_restarts(no_leftover_children):
    def always_fails():
        raise ValueError("bad batch")

    writes: list[str] = []
    with pytest.raises(LaunchError) as caught:
        # elastic on this machine
        gpumagic.launch_ddp(always_fails, 1, max_restarts=1, gpus="none", write=writes.append)
    error = caught.value
    assert error.root_cause.exc_type == "ValueError" and "bad batch" in error.root_cause.traceback
    assert "restarted 1 time(s)" in error.report()
    assert "restarting the group (restart 1 of 1)" in "".join(writes)
    run_dir = max(Path(os.environ["GPUMAGIC_RUNS_DIR"]).iterdir(), key=lambda p: p.stat().st_mtime)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.parent.name == "agents" for p in files)  # the agent's log and events are there, and private
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in files), {
        str(p.relative_to(run_dir)): oct(p.stat().st_mode) for p in files
    }


def _sealed_run(tmp_path: Path) -> Path:
    from gpumagic.launch.shipping import pack, ship_function
    from gpumagic.run_dirs.launch_files import write_spec
    from gpumagic.run_dirs.layout import RunFiles

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = {"nnodes": 2, "nproc_per_node": 1, "rdzv_id": "t", "backend": "gloo", "use_cuda": False}
    write_spec(RunFiles(run_dir), spec, pack(ship_function(print, ("hello",), {}, rank_first=False)))
    return run_dir


@pytest.mark.parametrize("changed", ["launch/payload.pkl", "launch/spec.json"])
def test_an_agent_refuses_a_changed_payload_before_running_anything(tmp_path, changed):
    run_dir = _sealed_run(tmp_path)
    path = run_dir / changed
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))
    agent = subprocess.run(
        [sys.executable, "-m", "gpumagic.agent", "--rdzv-endpoint", "127.0.0.1:1", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert agent.returncode == 2
    lines = agent.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not carry your key's seal" in lines[0], agent.stderr
    assert not (run_dir / "agents").exists()  # it joined no rendezvous and started no rank


def test_an_agent_says_what_is_wrong_with_its_arguments(tmp_path):
    run_dir = _sealed_run(tmp_path)

    def agent(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "gpumagic.agent", *args], capture_output=True, text=True, env=_env(), timeout=60
        )
        assert done.returncode == 2
        return done.stderr.strip().splitlines()[-1]

    assert "not a gpumagic run directory" in agent("--rdzv-endpoint", "127.0.0.1:1", "--run-dir", str(tmp_path))
    assert "HOST:PORT" in agent("--rdzv-endpoint", "nowhere", "--run-dir", str(run_dir))
    assert "leave out --node-rank" in agent(
        "--rdzv-endpoint", "127.0.0.1:1", "--run-dir", str(run_dir), "--node-rank", "1"
    )
    assert "cannot reach the rendezvous at 127.0.0.1:1" in agent(
        "--rdzv-endpoint", "127.0.0.1:1", "--run-dir", str(run_dir)
    )


def test_the_rendezvous_listens_only_on_the_address_named(no_leftover_children):
    nodes = OtherNodes()
    seen: set[str] = set()
    done = threading.Event()
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. a test Slurm cluster's daemons

    def watch() -> None:
        while not done.is_set():
            for process in psutil.Process().children(recursive=True):
                if process.pid in before:
                    continue
                try:
                    seen.update(c.laddr.ip for c in process.net_connections("inet") if c.status == "LISTEN")
                except psutil.Error:
                    pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    gpumagic.launch_ddp(
        train, 1, args=(20, 0.05), nnodes=2, rdzv_endpoint="127.0.0.1:0", gpus="none", write=nodes.write
    )
    done.set()
    watcher.join()
    nodes.wait()
    assert seen and seen <= {"127.0.0.1"}, seen


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("-n 1 --nnodes 2", "needs --rdzv-endpoint"),
        ("-n 1 --nnodes 2 --rdzv-endpoint nowhere", "HOST:PORT"),
        ("-n 1 --nnodes 2 --rdzv-endpoint 127.0.0.1:0 --node-rank 2", "node_rank must be from 0 to 1"),
        ("-n 1 --nnodes 0 --rdzv-endpoint 127.0.0.1:0", "nnodes must be"),
        ("-n 1 --max-restarts -1", "max_restarts must be"),
        ("-n 1 --rdzv-endpoint 127.0.0.1:0 --rdzv-id 'a b'", "rdzv_id is"),
        ("-n 1 --nnodes 2 --rdzv-endpoint 192.0.2.1:29400 --gpus none", "must name an address of this machine"),
        ("-n 1 --rdzv-endpoint 127.0.0.1:0 --port 5000", "leave out --port"),
        ("-n 1 --partition gpu", "--partition need --executor slurm"),
        ("-n 1 --executor slurm --rdzv-endpoint 127.0.0.1:0", "Slurm places the ranks"),
    ],
)
def test_bad_multi_node_options_are_one_line_errors(shell, line, says):
    shell.user_ns["x"] = 1
    with pytest.raises(UsageError) as caught:
        shell.run_cell_magic("launch_ddp", line + " --no-dashboard", "x + 1")
    message = str(caught.value)
    assert says in message and "\n" not in message, message


def test_launch_ddp_magic_runs_on_two_nodes_in_a_kernel(start_kernel):
    kernel = start_kernel(CUDA_VISIBLE_DEVICES="")  # CPU ranks with gloo, on every machine
    kernel.ok("%load_ext gpumagic")
    kernel.ok("import torch\nscale = torch.tensor(3.0)")
    started: list[subprocess.Popen] = []

    def second_node() -> None:  # what the user does on the other node, with the command the cell printed
        from gpumagic.run_dirs.launch_files import read_spec
        from gpumagic.run_dirs.layout import RunFiles

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for spec in Path(os.environ["GPUMAGIC_RUNS_DIR"]).glob("*-ddp-*/launch/spec.json"):
                run_dir = spec.parent.parent
                command = ["--rdzv-endpoint", read_spec(RunFiles(run_dir))["rdzv_endpoint"], "--run-dir", str(run_dir)]
                started.append(subprocess.Popen([sys.executable, "-m", "gpumagic.agent", *command], env=_env()))
                return
            time.sleep(0.1)

    helper = threading.Thread(target=second_node, daemon=True)
    helper.start()
    cell = kernel.ok(
        "%%launch_ddp -n 1 --nnodes 2 --rdzv-endpoint 127.0.0.1:0 -o out\n"
        "import os\n"
        "t = scale * (rank + 1)\n"
        "dist.all_reduce(t)\n"  # dist is defined in the cell, as rank is
        "print('sum', t.item())\n"
        "t.item(), os.environ['CUDA_VISIBLE_DEVICES']",
        timeout=120,
    )
    helper.join()
    assert started and started[0].wait(60) == 0
    assert "python -m gpumagic.agent --rdzv-endpoint 127.0.0.1:" in cell.stdout
    assert "[rank 1] sum 9.0" in cell.stdout
    assert "application/vnd.jupyter.widget-view+json" in cell.mimetypes  # the dashboard, following both nodes
    # the other node's agent had no CUDA_VISIBLE_DEVICES: a CPU group's ranks see no GPU on every node
    assert kernel.ok("print(out)").stdout.strip() == "{0: (9.0, ''), 1: (9.0, '')}"

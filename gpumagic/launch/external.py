"""A rank started by an outside engine (torch elastic's agent, Slurm through submitit) with the environment
torchrun gives (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), running the code shipped in a run directory that every node can read.

The run directory (``docs/run-directory.md``)::

    launch/spec.json            how the ranks run: backend, timeout, whether they use CUDA (sealed JSON)
    launch/payload.pkl          the shipped code (sealed)
    ranks/rank-R.log            rank R's stdout and stderr, every attempt appended
    ranks/rank-R.json           rank R's latest start: attempt, pid, host, time
    ranks/rank-R.result.pkl     rank R's value (sealed)
    ranks/rank-R.error.A.json   how rank R failed in attempt A (0 first, 1 after the first restart ...)

``python -m gpumagic.launch.external RUN_DIR`` is the agent's entry point; Slurm tasks call ``run_rank``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpumagic.launch.failures import RankOutcome
from gpumagic.launch.signing import read_sealed, write_sealed
from gpumagic.telemetry.private import write_private
from gpumagic.telemetry.store import RUN_DIR_VARIABLE

RANKS = "ranks"


def write_spec(run_dir: Path, spec: dict[str, Any], packed: bytes) -> None:
    """Write what the ranks of an external launch need, sealed: ``launch/spec.json`` and ``launch/payload.pkl``."""
    launch = run_dir / "launch"
    launch.mkdir(mode=0o700, exist_ok=True)
    (run_dir / RANKS).mkdir(mode=0o700, exist_ok=True)
    write_sealed(launch / "payload.pkl", packed)
    write_sealed(launch / "spec.json", json.dumps(spec, indent=1).encode())


def read_spec(run_dir: Path) -> dict[str, Any]:
    """The sealed spec of a run (raises PayloadRejected if it was changed, FileNotFoundError if absent)."""
    path = run_dir / "launch" / "spec.json"
    return json.loads(read_sealed(path, f"the launch description {path}"))


def rank_file(run_dir: Path, rank: int, suffix: str) -> Path:
    return run_dir / RANKS / f"rank-{rank}.{suffix}"


def rank_outcome(run_dir: Path, rank: int, attempt: int, failure: dict[str, Any] | None = None) -> RankOutcome:
    """How ``rank`` ended in ``attempt``: its own report, else the agent's ``failure`` record (exit code, pid),
    else stopped by its launcher (an agent or Slurm ended it because another rank failed)."""
    report = _read_json(rank_file(run_dir, rank, f"error.{attempt}.json"))
    if report is not None:
        return RankOutcome(
            rank,
            report.get("pid"),
            report.get("exitcode"),
            report.get("phase"),
            report.get("type"),
            report.get("message"),
            report.get("traceback"),
            report.get("timestamp"),
        )
    if failure is not None:
        return RankOutcome(rank, failure.get("pid"), failure.get("exitcode"), "process", timestamp=failure.get("time"))
    if rank_file(run_dir, rank, "result.pkl").exists():
        return RankOutcome(rank, None, 0)
    return RankOutcome(rank, None, -int(signal.SIGTERM), timestamp=time.time(), stopped_by_launcher=True)


def rank_outcomes(
    run_dir: Path, world_size: int, failures: dict[str, dict[str, Any]] | None = None
) -> list[RankOutcome]:
    """Every rank's outcome in its latest attempt (``failures``: the agents' records, by rank)."""
    outcomes = []
    for rank in range(world_size):
        attempt = int((_read_json(rank_file(run_dir, rank, "json")) or {}).get("attempt", 0))
        outcomes.append(rank_outcome(run_dir, rank, attempt, (failures or {}).get(str(rank))))
    return outcomes


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_rank(run_dir: Path) -> int:
    """Run this process's rank of the code in ``run_dir`` (torchrun's variables must be set); its exit code.

    Output goes to ``ranks/rank-R.log`` for the time of the call; the value to ``rank-R.result.pkl``; a
    failure to ``rank-R.error.A.json`` with the user's traceback.
    """
    from gpumagic.launch.worker import _flush, join_process_group, leave_process_group, rank_namespace, report_failure

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.environ[RUN_DIR_VARIABLE] = str(run_dir)
    with _output_to(rank_file(run_dir, rank, "log")):
        started = {"rank": rank, "attempt": attempt, "pid": os.getpid(), "host": socket.gethostname()}
        write_private(rank_file(run_dir, rank, "json"), json.dumps({**started, "started": time.time()}).encode())
        phase = "setup"
        try:
            spec = read_spec(run_dir)
            sys.path[:0] = [p for p in spec.get("sys_path", []) if p not in sys.path]  # the notebook's modules
            use_cuda = bool(spec.get("use_cuda"))
            if use_cuda:
                _own_gpus(local_rank, local_world_size)
            else:  # a CPU group on a GPU machine: its ranks see no GPU, on every node
                os.environ["CUDA_VISIBLE_DEVICES"] = ""
            import cloudpickle
            import torch

            torch.set_num_threads(int(spec.get("threads_per_rank") or 1))
            payload_path = run_dir / "launch" / "payload.pkl"
            payload = cloudpickle.loads(read_sealed(payload_path, f"the code sent to the ranks ({payload_path})"))
            payload.prepare()
            device = torch.device("cpu")
            if use_cuda:
                torch.cuda.set_device(0)
                device = torch.device("cuda", 0)
            backend = spec.get("backend")
            if backend:
                phase = "rendezvous"
                addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
                served = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # a static rendezvous's store
                prefix = f"/worker/attempt_{attempt}" if served else None
                join_process_group(
                    backend, addr, port, rank, world_size, float(spec.get("timeout_s", 1800)), served_prefix=prefix
                )
            phase = "user code"
            value = payload.run(rank_namespace(rank, local_rank, world_size, device))
            write_sealed(rank_file(run_dir, rank, "result.pkl"), cloudpickle.dumps(value))
            if backend:
                leave_process_group()
        except BaseException as err:  # noqa: BLE001 - every way a rank ends must be reported
            return report_failure(run_dir / RANKS, f"rank-{rank}.error.{attempt}.json", rank, phase, err)
        finally:
            _flush()  # the points logged since the last periodic write
    return 0


def _own_gpus(local_rank: int, local_world_size: int) -> None:
    """Narrow ``CUDA_VISIBLE_DEVICES`` to this rank's share of the node's GPUs (the same number each)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        visible = [str(i) for i in range(local_world_size)]
    per_rank = max(1, len(visible) // max(1, local_world_size))
    mine = visible[local_rank * per_rank : (local_rank + 1) * per_rank]
    if not mine:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: this node shows {len(visible)} GPU(s) to {local_world_size} ranks"
        )
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)


@contextmanager
def _output_to(path: Path) -> Any:
    """Send file descriptors 1 and 2 (so C libraries too) to ``path``, appended; put them back after."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.reconfigure(line_buffering=True)
            except (AttributeError, ValueError):
                pass
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for each in (fd, *saved):
            os.close(each)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m gpumagic.launch.external RUN_DIR  (gpumagic's agent starts it)\n")
        return 2
    from gpumagic.launch.worker import die_with_parent

    die_with_parent()
    code = run_rank(Path(argv[0]))
    sys.stdout.flush()
    os._exit(code)  # as a local rank does: skip teardown that could hang in a library's destructor


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

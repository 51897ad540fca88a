"""One node of a multi-node launch: torch.distributed.elastic's agent running the ranks of a run directory.

``python -m gpumagic.agent --rdzv-endpoint HOST:PORT --run-dir DIR`` (``%%launch_ddp --nnodes N`` prints it,
and starts the agent of its own node). The agent checks the run's seals before anything else, joins the
rendezvous (c10d, or static with ``--node-rank``), starts this node's ranks (``launch.rank_side.rank``), restarts
the whole group when a rank fails (up to the run's ``max_restarts``), and records what happened in
``agents/<node>.events.jsonl`` of the run directory.

Rendezvous stores listen only on the address they are named by: the rendezvous endpoint (served by the
notebook's node, on the socket the kernel bound) and each round's rank-0 store (bound by rank 0 on a port of its
own, published in the run directory); both are gpumagic's own stores (``secure_store``), which only this run's
agents and ranks can use.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpumagic.errors import GpumagicError
from gpumagic.launch import secure_store
from gpumagic.launch.options import parse_endpoint
from gpumagic.launch.rank_side.lifeline import die_with_parent
from gpumagic.launch.rank_side.process_group import rendezvous_name
from gpumagic.launch.rank_side.usage import start_sampling
from gpumagic.launch.store_server import serve_and_connect
from gpumagic.run_dirs.launch_files import read_spec, store_key
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.private import open_private
from gpumagic.run_dirs.signing import read_sealed

_log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # to reach the rendezvous: it listens from before the run directory exists


class AgentError(GpumagicError):
    """The agent cannot run this node (bad arguments, unreachable rendezvous)."""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def agent_command(endpoint: str, run_dir: Path, node_rank: int | None = None) -> str:
    """The command that starts another node's agent for a run."""

    command = f"python -m gpumagic.agent --rdzv-endpoint {endpoint} --run-dir {shlex.quote(str(run_dir))}"
    return command + (f" --node-rank {node_rank}" if node_rank is not None else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpumagic.agent",
        description="Run this node's ranks of a multi-node %%launch_ddp (the notebook prints this command).",
    )
    parser.add_argument("--rdzv-endpoint", required=True, metavar="HOST:PORT", help="the rendezvous, as printed")
    parser.add_argument("--run-dir", required=True, help="the run's directory (on a filesystem every node shares)")
    parser.add_argument("--node-rank", type=int, help="this node's rank (runs launched with --node-rank only)")
    parser.add_argument("--local-addr", help="the address other nodes reach this node at (default: its name)")
    parser.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # the kernel's bound rendezvous socket
    parser.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-only", action="store_true", help=argparse.SUPPRESS)  # a login node's kernel
    args = parser.parse_args(argv)
    if args.die_with_parent:
        die_with_parent(signal.SIGTERM)
    try:
        if args.serve_only:
            return serve_rendezvous(Path(args.run_dir), args.rdzv_endpoint, args.listen_fd)
        return run_agent(
            Path(args.run_dir),
            args.rdzv_endpoint,
            node_rank=args.node_rank,
            local_addr=args.local_addr,
            listen_fd=args.listen_fd,
        )
    except GpumagicError as err:
        sys.stderr.write(f"gpumagic agent: {err}\n")
        return 2


def run_agent(
    run_dir: Path,
    endpoint: str,
    *,
    node_rank: int | None = None,
    local_addr: str | None = None,
    listen_fd: int | None = None,
) -> int:
    """Run this node's ranks until the group finishes or gives up; 0 when every rank finished.

    Raises:
        PayloadRejected: the run's description or code does not carry the user's seal.
        AgentError: bad arguments for this run, or the rendezvous cannot be served or reached.
    """

    files = RunFiles(run_dir)
    if not files.launch.is_dir():
        raise AgentError(f"{run_dir} is not a gpumagic run directory (no launch/ in it); pass the one printed")
    spec = read_spec(files)
    read_sealed(files.payload, f"the code sent to the ranks ({files.payload})")  # refuse before joining anything
    host, port = parse_endpoint(endpoint)
    nnodes = int(spec["nnodes"])
    static = bool(spec.get("static"))
    if static and (node_rank is None or not 0 <= node_rank < nnodes):
        raise AgentError(f"this run names its nodes: pass --node-rank from 0 to {nnodes - 1}")
    if not static and node_rank is not None:
        raise AgentError("this run uses c10d rendezvous, which numbers the nodes itself; leave out --node-rank")
    if local_addr is None and is_loopback(host):
        local_addr = host  # a run on loopback stays on loopback
    _set_environment(spec, host)
    label = f"{socket.gethostname()}-{os.getpid()}"
    events = _Events(files.agent_events(label))
    hosting = listen_fd is not None or (static and node_rank == 0)
    store = _rendezvous_store(files, spec, (host, port), hosting, listen_fd)
    handler = _rendezvous_handler(spec, store, endpoint, node_rank, local_addr)
    agent = _agent(spec, run_dir, handler, events, local_addr, (host, port) if static else None)
    events.write("started", node=label, hosting=hosting, slurm_node=os.environ.get("SLURMD_NODENAME"))
    # the dashboard draws every node's ranks from these samples
    start_sampling(run_dir, nnodes * int(spec["nproc_per_node"]), bool(spec.get("use_cuda")))
    _stop_when_asked(files.stop)
    try:
        result = agent.run()
    except Exception as err:  # noqa: BLE001 - e.g. the rendezvous closed or timed out: say it, exit non-zero
        _log.debug("the elastic agent failed; the error is recorded and the agent exits 1", exc_info=True)
        events.write("error", message=f"{type(err).__name__}: {err}")
        sys.stderr.write(f"gpumagic agent: {type(err).__name__}: {err}\n")
        return 1
    if result.is_failed():
        events.write("gave up", failures=_failures(result))
        return 1
    events.write("finished")
    return 0


def serve_rendezvous(run_dir: Path, endpoint: str, listen_fd: int | None) -> int:
    """Serve only the rendezvous of a run whose ranks all run on other nodes (a kernel on an allocation's login
    node), until the notebook writes the stop file or ends this process.

    Raises:
        PayloadRejected, AgentError: as ``run_agent``.
    """
    files = RunFiles(run_dir)
    spec = read_spec(files)
    read_sealed(files.payload, f"the code sent to the ranks ({files.payload})")
    _rendezvous_store(files, spec, parse_endpoint(endpoint), True, listen_fd)
    _stop_when_asked(files.stop)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


def _set_environment(spec: dict[str, Any], host: str) -> None:
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # each round's rank 0 serves its own bound store
    os.environ["OMP_NUM_THREADS"] = str(spec.get("threads_per_rank") or 1)
    if is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    for key, value in (spec.get("env") or {}).items():
        os.environ[key] = str(value)


def _rendezvous_store(
    files: RunFiles, spec: dict[str, Any], endpoint: tuple[str, int], hosting: bool, listen_fd: int | None
) -> Any:
    """The rendezvous store (``secure_store``): served here when this node hosts it, else reached at the
    endpoint; either way only this run's agents and ranks get in (its proofs name the run's key and the
    rendezvous as the run's spec names it, however this agent was told to reach it)."""

    host, port = endpoint
    address = secure_store.tcp_address(host, port)
    key, name = store_key(files), rendezvous_name(spec.get("rdzv_endpoint") or f"{host}:{port}")
    timeout_s = float(spec.get("join_timeout_s", 600))
    if not hosting:
        try:
            client = secure_store.connect(address, CONNECT_TIMEOUT_S, key=key, role=secure_store.RENDEZVOUS, name=name)
        except secure_store.StoreRefused as err:
            raise AgentError(f"{err}: is {host}:{port} the endpoint the notebook printed for this run?") from None
        except (TimeoutError, OSError) as err:
            raise AgentError(
                f"cannot reach the rendezvous at {host}:{port} ({err}); is the notebook's launch still running, and "
                "can this node reach that address?"
            ) from None
        client.set_timeout(datetime.timedelta(seconds=timeout_s))
        return client
    if listen_fd is not None:
        listener = socket.socket(fileno=listen_fd)
    else:
        try:
            listener = secure_store.listen(address)
        except OSError as err:
            raise AgentError(f"cannot listen on {host}:{port} ({err.strerror}); name an address of this node") from None
    server, client = serve_and_connect(listener, name, CONNECT_TIMEOUT_S, key=key, role=secure_store.RENDEZVOUS)
    _SERVED.append(server)  # for the agent's life
    client.set_timeout(datetime.timedelta(seconds=timeout_s))
    return client


_SERVED: list[Any] = []


def _rendezvous_handler(
    spec: dict[str, Any], store: Any, endpoint: str, node_rank: int | None, local_addr: str | None
) -> Any:
    # lazy: torch takes seconds to import; only rank processes need it
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    run_id = spec["rdzv_id"]
    nnodes = int(spec["nnodes"])
    if spec.get("static"):
        host, port = parse_endpoint(endpoint)
        handler = StaticTCPRendezvous(host, port, node_rank, nnodes, run_id, int(spec.get("join_timeout_s", 600)))
        handler._store = store  # serve from the store bound above, not one listening on every interface
        return handler
    parameters = RendezvousParameters(
        backend="c10d",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=nnodes,
        max_nodes=nnodes,
        local_addr=local_addr,
        join_timeout=str(int(spec.get("join_timeout_s", 600))),
        last_call_timeout="1",
        close_timeout="10",
    )
    return create_handler(store, C10dRendezvousBackend(store, run_id), parameters)


def _agent(
    spec: dict[str, Any], run_dir: Path, handler: Any, events: _Events, local_addr: str | None, master: Any
) -> Any:
    # lazy: torch takes seconds to import; only rank processes need it
    from torch.distributed.elastic.agent.server.api import (
        RunResult,
        WorkerSpec,
        WorkerState,
    )
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class RecordingAgent(LocalElasticAgent):
        """torch's agent, recording each failed attempt (which ranks, how) for the notebook to tell."""

        def _monitor_workers(self, worker_group: Any) -> RunResult:
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED:
                remaining = getattr(self, "_remaining_restarts", 0)
                events.write(
                    "failed",
                    attempt=worker_group.spec.max_restarts - remaining,
                    restarts_left=remaining,
                    failures=_failures(result),
                )
            return result

    worker_spec = WorkerSpec(
        role="gpumagic",
        local_world_size=int(spec["nproc_per_node"]),
        entrypoint=sys.executable,
        args=("-m", "gpumagic.launch.rank_side.rank", str(run_dir)),
        rdzv_handler=handler,
        max_restarts=int(spec.get("max_restarts", 0)),
        monitor_interval=0.1,
        master_addr=master[0] if master else None,
        master_port=master[1] if master else None,
        local_addr=local_addr,
    )
    logs = DefaultLogsSpecs(log_dir=str(RunFiles(run_dir).torchelastic_logs))
    return RecordingAgent(spec=worker_spec, logs_specs=logs, start_method="spawn")


def _failures(result: Any) -> dict[str, dict[str, Any]]:
    return {
        str(rank): {"exitcode": failure.exitcode, "pid": failure.pid, "time": failure.timestamp}
        for rank, failure in result.failures.items()
    }


class _Events:
    """``agents/<node>.events.jsonl``: one JSON line per event, appended by this agent only."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "time": time.time(), **fields}) + "\n"

        with self._lock, open_private(self.path) as handle:
            handle.write(line.encode())


def _stop_when_asked(stop_file: Path) -> None:
    """The notebook writes ``stop`` when it is interrupted: every agent then stops as on SIGTERM."""

    def watch() -> None:
        while not stop_file.exists():
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="gpumagic-agent-stop", daemon=True).start()


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every agent's events of a run, oldest first, each with its ``node``."""
    found = []
    for node, path in RunFiles(run_dir).agent_event_files().items():
        for line in path.read_text().splitlines():
            try:
                found.append({"node": node, **json.loads(line)})
            except ValueError:
                continue  # a line being written
    return sorted(found, key=lambda e: e.get("time", 0))


if __name__ == "__main__":
    sys.exit(main())

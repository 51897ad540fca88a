"""Multi-node launches from the notebook: ``%%launch_ddp --nnodes N --rdzv-endpoint HOST:PORT``.

The kernel writes the sealed code and launch description into a run directory every node can read, binds
the rendezvous socket on the address the user named, starts this node's agent (``launch.rank_side.agent``, torch
elastic underneath) and prints the one command that starts each other node's agent. It then follows the run
through the directory: every rank's output (``ranks/rank-R.log``), the agents' restarts and failures
(``agents/*.events.jsonl``) and, at the end, every rank's sealed result. The kernel never imports torch.
"""

from __future__ import annotations

import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumagic.errors import GpumagicError, InvalidArgument
from gpumagic.launch.allocation import Allocation
from gpumagic.launch.failures import LaunchError, LaunchInterrupted
from gpumagic.launch.hang_reports import HangFollower
from gpumagic.launch.kernel_side import tracked
from gpumagic.launch.kernel_side.node_agents import NodeAgents, start_agents
from gpumagic.launch.kernel_side.output import RankOutput, progress_lines
from gpumagic.launch.options import LaunchOptions
from gpumagic.launch.plan import threads_per_rank
from gpumagic.launch.rank_side.agent import AgentError, agent_command, read_events
from gpumagic.launch.secure_store import BACKLOG
from gpumagic.run_dirs import store
from gpumagic.run_dirs.launch_files import write_spec
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.outcomes import ProcessEnd, rank_outcomes, read_outcome, read_rank_start, read_result, root_cause

RESULTS_WAIT_S = 60.0  # after this node's agent finished, for the other nodes' results to appear


@dataclass
class Rendezvous:
    """What an elastic launch holds before its ranks start: the endpoint (listening, if this node serves it)
    and the run directory."""

    endpoint: str
    listener: socket.socket | None
    run_dir: Path

    def abandon(self) -> None:
        """Give it all back: the launch was refused after all."""
        if self.listener is not None:
            self.listener.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def prepare_elastic(launch: LaunchOptions) -> Rendezvous:
    """Listen on the endpoint (node 0) and make the run directory, before anything else is taken (GPUs): a taken
    port or an unusable ``runs_dir`` is refused with nothing leased.

    Raises:
        InvalidArgument: the endpoint or the run directory cannot be used here.
    """
    host, port = launch.rendezvous_address()
    listener = _bind(host, port) if launch.hosts_rendezvous else None
    if listener is not None:
        port = listener.getsockname()[1]
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        run_dir = store.new_run(
            "ddp",
            ranks=0,  # known once the GPUs are
            root=Path(launch.runs_dir) if launch.runs_dir is not None else None,
            nnodes=launch.nnodes,
            rdzv_endpoint=endpoint,
        )
    except OSError as err:
        if listener is not None:
            listener.close()
        raise InvalidArgument(f"cannot create the run directory in {launch.runs_dir}: {err.strerror}") from None
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    return Rendezvous(endpoint, listener, run_dir)


def launch_elastic(
    packed: bytes,
    nprocs: int,
    launch: LaunchOptions,
    *,
    backend: str,
    use_cuda: bool,
    gpu_uuids: list[str],
    write: Callable[[str], None],
    dashboard: Any = None,
    poll_s: float = 0.1,
    rendezvous: Rendezvous | None = None,
) -> dict[int, Any]:
    """Run a packed payload on ``launch.nnodes`` nodes of ``nprocs`` ranks each; ``{rank: value}`` of every rank.

    ``rendezvous``: what ``prepare_elastic`` set up already (else it is set up here).

    Raises:
        LaunchError: the group failed with no restart left (root cause and every rank's fate).
        LaunchInterrupted: interrupted (or the dashboard's Stop); every node was told to stop.
        InvalidArgument: the endpoint cannot be served here. AgentError: this node's agent could not run.
    """
    if rendezvous is None:
        rendezvous = prepare_elastic(launch)
    run_dir, endpoint, listener = rendezvous.run_dir, rendezvous.endpoint, rendezvous.listener
    world_size = launch.nnodes * nprocs
    store.update_run(run_dir, ranks=world_size, backend=backend)
    spec = {
        "nnodes": launch.nnodes,
        "nproc_per_node": nprocs,
        "rdzv_endpoint": endpoint,
        "rdzv_id": launch.rdzv_id or run_dir.name,
        "static": launch.node_rank is not None,
        "max_restarts": launch.max_restarts,
        "backend": backend,
        "use_cuda": use_cuda,
        "timeout_s": launch.timeout_s,
        "hang_after_s": launch.hang_after_s,
        "threads_per_rank": threads_per_rank(nprocs),
        "sys_path": [p for p in sys.path if p],  # where the notebook imports from: the nodes share it, usually
    }
    files = RunFiles(run_dir)
    write_spec(files, spec, packed)
    write(_announce(spec, run_dir, launch.node_rank, launch.allocation))
    agents = start_agents(run_dir, endpoint, listener, launch.node_rank, gpu_uuids, launch.allocation, launch.nnodes)
    sink = RankOutput(write, launch.output, world_size, progress_lines())
    follower = _Follower(run_dir, world_size, launch.max_restarts, sink, write)
    hangs = HangFollower.of_run(run_dir, world_size, launch.hang_after_s, lambda text: write(text + "\n"))
    status = "failed"
    exporting = tracked.follow(run_dir, "ddp", launch, nprocs=nprocs, world_size=world_size, backend=backend)
    try:
        _follow(agents, follower, dashboard, run_dir, spec, poll_s, hangs.poll)
        if agents.returncode != 0:
            raise follower.failure(agents.returncode or 1)
        results = follower.results()
        status = "finished"
        return results
    except (KeyboardInterrupt, _Cancelled) as reason:
        status = "interrupted"
        took = agents.stop()
        follower.drain()
        why = "stopped from the dashboard" if isinstance(reason, _Cancelled) else "interrupted"
        raise LaunchInterrupted(
            f"{why}; told every node to stop (the agents started here ended in {took:.1f}s)"
        ) from None
    finally:
        if agents.running():
            agents.stop()
        agents.close()
        follower.drain()
        store.finish_run(run_dir, status)
        tracked.end(exporting, status, lambda line: write(line + "\n"))
        if dashboard is not None:
            dashboard.finish(status)


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=BACKLOG)
    except OSError as err:
        raise InvalidArgument(
            f"cannot listen on {host}:{port} ({err.strerror}): the notebook's node serves the rendezvous, so "
            "--rdzv-endpoint must name an address of this machine and a free port (port 0 takes one)"
        ) from None


def _announce(spec: dict[str, Any], run_dir: Path, node_rank: int | None, allocation: Allocation | None) -> str:
    restarts = f", up to {spec['max_restarts']} group restart(s)" if spec["max_restarts"] else ""
    kind = "static rendezvous" if spec["static"] else f"c10d rendezvous (id {spec['rdzv_id']})"
    lines = [
        f"[gpumagic] {spec['nnodes']} nodes × {spec['nproc_per_node']} rank(s), {kind} at {spec['rdzv_endpoint']}"
        f"{restarts}; run directory {run_dir}",
    ]
    if allocation is not None:
        nodes = allocation.nodes_to_start(int(spec["nnodes"]))
        here = f"this node ({allocation.here}) and " if allocation.here else ""
        lines.append(f"[gpumagic] {allocation.describe()}: ranks on {here}{', '.join(nodes)} (srun --overlap)")
        return "\n".join(lines) + "\n"
    lines.append(
        "[gpumagic] on each other node, in the same Python environment and with this directory reachable, run:"
    )
    if node_rank is None:
        lines.append("  " + agent_command(spec["rdzv_endpoint"], run_dir))
    else:
        lines += [
            "  " + agent_command(spec["rdzv_endpoint"], run_dir, rank)
            for rank in range(spec["nnodes"])
            if rank != node_rank
        ]
    return "\n".join(lines) + "\n"


class _Cancelled(Exception):
    """The dashboard's Stop button."""


def _follow(
    agents: NodeAgents,
    follower: _Follower,
    dashboard: Any,
    run_dir: Path,
    spec: dict[str, Any],
    poll_s: float,
    look_for_hangs: Callable[[], Any],
) -> None:
    attached = told_stop = False
    while agents.running():
        follower.read()
        look_for_hangs()
        agents.check_nodes()
        if agents.failed_early() and not told_stop:  # one node gave up: the others stop too, not at their timeout
            agents.tell_stop()
            told_stop = True
        if dashboard is not None:
            if not attached and follower.started():
                dashboard.attach(run_dir, follower.local_pids(), use_gpus=spec["use_cuda"])
                attached = True
            if dashboard.cancel.is_set():
                raise _Cancelled()
        time.sleep(poll_s)
    follower.read()


class _Follower:
    """Reads a run directory as the ranks and agents write it: output, starts, failures, results."""

    def __init__(
        self, run_dir: Path, world_size: int, max_restarts: int, sink: RankOutput, write: Callable[[str], None]
    ) -> None:
        self.run_dir = run_dir
        self.files = RunFiles(run_dir)
        self.world_size = world_size
        self.max_restarts = max_restarts
        self.sink = sink
        self.write = write
        self.offsets = [0] * world_size
        self.events_seen = 0
        self.restarts = 0
        self._announced: set[int] = set()  # attempts whose restart was told already
        self._lock = threading.Lock()

    def read(self) -> None:
        with self._lock:
            for rank in range(self.world_size):
                path = self.files.rank_log(rank)
                try:
                    with open(path, "rb") as handle:
                        handle.seek(self.offsets[rank])
                        data = handle.read()
                except FileNotFoundError:
                    continue
                if data:
                    self.offsets[rank] += len(data)
                    self.sink.feed(rank, data)
            events = read_events(self.run_dir)
            for event in events[self.events_seen :]:
                self._tell(event)
            self.events_seen = len(events)

    def drain(self) -> None:
        self.read()
        self.sink.flush()

    def _tell(self, event: dict[str, Any]) -> None:
        if event["event"] != "failed":
            return
        failures = event.get("failures") or {}
        attempt = int(event.get("attempt", 0))
        what = "; ".join(self._describe(int(rank), attempt, failure) for rank, failure in sorted(failures.items()))
        left = int(event.get("restarts_left", 0))
        self.sink.flush()
        if attempt in self._announced:  # another node's ranks, failing because the first failure broke the group
            self.write(f"[gpumagic] then {_first_line(what)}\n")
            return
        self._announced.add(attempt)
        if left > 0:
            self.restarts += 1
            then = f"restarting the group (restart {attempt + 1} of {self.max_restarts})"
        else:
            then = "no restart left" if self.max_restarts else "no restarts allowed (--max-restarts 0)"
        self.write(f"[gpumagic] {_first_line(what)}; {then}\n")

    def _describe(self, rank: int, attempt: int, failure: dict[str, Any]) -> str:
        end = ProcessEnd(failure.get("pid"), failure.get("exitcode"), failure.get("time"))
        return read_outcome(self.files, rank, attempt, end).describe()

    def started(self) -> bool:
        return all(self.files.rank_start(rank).exists() for rank in range(self.world_size))

    def local_pids(self) -> list[int | None]:
        host = socket.gethostname()
        pids: list[int | None] = []
        for rank in range(self.world_size):
            record = read_rank_start(self.files, rank)
            pids.append(record.get("pid") if record.get("host") == host else None)
        return pids

    def failure(self, returncode: int) -> GpumagicError:
        """The error for a run whose agent on this node exited with ``returncode``."""
        self.drain()
        events = read_events(self.run_dir)
        last_failures: dict[str, Any] = {}
        for event in events:
            if event["event"] in ("failed", "gave up"):
                last_failures.update(event.get("failures") or {})
        outcomes = rank_outcomes(self.files, self.world_size, last_failures)
        cause = root_cause(outcomes)
        if cause is not None:
            note = f"The group was restarted {self.restarts} time(s) before." if self.restarts else ""
            return LaunchError(outcomes, cause, note)
        log = self.files.notebook_agent_log
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
        said = lines[-1] if lines else f"exit code {returncode}"
        return AgentError(f"this node's agent stopped before the ranks could run: {said} (log: {log})")

    def results(self) -> dict[int, Any]:
        """Every rank's value, waiting a little for the other nodes' files to appear."""
        deadline = time.monotonic() + RESULTS_WAIT_S
        paths = [self.files.rank_result(rank) for rank in range(self.world_size)]
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                missing = [rank for rank, p in enumerate(paths) if not p.exists()]
                raise AgentError(
                    f"this node finished, but no result came from rank(s) {missing} within {RESULTS_WAIT_S:.0f}s: is "
                    f"{self.files.ranks} on a filesystem every node shares?"
                )
            time.sleep(0.1)
        self.drain()
        return {rank: read_result(self.files, rank) for rank in range(self.world_size)}


def _first_line(text: str, limit: int = 300) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"

"""The agents of a multi-node launch that the kernel starts: this node's (``python -m gpumagic.agent``, handed the
rendezvous socket the kernel bound), and inside a Slurm allocation the other nodes' too, one per node through
``srun --overlap``. On a login node, where no rank runs, a rendezvous-only agent serves the nodes instead.

``NodeAgents`` follows them as one: running while any agent that runs ranks is, its exit code the first failure,
every expected node named when it has not started its agent in time, and one ``stop`` for all of them (the run's
stop file first, so each node stops its own ranks; then signals).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpumagic.launch.allocation import Allocation, srun_command, srun_environment
from gpumagic.launch.plan import command_environment
from gpumagic.launch.process_set import ProcessSet
from gpumagic.launch.rank_side.agent import AgentError, read_events
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.private import open_private

_log = logging.getLogger(__name__)

NODE_TIMEOUT_VARIABLE = "GPUMAGIC_NODE_TIMEOUT"
NODE_TIMEOUT_S = 120.0  # for srun to start a node's agent and the agent to start (it imports torch)
STOP_GRACE_S = 10.0


class NodeAgents:
    """The agents this kernel started for a run, followed as one."""

    def __init__(self, run_dir: Path, ranks_here: subprocess.Popen | None, server: subprocess.Popen | None,
                 srun: subprocess.Popen | None, srun_nodes: list[str]) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.ranks_here = ranks_here
        self.server = server
        self.srun = srun
        self.srun_nodes = srun_nodes
        self.started = time.monotonic()
        self.timeout_s = node_timeout()
        self._all_answered = not srun_nodes

    @property
    def workers(self) -> list[subprocess.Popen]:
        """The processes whose end is the run's end: this node's agent and srun."""
        return [p for p in (self.ranks_here, self.srun) if p is not None]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.workers)

    @property
    def returncode(self) -> int | None:
        """The first non-zero exit code (0: all finished; None: some still run)."""
        codes = [p.poll() for p in self.workers]
        failed = [c for c in codes if c not in (None, 0)]
        return failed[0] if failed else (None if None in codes else 0)

    def failed_early(self) -> bool:
        """Whether an agent already failed while another still runs (the others are then told to stop)."""
        return any(p.poll() not in (None, 0) for p in self.workers) and self.running()

    def check_nodes(self) -> None:
        """Raises AgentError naming the nodes whose agent srun has not started within the timeout."""
        if self._all_answered:
            return
        started = [e for e in read_events(self.run_dir) if e.get("event") == "started"]
        # Slurm's name for the node (srun sets SLURMD_NODENAME), else its host name
        answered = {str(e.get("slurm_node") or e["node"].rsplit("-", 1)[0]).split(".")[0] for e in started}
        missing = [node for node in self.srun_nodes if node.split(".")[0] not in answered]
        if not missing:
            self._all_answered = True
            return
        waited = time.monotonic() - self.started
        if self.srun is not None and self.srun.poll() is not None:
            raise AgentError(
                f"srun ended (exit code {self.srun.returncode}) before node(s) {', '.join(missing)} started an agent: "
                f"{last_line(RunFiles(self.run_dir).agents / 'srun.log')}"
            )
        if waited > self.timeout_s:
            raise AgentError(
                f"node(s) {', '.join(missing)} did not answer within {self.timeout_s:.0f}s (srun started no agent "
                f"there); see sinfo -n {','.join(missing)}, or set {NODE_TIMEOUT_VARIABLE} to wait longer"
            )

    def tell_stop(self) -> None:
        """Write the run's stop file: every node's agent stops its ranks and exits."""
        with contextlib.suppress(OSError):
            open_private(RunFiles(self.run_dir).stop).close()

    def stop(self, grace_s: float = STOP_GRACE_S) -> float:
        """Stop every agent: the stop file, then SIGTERM what still runs after a moment, SIGKILL after ``grace_s``.
        The seconds it took."""
        began = time.monotonic()
        self.tell_stop()
        deadline = began + min(3.0, grace_s)
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        everyone = ProcessSet([p for p in (*self.workers, self.server) if p is not None])
        everyone.stop(signal.SIGTERM, grace_s=grace_s)
        everyone.close()
        return time.monotonic() - began

    def close(self) -> None:
        """After the run: the rendezvous-only agent has nothing left to serve."""
        if self.server is not None and self.server.poll() is None:
            servers = ProcessSet([self.server])
            servers.stop(signal.SIGTERM, grace_s=STOP_GRACE_S)
            servers.close()


def node_timeout() -> float:
    try:
        return max(1.0, float(os.environ.get(NODE_TIMEOUT_VARIABLE, NODE_TIMEOUT_S)))
    except ValueError:
        return NODE_TIMEOUT_S


def start_agents(
    run_dir: Path,
    endpoint: str,
    listener: socket.socket | None,
    node_rank: int | None,
    gpu_uuids: list[str],
    allocation: Allocation | None,
    nnodes: int,
) -> NodeAgents:
    """Start this node's agent (or, on a login node of an allocation, the rendezvous-only one) and, inside an
    allocation, the other nodes' agents through srun."""
    files = RunFiles(run_dir)
    files.agents.mkdir(mode=0o700, exist_ok=True)
    agent = [sys.executable, "-m", "gpumagic.agent", "--rdzv-endpoint", endpoint, "--run-dir", str(run_dir)]
    serve_only = allocation is not None and allocation.here is None
    local = _start_local(files, agent, listener, node_rank, gpu_uuids, serve_only)
    if allocation is None:
        return NodeAgents(run_dir, local, None, None, [])
    nodes = allocation.nodes_to_start(nnodes)
    env = srun_environment(command_environment())
    try:
        with open_private(files.agents / "srun.log") as log:
            srun = subprocess.Popen(
                srun_command(allocation, nodes, agent),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # an interrupt of the kernel reaches srun through NodeAgents.stop only
            )
    except OSError as err:
        local.kill()
        local.wait()
        raise AgentError(f"cannot start srun for the other nodes ({err.strerror})") from None
    if serve_only:
        return NodeAgents(run_dir, None, local, srun, nodes)
    return NodeAgents(run_dir, local, None, srun, nodes)


def _start_local(
    files: RunFiles,
    agent: list[str],
    listener: socket.socket | None,
    node_rank: int | None,
    gpu_uuids: list[str],
    serve_only: bool,
) -> subprocess.Popen:
    command = [*agent, "--die-with-parent"]
    if node_rank is not None:
        command += ["--node-rank", str(node_rank)]
    if serve_only:
        command.append("--serve-only")
    pass_fds: tuple[int, ...] = ()
    if listener is not None:
        listener.set_inheritable(True)
        pass_fds = (listener.fileno(),)
        command += ["--listen-fd", str(listener.fileno())]
    env = command_environment()
    if gpu_uuids:
        env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=",".join(gpu_uuids))
    try:
        with open_private(files.notebook_agent_log) as log:
            return subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=pass_fds
            )
    finally:
        if listener is not None:
            listener.close()  # the agent holds it now


def last_line(path: Path) -> str:
    """The last non-empty line of a log (``(empty)`` if none)."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        _log.debug("the log %s is unreadable; shown as '(no log)'", path, exc_info=True)
        return "(no log)"
    return lines[-1] if lines else "(empty)"

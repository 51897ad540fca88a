"""The Slurm allocation the notebook runs in (``salloc -N 2`` then ``jupyter lab``, Open OnDemand, batchspawner):
its nodes, the node the kernel is on (if it is one of them), and the address the nodes reach the kernel at.

A multi-node launch without ``--rdzv-endpoint`` inside an allocation serves the rendezvous from the kernel and
starts one agent per other node itself with ``srun --overlap`` (``launch.kernel_side.elastic``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from gpumagic.errors import InvalidArgument

_log = logging.getLogger(__name__)

HOSTLIST_PART = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?(?:,|$)")


@dataclass(frozen=True)
class Allocation:
    """A Slurm job the kernel runs inside: ``job_id``, its ``nodes`` in Slurm's order, ``here`` (this machine's
    node name, when the kernel runs on one of the nodes), ``address`` (this machine's address that the nodes
    reach: the rendezvous listens there) and ``gpus_per_node``."""

    job_id: str
    nodes: tuple[str, ...]
    here: str | None
    address: str
    gpus_per_node: int = 0  # what Slurm allocated on each node (gres/gpu), 0 if none or unknown

    def nodes_to_start(self, nnodes: int) -> list[str]:
        """The nodes whose agents srun starts for a launch on ``nnodes`` nodes: the others after this one, or the
        first ``nnodes`` where the kernel is on none of them (a login node)."""
        if self.here is not None:
            return [node for node in self.nodes if node != self.here][: nnodes - 1]
        return list(self.nodes[:nnodes])

    def describe(self) -> str:
        return f"Slurm allocation {self.job_id} ({len(self.nodes)} node(s): {', '.join(self.nodes)})"


def current(environ: Mapping[str, str] = os.environ) -> Allocation | None:
    """The allocation this process runs inside (``SLURM_JOB_ID`` and its node list), or None.

    Raises:
        InvalidArgument: inside an allocation whose nodes cannot be reached from here (named).
    """
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    node_list = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job_id or not node_list:
        return None
    # a step's variables name the step's nodes (a kernel started by srun sees only its own): the job's are the
    # controller's to tell
    fields = job_fields(job_id)
    nodes = tuple(expand_hostlist(fields.get("NodeList") or node_list))
    names = {socket.gethostname(), socket.gethostname().split(".")[0], environ.get("SLURMD_NODENAME", "")}
    here = next((node for node in nodes if node in names), None)
    others = [node for node in nodes if node != here]
    address = contact_address(others[0]) if others else "127.0.0.1"
    return Allocation(job_id, nodes, here, address, allocated_gpus(fields.get("AllocTRES", "")) // max(1, len(nodes)))


def job_fields(job_id: str) -> dict[str, str]:
    """The job's fields as the controller has them (``scontrol show job``: ``NodeList``, ``AllocTRES`` ...); {} if
    it cannot tell."""
    if shutil.which("scontrol") is None:
        return {}
    try:
        done = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        _log.debug("scontrol failed for job %s; its fields are taken as unknown", job_id, exc_info=True)
        return {}
    if done.returncode != 0:
        return {}
    return {key: value for key, value in parse_fields(done.stdout).items() if value and value != "(null)"}


def parse_fields(line: str) -> dict[str, str]:
    """``scontrol show --oneliner``'s ``Key=Value`` words (a value with spaces, such as ``Command``, is cut).

    >>> parse_fields("JobId=7 JobState=RUNNING Reason=None NodeList=n[1-2]")["NodeList"]
    'n[1-2]'
    """
    return dict(word.split("=", 1) for word in line.split() if "=" in word)


def allocated_gpus(tres: str) -> int:
    """The GPUs in a job's ``AllocTRES``, all nodes together.

    >>> allocated_gpus("cpu=16,mem=64G,node=2,billing=16,gres/gpu=8,gres/gpu:a100=8")
    8
    """
    for part in tres.split(","):
        key, _, value = part.partition("=")
        if key == "gres/gpu" and value.isdigit():
            return int(value)
    return 0


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list as names, in order.

    >>> expand_hostlist("gpu[01-03,7],login1")
    ['gpu01', 'gpu02', 'gpu03', 'gpu7', 'login1']
    """
    names: list[str] = []
    for prefix, ranges in HOSTLIST_PART.findall(text.strip()):
        if not ranges:
            names.append(prefix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            width = len(first)
            names += [f"{prefix}{n:0{width}d}" for n in range(int(first), int(last or first) + 1)]
    return names


def contact_address(node: str) -> str:
    """This machine's address on the route to ``node``: where that node reaches the kernel.

    Raises:
        InvalidArgument: ``node`` does not resolve, or no route leads there.
    """
    try:
        target = socket.getaddrinfo(node, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(target[0], socket.SOCK_DGRAM) as probe:
            probe.connect(target[4])  # UDP: picks the route and source address, sends nothing
            return str(probe.getsockname()[0])
    except OSError as err:
        raise InvalidArgument(
            f"the allocation's node {node} cannot be reached from here ({err}); give --rdzv-endpoint HOST:PORT, an "
            "address of this machine the nodes reach"
        ) from None


def check_srun() -> None:
    """Raises InvalidArgument (saying what to do) unless ``srun`` can start the other nodes' agents."""
    if shutil.which("srun") is None:
        raise InvalidArgument(
            "a multi-node launch inside a Slurm allocation starts the other nodes' agents with srun, which is not on "
            "PATH here; add Slurm's bin directory to PATH, or give --rdzv-endpoint and start the agents yourself"
        )


# what a kernel inside a step (started by srun) sees of that step's shape, even as its job's (SLURM_JOB_NODELIST
# names the step's one node there): an srun given them refuses more nodes ("Only allocated 1 nodes asked for 2")
STEP_SHAPE = (
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NODELIST",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_TASKS_PER_NODE",
)


def srun_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """``environment`` for the kernel's ``srun --overlap --jobid``: without its step's shape, so srun reads the
    job's nodes from the controller, and without its GPUs (each node's are Slurm's to give the step)."""
    return {
        name: value
        for name, value in environment.items()
        if name not in (*STEP_SHAPE, "CUDA_VISIBLE_DEVICES") and not name.startswith(("SLURM_STEP", "SLURM_JOB_CPUS"))
    }


def srun_command(allocation: Allocation, nodes: list[str], agent: list[str], name: str = "gpumagic-agent") -> list[str]:
    """``srun --overlap`` running ``agent`` once on each of ``nodes`` of the allocation, as step ``name``."""
    return [
        "srun",
        "--overlap",
        f"--jobid={allocation.job_id}",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        "--kill-on-bad-exit=0",
        f"--job-name={name}",
        *([f"--gres=gpu:{allocation.gpus_per_node}"] if allocation.gpus_per_node else []),  # each node's GPUs
        *agent,
    ]

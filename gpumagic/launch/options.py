"""A launch's options as one value, ``LaunchOptions``: checked once, when it is made, with what follows from them
(the timeout in seconds, whether the launch is elastic, its rendezvous endpoint).

The magics build it from their arguments and the launch API (``launch_ddp``, ``spawn``, ``launch_prepared``,
``check_launch``) from its keywords; local and elastic launches, background jobs, Slurm launches and ``%ddp``
groups all read it, so an option means the same, and is refused with the same words, everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from gpumagic.errors import InvalidArgument
from gpumagic.launch.allocation import Allocation, check_srun, current
from gpumagic.launch.option_table import (
    check_hang_after,  # noqa: F401 (kernel_side/group.py imports it from here)
    default,
    is_whole,
    on,
)

MAX_NODES = 1024
MAX_RESTARTS = 100
RDZV_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
LOCAL_ENDPOINT = "127.0.0.1:0"  # an elastic launch on this machine alone: loopback, a free port
# what a launch on this machine alone, without restarts, has; anything else makes it elastic
ELASTIC_DEFAULTS = {
    "nnodes": 1,
    "rdzv_endpoint": None,
    "node_rank": None,
    "rdzv_id": None,
    "max_restarts": 0,
    "runs_dir": None,
}


@dataclass(frozen=True)
class LaunchOptions:
    """What a launch was asked for; making one checks every option (``InvalidArgument``, one line, naming it).

    ``nprocs`` ``None``: one rank per GPU the launch gets (``gpus_per_rank`` each), or 2 on the CPU. ``gpus``: a
    device spec, ``"auto"`` (pick free ones) or ``"none"``; ``None``: the GPUs this kernel sees (checked when
    they are read). ``timeout``: the process group's (``"30m"``, seconds). Multi-node and elastic: ``nnodes``,
    ``rdzv_endpoint``, ``node_rank`` or ``rdzv_id``, ``max_restarts``, ``runs_dir``. ``process_group`` ``False``
    is ``spawn``'s launch, whose code makes its own group.

    >>> LaunchOptions(2, gpus="none", timeout="1m").timeout_s
    60.0
    """

    nprocs: int | None = default("launch", "nprocs")
    gpus: str | None = default("launch", "gpus")
    gpus_per_rank: int = default("launch", "gpus_per_rank")
    backend: str | None = default("launch", "backend")
    port: int | None = default("launch", "port")
    timeout: str | float = default("launch", "timeout")
    start_method: str = default("launch", "start_method")
    output: str = default("launch", "output")
    nnodes: int = default("launch", "nnodes")
    rdzv_endpoint: str | None = default("launch", "rdzv_endpoint")
    node_rank: int | None = default("launch", "node_rank")
    rdzv_id: str | None = default("launch", "rdzv_id")
    max_restarts: int = default("launch", "max_restarts")
    runs_dir: str | None = default("launch", "runs_dir")
    process_group: bool = True
    hang_after: str | float = default("launch", "hang_after")
    pdb: bool = default("launch", "pdb")
    timeout_s: float = field(init=False, repr=False, compare=False)
    hang_after_s: float = field(init=False, repr=False, compare=False)
    # the Slurm allocation whose nodes a multi-node launch without an endpoint runs on (srun starts their agents)
    allocation: Allocation | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        timeout_s, hang_after_s = self._check()
        object.__setattr__(self, "timeout_s", timeout_s)
        object.__setattr__(self, "hang_after_s", hang_after_s)

    @classmethod
    def of(cls, nprocs: int | None, options: Mapping[str, Any], *, process_group: bool = True) -> LaunchOptions:
        """The options a launch function was given as keywords.

        Raises:
            InvalidArgument: an unknown option (named), or a bad value.
        """
        unknown = set(options) - set(USER_OPTIONS)
        if unknown:
            raise InvalidArgument(f"unknown launch option(s): {', '.join(sorted(unknown))}")
        return cls(nprocs, process_group=process_group, **options)

    @classmethod
    def for_group(cls, nprocs: int | None = None, **options: Any) -> LaunchOptions:
        """The options of a group that lives across cells (``%ddp start``, ``gpumagic.ranks``): those of the option
        table's ``group`` surface, with its defaults (rank 0's output).

        ``nnodes`` above 1: the group runs on that many nodes of the Slurm allocation the kernel runs in (``nprocs``
        ranks on each), as ``%%launch_ddp --nnodes`` does.

        Raises:
            InvalidArgument: an option a group does not take (a port, a start method: named), several nodes outside
            an allocation, or a bad value.
        """
        if options.get("nnodes", 1) != 1 and current() is None:
            raise InvalidArgument(
                "a group across several nodes runs on the nodes of a Slurm allocation: start the notebook inside "
                "one (salloc -N 2, then jupyter lab), or leave out --nnodes for a group on this machine"
            )
        others = set(options) - set(GROUP_OPTIONS)
        if others:
            raise InvalidArgument(
                f"a group of ranks does not take {', '.join(sorted(others))}; it takes {', '.join(GROUP_OPTIONS[:-1])} "
                f"and {GROUP_OPTIONS[-1]}"
            )
        chosen = {name: default("group", name) for name in GROUP_OPTIONS[1:]}
        return cls(nprocs, **{**chosen, **options})

    @property
    def elastic(self) -> bool:
        """Whether torch elastic runs it (several nodes, restarts, or a run directory elsewhere)."""
        return {name: getattr(self, name) for name in ELASTIC_DEFAULTS} != ELASTIC_DEFAULTS

    @property
    def endpoint(self) -> str | None:
        """The rendezvous endpoint of an elastic launch (this machine's loopback for one node; inside a Slurm
        allocation, the address its nodes reach this machine at, any free port)."""
        if self.rdzv_endpoint or self.nnodes == 1:
            return self.rdzv_endpoint or LOCAL_ENDPOINT
        return f"{self.allocation.address}:0" if self.allocation is not None else None

    @property
    def hosts_rendezvous(self) -> bool:
        """Whether this node serves the rendezvous (node 0, or any node under c10d: the notebook's)."""
        return self.node_rank is None or self.node_rank == 0

    def rendezvous_address(self) -> tuple[str, int]:
        """(host, port) of ``endpoint``; port 0: any free one."""
        return parse_endpoint(self.endpoint or "", free_port=True)

    def _check(self) -> tuple[float, float]:
        """Every option, each by the table's check, in the table's order (the magic's help shows them so); the
        timeout and the hang report's threshold in seconds."""
        seconds = {o.name: o.check(getattr(self, o.name)) for o in on("launch") if o.check is not None}
        if self.elastic:
            self._check_elastic()
        return seconds["timeout"], seconds["hang_after"]

    def _check_elastic(self) -> None:
        if self.pdb:
            raise InvalidArgument(
                "--pdb keeps a failed rank of this machine for a debugger in the notebook; it does not go with "
                "--nnodes, --max-restarts, --rdzv-endpoint or --runs-dir"
            )
        if not self.process_group:
            raise InvalidArgument("spawn runs on this machine only; use launch_ddp for a multi-node or elastic run")
        if self.port is not None:
            raise InvalidArgument("with an elastic launch the port is --rdzv-endpoint's; leave out --port")
        if not is_whole(self.nnodes, 1, MAX_NODES):
            raise InvalidArgument(f"nnodes must be a whole number from 1 to {MAX_NODES}, got {self.nnodes!r}")
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            self._check_allocation()
        if self.endpoint is None:
            raise InvalidArgument(
                "a multi-node launch needs --rdzv-endpoint HOST:PORT (an address of this machine), or a notebook "
                "inside a Slurm allocation (salloc -N 2, then jupyter lab), where gpumagic starts the other nodes"
            )
        _, port = self.rendezvous_address()
        if self.node_rank is not None:
            if not is_whole(self.node_rank, 0, self.nnodes - 1):
                raise InvalidArgument(f"node_rank must be from 0 to {self.nnodes - 1}, got {self.node_rank!r}")
            if self.rdzv_id is not None:
                raise InvalidArgument("give --node-rank (fixed node numbers) or --rdzv-id (c10d rendezvous), not both")
        if self.rdzv_id is not None and (not isinstance(self.rdzv_id, str) or not RDZV_ID.match(self.rdzv_id)):
            raise InvalidArgument(
                f"rdzv_id is 1-100 letters, digits and _ . - (starting with one of the first two), got {self.rdzv_id!r}"
            )
        if not is_whole(self.max_restarts, 0, MAX_RESTARTS):
            raise InvalidArgument(
                f"max_restarts must be a whole number from 0 to {MAX_RESTARTS}, got {self.max_restarts!r}"
            )
        if port == 0 and not self.hosts_rendezvous:
            raise InvalidArgument("node 0 serves the rendezvous: name its address and port in --rdzv-endpoint")

    def _check_allocation(self) -> None:
        """Inside a Slurm allocation, ``nnodes`` without an endpoint runs on its nodes: enough of them, srun."""
        allocation = current()
        if allocation is None:
            return
        if self.node_rank is not None:
            raise InvalidArgument(
                "inside a Slurm allocation the rendezvous numbers the nodes: leave out --node-rank (or give "
                "--rdzv-endpoint and start every agent yourself)"
            )
        if self.nnodes > len(allocation.nodes):
            raise InvalidArgument(
                f"--nnodes {self.nnodes}, but {allocation.describe()}; ask for at most {len(allocation.nodes)}, or "
                f"allocate more nodes (salloc -N {self.nnodes})"
            )
        check_srun()
        object.__setattr__(self, "allocation", allocation)


USER_OPTIONS = tuple(f.name for f in fields(LaunchOptions) if f.init and f.name not in ("nprocs", "process_group"))
# what for_group takes: the group surface's launch options
GROUP_OPTIONS = tuple(o.name for o in on("group") if o.name in ("nprocs", *USER_OPTIONS))


def parse_endpoint(endpoint: str, free_port: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); ``free_port``: port 0 (any free one) is allowed.

    Raises:
        InvalidArgument: not HOST:PORT.
    """
    host, sep, port = str(endpoint).strip().rpartition(":")
    host = host.strip("[]")
    lowest = 0 if free_port else 1
    if not sep or not host or not port.isascii() or not port.isdigit() or not lowest <= int(port) < 65536:
        raise InvalidArgument(
            f"the rendezvous endpoint is HOST:PORT with a port from {lowest} to 65535, got {endpoint!r}"
            + (" (0: any free port)" if free_port else "")
        )
    return host, int(port)

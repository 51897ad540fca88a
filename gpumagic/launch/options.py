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
from gpumagic.launch.hang_reports import DEFAULT_HANG_AFTER
from gpumagic.launch.plan import check_backend, check_timeout
from gpumagic.units import parse_duration

MAX_RANKS = 256
MAX_NODES = 1024
MAX_RESTARTS = 100
START_METHODS = ("forkserver", "spawn")
OUTPUT_MODES = ("all", "rank0", "none")
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

    nprocs: int | None = None
    gpus: str | None = None
    gpus_per_rank: int = 1
    backend: str | None = None
    port: int | None = None
    timeout: str | float = "30m"
    start_method: str = "forkserver"
    output: str = "all"
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    node_rank: int | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    runs_dir: str | None = None
    process_group: bool = True
    hang_after: str | float = DEFAULT_HANG_AFTER
    pdb: bool = False
    timeout_s: float = field(init=False, repr=False, compare=False)
    hang_after_s: float = field(init=False, repr=False, compare=False)
    # the Slurm allocation whose nodes a multi-node launch without an endpoint runs on (srun starts their agents)
    allocation: Allocation | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout_s", self._check())
        object.__setattr__(self, "hang_after_s", check_hang_after(self.hang_after))

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
    def for_group(
        cls,
        nprocs: int | None = None,
        *,
        gpus: str | None = None,
        gpus_per_rank: int = 1,
        backend: str | None = None,
        timeout: str | float = "30m",
        output: str = "rank0",
        hang_after: str | float = DEFAULT_HANG_AFTER,
        **others: Any,
    ) -> LaunchOptions:
        """The options of a group that lives across cells (``%ddp start``, ``gpumagic.ranks``): those it takes,
        with its own default output (rank 0's).

        Raises:
            InvalidArgument: an option a group does not take (a port, a start method, several nodes: named), or a
            bad value.
        """
        if others.get("nnodes", 1) != 1:
            raise InvalidArgument(
                "a group that lives across cells runs its ranks on this machine; for one DDP group across several "
                "nodes run the cell with %%launch_ddp --nnodes N (launch_ddp(fn, n, nnodes=N))"
            )
        others.pop("nnodes", None)
        if others:
            raise InvalidArgument(
                f"a group of ranks does not take {', '.join(sorted(others))}; it takes nprocs, gpus, gpus_per_rank, "
                "backend, timeout, output and hang_after"
            )
        return cls(nprocs, gpus, gpus_per_rank, backend, timeout=timeout, output=output, hang_after=hang_after)

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

    def _check(self) -> float:
        """Every option, in the order a user meets them; the timeout in seconds."""
        if self.start_method not in START_METHODS:
            raise InvalidArgument(f"start method must be one of {', '.join(START_METHODS)}, got {self.start_method!r}")
        check_output(self.output)
        check_gpus_per_rank(self.gpus_per_rank)
        check_backend(self.backend)
        timeout_s = check_timeout(self.timeout)
        if self.port is not None and not _whole(self.port, 1, 65535):
            raise InvalidArgument(f"port must be a whole number from 1 to 65535, got {self.port!r}")
        if self.nprocs is not None:
            check_nprocs(self.nprocs)
        if not isinstance(self.pdb, bool):
            raise InvalidArgument(f"pdb is True or False, got {self.pdb!r}")
        if self.elastic:
            self._check_elastic()
        return timeout_s

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
        if not _whole(self.nnodes, 1, MAX_NODES):
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
            if not _whole(self.node_rank, 0, self.nnodes - 1):
                raise InvalidArgument(f"node_rank must be from 0 to {self.nnodes - 1}, got {self.node_rank!r}")
            if self.rdzv_id is not None:
                raise InvalidArgument("give --node-rank (fixed node numbers) or --rdzv-id (c10d rendezvous), not both")
        if self.rdzv_id is not None and (not isinstance(self.rdzv_id, str) or not RDZV_ID.match(self.rdzv_id)):
            raise InvalidArgument(
                f"rdzv_id is 1-100 letters, digits and _ . - (starting with one of the first two), got {self.rdzv_id!r}"
            )
        if not _whole(self.max_restarts, 0, MAX_RESTARTS):
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


GROUP_OPTIONS = (
    "nprocs",
    "gpus",
    "gpus_per_rank",
    "backend",
    "timeout",
    "output",
    "hang_after",
)  # what for_group takes
USER_OPTIONS = tuple(f.name for f in fields(LaunchOptions) if f.init and f.name not in ("nprocs", "process_group"))


def check_hang_after(value: str | float) -> float:
    """``--hang-after``: how long a collective may wait before the cell says who is stuck where (0: never).

    >>> check_hang_after("10s"), check_hang_after(0)
    (10.0, 0.0)
    """
    return parse_duration(value, at_most=7 * 86400, what="--hang-after")


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


def check_nprocs(nprocs: object) -> None:
    """Raises InvalidArgument unless ``nprocs`` is a number of ranks gpumagic starts (1 to ``MAX_RANKS``)."""
    if not _whole(nprocs, 1, MAX_RANKS):
        raise InvalidArgument(f"the number of ranks must be a whole number from 1 to {MAX_RANKS}, got {nprocs!r}")


def check_output(output: object) -> None:
    """Raises InvalidArgument unless ``output`` says whose output to show (``OUTPUT_MODES``)."""
    if output not in OUTPUT_MODES:
        raise InvalidArgument(f"output must be one of {', '.join(OUTPUT_MODES)}, got {output!r}")


def check_gpus_per_rank(gpus_per_rank: object) -> None:
    """Raises InvalidArgument unless ``gpus_per_rank`` is a whole number of at least 1."""
    if not _whole(gpus_per_rank, 1, None):
        raise InvalidArgument(f"gpus_per_rank must be a whole number of at least 1, got {gpus_per_rank!r}")


def _whole(value: object, lowest: int, highest: int | None) -> bool:
    """Whether ``value`` is an int (not a bool) from ``lowest`` to ``highest`` (``None``: no end)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return lowest <= value and (highest is None or value <= highest)

"""The kernel's session: what this kernel runs across cells, in one object (``SESSION``) that the magics and the
public API both use: the persistent group ``%ddp start`` (or a first ``%%ddp`` cell) started, its dashboard and
how it was started (for ``%ddp restart``), and the latest ``%%launch_ddp`` with its dashboard. ``ranks`` starts
a group from Python; ``ddp_group`` is the session's running one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumagic.launch.kernel_side.group import RankGroup
from gpumagic.launch.kernel_side.launch_handle import LaunchHandle
from gpumagic.launch.option_table import default
from gpumagic.launch.options import LaunchOptions


@dataclass
class Session:
    """What one kernel runs across cells. ``group``: the persistent group of ``%ddp``/``%%ddp`` (``None``: none
    started, or it was stopped); ``group_dashboard`` its dashboard; ``group_start`` the arguments it was started
    with (``%ddp restart`` starts the same). ``last_launch``: the latest ``%%launch_ddp --no-wait``;
    ``last_dashboard``: the latest ``%%launch_ddp``'s dashboard."""

    group: RankGroup | None = None
    group_dashboard: Any = None
    group_start: dict[str, Any] = field(default_factory=dict)
    last_launch: LaunchHandle | None = None
    last_dashboard: Any = None

    def running_group(self) -> RankGroup | None:
        """The group, unless there is none or it has closed (then it is forgotten)."""
        if self.group is not None and self.group.closed:
            self.group = None
        return self.group


SESSION = Session()  # this kernel's


def ddp_group() -> RankGroup | None:
    """The group ``%ddp start`` (or the first ``%%ddp`` cell) started in this kernel; ``None`` if none runs."""
    return SESSION.running_group()


def ranks(  # every option of the table's group surface: tests/unit/test_option_table.py holds them equal
    nprocs: int | None = default("group", "nprocs"),
    *,
    gpus: str | None = default("group", "gpus"),
    gpus_per_rank: int = default("group", "gpus_per_rank"),
    backend: str | None = default("group", "backend"),
    timeout: str | float = default("group", "timeout"),
    output: str = default("group", "output"),
    hang_after: str | float = default("group", "hang_after"),
    grace: str | float = default("group", "grace"),
    nnodes: int = default("group", "nnodes"),
    write: Callable[[str], None] | None = default("group", "write"),
    on_note: Callable[[str], None] | None = default("group", "on_note"),
) -> RankGroup:
    """Start ``nprocs`` ranks with their process group ready, kept across calls (``%ddp start``'s API).

    ``group.run(fn, *args)`` and ``group.exec(code)`` return ``{rank: value}``; each rank keeps its namespace
    between them (``rank``, ``world_size``, ``device``, ``dist`` defined). ``group.pull(name, rank=0)`` copies a
    value to the kernel (tensors on the CPU), ``group.push(name=value)`` sets names on every rank,
    ``group.status()``, ``group.free()``, ``group.close()``; a context manager. ``gpus``: a spec, ``"auto"`` or
    ``"none"``; ``timeout``: the process group's; ``grace``: how long an interrupted rank may stay busy before its
    collective is broken; ``output``: ``rank0``, ``all``, ``none``; ``hang_after``: a collective waiting this long
    is reported with where every rank is (0: off; ``group.hang_reports`` keeps them); ``nnodes``: above 1, the
    group runs ``nprocs`` ranks on each of that many nodes of the Slurm allocation the kernel runs in (one host
    per node, started by srun); ``write``: where rank output goes; ``on_note``: where gpumagic's notes go.
    ``group.debug(rank)`` opens pdb on a rank whose last call failed. See docs/launch.md.

    Raises:
        InvalidArgument: a bad option (named), too few GPUs. GroupError: the ranks could not start.
    """
    launch = LaunchOptions.for_group(
        nprocs,
        gpus=gpus,
        gpus_per_rank=gpus_per_rank,
        backend=backend,
        timeout=timeout,
        output=output,
        hang_after=hang_after,
        nnodes=nnodes,
    )
    return RankGroup(launch, grace=grace, write=write, on_note=on_note)

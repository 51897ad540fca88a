"""The launch plan: ranks, their environment (what torchrun gives), their GPUs and CPU threads, and where ranks
on this machine run (``place_on``: their GPUs, CUDA or not, the one default backend, ``choose_backend``).

Pure values, independent of how processes start, so a local forkserver, an elastic agent or Slurm can
carry out the same plan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from gpumagic.errors import InvalidArgument
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.store import RUN_DIR_VARIABLE
from gpumagic.units import parse_duration

BACKENDS = ("gloo", "nccl", "mpi", "ucc")
MAX_TIMEOUT_S = 7 * 86400.0  # torch overflows (1e9 days) or hangs (1e5 days) on longer ones; a week is ample
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


# the kernel's own variables, which a process it starts must not inherit
KERNEL_ONLY = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "GPUMAGIC_RUN_DIR",
    "GPUMAGIC_STORE",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
)


def launch_environment() -> dict[str, str]:
    """The environment a process the kernel starts gets: the kernel's as it is now, less what only the kernel
    means (Jupyter's ``JPY_*``, its GPUs, its run), with matplotlib drawing off-screen (the inline backend
    needs a kernel)."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_ONLY and not k.startswith("JPY_")}
    env["MPLBACKEND"] = "Agg"
    return env


def command_environment() -> dict[str, str]:
    """``launch_environment()`` for a ``python -m gpumagic...`` process the kernel starts (a job's runner, an
    elastic agent): with this gpumagic importable, wherever the kernel imported it from."""
    env = launch_environment()
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH", "")]))
    return env


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a local rank needs to know before it starts.

    ``rank_gpus[i]`` are the ``CUDA_VISIBLE_DEVICES`` entries (UUIDs) of local rank ``i``; an empty tuple makes
    it a CPU rank, which sees no GPU at all. ``backend`` ``None`` means no process group is created (``spawn``:
    the code makes its own). ``base_env``: the launcher's environment at this launch, which every rank starts
    from (``launch_environment``).
    """

    run_dir: str
    nprocs: int
    master_port: int
    backend: str | None
    rank_gpus: tuple[tuple[str, ...], ...]
    use_cuda: bool
    threads_per_rank: int
    timeout_s: float
    launcher_pid: int
    base_env: dict[str, str] = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    store_address: str = ""  # the group's store (secure_store); MASTER_PORT is only for code that reads it
    node_rank: int = 0
    nnodes: int = 1
    hang_after_s: float = 0.0  # --hang-after: the ranks' hang watch (0: off)
    post_mortem: bool = False  # --pdb: a rank failing in the user's code waits for a debugger from the notebook

    @classmethod
    def on_this_machine(
        cls,
        run_dir: str | os.PathLike[str],
        rank_gpus: tuple[tuple[str, ...], ...],
        *,
        backend: str | None,
        use_cuda: bool,
        master_port: int,
        timeout_s: float,
        hang_after_s: float = 0.0,
        post_mortem: bool = False,
        extra_env: Mapping[str, str] | None = None,
    ) -> LaunchPlan:
        """The plan of a launch whose ranks all run here, started by this process, now: their store is a Unix
        socket in the run's private launch directory (``RunFiles.store_socket``); ``extra_env`` is added to the
        environment every rank starts from (``launch_environment``)."""
        nprocs = len(rank_gpus)
        return cls(
            run_dir=str(run_dir),
            store_address=f"unix:{RunFiles(run_dir).store_socket}",
            nprocs=nprocs,
            master_port=master_port,
            backend=backend,
            rank_gpus=rank_gpus,
            use_cuda=use_cuda,
            threads_per_rank=threads_per_rank(nprocs),
            timeout_s=timeout_s,
            hang_after_s=hang_after_s,
            post_mortem=post_mortem,
            launcher_pid=os.getpid(),
            base_env={**launch_environment(), **(extra_env or {})},
        )

    @property
    def world_size(self) -> int:
        return self.nprocs * self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nprocs + local_rank

    def environment(self, local_rank: int) -> dict[str, str]:
        """The rank's whole environment: ``base_env``, the variables torchrun sets, its GPUs and thread count."""
        env = dict(self.base_env)
        env.update(
            torchrun_variables(
                rank=self.global_rank(local_rank),
                local_rank=local_rank,
                world_size=self.world_size,
                local_world_size=self.nprocs,
                node_rank=self.node_rank,
                master=(self.master_addr, self.master_port),
                run_id=os.path.basename(self.run_dir),
            )
        )
        env.update({"OMP_NUM_THREADS": str(self.threads_per_rank), RUN_DIR_VARIABLE: self.run_dir})
        if self.store_address:
            env["GPUMAGIC_STORE"] = self.store_address  # secure_store.VARIABLE
        if self.nnodes == 1:  # keep gloo/NCCL bootstrap sockets on loopback for single-node runs
            env["GLOO_SOCKET_IFNAME"] = "lo"
            env["NCCL_SOCKET_IFNAME"] = "lo"
        gpus = self.rank_gpus[local_rank] if self.rank_gpus else ()
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # empty for a CPU rank, so it cannot touch a GPU
        if gpus:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        return env


def torchrun_variables(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node_rank: int,
    master: tuple[str, int],
    run_id: str,
) -> dict[str, str]:
    """The variables torchrun sets for a rank (``TORCHRUN_VARIABLES``), wherever it runs: on this machine
    (``LaunchPlan``) or as a Slurm task (``jobs.slurm``). ``master``: (``MASTER_ADDR``, ``MASTER_PORT``)."""
    values = (rank, local_rank, world_size, local_world_size, node_rank, node_rank, *master, run_id)
    return {name: str(value) for name, value in zip(TORCHRUN_VARIABLES, values, strict=True)}


def threads_per_rank(nprocs: int, cpus: int | None = None) -> int:
    """Divide this machine's CPUs among ranks so they do not oversubscribe it (at least 1 each)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // max(1, nprocs))


def assign_gpus(gpus: list[str], nprocs: int, per_rank: int) -> tuple[tuple[str, ...], ...]:
    """Give each rank ``per_rank`` consecutive GPUs from ``gpus`` (UUIDs in cuda order).

    Raises:
        InvalidArgument: fewer GPUs than ``nprocs * per_rank``.
    """
    if not gpus:
        return tuple(() for _ in range(nprocs))
    needed = nprocs * per_rank
    if len(gpus) < needed:
        raise InvalidArgument(
            f"{nprocs} ranks × {per_rank} GPU(s) need {needed} GPUs but {len(gpus)} are available to this kernel; "
            "lower -n, pick more with %gpu pick or --gpus auto, or run the ranks on the CPU with --gpus none"
        )
    return tuple(tuple(gpus[r * per_rank : (r + 1) * per_rank]) for r in range(nprocs))


def choose_backend(asked: str | None, *, use_cuda: bool) -> str:
    """The process group's backend: the one ``asked`` for, else NCCL where the ranks use CUDA and gloo where they
    do not (CPU ranks, simulated GPUs). The one default of every launcher: a launch, a group, a job, a Slurm job.

    >>> choose_backend(None, use_cuda=True), choose_backend(None, use_cuda=False), choose_backend("gloo", use_cuda=True)
    ('nccl', 'gloo', 'gloo')
    """
    return asked or ("nccl" if use_cuda else "gloo")


class Placement(NamedTuple):
    """Where ranks on this machine run: each rank's GPUs (UUIDs), whether CUDA is used, the process group's
    backend (``None``: no process group, ``spawn``'s code makes its own)."""

    rank_gpus: tuple[tuple[str, ...], ...]
    use_cuda: bool
    backend: str | None


def place_on(
    gpus: list[str],
    nprocs: int,
    per_rank: int,
    *,
    simulated: bool,
    backend: str | None,
    process_group: bool,
    every_rank_sees_all: bool = False,
) -> Placement:
    """Give ``nprocs`` ranks their share of ``gpus`` (UUIDs in cuda order, ``simulated`` or real): ``per_rank``
    each (``assign_gpus``), or all of them each with ``every_rank_sees_all`` (as under ``mp.spawn``); CUDA is used
    on real GPUs only; the backend is ``choose_backend``'s where a process group is made. What a launch or a group
    (``ddp.place_ranks``, from the GPUs it read or leased) and a job (``jobs.runner``, from its queue) run on.

    Raises:
        InvalidArgument: fewer GPUs than ``nprocs * per_rank``.
    """
    if every_rank_sees_all:
        rank_gpus = tuple(tuple(gpus) for _ in range(nprocs))
    else:
        rank_gpus = assign_gpus(gpus, nprocs, per_rank)
    use_cuda = bool(gpus) and not simulated
    return Placement(rank_gpus, use_cuda, choose_backend(backend, use_cuda=use_cuda) if process_group else None)


def check_backend(backend: str | None) -> str | None:
    if backend is not None and backend not in BACKENDS:
        raise InvalidArgument(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    return backend


def check_timeout(timeout: str | float, what: str = "a process group timeout") -> float:
    """A timeout ("30m", seconds) in seconds: a process group's, or ``what`` names another (a cell's).

    Raises:
        InvalidArgument: not a duration, 0, or more than a week (``MAX_TIMEOUT_S``).
    """
    seconds = parse_duration(timeout, at_most=MAX_TIMEOUT_S, what=what)
    if seconds <= 0:
        raise InvalidArgument("timeout must be more than 0 seconds")
    return seconds

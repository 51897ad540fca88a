"""The runtime every rank gpumagic starts shares, whatever started it (a local forkserver launch, an elastic
agent, a Slurm task, a persistent ``%ddp`` group): the process becoming a rank (its own process group, dying
with the kernel, its output, the launch's environment) and ``RankRuntime.set_up``, the one set-up before the
user's code: fatal-signal stacks recorded, threads, forking workers, seeding, the user's own
``init_process_group`` accepted, the device, the process group (for a launch) and a fresh ``__main__``.

Imported by the rank server (with torch preloaded): so torch is imported only where it is used.
"""

from __future__ import annotations

import builtins
import faulthandler
import importlib
import logging
import multiprocessing
import os
import sys
import types
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, NoReturn

import cloudpickle

from gpumagic import debug_log
from gpumagic.launch.plan import LaunchPlan
from gpumagic.launch.rank_side.hang_watch import CollectiveRecorder, HangWatch, enable_flight_recorder
from gpumagic.launch.rank_side.lifeline import die_with
from gpumagic.launch.rank_side.memory_cap import cap_memory
from gpumagic.launch.rank_side.output_routing import flush, route_output
from gpumagic.launch.rank_side.process_group import (
    StorePlace,
    accept_the_users_own_set_up,
    join_process_group,
    keep_ended_process_groups,
    serve_the_users_own_group,
)
from gpumagic.launch.seeding import DETERMINISTIC_VARIABLE, SEED_VARIABLE, seed
from gpumagic.launch.shipping import dumps
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.private import open_private

_log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class RankSetup:
    """What one rank needs to join its group and run: who it is, where the run is, how the group is made."""

    files: RunFiles
    rank: int
    local_rank: int
    world_size: int
    backend: str | None  # None: no process group (spawn's code makes its own, on the same store)
    store: StorePlace = field(default_factory=StorePlace)  # where the group's store is (secure_store): the run's own
    timeout_s: float = DEFAULT_TIMEOUT_S
    use_cuda: bool = False
    threads: int = 1
    attempt: int = 0
    hang_after_s: float = 0.0  # --hang-after: the hang watch's threshold (0: no watch, no recorder)
    post_mortem: bool = False  # --pdb: on a failure in the user's code, serve a debugger before ending


def plan_setup(plan: LaunchPlan, local_rank: int, listener: Any = None) -> RankSetup:
    """What local rank ``local_rank`` of a plan started on this machine needs to join its group and run."""
    return RankSetup(
        files=RunFiles(plan.run_dir),
        rank=plan.global_rank(local_rank),
        local_rank=local_rank,
        world_size=plan.world_size,
        backend=plan.backend,
        store=StorePlace(address=plan.store_address, listener=listener),
        timeout_s=plan.timeout_s,
        use_cuda=plan.use_cuda,
        threads=plan.threads_per_rank,
        hang_after_s=plan.hang_after_s,
        post_mortem=plan.post_mortem,
    )


def become_rank(plan: LaunchPlan, local_rank: int, outputs: list[Any], own_output: int) -> None:
    """Make this freshly started process a rank of ``plan``: it leads its own process group (what it starts ends
    with it), dies with the kernel, writes to ``outputs[own_output]`` and has the launch's environment."""
    os.setpgid(0, 0)  # first: the rank leads its own process group, what it starts ends with it
    die_with(plan.launcher_pid)
    route_output(own_output, outputs)
    set_environment(plan.environment(local_rank))


def exit_rank(code: int) -> NoReturn:
    """End the rank with ``code`` once its output is out, skipping interpreter teardown: a finished rank must not
    hang in a library's destructor."""
    flush()
    os._exit(code)


class RankRuntime:
    """A rank's state and its one ``set_up``; subclasses run the user's code: ``Rank`` once (a launch),
    ``GroupRank`` cell after cell (a persistent group). ``phase`` says where a failure happened."""

    made_by = "%%launch_ddp"  # what made the process group, as the user's own init_process_group is told
    joins_at_set_up = True  # a launch's ranks join their group in set_up; a persistent group's when asked

    def __init__(self, setup: RankSetup) -> None:
        self.setup = setup
        self.phase = "setup"
        self.device: Any = None
        self.main_module: Any = None
        self._fatal: Any = None  # faulthandler's file, open while the rank lives
        self.recorder: CollectiveRecorder | None = None
        self.hang_watch: HangWatch | None = None

    def set_up(self) -> None:
        """Everything before the user's code: a failure here is setup's (or rendezvous's)."""
        # lazy: torch, in rank processes only
        import torch

        setup = self.setup
        self._fatal = record_fatal_signals(setup.files.rank_fatal(setup.rank, setup.attempt))
        torch.set_num_threads(setup.threads)
        fork_for_workers()
        keep_ended_process_groups()
        seed_from_environment()
        if setup.hang_after_s > 0:  # before any process group: torch reads its size when one is made
            enable_flight_recorder()
            self.recorder = CollectiveRecorder(setup.files.rank_collective(setup.rank))
        if setup.backend is not None:  # before the code is loaded: it may hold torch's function already
            accept_the_users_own_set_up(setup.backend, setup.world_size, setup.rank, self.made_by)
        elif setup.store.address:
            serve_the_users_own_group(setup.files, setup.store, setup.rank, setup.world_size, setup.timeout_s)
        self.prepare()
        self.device = torch.device("cpu")
        if setup.use_cuda:
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
            cap_memory(torch)
        if setup.backend is not None and self.joins_at_set_up:  # spawn's code makes its group itself
            self.phase = "rendezvous"
            join_process_group(
                setup.files,
                setup.store,
                setup.backend,
                setup.rank,
                setup.world_size,
                setup.timeout_s,
            )
            if self.recorder is not None:
                self.recorder.restart_count()  # the user's collectives are numbered from 1, on every rank alike
        self.main_module = notebook_main()
        if setup.hang_after_s > 0:
            self.hang_watch = HangWatch(setup.files, setup.rank, setup.hang_after_s, self.recorder, self.busy)
            self.hang_watch.start()

    def busy(self) -> bool:
        """Whether the user's code runs now (a launch's rank: always, once set up)."""
        return True

    def prepare(self) -> None:
        """What this kind of rank needs before its device is chosen (its code, its watches): nothing here."""

    def context(self) -> dict[str, Any]:
        """The names the user's code finds defined (``rank_namespace``)."""
        setup = self.setup
        return rank_namespace(setup.rank, setup.local_rank, setup.world_size, self.device)


def rank_namespace(rank: int, local_rank: int, world_size: int, device: Any) -> dict[str, Any]:
    """The names a ``%%launch_ddp`` cell finds defined: ``rank``, ``local_rank``, ``world_size``, ``device``,
    ``dist`` (``torch.distributed``) and ``gpumagic`` (the user-facing package, so ``gpumagic.log`` works
    without an import)."""
    # lazy: torch, in rank processes only
    import torch.distributed as dist

    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "device": device,
        "dist": dist,
        "gpumagic": importlib.import_module("gpumagic"),  # the face, by name: no floor imports it
    }


def notebook_main() -> Any:
    """A fresh ``__main__`` module for the user's code, registered in ``sys.modules``: what a notebook (or a
    script under torchrun) defines lives there, so it pickles by reference to DataLoader workers and
    ``multiprocessing.Pool`` as it does under torchrun."""
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    return module


def fork_for_workers() -> None:
    """Processes the user's code starts (DataLoader workers, ``multiprocessing.Pool``) fork, as under torchrun
    on Linux; the rank would otherwise inherit the start method it was started with (forkserver, spawn). What
    still cannot pickle by reference (a lambda given to a Pool) travels by value (cloudpickle)."""
    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)
    ForkingPickler.reducer_override = _by_value_when_needed  # type: ignore[attr-defined]


def _by_value_when_needed(self: Any, obj: Any) -> Any:
    """ForkingPickler's hook, called for every object a worker's queue pickles: the common case returns at
    once."""
    if not isinstance(obj, (types.FunctionType, type)):
        return NotImplemented
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    found: Any = module
    for part in getattr(obj, "__qualname__", "").split("."):
        found = getattr(found, part, None)
    if found is obj:
        return NotImplemented  # importable: pickled by reference as usual
    return cloudpickle.loads, (dumps(obj),)


def seed_from_environment() -> None:
    """``%gpu seed N`` in the kernel exports ``GPUMAGIC_SEED``: every rank seeds itself with it."""
    value = os.environ.get(SEED_VARIABLE, "").strip()
    if value.isdigit():
        seed(int(value), deterministic=os.environ.get(DETERMINISTIC_VARIABLE) == "1")


def record_fatal_signals(path: Path) -> Any:
    """Have ``faulthandler`` write the Python stack to ``path`` when a fatal signal (SIGSEGV, SIGABRT, SIGBUS,
    SIGFPE, SIGILL) ends the rank: it shows where the rank died, and its write time is when (a launcher only
    notices later, after peers may have failed because of it). A rank that replaces a dead one of a persistent
    group starts the file afresh."""
    try:
        handle = open_private(path)
        handle.truncate(0)
    except OSError:
        _log.debug("the fatal-signal file %s cannot be opened; fatal signals are not recorded", path, exc_info=True)
        return None
    faulthandler.enable(file=handle, all_threads=True)
    os.register_at_fork(after_in_child=faulthandler.disable)  # a worker's crash is not the rank's death
    return handle


def set_environment(environment: dict[str, str]) -> None:
    """Replace this process's environment with the launch's: the kernel's as it was at this launch (not as it
    was when the forkserver started), plus the rank's own variables. What the libraries preloaded in the
    forkserver set for themselves when imported (it is not in the forkserver's initial environment) stays."""
    initial = _initial_environment()
    preloaded = {k: v for k, v in os.environ.items() if initial is not None and k not in initial}
    os.environ.clear()
    os.environ.update(preloaded)
    os.environ.update(environment)
    debug_log.configure()  # the launch's GPUMAGIC_DEBUG, not the forkserver's


def _initial_environment() -> set[str] | None:
    """The names in the environment this process's program started with (``/proc/self/environ``)."""
    try:
        with open("/proc/self/environ", "rb") as handle:
            entries = handle.read().split(b"\0")
    except OSError:
        _log.debug("/proc/self/environ is unreadable; the initial environment is unknown", exc_info=True)
        return None
    return {entry.split(b"=", 1)[0].decode(errors="replace") for entry in entries if b"=" in entry}

"""One rank's life, the same wherever it was started (a local forkserver rank, an elastic agent's worker, a
Slurm task): set up (environment, the notebook's ``__main__``, the process group), execute the shipped
code, report (a sealed value, or how it failed), tear down.

Entry points: ``run_local_rank`` (the target of ``launch.kernel_side.local``'s rank processes) and ``run_rank`` (ranks
started with torchrun's environment: ``python -m gpumagic.launch.rank_side.rank RUN_DIR``, Slurm tasks). Imported by
the forkserver (with torch preloaded) and, for pickling by reference, by the kernel: so nothing heavy is
imported at module level.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumagic.launch.failures import RankOutcome
from gpumagic.launch.plan import LaunchPlan
from gpumagic.run_dirs.launch_files import read_spec
from gpumagic.run_dirs.layout import RunFiles

PR_SET_PDEATHSIG = 1
FATAL_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}  # faulthandler's
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class RankSetup:
    """What one rank needs to join its group and run: who it is, where the run is, how the group is made."""

    files: RunFiles
    rank: int
    local_rank: int
    world_size: int
    backend: str | None  # None: no process group (spawn's code makes its own, on the same store)
    store_address: str = ""  # the group's store (secure_store): unix:PATH on one machine, tcp:HOST:PORT across
    timeout_s: float = DEFAULT_TIMEOUT_S
    use_cuda: bool = False
    threads: int = 1
    attempt: int = 0
    listener: Any = None  # rank 0 of a local launch: the socket the kernel bound for the store
    served_prefix: str | None = None  # an elastic agent serves the store; every rank is a client under this


def plan_setup(plan: LaunchPlan, local_rank: int, listener: Any = None) -> RankSetup:
    """What local rank ``local_rank`` of a plan started on this machine needs to join its group and run."""
    return RankSetup(
        files=RunFiles(plan.run_dir),
        rank=plan.global_rank(local_rank),
        local_rank=local_rank,
        world_size=plan.world_size,
        backend=plan.backend,
        store_address=plan.store_address,
        timeout_s=plan.timeout_s,
        use_cuda=plan.use_cuda,
        threads=plan.threads_per_rank,
        listener=listener,
    )


class Rank:
    """Set-up, execute, report, teardown of one rank; ``run`` does them in order and returns the exit code."""

    def __init__(self, setup: RankSetup) -> None:
        self.setup = setup
        self.phase = "setup"
        self.payload: Any = None
        self.device: Any = None
        self.main_module: Any = None
        self._fatal: Any = None

    def run(self) -> int:
        try:
            self.set_up()
            self.phase = "user code"
            value = self.execute()
            self.report(value)
            self.tear_down()
        except BaseException as err:  # noqa: BLE001 - every way a rank ends must be reported
            return self.report_failure(name_memory_limit(err))
        finally:
            flush()
        return 0

    def set_up(self) -> None:
        """Everything before the user's code: a failure here is setup's (or rendezvous's)."""
        import cloudpickle
        import torch

        setup = self.setup
        self._fatal = _record_fatal_signals(setup.files.rank_fatal(setup.rank, setup.attempt))
        torch.set_num_threads(setup.threads)
        _fork_for_workers()
        _keep_ended_process_groups()
        _seed_from_environment()
        if setup.backend is not None:  # before the code is loaded: it may hold torch's function already
            _accept_the_users_own_set_up(setup.backend, setup.world_size, setup.rank)
        elif setup.store_address:
            _serve_the_users_own_group(setup)
        from gpumagic.run_dirs.signing import read_sealed

        path = setup.files.payload
        self.payload = cloudpickle.loads(read_sealed(path, f"the code sent to the ranks ({path})"))
        self.payload.prepare()
        self.device = torch.device("cpu")
        if setup.use_cuda:
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
            _cap_memory(torch)
        if setup.backend is not None:  # spawn's code chooses its devices and makes its group itself
            self.phase = "rendezvous"
            join_process_group(
                setup.backend,
                setup.store_address,
                setup.rank,
                setup.world_size,
                setup.timeout_s,
                setup.listener,
                setup.served_prefix,
            )
        self.main_module = _notebook_main()

    def execute(self) -> Any:
        setup = self.setup
        context = rank_namespace(setup.rank, setup.local_rank, setup.world_size, self.device)
        return self.payload.run(context, self.main_module.__dict__)

    def report(self, value: Any) -> None:
        import cloudpickle

        from gpumagic.run_dirs.signing import write_sealed

        write_sealed(self.setup.files.rank_result(self.setup.rank), cloudpickle.dumps(value))

    def tear_down(self) -> None:
        if self.setup.backend is not None:
            leave_process_group()

    def report_failure(self, err: BaseException) -> int:
        """Write how the rank failed (``ranks/rank-R.error.A.json``); the exit code (0 for ``sys.exit(0)``)."""
        setup = self.setup
        return report_failure(setup.files.rank_error(setup.rank, setup.attempt), setup.rank, self.phase, err)


MEMORY_LIMIT_VARIABLE = "GPUMAGIC_MEMORY_LIMIT"  # bytes a job's rank may allocate on its GPU (--memory-limit)


def _cap_memory(torch: Any) -> None:
    """Cap this rank's CUDA caching allocator at the job's reservation, when it asked for ``--memory-limit``."""
    limit = memory_limit()
    if limit:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), 0)


def memory_limit() -> int | None:
    """The job's ``--memory-limit`` in bytes, from the rank's environment (None: no cap)."""
    value = os.environ.get(MEMORY_LIMIT_VARIABLE, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def name_memory_limit(err: BaseException) -> BaseException:
    """An out-of-memory error of a capped job, its message naming the cap and what to do; others unchanged."""
    limit = memory_limit()
    if limit is None or type(err).__name__ != "OutOfMemoryError":
        return err
    from gpumagic.units import format_bytes

    cap = format_bytes(limit)
    first = str(err).split("\n", 1)[0]
    err.args = (
        f"the job ran out of its --memory-limit of {cap}, the memory it declared with --min-free {cap} ({first}); "
        "declare more with --min-free, or lower its batch size",
    )
    return err


def run_local_rank(local_rank: int, plan: LaunchPlan, outputs: list[Any], listener: Any) -> None:
    """The target of a local rank process (``launch.kernel_side.local`` starts it with the rank's local index)."""
    os.setpgid(0, 0)  # first: the rank leads its own process group, what it starts ends with it
    _die_with(plan.launcher_pid)
    _route_output(local_rank, outputs)
    _set_environment(plan.environment(local_rank))
    if plan.global_rank(local_rank) != 0 and listener is not None:
        listener.close()
        listener = None
    code = Rank(plan_setup(plan, local_rank, listener)).run()
    os._exit(code)  # skip interpreter teardown: a finished rank must not hang in a library's destructor


def run_rank(run_dir: Path) -> int:
    """Run this process's rank of the code in ``run_dir`` (torchrun's variables must be set); its exit code.

    Output goes to ``ranks/rank-R.log`` for the time of the call; the value to ``rank-R.result.pkl``; a
    failure to ``rank-R.error.A.json`` with the user's traceback.
    """
    from gpumagic.run_dirs.private import write_private
    from gpumagic.run_dirs.store import RUN_DIR_VARIABLE

    files = RunFiles(run_dir)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.environ[RUN_DIR_VARIABLE] = str(run_dir)
    with _output_to(files.rank_log(rank)):
        started = {"rank": rank, "attempt": attempt, "pid": os.getpid(), "host": socket.gethostname()}
        write_private(files.rank_start(rank), json.dumps({**started, "started": time.time()}).encode())
        try:
            spec = read_spec(files)
        except BaseException as err:  # noqa: BLE001 - a changed or missing description is setup's failure
            return report_failure(files.rank_error(rank, attempt), rank, "setup", err)
        sys.path[:0] = [p for p in spec.get("sys_path", []) if p not in sys.path]  # the notebook's modules
        use_cuda = bool(spec.get("use_cuda"))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if use_cuda:
            try:
                _own_gpus(local_rank, local_world_size)
            except RuntimeError as err:
                return report_failure(files.rank_error(rank, attempt), rank, "setup", err)
        else:  # a CPU group on a GPU machine: its ranks see no GPU, on every node
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        served = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # a static rendezvous's store
        setup = RankSetup(
            files=files,
            rank=rank,
            local_rank=local_rank,
            world_size=int(os.environ["WORLD_SIZE"]),
            backend=spec.get("backend") or None,
            store_address=environment_store_address(),
            timeout_s=float(spec.get("timeout_s", DEFAULT_TIMEOUT_S)),
            use_cuda=use_cuda,
            threads=int(spec.get("threads_per_rank") or 1),
            attempt=attempt,
            served_prefix=f"/worker/attempt_{attempt}" if served else None,
        )
        return Rank(setup).run()


# --- the run's description and the ranks' reports, as launchers read them -------------------------------


@dataclass(frozen=True)
class ProcessEnd:
    """How a rank's process ended, as its launcher saw it: exit code (negative: the signal) and when."""

    pid: int | None
    exitcode: int | None
    time: float | None
    stopped_by_launcher: bool = False


def read_outcome(files: RunFiles, rank: int, attempt: int = 0, end: ProcessEnd | None = None) -> RankOutcome:
    """How ``rank`` ended in ``attempt``: its own report; else the Python stack a fatal signal left (timed by when
    the signal came, not when a launcher noticed); else how its process ended (``end``); else, with a result,
    finished; else stopped by its launcher (an agent or Slurm ended it because another rank failed)."""
    report = _read_json(files.rank_error(rank, attempt))
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
    fatal = _fatal_stack(files.rank_fatal(rank, attempt))
    if fatal is not None and (end is None or end.exitcode is None or -end.exitcode in FATAL_SIGNALS):
        stack, died = fatal
        exitcode = end.exitcode if end is not None and end.exitcode is not None else None
        return RankOutcome(rank, end.pid if end else None, exitcode, "process", traceback=stack, timestamp=died)
    if end is not None and end.exitcode is not None:
        if end.exitcode == 0:
            return RankOutcome(rank, end.pid, 0, timestamp=end.time)
        return RankOutcome(
            rank,
            end.pid,
            end.exitcode,
            "process",
            timestamp=end.time,
            stopped_by_launcher=end.stopped_by_launcher,
        )
    if files.rank_result(rank).exists():
        return RankOutcome(rank, None, 0)
    return RankOutcome(rank, None, -int(signal.SIGTERM), timestamp=time.time(), stopped_by_launcher=True)


def rank_outcomes(
    files: RunFiles, world_size: int, failures: dict[str, dict[str, Any]] | None = None
) -> list[RankOutcome]:
    """Every rank's outcome in its latest attempt (``failures``: the elastic agents' records, by rank)."""
    outcomes = []
    for rank in range(world_size):
        attempt = int(read_rank_start(files, rank).get("attempt", 0))
        failure = (failures or {}).get(str(rank))
        end = ProcessEnd(failure.get("pid"), failure.get("exitcode"), failure.get("time")) if failure else None
        outcomes.append(read_outcome(files, rank, attempt, end))
    return outcomes


def read_rank_start(files: RunFiles, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s latest start (``ranks/rank-R.json``: attempt, pid, host, time); empty before it started."""
    return _read_json(files.rank_start(rank)) or {}


def read_result(files: RunFiles, rank: int) -> Any:
    """Rank ``rank``'s value (``None`` if it wrote none)."""
    import cloudpickle

    from gpumagic.run_dirs.signing import read_sealed

    path = files.rank_result(rank)
    return cloudpickle.loads(read_sealed(path, f"rank {rank}'s result ({path})")) if path.exists() else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fatal_stack(path: Path) -> tuple[str, float] | None:
    """The Python stack ``faulthandler`` wrote when a fatal signal hit, and when (the file's change time)."""
    try:
        status = path.stat()
        if not status.st_size:
            return None
        return _tidy_stack(path.read_text(errors="replace")), status.st_mtime
    except OSError:
        return None


def _tidy_stack(dump: str) -> str:
    """``faulthandler``'s dump without gpumagic's own threads and the frames under the user's code."""
    import multiprocessing

    machinery = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(multiprocessing.__file__))
    machinery += (
        threading.__file__,
        "<string>",
        "<frozen ",
    )  # <frozen runpy>: python -m ...rank_side.rank
    blocks = []
    for block in dump.strip().split("\n\n"):
        lines = block.splitlines()
        if lines and lines[0].startswith("Extension modules:"):
            continue
        frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
        users = [i for i in frames if not any(f'"{root}' in lines[i] for root in machinery)]
        if frames and not users:
            continue  # a thread of gpumagic's (the watchdog)
        blocks.append("\n".join(lines[: users[-1] + 1] if users else lines))
    return "\n\n".join(blocks)


# --- set-up ----------------------------------------------------------------------------------------------


def rank_namespace(rank: int, local_rank: int, world_size: int, device: Any) -> dict[str, Any]:
    """The names a ``%%launch_ddp`` cell finds defined: ``rank``, ``local_rank``, ``world_size``, ``device``,
    ``dist`` (``torch.distributed``) and ``gpumagic`` (the user-facing package, so ``gpumagic.log`` works
    without an import)."""
    import importlib

    import torch.distributed as dist

    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "device": device,
        "dist": dist,
        "gpumagic": importlib.import_module("gpumagic"),
    }


def environment_store_address() -> str:
    """The store of a rank started with torchrun's variables: ``GPUMAGIC_STORE``, else MASTER_ADDR:MASTER_PORT."""
    from gpumagic.launch.secure_store import VARIABLE, tcp_address

    return os.environ.get(VARIABLE) or tcp_address(
        os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "0")
    )


_STORE_SERVERS: list[Any] = []  # the stores this rank serves: alive while the rank runs (or until left)


def group_store(
    address: str, rank: int, timeout_s: float, listener: Any = None, served_prefix: str | None = None
) -> Any:
    """The process group's store at ``address`` (``secure_store``: only the user's own processes get in). Rank 0
    serves it: on ``listener`` (a socket bound already by the launcher) when given, else on a socket it binds to
    ``address`` itself, never on every interface. ``served_prefix``: an elastic agent serves the store already;
    every rank is a client under that prefix."""
    import torch.distributed as dist

    from gpumagic.launch import secure_store

    if served_prefix is not None:
        return dist.PrefixStore(served_prefix, secure_store.connect(address, timeout_s))
    if rank != 0:
        return secure_store.connect(address, timeout_s)
    if listener is None:
        listener = secure_store.listen(address)
    server, store = secure_store.serve_and_connect(listener, address, timeout_s)
    _STORE_SERVERS.append(server)
    return store


def close_served_stores() -> None:
    """Stop serving the stores of groups this rank left (a persistent group's rank, before a re-form)."""
    while _STORE_SERVERS:
        _STORE_SERVERS.pop().close()


def join_process_group(
    backend: str,
    store_address: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    listener: Any = None,
    served_prefix: str | None = None,
) -> None:
    """Join the process group through its store (``group_store``).

    With gloo every rank then waits at a barrier, so that none finishes and exits while a peer is still
    connecting to it (``Gloo connectFullMesh failed ... Connection closed by peer``).
    """
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = group_store(store_address, rank, timeout_s, listener, served_prefix)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    if backend == "gloo" and world_size > 1:
        dist.barrier()


def _serve_the_users_own_group(setup: RankSetup) -> None:
    """Code that makes its own group (``spawn``) the torchrun way (``init_process_group(backend)``, env://) gets
    it on the launch's own store, which only the user's processes can reach, not on a TCPStore that answers
    anyone at MASTER_PORT. A group made again after ``destroy_process_group`` meets under a fresh prefix."""
    import inspect

    import torch.distributed as dist

    made = [0]
    listener = [setup.listener]

    def wrap(original: Any) -> Any:
        signature = inspect.signature(original)

        def init_process_group(*args: Any, **kwargs: Any) -> None:
            asked = signature.bind_partial(*args, **kwargs).arguments
            if asked.get("store") is not None or asked.get("init_method") not in (None, "env://"):
                return original(*args, **kwargs)  # the user's own rendezvous: theirs to secure
            rank = int(asked["rank"]) if asked.get("rank") not in (None, -1) else setup.rank
            world = int(asked["world_size"]) if asked.get("world_size") not in (None, -1) else setup.world_size
            timeout = asked.get("timeout")
            timeout_s = timeout.total_seconds() if timeout is not None else setup.timeout_s
            if made[0] == 0:
                store = group_store(setup.store_address, rank, timeout_s, listener[0])
                listener[0] = None
                _USERS_STORE[:] = [store]
            else:
                store = _USERS_STORE[0] if rank == 0 else group_store(setup.store_address, rank, timeout_s)
            made[0] += 1
            asked.pop("init_method", None)
            asked.update(store=dist.PrefixStore(f"gpumagic-init-{made[0]}", store), rank=rank, world_size=world)
            return original(**asked)

        return init_process_group

    _replace_in_torch_distributed("init_process_group", wrap)


_USERS_STORE: list[Any] = []


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessGroupExists(RuntimeError):
    """The user's code asked for a process group other than the one the launch made."""


def _accept_the_users_own_set_up(backend: str, world_size: int, rank: int, made_by: str = "%%launch_ddp") -> None:
    """Let code written for torchrun (``init_process_group(...)`` first thing, as pytorch/examples' multigpu.py)
    run unchanged: a call asking for the group the launch made does nothing, with one line from rank 0; a call
    asking for another group fails in one line that says what to change."""
    import inspect

    import torch.distributed as dist

    def wrap(original: Any) -> Any:
        signature = inspect.signature(original)

        def init_process_group(*args: Any, **kwargs: Any) -> None:
            if not dist.is_initialized():  # the user destroyed ours first: theirs is theirs
                return original(*args, **kwargs)
            asked = signature.bind_partial(*args, **kwargs).arguments
            asked_backend = str(asked.get("backend") or backend).lower()
            asked_world = int(asked.get("world_size", -1) if asked.get("world_size") is not None else -1)
            asked_rank = int(asked.get("rank", -1) if asked.get("rank") is not None else -1)
            same = (
                backend in asked_backend.replace(",", ":").split(":")
                and asked_world in (-1, world_size)
                and asked_rank in (-1, rank)
            )
            made = f"{backend}, {world_size} rank{'s' if world_size != 1 else ''}"
            if not same:
                wanted = ", ".join(f"{k}={v!r}" for k, v in asked.items() if k in ("backend", "world_size", "rank"))
                raise ProcessGroupExists(
                    f"init_process_group({wanted}): {made_by} made the process group already ({made}, this is rank "
                    f"{rank}); remove the call, or launch with the backend (--backend) and number of ranks (-n) it "
                    "asks for"
                )
            if rank == 0:
                print(
                    f"[gpumagic] init_process_group: {made_by} made the process group already ({made}); "
                    "the call does nothing",
                    file=sys.stderr,
                )
            return None

        return init_process_group

    _replace_in_torch_distributed("init_process_group", wrap)


_ENDED_PROCESS_GROUPS: list[Any] = []


def _keep_ended_process_groups() -> None:
    """``destroy_process_group`` in a rank keeps the groups it ends alive until the rank exits (``os._exit``:
    their destructors never run).

    torch 2.13 can deadlock when the last reference to a gloo group goes (pytorch PRs 180700, 182083): the
    group's destructor joins its worker threads while holding the GIL, and a worker still releasing a
    collective made in ``backward()`` waits for the GIL. The DDP tutorial's ``demo_basic`` (``cleanup()``,
    then ``return``: the DDP model's reducer holds the group's last reference) hung in 24 of 100
    ``gpumagic.spawn`` launches. Kept here, the group's last reference never goes while the rank runs.
    """
    from torch.distributed import distributed_c10d

    def wrap(original: Any) -> Any:
        def destroy_process_group(group: Any = None) -> None:
            if group is None or group == distributed_c10d.GroupMember.WORLD:
                _ENDED_PROCESS_GROUPS.extend(distributed_c10d._world.pg_map)
            else:
                _ENDED_PROCESS_GROUPS.append(group)
            return original(group)

        return destroy_process_group

    _replace_in_torch_distributed("destroy_process_group", wrap)


def _replace_in_torch_distributed(name: str, wrap: Callable[[Any], Any]) -> None:
    """Replace ``torch.distributed.<name>`` (and ``distributed_c10d.<name>``, which torch's own code calls)
    with ``wrap(original)``, once per process: code that looks it up later, or unpickles a reference to it,
    gets the replacement."""
    import functools

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = getattr(distributed_c10d, name)
    if getattr(original, "_gpumagic_replaced", False):
        return
    replacement = functools.wraps(original)(wrap(original))
    replacement._gpumagic_replaced = True
    setattr(distributed_c10d, name, replacement)
    setattr(dist, name, replacement)


def _notebook_main() -> Any:
    """A fresh ``__main__`` module for the user's code, registered in ``sys.modules``: what a notebook (or a
    script under torchrun) defines lives there, so it pickles by reference to DataLoader workers and
    ``multiprocessing.Pool`` as it does under torchrun."""
    import builtins

    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    return module


def _fork_for_workers() -> None:
    """Processes the user's code starts (DataLoader workers, ``multiprocessing.Pool``) fork, as under torchrun
    on Linux; the rank would otherwise inherit the start method it was started with (forkserver, spawn). What
    still cannot pickle by reference (a lambda given to a Pool) travels by value (cloudpickle)."""
    import multiprocessing

    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)
    from multiprocessing.reduction import ForkingPickler

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
    import cloudpickle

    from gpumagic.launch.shipping import dumps

    return cloudpickle.loads, (dumps(obj),)


def _seed_from_environment() -> None:
    """``%gpu seed N`` in the kernel exports ``GPUMAGIC_SEED``: every rank seeds itself with it."""
    from gpumagic.launch.seeding import DETERMINISTIC_VARIABLE, SEED_VARIABLE, seed

    value = os.environ.get(SEED_VARIABLE, "").strip()
    if value.isdigit():
        seed(int(value), deterministic=os.environ.get(DETERMINISTIC_VARIABLE) == "1")


def _record_fatal_signals(path: Path) -> Any:
    """Have ``faulthandler`` write the Python stack to ``path`` when a fatal signal (SIGSEGV, SIGABRT, SIGBUS,
    SIGFPE, SIGILL) ends the rank: it shows where the rank died, and its write time is when (a launcher only
    notices later, after peers may have failed because of it)."""
    import faulthandler

    from gpumagic.run_dirs.private import open_private

    try:
        handle = open_private(path)
    except OSError:
        return None
    faulthandler.enable(file=handle, all_threads=True)
    os.register_at_fork(after_in_child=faulthandler.disable)  # a worker's crash is not the rank's death
    return handle


def _set_environment(environment: dict[str, str]) -> None:
    """Replace this process's environment with the launch's: the kernel's as it was at this launch (not as it
    was when the forkserver started), plus the rank's own variables. What the libraries preloaded in the
    forkserver set for themselves when imported (it is not in the forkserver's initial environment) stays."""
    initial = _initial_environment()
    preloaded = {k: v for k, v in os.environ.items() if initial is not None and k not in initial}
    os.environ.clear()
    os.environ.update(preloaded)
    os.environ.update(environment)


def _initial_environment() -> set[str] | None:
    """The names in the environment this process's program started with (``/proc/self/environ``)."""
    try:
        with open("/proc/self/environ", "rb") as handle:
            entries = handle.read().split(b"\0")
    except OSError:
        return None
    return {entry.split(b"=", 1)[0].decode(errors="replace") for entry in entries if b"=" in entry}


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


# --- report ----------------------------------------------------------------------------------------------


def report_failure(path: Path, rank: int, phase: str, err: BaseException) -> int:
    """Write how a rank failed to ``path`` (JSON); its exit code (0 for ``sys.exit(0)``)."""
    if isinstance(err, SystemExit):
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        if code == 0:
            return 0
    elif isinstance(err, KeyboardInterrupt):
        return 128 + signal.SIGINT
    else:
        code = 1
    report = {"rank": rank, "pid": os.getpid(), **failure_report(phase, err), "exitcode": code}
    message = report["message"]
    from gpumagic.run_dirs.private import write_private

    try:
        write_private(path, json.dumps(report).encode())
    except OSError as unwritten:  # a full disk: the launcher says so, and stderr still carries the failure
        sys.stderr.write(f"rank {rank} could not record its failure: {unwritten}\n")
    sys.stderr.write(f"rank {rank} failed: {type(err).__name__}: {message}\n")
    return code


def failure_report(phase: str, err: BaseException) -> dict[str, Any]:
    """How the user's code failed, as a launcher reads it: where (``phase``), the exception, its traceback from
    the user's first frame (none for ``sys.exit``), and when."""
    exited = isinstance(err, SystemExit)
    return {
        "phase": phase,
        "type": type(err).__name__,
        "message": str(err.code) if exited else str(err),
        "traceback": None if exited else _user_traceback(err),
        "timestamp": time.time(),
    }


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's first frame on: gpumagic's own frames are noise to the user."""
    own = os.path.dirname(os.path.abspath(__file__))
    tb = err.__traceback__
    while tb is not None and os.path.dirname(os.path.abspath(tb.tb_frame.f_code.co_filename)) == own:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb or err.__traceback__))


def flush() -> None:
    """Write out what the rank logged and printed: before it exits without interpreter teardown."""
    telemetry = sys.modules.get("gpumagic.telemetry.log")
    if telemetry is not None:  # the points logged since the last periodic write
        try:
            telemetry.flush()
        except (OSError, ValueError):
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


# --- living and dying with the launcher ------------------------------------------------------------------


def _die_with(launcher_pid: int) -> None:
    """End this rank if the kernel that launched it dies: a parent-death signal (the forkserver's death,
    which follows the kernel's) and a watchdog on the kernel itself."""
    die_with_parent()
    _release_forkserver()

    def watch() -> None:
        from gpumagic.devices.processes import is_running

        while True:
            time.sleep(0.5)
            if not is_running(launcher_pid):
                _end_own_group()

    threading.Thread(target=watch, name="gpumagic-watchdog", daemon=True).start()


def _end_own_group() -> None:
    """The launcher is gone: end this rank and every process it started (its process group)."""
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(1)


def die_with_parent(how: int = signal.SIGKILL) -> None:
    """Have the kernel send ``how`` to this process when its parent dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, how, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _release_forkserver() -> None:
    """Drop the forkserver's keep-alive pipe that multiprocessing hands every child: held by the ranks, it
    would keep the forkserver (and so the ranks, through their parent-death signal) alive after the kernel."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None
        server._forkserver_address = None


def _route_output(local_rank: int, outputs: list[Any]) -> None:
    """Send this rank's stdout and stderr (file descriptors 1 and 2, so C libraries too) to the launcher."""
    own = outputs[local_rank]
    flush()
    os.dup2(own.fileno(), 1)
    os.dup2(own.fileno(), 2)
    for connection in outputs:
        connection.close()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass


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
        flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for each in (fd, *saved):
            os.close(each)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m gpumagic.launch.rank_side.rank RUN_DIR  (gpumagic's agent starts it)\n")
        return 2
    die_with_parent()
    code = run_rank(Path(argv[0]))
    flush()
    os._exit(code)  # as a local rank does: skip teardown that could hang in a library's destructor


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Starting a plan's ranks on this machine through multiprocessing (the contexts ``torch.multiprocessing``
wraps; the launcher itself never imports torch, so a background job's runner stays small) and watching them.

Ranks start from a forkserver whose server process has torch imported, so a relaunch costs a fork, not a
torch import (``spawn`` is the fallback); the kernel itself is never forked. The watch loop is all or
nothing, as in torch elastic: every rank succeeds, or at the first failure the rest are stopped (SIGTERM,
then SIGKILL) and one error names the root cause.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumagic.launch.failures import LaunchError, LaunchInterrupted, RankOutcome, root_cause
from gpumagic.launch.plan import LaunchPlan

START_METHODS = ("forkserver", "spawn")
# torch._dynamo: the first DistributedDataParallel() in a process imports it (about 1 s on a CPU, more on a GPU
# machine); imported once in the forkserver, no rank pays it again (benchmarks/launch.py measures both).
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "cloudpickle", "gpumagic.launch.worker"]
STOP_GRACE_S = 3.0


def run_local(
    plan: LaunchPlan,
    packed: bytes,
    *,
    start_method: str = "forkserver",
    listener: Any = None,
    on_output: Callable[[int, bytes], None] | None = None,
    on_start: Callable[[LaunchPlan, list[int]], None] | None = None,
    cancel: threading.Event | None = None,
    poll_s: float = 0.1,
) -> dict[int, Any]:
    """Run a packed payload (``shipping.pack``) on ``plan.nprocs`` local ranks; return ``{rank: value}``.

    Raises:
        LaunchError: a rank failed (raised, exited non-zero, was killed); all ranks are gone when it is raised.
        LaunchInterrupted: KeyboardInterrupt (the kernel's interrupt); all ranks are gone when it is raised.
    """
    from gpumagic.launch.signing import write_sealed
    from gpumagic.launch.worker import run_rank

    write_sealed(Path(plan.job_dir, "payload.pkl"), packed)
    if start_method == "forkserver":
        multiprocessing.forkserver.set_forkserver_preload(_FORKSERVER_PRELOAD)
    context = multiprocessing.get_context(start_method)
    if start_method == "spawn":  # start it now, so it does not inherit a rank's GPUs (_initial_environment)
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    pipes = [context.Pipe(duplex=False) for _ in range(plan.nprocs)]
    readers = {reader.fileno(): (rank, reader) for rank, (reader, _) in enumerate(pipes)}
    processes = []
    try:
        for local_rank in range(plan.nprocs):
            process = context.Process(
                target=run_rank, args=(local_rank, plan, [w for _, w in pipes], listener), name=f"rank-{local_rank}"
            )
            with _initial_environment(plan, local_rank, start_method):
                process.start()
            processes.append(process)
    except BaseException:
        for process in processes:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(process.pid, signal.SIGKILL)
            process.join(5)
        raise
    finally:
        for _, writer in pipes:
            writer.close()
        if listener is not None:
            listener.close()
    watcher = _Watcher(plan, processes, readers, on_output or (lambda rank, data: None), poll_s, cancel)
    try:
        if on_start is not None:
            on_start(plan, [p.pid for p in processes])
        outcomes = watcher.watch()
    except (KeyboardInterrupt, _Cancelled) as reason:
        started = time.monotonic()
        watcher.stop_all(signal.SIGINT)
        why = "stopped from the dashboard" if isinstance(reason, _Cancelled) else "interrupted"
        raise LaunchInterrupted(
            f"{why}; stopped ranks {', '.join(map(str, range(plan.nprocs)))} in "
            f"{time.monotonic() - started:.1f}s. The next launch starts fresh."
        ) from None
    finally:
        watcher.close()
    failure = root_cause(outcomes)
    if failure is not None:
        raise LaunchError(outcomes, failure, _full_disk_note(plan.job_dir))
    return {o.rank: _result(plan, o.rank) for o in outcomes}


@contextlib.contextmanager
def _initial_environment(plan: LaunchPlan, local_rank: int, start_method: str) -> Any:
    """With ``spawn``, start the rank with its GPUs in its initial environment (the one ``/proc`` shows, so the
    simulated inventory counts the rank on its GPU); the rank sets the rest of its environment itself."""
    gpus = plan.rank_gpus[local_rank] if plan.rank_gpus else ()
    if start_method != "spawn" or not gpus:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    os.environ.update(CUDA_VISIBLE_DEVICES=",".join(gpus), CUDA_DEVICE_ORDER="PCI_BUS_ID")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _full_disk_note(job_dir: str) -> str:
    """A note for a failed launch whose ranks' files have no space left: a rank that cannot write its result
    cannot write its error report either, and would seem to have exited without one."""
    from gpumagic.telemetry.private import out_of_space

    if not out_of_space(job_dir):
        return ""
    return (
        f"disk full: {job_dir} has no space left, so a rank may have failed writing its result or its report; "
        "free space or set GPUMAGIC_RUNS_DIR"
    )


def _result(plan: LaunchPlan, rank: int) -> Any:
    import cloudpickle

    from gpumagic.launch.signing import read_sealed

    path = Path(plan.job_dir, f"rank-{rank}.result.pkl")
    return cloudpickle.loads(read_sealed(path, f"rank {rank}'s result ({path})")) if path.exists() else None


class _Cancelled(Exception):
    """The launch's cancel event was set (the dashboard's Stop button)."""


class _Watcher:
    """Multiplexes the ranks' output pipes and exit sentinels in one ``select`` loop."""

    def __init__(
        self,
        plan: LaunchPlan,
        processes: list[Any],
        readers: dict[int, tuple[int, Any]],
        on_output: Callable[[int, bytes], None],
        poll_s: float,
        cancel: threading.Event | None = None,
    ) -> None:
        self.plan = plan
        self.processes = processes
        self.readers = dict(readers)
        self.on_output = on_output
        self.poll_s = poll_s
        self.cancel = cancel
        self.outcomes: dict[int, RankOutcome] = {}
        self.stopping_since: float | None = None
        self.stopped: set[int] = set()

    def watch(self) -> list[RankOutcome]:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        while len(self.outcomes) < len(self.processes):
            waiting = list(self.readers) + [s for s, r in sentinels.items() if r not in self.outcomes]
            ready, _, _ = select.select(waiting, [], [], self.poll_s)
            for fd in ready:
                if fd in self.readers:
                    self._read(fd)
                elif fd in sentinels:
                    self._ended(sentinels[fd])
            self._escalate()
            if self.cancel is not None and self.cancel.is_set() and self.stopping_since is None:
                raise _Cancelled()
        self.drain(timeout=2.0)
        return [self.outcomes[r] for r in range(len(self.processes))]

    def _read(self, fd: int) -> None:
        rank, _ = self.readers[fd]
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if data:
            self.on_output(rank, data)
        else:
            self.readers.pop(fd)[1].close()

    def _ended(self, rank: int) -> None:
        process = self.processes[rank]
        process.join(0.5)
        if process.exitcode is None:
            return
        outcome = self._outcome(rank, process)
        self.outcomes[rank] = outcome
        if not outcome.ok and self.stopping_since is None:
            self._stop_others(signal.SIGTERM)

    def _outcome(self, rank: int, process: Any) -> RankOutcome:
        report_path = Path(self.plan.job_dir, f"rank-{rank}.error.json")
        stopped = rank in self.stopped
        if report_path.exists():
            try:
                report = json.loads(report_path.read_text())
                return RankOutcome(
                    rank,
                    process.pid,
                    process.exitcode,
                    report["phase"],
                    report["type"],
                    report["message"],
                    report["traceback"],
                    report["timestamp"],
                    False,
                )
            except (OSError, ValueError, KeyError):
                pass
        return RankOutcome(
            rank,
            process.pid,
            process.exitcode,
            "process" if process.exitcode else None,
            timestamp=time.time(),
            stopped_by_launcher=stopped and process.exitcode != 0,
        )

    def _stop_others(self, how: int) -> None:
        self.stopping_since = time.monotonic()
        for rank, process in enumerate(self.processes):
            if rank not in self.outcomes and process.exitcode is None:
                self.stopped.add(rank)
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(process.pid, how)

    def _escalate(self) -> None:
        if self.stopping_since is not None and time.monotonic() - self.stopping_since > STOP_GRACE_S:
            for rank, process in enumerate(self.processes):
                if rank not in self.outcomes:
                    with contextlib.suppress(ProcessLookupError, TypeError):
                        os.kill(process.pid, signal.SIGKILL)

    def stop_all(self, first: int) -> None:
        """Stop every rank now (interrupt): ``first`` signal, SIGKILL after the grace period; reap all."""
        self._stop_others(first)
        deadline = time.monotonic() + STOP_GRACE_S
        for rank, process in enumerate(self.processes):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(process.pid, signal.SIGKILL)
                process.join(5)
            self.outcomes.setdefault(rank, self._outcome(rank, process))
        self.drain(timeout=0.5)

    def drain(self, timeout: float) -> None:
        """Read what the ranks wrote before they ended (their pipes close when they exit)."""
        deadline = time.monotonic() + timeout
        while self.readers and time.monotonic() < deadline:
            ready, _, _ = select.select(list(self.readers), [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                self._read(fd)

    def close(self) -> None:
        for _, reader in self.readers.values():
            reader.close()
        self.readers.clear()
        for process in self.processes:
            with contextlib.suppress(ValueError, AssertionError):
                process.close()

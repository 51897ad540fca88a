"""Running a plan's ranks on this machine: started the one way every local rank starts (``rank_start``, through
multiprocessing, the contexts ``torch.multiprocessing`` wraps; the launcher itself never imports torch, so a
background job's runner stays small) and watched.

Ranks start from the rank server (``rank_server``: a forkserver with torch imported), so a relaunch costs a
fork, not a torch import (``spawn`` is the fallback); the kernel itself is never forked. The watch loop is
all or nothing, as in torch elastic: every rank succeeds, or at the first failure the rest are stopped
(SIGTERM, then SIGKILL) and one error names the root cause, the rank that failed first.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from gpumagic.errors import InvalidArgument
from gpumagic.launch.failures import LaunchError, LaunchInterrupted
from gpumagic.launch.hang_reports import mismatch_after_failure
from gpumagic.launch.kernel_side.rank_start import rank_context
from gpumagic.launch.plan import LaunchPlan
from gpumagic.launch.process_set import Exit, ProcessSet
from gpumagic.launch.rank_side.rank import run_local_rank
from gpumagic.launch.rank_side.starter import RankStarter
from gpumagic.launch.secure_store import listen
from gpumagic.run_dirs.launch_files import make_launch_directories
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.outcomes import ProcessEnd, RankOutcome, read_outcome, read_result, root_cause
from gpumagic.run_dirs.private import out_of_space
from gpumagic.run_dirs.signing import write_sealed


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
    on_poll: Callable[[], None] | None = None,
) -> dict[int, Any]:
    """Run a packed payload (``shipping.pack``) on ``plan.nprocs`` local ranks; return ``{rank: value}``.
    ``on_poll()`` is called every round of the watch (``poll_s``): the hang follower's look.

    Raises:
        LaunchError: a rank failed (raised, exited non-zero, was killed); all ranks are gone when it is raised.
        LaunchInterrupted: KeyboardInterrupt (the kernel's interrupt); all ranks are gone when it is raised.
    """
    files = RunFiles(plan.run_dir)
    make_launch_directories(files)
    write_sealed(files.payload, packed)
    with rank_context(start_method) as context:  # held until the ranks ended: the server is not restarted under them
        starter = RankStarter(plan, context, target=run_local_rank, name="rank-{}", start_method=start_method)
        ranks = _start(starter, listener)
        watcher = _Watcher(plan, ranks, on_output or (lambda rank, data: None), poll_s, cancel, on_poll)
        try:
            if on_start is not None:
                on_start(plan, ranks.pids)
            outcomes = watcher.watch()
        except (KeyboardInterrupt, _Cancelled) as reason:
            started = time.monotonic()
            watcher.stop_all(signal.SIGINT)
            why = "stopped from the dashboard" if isinstance(reason, _Cancelled) else "interrupted"
            raise LaunchInterrupted(
                f"{why}; stopped ranks {', '.join(map(str, range(plan.nprocs)))} in "
                f"{time.monotonic() - started:.1f}s. The next launch starts fresh."
            ) from None
        except BaseException:  # gpumagic's own failure (a callback, a full disk): no rank outlives the launch
            watcher.stop_all(signal.SIGTERM)
            raise
        finally:
            watcher.close()
    failure = root_cause(outcomes)
    if failure is not None:
        mismatches = mismatch_after_failure(files, list(range(plan.nprocs)))
        raise LaunchError(outcomes, failure, "\n".join(filter(None, [_full_disk_note(plan.run_dir), *mismatches])))
    return {o.rank: read_result(files, o.rank) for o in outcomes}


def ended_outcome(files: RunFiles, exit: Exit) -> RankOutcome:
    """How a local rank ended (``read_outcome``), with how the watcher saw its process end: stopped by this launch
    only where it sent the signal, so a rank that left no word and no readable exit code is lost."""
    return read_outcome(
        files, exit.index, 0, ProcessEnd(exit.pid, exit.exitcode, exit.time, exit.stopped and exit.exitcode != 0)
    )


def loopback_port(port: int | None) -> int:
    """A port number for ``MASTER_PORT`` (``port`` if free on 127.0.0.1, else any free one), which only code that
    reads it uses: gpumagic's own groups meet on the run's store (``store_listener``), never on a TCP port.

    Raises:
        InvalidArgument: ``port`` is taken.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port or 0))
        except OSError as err:
            raise InvalidArgument(
                f"port {port} is taken on 127.0.0.1 ({err.strerror}); leave out --port to use a free one"
            ) from None
        return probe.getsockname()[1]


def store_listener(files: RunFiles) -> Any:
    """The listening Unix socket of a local launch's store, in the run's private launch directory (made first):
    handed to rank 0, which serves the store on it (``secure_store``); no other user can connect to it."""
    listener = listen(f"unix:{files.store_socket}")
    listener.set_inheritable(False)
    return listener


class _Ranks(ProcessSet):
    """The rank processes of a local launch, with the read ends of their output pipes."""

    readers: dict[int, tuple[int, Any]]


def _start(starter: RankStarter, listener: Any) -> _Ranks:
    """Start every rank, each with the write ends of all output pipes (it keeps its own) and rank 0's store
    listener; if one cannot start, those started are killed."""
    pipes = [starter.context.Pipe(duplex=False) for _ in range(starter.plan.nprocs)]
    processes = []
    try:
        for local_rank in range(starter.plan.nprocs):
            processes.append(starter.start(local_rank, [w for _, w in pipes], listener))
    except BaseException:
        started = ProcessSet(processes, groups=True)
        started.stop(signal.SIGKILL, grace_s=5.0)
        started.close()
        for reader, _ in pipes:
            reader.close()
        raise
    finally:
        for _, writer in pipes:
            writer.close()
        if listener is not None:
            listener.close()
    ranks = _Ranks(processes, groups=True)
    ranks.readers = {reader.fileno(): (rank, reader) for rank, (reader, _) in enumerate(pipes)}
    return ranks


def _full_disk_note(run_dir: str) -> str:
    """A note for a failed launch whose ranks' files have no space left: a rank that cannot write its result
    cannot write its error report either, and would seem to have exited without one."""
    if not out_of_space(run_dir):
        return ""
    return (
        f"disk full: {run_dir} has no space left, so a rank may have failed writing its result or its report; "
        "free space or set GPUMAGIC_RUNS_DIR"
    )


class _Cancelled(Exception):
    """The launch's cancel event was set (the dashboard's Stop button)."""


class _Watcher:
    """Multiplexes the ranks' output pipes and their ends in one ``select`` loop."""

    def __init__(
        self,
        plan: LaunchPlan,
        ranks: _Ranks,
        on_output: Callable[[int, bytes], None],
        poll_s: float,
        cancel: threading.Event | None = None,
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        self.files = RunFiles(plan.run_dir)
        self.on_poll = on_poll
        self.ranks = ranks
        self.readers = dict(ranks.readers)
        self.on_output = on_output
        self.poll_s = poll_s
        self.cancel = cancel
        self.outcomes: dict[int, RankOutcome] = {}

    def watch(self) -> list[RankOutcome]:
        while self.ranks.running:
            ended, ready = self.ranks.poll(self.poll_s, also=list(self.readers))
            for fd in ready:
                self._read(fd)
            for exit in ended:
                self._ended(exit)
            self.ranks.escalate()
            if self.on_poll is not None and not self.ranks.stopping:
                self.on_poll()
            if self.cancel is not None and self.cancel.is_set() and not self.ranks.stopping:
                raise _Cancelled()
        self.ranks.end_leftovers()  # first: what they left running may hold their output pipes open
        self.drain(timeout=2.0)
        return [self.outcomes[r] for r in range(len(self.ranks))]

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

    def _ended(self, exit: Exit) -> None:
        outcome = ended_outcome(self.files, exit)
        self.outcomes[exit.index] = outcome
        if not outcome.ok:
            self.ranks.begin_stop(signal.SIGTERM)  # the others: SIGTERM, SIGKILL after the grace period

    def stop_all(self, first: int) -> None:
        """Stop every rank now (interrupt): ``first`` signal, SIGKILL after the grace period; reap all."""
        self.ranks.stop(first)
        for exit in self.ranks.exits.values():
            if exit.index not in self.outcomes:
                self._ended(exit)
        self.ranks.end_leftovers()
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
        self.ranks.close()

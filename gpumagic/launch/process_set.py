"""Processes started together and ended together (a launch's ranks, an elastic agent, a persistent group's
ranks): which ended, how and when (timed when each died, through a pidfd, not when someone looked), and one way
to stop them (``devices.processes.Escalation``: the first signal, a grace period, SIGKILL).

The model is torch elastic's ``PContext``: start / poll for outcomes / pids / close, under every launcher. A
persistent group also kills one process that stays stuck and puts a fresh one in the place of one that ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpumagic.devices.processes import Escalation, end_processes, is_running, signal_processes

_log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0


@dataclass(frozen=True)
class Exit:
    """Process ``index`` of the set ended with ``exitcode`` (negative: killed by that signal) at ``time``."""

    index: int
    pid: int
    exitcode: int | None
    time: float
    stopped: bool  # the set stopped it (after another failed, or on an interrupt)


class ProcessSet:
    """Started processes: ``multiprocessing.Process`` objects or ``subprocess.Popen`` objects.

    ``groups``: each process leads its own process group (it calls ``setpgid(0, 0)`` first thing); stopping
    one stops what it started too, and ``end_leftovers`` ends what it left behind.
    """

    def __init__(self, processes: Sequence[Any], *, groups: bool = False) -> None:
        self.processes: list[Any] = []
        self.pids: list[int] = []
        self.groups = groups
        self.exits: dict[int, Exit] = {}
        self.stopped: set[int] = set()
        self._fds: dict[int, int] = {}
        self._escalation: Escalation | None = None
        for process in processes:
            self.add(process)

    def __len__(self) -> int:
        return len(self.processes)

    def add(self, process: Any) -> int:
        """Watch one more started process; its index in the set."""
        self.processes.append(process)
        self.pids.append(process.pid)
        self._watch(len(self.processes) - 1)
        return len(self.processes) - 1

    def replace(self, index: int, process: Any) -> None:
        """Put a fresh started process in the place of process ``index``, which ended (its exit is forgotten)."""
        self._unwatch(index)
        self.processes[index], self.pids[index] = process, process.pid
        self.exits.pop(index, None)
        self.stopped.discard(index)
        self._watch(index)

    def _watch(self, index: int) -> None:
        fd = _pidfd(self.pids[index])
        if fd is None:
            fd = getattr(self.processes[index], "sentinel", None)
        if fd is not None:
            self._fds[fd] = index

    def _unwatch(self, index: int) -> None:
        """Close process ``index``'s descriptor and its handle (it ended)."""
        process = self.processes[index]
        for fd in [fd for fd, watched in self._fds.items() if watched == index]:
            del self._fds[fd]
            if fd != getattr(process, "sentinel", None):
                with contextlib.suppress(OSError):
                    os.close(fd)
        if not isinstance(process, subprocess.Popen):
            with contextlib.suppress(ValueError, AssertionError):
                process.close()

    @property
    def running(self) -> list[int]:
        return [i for i in range(len(self.processes)) if i not in self.exits]

    def waitables(self) -> list[int]:
        """File descriptors that become readable when a process of the set ends (for ``select``)."""
        return [fd for fd, index in self._fds.items() if index not in self.exits]

    def poll(self, timeout: float = 0.0, also: Iterable[int] = ()) -> tuple[list[Exit], list[int]]:
        """Wait up to ``timeout`` for a process to end or one of ``also`` (other descriptors) to be readable;
        the processes that ended (each timed as it ended) and the ``also`` descriptors that are ready."""
        also = list(also)
        ready, _, _ = select.select(self.waitables() + also, [], [], timeout)
        now = time.time()
        ended = [self._record(self._fds[fd], now) for fd in ready if fd in self._fds]
        for index in self.running:  # a process with no descriptor to watch
            if index not in self._fds.values() and self._exit_code(index, 0) is not None:
                ended.append(self._record(index, now))
        return [e for e in ended if e is not None], [fd for fd in ready if fd in also]

    def gone(self) -> list[Exit]:
        """Record the processes that ``/proc`` shows ended though their descriptor does not say so yet (a process
        whose main thread ended is a zombie while its other threads still end)."""
        now = time.time()
        ended = [self._record(i, now) for i in self.running if not is_running(self.pids[i])]
        return [e for e in ended if e is not None]

    def send_signal(self, index: int, signum: int) -> None:
        """Send ``signum`` to process ``index`` alone (an interrupt)."""
        os.kill(self.pids[index], signum)

    def kill(self, index: int) -> Exit:
        """SIGKILL process ``index`` now (and what it started, with ``groups``): one that stays stuck. How it ended."""
        self.stopped.add(index)
        pid = self.pids[index]
        signal_processes([pid], [pid] if self.groups else [], signal.SIGKILL)
        self._record(index, time.time())
        return self.exits[index]

    def _record(self, index: int, when: float) -> Exit | None:
        if index in self.exits:
            return None
        code = self._exit_code(index, 5.0)  # it is dead: its exit code is on its way (the forkserver reaps it)
        exit = Exit(index, self.pids[index], code, when, index in self.stopped)
        self.exits[index] = exit
        return exit

    def _exit_code(self, index: int, timeout: float) -> int | None:
        process = self.processes[index]
        if isinstance(process, subprocess.Popen):
            try:
                return process.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        process.join(timeout)
        return process.exitcode

    def stop(self, first: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> str:
        """Stop every process still running (``first``, SIGKILL after ``grace_s``; a stop ``begin_stop`` started
        goes on), wait, then record how each ended. Returns the strongest signal it took (``Escalation.used``)."""
        running = self.running
        self.begin_stop(first, grace_s)
        assert self._escalation is not None
        while not self._escalation.step():
            time.sleep(0.02)
        now = time.time()
        for index in running:
            self._record(index, now)
        return self._escalation.used

    def begin_stop(self, first: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> None:
        """Start stopping every process still running without waiting (``first`` now, SIGKILL after ``grace_s``
        through ``escalate``, which the caller's poll loop calls), marking them stopped."""
        if self._escalation is not None:
            return
        running = self.running
        self.stopped.update(running)
        pids = [self.pids[i] for i in running]
        self._escalation = Escalation(pids, first=first, grace_s=grace_s, groups=pids if self.groups else ())
        self._escalation.start()

    @property
    def stopping(self) -> bool:
        return self._escalation is not None

    def escalate(self) -> None:
        """The stop ``begin_stop`` started: SIGKILL once its grace period is over."""
        if self._escalation is not None:
            self._escalation.step()

    def end_leftovers(self, indices: Iterable[int] | None = None) -> None:
        """End what the processes (all, or those of ``indices``) started and left running in their groups (they
        ended)."""
        if self.groups:
            chosen = range(len(self.pids)) if indices is None else indices
            end_processes([], groups=[self.pids[i] for i in chosen], grace_s=0)

    def close(self) -> None:
        for index in range(len(self.processes)):
            self._unwatch(index)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable the moment ``pid`` ends, whoever its parent (Linux 5.3+)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        _log.debug("no pidfd for process %d; it is watched without one", pid, exc_info=True)
        return None

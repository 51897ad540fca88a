"""Facts about OS processes (owner, command line, liveness) and killing the user's own GPU processes."""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from gpumagic.errors import KillRefused

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessFacts:
    user: str | None
    command: str | None
    alive: bool


def describe_process(pid: int) -> ProcessFacts:
    """Owner and command line of ``pid``; ``alive`` is False when no such process is visible here."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            user = _username(proc)
            try:
                command = " ".join(proc.cmdline()) or proc.name()
            except (psutil.AccessDenied, psutil.ZombieProcess):
                command = proc.name()
        return ProcessFacts(user, command, True)
    except psutil.NoSuchProcess:
        return ProcessFacts(None, None, False)
    except psutil.AccessDenied:
        return ProcessFacts(None, None, True)


def _username(proc) -> str | None:
    try:
        return proc.username()
    except (KeyError, psutil.AccessDenied):  # a uid with no passwd entry (containers)
        try:
            return str(proc.uids().real)
        except psutil.Error:
            return None


def current_user() -> str:
    """The login name of the user running this process (the uid if it has no name)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch), or ``None`` if it is gone: tells reused PIDs apart.

    A zombie (it exited; its parent has not reaped it yet) is gone: it runs nothing and holds nothing.
    """
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc.create_time()
    except psutil.Error:
        return None


def is_same_process(pid: int, recorded_start: float | None) -> bool:
    """True while ``pid`` runs and (if known) started when recorded: a dead holder's reused PID is not it."""
    started = process_start_time(pid)
    return started is not None and (recorded_start is None or abs(started - float(recorded_start)) <= 1.0)


@dataclass(frozen=True)
class KillReport:
    pid: int
    command: str | None
    signal_name: str
    seconds: float

    def __repr__(self) -> str:
        return f"Stopped PID {self.pid} ({self.command or '?'}) with {self.signal_name} in {self.seconds:.1f}s"


def kill_own_process(pid: int, gpu_pids: set[int], timeout: float = 5.0) -> KillReport:
    """Stop ``pid`` (SIGTERM, then SIGKILL after ``timeout`` seconds) if it is this user's GPU process.

    Raises:
        KillRefused: the process is not on a GPU, belongs to another user, is this kernel or one of its
            parents, or is already gone.
    """
    if pid in _self_and_ancestors():
        raise KillRefused(f"PID {pid} is this kernel or one of its parents; restart the kernel instead")
    if pid not in gpu_pids:
        raise KillRefused(
            f"PID {pid} is not a compute process on any GPU here; %gpu kill stops only GPU processes (see %gpu status)"
        )
    try:
        proc = psutil.Process(pid)
        owner_uid = proc.uids().real
        command = " ".join(proc.cmdline()) or proc.name()
    except psutil.NoSuchProcess:
        raise KillRefused(f"PID {pid} has already exited (or runs in another container)") from None
    if owner_uid != os.getuid():
        raise KillRefused(
            f"PID {pid} belongs to {_username(proc) or owner_uid}; gpumagic stops only your own processes. "
            "Ask its owner or an administrator."
        )
    start = time.monotonic()
    used = end_processes([pid], grace_s=timeout)
    if used == "none":  # it ended between the check and the signal
        used = "SIGTERM"
    elif used == "SIGKILL":
        used = f"SIGKILL (it ignored SIGTERM for {timeout:.0f}s)"
    return KillReport(pid, command, used, time.monotonic() - start)


def read_stat(pid: int) -> tuple[bytes, list[bytes]] | None:
    """``/proc/PID/stat`` split where its command ends: (``PID (command)``, fields 3 on of proc(5): state,
    parent pid, ...), so a command holding spaces or parentheses cannot shift them; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            head, _, rest = handle.read().rpartition(b")")
    except (FileNotFoundError, ProcessLookupError):  # it has ended: the usual answer while /proc is listed
        return None
    except OSError:
        _log.debug("/proc/%d/stat is unreadable; the process is taken as unknown", pid, exc_info=True)
        return None
    return head, rest.split()


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (0 for the first process), None if it is gone or unreadable."""
    stat = read_stat(pid)
    return int(stat[1][1]) if stat and len(stat[1]) > 1 else None


class Ancestry:
    """Which process descends from which, each parent read from ``/proc`` once (one per placement, or look)."""

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}

    def parent(self, pid: int) -> int:
        if pid not in self._parent:
            self._parent[pid] = parent_pid(pid) or 0
        return self._parent[pid]

    def descends(self, pid: int, ancestor: int) -> bool:
        """True if ``pid`` is ``ancestor`` or below it (up to 16 generations)."""
        for _ in range(16):
            if pid == ancestor:
                return True
            if pid <= 1:
                return False
            pid = self.parent(pid)
        return False


def proc_hides_others() -> bool:
    """True if ``/proc`` hides other users' processes (mounted with ``hidepid``): then a pid that cannot be
    seen may still run."""
    global _hides
    if _hides is None:
        _hides = False
        try:
            mounts = open("/proc/mounts").read().splitlines()
        except OSError:
            mounts = []
        for line in mounts:
            fields = line.split()
            if len(fields) > 3 and fields[1] == "/proc":
                options = dict(o.partition("=")[::2] for o in fields[3].split(","))
                _hides = options.get("hidepid", "0") not in ("0", "off")
    return _hides


_hides: bool | None = None


def is_running(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


class Escalation:
    """gpumagic's one way to stop processes: ``first`` to each of ``pids`` and to each process group of
    ``groups``; a grace period (``grace_s``) for them to end; SIGKILL to what still runs (and to the groups:
    what the processes started and left behind). Never reaps: a caller's own children stay for it to wait for.

    ``start()`` sends the first signal; ``step()`` (call it while waiting) says whether all ended, and sends
    SIGKILL once when the grace period is over; ``end_processes`` does both and blocks.
    """

    def __init__(
        self, pids: Iterable[int], *, first: int = signal.SIGTERM, grace_s: float = 3.0, groups: Iterable[int] = ()
    ) -> None:
        self.alive = [p for p in pids if p and is_running(p)]
        self.groups = [g for g in groups if g]
        self.first = first
        self.grace_s = grace_s
        self.used = "none"  # the strongest signal sent so far
        self._deadline = 0.0
        self._killed = False

    def start(self) -> Escalation:
        if self.alive or self.groups:
            signal_processes(self.alive, self.groups, self.first)
            self.used = signal.Signals(self.first).name
        self._deadline = time.monotonic() + self.grace_s
        return self

    def step(self) -> bool:
        """True once every process ended (or 5 s after SIGKILL, when waiting longer is pointless)."""
        self.alive = [p for p in self.alive if is_running(p)]
        now = time.monotonic()
        if not self.alive:
            if not self._killed:
                signal_processes([], self.groups, signal.SIGKILL)  # what they left behind in their groups
                self._killed = True
            return True
        if not self._killed and now >= self._deadline:
            signal_processes(self.alive, self.groups, signal.SIGKILL)
            self._killed, self.used, self._deadline = True, "SIGKILL", now + 5.0
        return self._killed and now >= self._deadline


def end_processes(
    pids: Iterable[int],
    *,
    first: int = signal.SIGTERM,
    grace_s: float = 3.0,
    groups: Iterable[int] = (),
) -> str:
    """Stop processes with the one ladder (``Escalation``) and wait until they ended. Returns the strongest
    signal it took: ``"none"`` (all had ended), ``first``'s name (``"SIGTERM"``) or ``"SIGKILL"``."""
    escalation = Escalation(pids, first=first, grace_s=grace_s, groups=groups).start()
    while not escalation.step():
        time.sleep(0.02)
    return escalation.used


def signal_processes(pids: list[int], groups: list[int], how: int) -> None:
    """Send ``how`` to each process group of ``groups``, then to each of ``pids``; what is gone is skipped."""
    for group in groups:
        with contextlib.suppress(OSError):
            os.killpg(group, how)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, how)


def _self_and_ancestors() -> set[int]:
    me = psutil.Process()
    return {me.pid, 1} | {p.pid for p in me.parents()}

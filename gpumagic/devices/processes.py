"""Facts about OS processes (owner, command line, liveness) and killing the user's own GPU processes."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from gpumagic.errors import KillRefused


@dataclass(frozen=True)
class ProcessFacts:
    user: str | None
    command: str | None
    alive: bool


def describe_process(pid: int) -> ProcessFacts:
    """Owner and command line of ``pid``; ``alive`` is False when no such process is visible here."""
    import psutil

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
    import psutil

    try:
        return proc.username()
    except (KeyError, psutil.AccessDenied):  # a uid with no passwd entry (containers)
        try:
            return str(proc.uids().real)
        except psutil.Error:
            return None


def current_user() -> str:
    """The login name of the user running this process (the uid if it has no name)."""
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch), or ``None`` if it is gone: tells reused PIDs apart.

    A zombie (it exited; its parent has not reaped it yet) is gone: it runs nothing and holds nothing.
    """
    import psutil

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
    import psutil

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
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
        used = "SIGTERM"
    except psutil.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
        used = f"SIGKILL (it ignored SIGTERM for {timeout:.0f}s)"
    except psutil.NoSuchProcess:
        used = "SIGTERM"
    return KillReport(pid, command, used, time.monotonic() - start)


def _self_and_ancestors() -> set[int]:
    import psutil

    me = psutil.Process()
    return {me.pid, 1} | {p.pid for p in me.parents()}

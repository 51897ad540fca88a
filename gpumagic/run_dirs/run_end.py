"""How a run ended (status, why, when), or that it has not: the one reader of a run's end, for a launch's run
(``ddp``, ``ddp-group``), a kernel's own run (``kernel``) and a background job (``job``) alike.

The process that carries a run records its end in ``run.json`` (``store.record_end``): the kernel for its launches
and its own run, a job's runner, a Slurm job's rank 0. While the record says the run is active, whoever carries it
is asked: gone without recording an end, the run is ``lost``. The kernel is this module's to ask; a job's carrier
is its executor's (``jobs.local``: the runner; ``jobs.slurm``: Slurm), which passes what it sees as ``watch``.

>>> run_end({"status": "failed", "exit": "rank 1 raised ValueError", "ended": 5.0})
RunEnd(status='failed', why='rank 1 raised ValueError', ended=5.0, brief='')
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpumagic.devices.processes import is_same_process

_log = logging.getLogger(__name__)

ACTIVE = ("queued", "running")
KERNEL_KINDS = ("ddp", "ddp-group", "kernel")  # the runs a kernel carries, and records the end of


@dataclass(frozen=True)
class RunEnd:
    """How a run ended, or that it is active.

    ``status``: ``queued`` or ``running`` while active; then ``finished``, ``failed``, ``interrupted``, ``killed``,
    ``cancelled`` or ``lost`` (``?``: no record says). ``why``: why it waits or how it ended (empty: nothing to
    add); ``brief``: the same in a few words, for a table cell (empty: ``why`` is short already). ``ended``: when
    (seconds since the epoch); None while active, or when nobody recorded it.
    """

    status: str
    why: str = ""
    ended: float | None = None
    brief: str = ""

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    @property
    def short(self) -> str:
        """``why`` in a few words."""
        return self.brief or self.why


Watch = Callable[[Mapping[str, Any]], "RunEnd | None"]  # what a carrier shows of an active run; None: as recorded


def recorded_end(info: Mapping[str, Any]) -> RunEnd:
    """What the run's record (``info``: its ``run.json``) says: its status, why (``exit``, else ``reason``), when."""
    ended = info.get("ended")
    why = info.get("exit") or info.get("reason") or ""
    return RunEnd(str(info.get("status", "?")), str(why), float(ended) if ended is not None else None)


def run_end(info: Mapping[str, Any], watch: Watch | None = None) -> RunEnd:
    """How the run ``info`` (its ``run.json``) describes ended, or that it is still active.

    A record that says the run ended is the answer. One that says it is active is checked with whoever carries
    the run: ``watch`` (a job's executor) if given, else the kernel of a launch's or kernel's run (``lost`` when
    that kernel is gone, where this machine can tell).
    """
    recorded = recorded_end(info)
    if not recorded.active:
        return recorded
    seen = (watch or _kernel_watch)(info)
    return recorded if seen is None else seen


def lost(carrier: str) -> RunEnd:
    """The end of a run whose ``carrier`` (``"runner (pid 5)"``) is gone without recording one."""
    return RunEnd("lost", f"its {carrier} is gone without recording an end", brief=f"{carrier} gone")


def judged_here(info: Mapping[str, Any]) -> bool:
    """Whether this process can tell if the run's processes live: the run was made where a PID means the same."""
    return info.get("pid_space") == pid_space()


def pid_space() -> str:
    """Where a PID means this process: the machine's boot and this PID namespace (containers sharing a host
    name have their own PIDs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        _log.debug("the boot id or PID namespace is unreadable; the host name stands for them", exc_info=True)
        return socket.gethostname()


def _kernel_watch(info: Mapping[str, Any]) -> RunEnd | None:
    """A launch's or kernel's run whose kernel is gone ended with it (another machine's or container's run cannot
    be judged from here)."""
    if info.get("kind") not in KERNEL_KINDS or not judged_here(info):
        return None
    pid = info.get("pid")
    if isinstance(pid, int) and is_same_process(pid, info.get("pid_start")):
        return None
    return lost(f"kernel (pid {pid})")

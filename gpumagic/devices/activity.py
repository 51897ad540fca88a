"""Whether this kernel uses its GPUs, as its lease records tell everyone: busy, or idle since when.

A kernel is busy while a cell runs, and its GPUs count as used while its processes (the kernel, its ranks) keep
them busy where NVML tells (``GpuProcess.utilization``); otherwise it is idle since the later of its last cell's
end and that use. The lease records of a kernel carry it as their last field, ``"activity"``: a string of fixed
width (``idle 1764441234.123456 1a2b3c4d``: state, since when, a CRC-32 of the two). It is rewritten in place,
its bytes alone, when a cell starts or ends and when the kernel's processes are seen using a GPU: the record's
other bytes never change, so a reader never sees half a lease; at worst (rarely) a torn activity, which fails
its check and reads as unknown, never idle. A record is its holder's own file (0644, in a sticky directory):
nobody else can make a kernel look idle or busy. Processes that are not IPython kernels (scripts, job
runners) write no activity, and are never idle.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

BUSY, IDLE = "busy", "idle"
_WIDTH = len("idle 0000000000.000000 00000000")


@dataclass(frozen=True)
class Activity:
    """A kernel's use of its GPUs at one moment: ``busy`` (a cell runs) or idle, ``since`` when (epoch s)."""

    busy: bool
    since: float

    def idle_s(self, now: float | None = None) -> float | None:
        """How long it has been idle; None while busy."""
        if self.busy:
            return None
        return max((time.time() if now is None else now) - self.since, 0.0)

    def text(self) -> str:
        """The record's fixed-width field: ``idle 1764441234.123456 1a2b3c4d``."""
        head = f"{BUSY if self.busy else IDLE} {min(max(self.since, 0.0), 9_999_999_999.0):017.6f}"
        return f"{head} {zlib.crc32(head.encode()):08x}"

    @classmethod
    def parse(cls, value: object) -> Activity | None:
        """The activity a record's field gives; None if it has none, or one that fails its check."""
        if not isinstance(value, str) or len(value) != _WIDTH:
            return None
        head, _, check = value.rpartition(" ")
        state, _, since = head.partition(" ")
        if state not in (BUSY, IDLE) or f"{zlib.crc32(head.encode()):08x}" != check:
            return None
        try:
            moment = float(since)
        except ValueError:
            return None
        if not 0.0 <= moment <= time.time() + 60.0:  # a clock ahead by a minute; anything later is no time
            return None
        return cls(state == BUSY, moment)


class CellActivity:
    """This kernel's activity, kept by IPython's cell events (``devices.idle_release.watch_cells``).

    ``tracked`` is False until a kernel's cells are watched: a process whose cells nobody watches is never idle,
    and its records carry no activity."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.tracked = False
        self._now = Activity(True, time.time())

    def now(self) -> Activity | None:
        """The activity now; None where it is not tracked (never idle)."""
        with self._lock:
            return self._now if self.tracked else None

    def track(self, running: bool) -> None:
        """Start tracking, busy if a cell runs (``running``), else idle from now."""
        with self._lock:
            if not self.tracked:
                self.tracked = True
                self._now = Activity(running, time.time())

    def cell_started(self, write: Callable[[Activity], None] | None = None) -> Activity:
        """A cell starts: busy. ``write`` (the lease book's) tells the records, under this lock, so that a
        slower write of an earlier state never lands after it."""
        return self._change(Activity(True, time.time()), write)

    def cell_ended(self, write: Callable[[Activity], None] | None = None) -> Activity:
        return self._change(Activity(False, time.time()), write)

    def _change(self, new: Activity, write: Callable[[Activity], None] | None) -> Activity:
        with self._lock:
            self._now = new
            if write is not None:
                write(new)
            return new

    def if_unchanged(self, seen: Activity, action: Callable[[], T]) -> T | None:
        """``action()`` if the activity is still ``seen`` (no cell has started since), holding off a cell's start
        until it is done; else None."""
        with self._lock:
            return action() if self.tracked and self._now == seen else None

    def gpu_used(self, when: float, write: Callable[[Activity], None] | None = None) -> Activity | None:
        """Its processes used a GPU at ``when``: idle only from then on (told with ``write``). The new activity,
        or None if unchanged (busy, or idle since later already)."""
        with self._lock:
            if self._now.busy or self._now.since >= when:
                return None
            return self._change(Activity(False, when), write)


_activity = CellActivity()


def cell_activity() -> CellActivity:
    """This process's."""
    return _activity

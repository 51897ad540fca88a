"""Stopping every rank of a persistent group at the same point of its program (a rank's side).

A *sync point* is the entry of a collective (``dist.all_reduce``, ``dist.barrier``, ...) or of a training forward
of a DistributedDataParallel model (whose backward all-reduces the gradients). Every rank of a data-parallel
program passes the same sync points in the same order, so "stop before sync point N" names one moment of the
whole group's computation. An interrupt then reaches every rank there instead of wherever each happens to be
(which left replicas one optimizer step apart).

The kernel asks in two steps, answered by the rank's control thread while the main thread runs the cell:

1. ``pause``: from now on the rank waits at its next sync point (so its count no longer moves); the answer is
   how many it entered in this cell and how fast they come.
2. ``stop_at(N)``: N is one past the highest count any rank answered, so no rank has passed it; a rank waiting
   at a sync point below N goes on, and every rank raises KeyboardInterrupt on reaching the cell's N-th.

Counted from the cell's start, so that a cell run on some ranks only does not put the others out of count.

A rank that makes no sync point in time is interrupted the usual way (SIGINT), which also ends a wait here.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any


class SyncPoints:
    """The sync points a rank entered, and the stop the kernel asked for. ``enter`` runs on the main thread at
    every sync point (about a microsecond); ``pause``/``stop_at`` on the control thread."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._cell: int | None = None  # the request number of the cell running, None between cells
        self._made = 0  # sync points entered in this cell
        self._last = 0.0  # monotonic time of the last sync point
        self._gap: float | None = None  # the usual time between sync points in this cell, seconds
        self._pausing = False
        self._stop_at: int | None = None
        self.stopped_at: int | None = None  # the sync point this cell stopped at (counted from the cell's start)

    def start_cell(self, ident: int) -> None:
        with self._lock:
            self._cell, self._made, self._gap = ident, 0, None
            self._pausing, self._stop_at, self.stopped_at = False, None, None

    def end_cell(self) -> None:
        with self._lock:
            self._cell, self._pausing, self._stop_at = None, False, None
            self._lock.notify_all()

    def enter(self) -> None:
        """At a sync point: wait while paused, raise KeyboardInterrupt at the stop, else count it."""
        with self._lock:
            while self._pausing and self._stop_at is None:
                self._lock.wait()  # the kernel's SIGINT still raises here
            if self._stop_at is not None and self._made + 1 >= self._stop_at:
                self.stopped_at = self._made
                self._stop_at, self._pausing = None, False  # the user's handler may make collectives
                raise KeyboardInterrupt
            now = time.monotonic()
            if self._made:
                gap = now - self._last
                self._gap = gap if self._gap is None else max(gap, 0.7 * self._gap + 0.3 * gap)
            self._last = now
            self._made += 1

    def pause(self, cell: int) -> dict[str, Any] | None:
        """Hold the rank at its next sync point; where it is (``None``: it runs no such cell any more): sync
        points made in the cell, the usual seconds between them, seconds since the last."""
        with self._lock:
            if cell != self._cell:
                return None
            self._pausing = True
            return {"made": self._made, "gap": self._gap, "since": time.monotonic() - self._last}

    def stop_at(self, cell: int, point: int) -> None:
        """Raise KeyboardInterrupt on reaching the cell's sync point ``point`` (1: its first)."""
        with self._lock:
            if cell == self._cell:
                self._stop_at = point
                self._lock.notify_all()


def track_ddp_forwards(points: SyncPoints) -> None:
    """Make every training forward of a DistributedDataParallel model a sync point (once per process)."""

    # lazy: torch takes seconds to import; only rank processes need it
    import torch
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.forward
    if getattr(original, "_gpumagic_sync_point", False):
        return

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():  # its backward all-reduces: every rank makes it
            points.enter()
        return original(self, *args, **kwargs)

    forward._gpumagic_sync_point = True  # type: ignore[attr-defined]
    DistributedDataParallel.forward = forward

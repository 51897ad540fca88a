"""The machine's job queue: a waiting job's ticket, and the loop its runner waits in until it is placed.

Placement itself (queue order, backfill and its bound, reservations, the reasons a job waits) is
``gpumagic.devices.placement``, the same that ``%gpu pick`` uses; tickets are files of the lease directory
(``gpumagic.devices.tickets``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from gpumagic.devices import leases as leasing
from gpumagic.devices import placement, tickets
from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.model import GpuInfo, Inventory
from gpumagic.devices.pick_lock import LeaseBusy
from gpumagic.devices.placement import Request, Ticket

__all__ = [
    "Request",
    "Ticket",
    "one_line_why",
    "place",
    "places",
    "remove_tickets",
    "take",
    "wait_for_gpus",
    "waiting_tickets",
]
PROVISIONAL_S = tickets.PROVISIONAL_S


def remove_tickets(key: str) -> None:
    """Take job ``key`` (its run id) out of the queue: a killed job's ticket, even one its runner never took
    over, must not hold a place."""
    tickets.remove_tickets(key)


def waiting_tickets() -> list[Ticket]:
    """Live tickets of every user, in queue order."""
    view = leasing.read_view(leasing.book(), PROVISIONAL_S)
    return placement.queue_order(Ticket.of(f) for f in view.tickets)


def places() -> dict[str, tuple[int, int]]:
    """This user's waiting jobs, by name: (tickets ahead of it in the queue, of them jobs), in serving order."""
    result = {}
    jobs_ahead = 0
    for ahead, ticket in enumerate(waiting_tickets()):
        if ticket.kind == "job" and ticket.uid == os.getuid():
            result[ticket.name] = (ahead, jobs_ahead)
        jobs_ahead += ticket.kind == "job"
    return result


def one_line_why(
    why: str, request: Request | None = None, place: tuple[int, int] | None = None, width: int = 80
) -> str:
    """A job's why in one short line, for a table cell (the full text, ``why``, is for a tooltip or ``%jobs``).

    A job waiting in the queue (``place``: from ``places``) reads ``waiting for 2 GPUs with 20 GiB reserved
    (3 jobs ahead)``; anything else is the first line of ``why``, cut at ``width`` characters.

    >>> one_line_why("waiting for 1 GPU — GPU 0: held by bob; GPU 1: ...", Request(1), (0, 0))
    'waiting for 1 GPU (next in the queue)'
    """
    if place is not None and request is not None:
        ahead, jobs = place
        where = "next in the queue" if not ahead else f"{ahead} job{'s' if ahead != 1 else ''} ahead"
        if ahead != jobs:
            where = f"{ahead} ahead in the queue"  # kernels waiting in %gpu pick --wait among them
        return f"waiting for {request.describe()} ({where})"
    first = why.strip().splitlines()[0] if why.strip() else ""
    return first if len(first) <= width else first[: width - 1].rstrip() + "…"


def place(mine: Ticket, inventory: Inventory, book: leasing.LeaseBook) -> tuple[list[GpuInfo], str]:
    """The GPUs ``mine`` may take now (empty if none), and if none why it waits. Call under ``pick_lock()``."""
    view = leasing.read_view(book, PROVISIONAL_S)
    result = placement.place(mine.request, inventory, view, mine, keep_own=False)
    return list(result.gpus), "" if result.gpus else result.explain()


def take(gpus: list[GpuInfo], request: Request, book: leasing.LeaseBook) -> bool:
    """Lease what ``place`` chose (shared leases, with their reservation, for sharing jobs). Call under the same
    ``pick_lock()``."""
    taken = []
    for gpu in gpus:
        ok = book.try_share(gpu.uuid, request.min_free or 0) if request.shares else book.try_acquire(gpu.uuid)
        if not ok:
            book.release(taken)
            return False
        taken.append(gpu.uuid)
    return True


def wait_for_gpus(
    name: str,
    request: Request,
    submitted: float,
    key: str,
    on_wait: Any,
    poll_s: float = 0.25,
) -> list[GpuInfo]:
    """Queue up and block until ``request`` can be placed; the GPUs are then leased by this process.

    ``on_wait(reason)`` hears why the job waits whenever that changes.
    """
    book = leasing.book()
    book.label = f"job {name}"
    ticket = Ticket.create(name, request, submitted, key)
    last = None
    try:
        while True:
            inventory = read_inventory()
            try:
                placed = placement.place_and_take(
                    request, inventory, lambda gpus: take(list(gpus), request, book), ticket, False, poll_s * 4
                )
                if placed.gpus:
                    return sorted(placed.gpus, key=lambda g: g.nvml_index)
                reason = placed.explain()
            except LeaseBusy as busy:  # a waiting job stays queued, however long that lasts
                reason = f"waiting for the GPU lease directory: {busy.holder} keeps its pick lock"
            if reason and reason != last:
                on_wait(reason)
                last = reason
            time.sleep(poll_s)
    finally:
        ticket.remove()

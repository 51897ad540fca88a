"""The machine's job queue: a waiting job's ticket, and the loop its runner waits in until it is placed.

Placement itself (queue order, backfill and its bound, reservations, the reasons a job waits) is
``gpumagic.devices.placement``, the same that ``%gpu pick`` uses; tickets are files of the lease directory
(``gpumagic.devices.leases``).
"""

from __future__ import annotations

import time
from typing import Any

from gpumagic.devices import leases as leasing
from gpumagic.devices import placement
from gpumagic.devices.model import GpuInfo, Inventory
from gpumagic.devices.placement import Request, Ticket

__all__ = ["Request", "Ticket", "place", "remove_tickets", "take", "wait_for_gpus", "waiting_tickets"]
PROVISIONAL_S = leasing.PROVISIONAL_S


def remove_tickets(key: str) -> None:
    """Take job ``key`` (its run id) out of the queue: a killed job's ticket, even one its runner never took
    over, must not hold a place."""
    leasing.remove_tickets(key)


def waiting_tickets() -> list[Ticket]:
    """Live tickets of every user, in queue order."""
    view = leasing.read_view(leasing.book(), PROVISIONAL_S)
    return placement.queue_order(Ticket.of(f) for f in view.tickets)


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
    from gpumagic.devices.inventory import read_inventory

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
            except leasing.LeaseBusy as busy:  # a waiting job stays queued, however long that lasts
                reason = f"waiting for the GPU lease directory: {busy.holder} keeps its pick lock"
            if reason and reason != last:
                on_wait(reason)
                last = reason
            time.sleep(poll_s)
    finally:
        ticket.remove()

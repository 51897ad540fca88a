"""The machine's job queue: which waiting job gets which GPUs, and why the others wait.

Every waiting job has a ticket in the lease directory (``queue.<submitted ns>.<run id>.json``, alive
while its runner is). Runners place themselves under the lease directory's ``pick_lock``: tickets are served
in submission order, each taking the GPUs it qualifies for; a job that cannot start yet does not hold up a
later one that can (backfill). A GPU qualifies for a job when:

- whole-GPU jobs (no memory need): nobody leases it (no kernel, no job);
- sharing jobs (``min_free``): no kernel or whole-GPU job holds it, it has that much memory free, and every
  job already on it has *settled* (allocated its memory). That is the ``sleep 5`` people put between jobs
  today, made exact: the next job is placed when the memory it sees free is really free.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumagic.devices import leases as leasing
from gpumagic.devices.model import GpuInfo, Inventory
from gpumagic.devices.processes import is_same_process, process_start_time
from gpumagic.units import format_bytes

PROVISIONAL_S = 30.0


@dataclass(frozen=True)
class Request:
    """What a job needs: ``count`` best GPUs or exactly ``uuids``; ``min_free`` bytes each (and then it may
    share a GPU with other jobs)."""

    count: int = 1
    uuids: tuple[str, ...] = ()
    min_free: int | None = None

    @property
    def shares(self) -> bool:
        return self.min_free is not None

    @property
    def wants(self) -> int:
        return len(self.uuids) if self.uuids else self.count

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "uuids": list(self.uuids), "min_free": self.min_free}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Request:
        return cls(int(data.get("count", 1)), tuple(data.get("uuids") or ()), data.get("min_free"))


@dataclass
class _Slot:
    """A GPU as the placement sees it, updated as earlier tickets take it."""

    gpu: GpuInfo
    lease: leasing.Lease | None
    free: int
    taken_whole_by: str | None = None  # an earlier ticket placed on it in this round
    settling_by: str | None = None

    def why_not(self, request: Request) -> str | None:
        gpu, lease = self.gpu, self.lease
        if not gpu.healthy:
            return gpu.problem
        if gpu.mig_enabled:
            return "MIG mode is on"
        if self.taken_whole_by is not None or (self.settling_by is not None and not request.shares):
            return f"goes to {self.taken_whole_by or self.settling_by}, ahead in the queue"
        if lease is not None and not (request.shares and lease.shared):
            return lease.describe()
        if request.shares:
            if self.settling_by is not None or (lease is not None and not lease.settled):
                return f"{self.settling_by or 'a job on it'} is still allocating its memory"
            if self.free < (request.min_free or 0):
                return f"has {format_bytes(self.free)} free, job needs {format_bytes(request.min_free)}"
        return None

    def take(self, request: Request, by: str) -> None:
        if request.shares:
            self.free -= request.min_free or 0
            self.settling_by = by
        else:
            self.taken_whole_by = by


@dataclass(frozen=True)
class Ticket:
    """A waiting job's place in the queue."""

    path: Path
    name: str
    request: Request
    submitted_ns: int
    pid: int = field(default_factory=os.getpid)

    @classmethod
    def create(cls, name: str, request: Request, submitted: float, key: str, provisional: bool = False) -> Ticket:
        """Write (or take over) the ticket of job ``key`` (its run id). The submitting kernel writes a
        ``provisional`` one at once, so the queue order is the submission order even before the job's runner
        has started; the runner then writes its own, alive while it is."""
        directory = leasing.lease_dir()
        submitted_ns = int(submitted * 1e9)
        pid = os.getpid()
        path = directory / f"queue.{submitted_ns:020d}.{leasing.safe_name(key)}.json"
        record = {
            "name": name,
            "request": request.to_json(),
            "uid": os.getuid(),
            "pid": pid,
            "process_start": process_start_time(pid),
            "submitted_ns": submitted_ns,
            "provisional_until": time.time() + PROVISIONAL_S if provisional else None,
        }
        leasing.publish(path, record)
        return cls(path, name, request, submitted_ns, pid)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def remove_tickets(key: str) -> None:
    """Take job ``key`` (its run id) out of the queue: a killed job's ticket, even one its runner never took
    over, must not hold a place."""
    directory = leasing.lease_dir()
    for name in os.listdir(directory):
        if name.startswith("queue.") and name.endswith(f".{leasing.safe_name(key)}.json"):
            with contextlib.suppress(OSError):
                (directory / name).unlink()


def waiting_tickets() -> list[Ticket]:
    """Live tickets of every user, in queue order (dead runners' tickets are skipped, and removed if ours)."""
    directory = leasing.lease_dir()
    tickets = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("queue.") and name.endswith(".json")):
            continue
        path = directory / name
        try:
            owner = path.lstat().st_uid
            data = json.loads(path.read_text())
            pid, uid = int(data["pid"]), int(data["uid"])
            alive = is_same_process(pid, data.get("process_start"))
            until = data.get("provisional_until")
            if until is not None and time.time() > float(until):  # its runner never took it over
                alive = False
            if owner != uid:
                continue
            if not alive:
                if owner == os.getuid():
                    path.unlink()
                continue
            tickets.append(
                Ticket(path, str(data["name"]), Request.from_json(data["request"]), int(data["submitted_ns"]), pid)
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(tickets, key=lambda t: (t.submitted_ns, t.pid))


def place(mine: Ticket, inventory: Inventory, book: leasing.LeaseBook) -> tuple[list[GpuInfo], str]:
    """The GPUs ``mine`` may take now (empty if none), and if none why it waits. Call under ``pick_lock()``.

    Earlier tickets are placed first on a copy of the GPUs' state, so a job never takes what an earlier one
    can use now.
    """
    held = leasing.holders([g.uuid for g in inventory.gpus], book)
    slots = [_Slot(g, held.get(g.uuid), g.memory_free or 0) for g in inventory.gpus]
    tickets = [t for t in waiting_tickets() if t.path != mine.path]
    earlier = [t for t in tickets if (t.submitted_ns, t.pid) < (mine.submitted_ns, mine.pid)]
    for ticket in earlier:
        chosen, _ = _choose(ticket.request, slots)
        for slot in chosen:
            slot.take(ticket.request, f"job {ticket.name}")
    chosen, reasons = _choose(mine.request, slots)
    if chosen:
        return [s.gpu for s in chosen], ""
    return [], _explain(mine.request, reasons, len(inventory.gpus))


def _choose(request: Request, slots: list[_Slot]) -> tuple[list[_Slot], dict[int, str]]:
    """The slots a request gets (all it wants, or none), and why each other slot does not qualify."""
    candidates = slots
    if request.uuids:
        by_uuid = {s.gpu.uuid: s for s in slots}
        candidates = [by_uuid[u] for u in request.uuids if u in by_uuid]
    good, reasons = [], {}
    for slot in candidates:
        why = slot.why_not(request)
        if why is None:
            good.append(slot)
        else:
            reasons[slot.gpu.nvml_index] = why
    if len(good) < request.wants or (request.uuids and len(candidates) < len(request.uuids)):
        return [], reasons
    good.sort(key=lambda s: (-s.free, s.gpu.utilization or 0, s.gpu.nvml_index))
    return good[: request.wants], reasons


def _explain(request: Request, reasons: dict[int, str], total: int) -> str:
    need = f"{request.wants} GPU{'s' if request.wants > 1 else ''}"
    if request.min_free is not None:
        need += f" with {format_bytes(request.min_free)} free"
    lacking = "; ".join(
        f"GPU {i} {why}" if why.startswith("has ") else f"GPU {i}: {why}" for i, why in sorted(reasons.items())
    )
    return f"waiting for {need}" + (f" — {lacking}" if lacking else f" (this machine has {total})")


def take(gpus: list[GpuInfo], request: Request, book: leasing.LeaseBook) -> bool:
    """Lease what ``place`` chose (shared leases for sharing jobs). Call under the same ``pick_lock()``."""
    taken = []
    for gpu in gpus:
        ok = book.try_share(gpu.uuid) if request.shares else book.try_acquire(gpu.uuid)
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
            with leasing.pick_lock():
                chosen, reason = place(ticket, inventory, book)
                if chosen and take(chosen, request, book):
                    return sorted(chosen, key=lambda g: g.nvml_index)
            if reason and reason != last:
                on_wait(reason)
                last = reason
            time.sleep(poll_s)
    finally:
        ticket.remove()

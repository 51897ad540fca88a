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
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumagic.devices import leases as leasing
from gpumagic.devices import shared_files
from gpumagic.devices.model import GpuInfo, Inventory
from gpumagic.units import format_bytes

PROVISIONAL_S = leasing.PROVISIONAL_S
STALLED_S = 10.0  # another user's job that could start this long and did not is no longer waited for
_startable_since: dict[Path, float] = {}  # earlier tickets that could start now, since when (this process's view)


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
    """A waiting job's place in the queue: a file in the lease directory (``queue.<uid>.<run id>.<token>.json``).

    Its place is when the directory saw it made (the file's change time, which nobody can set back), not
    a number its writer chose. It counts while its runner holds a ``flock`` on it (for another user's ticket,
    the holder must be a gpumagic job runner of that user, per ``/proc/locks``), or for ``PROVISIONAL_S`` after
    it was made while the runner starts.
    """

    path: Path
    name: str
    request: Request
    submitted_ns: int
    uid: int = field(default_factory=os.getuid)
    made_ns: int = 0
    fd: int | None = field(default=None, compare=False, repr=False)  # the runner's locked descriptor

    @property
    def order(self) -> tuple[int, int, int, str]:
        return (self.made_ns, self.uid, self.submitted_ns, self.path.name)

    @classmethod
    def create(cls, name: str, request: Request, submitted: float, key: str, provisional: bool = False) -> Ticket:
        """The ticket of job ``key`` (its run id). The submitting kernel writes a ``provisional`` one at once,
        so the queue order is the submission order even before the job's runner has started; the runner
        then takes it over (locks it), or writes its own if there is none."""
        directory = leasing.lease_dir()
        submitted_ns = int(submitted * 1e9)
        if not provisional:
            claimed = _claim(directory, key, name, request, submitted_ns)
            if claimed is not None:
                return claimed
        record = {"name": name, "request": request.to_json(), "uid": os.getuid(), "submitted_ns": submitted_ns}
        stem = f"queue.{os.getuid()}.{leasing.safe_name(key)}."
        fd, path = leasing.create_own_file(directory, stem, ".json", json.dumps(record).encode(), lock=not provisional)
        made = os.fstat(fd).st_ctime_ns
        if provisional:  # the runner locks it when it comes
            os.close(fd)
            return cls(path, name, request, submitted_ns, os.getuid(), made, None)
        return cls(path, name, request, submitted_ns, os.getuid(), made, fd)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)


def _claim(directory: Path, key: str, name: str, request: Request, submitted_ns: int) -> Ticket | None:
    """Take over the provisional ticket this user's kernel wrote for job ``key``: lock it, keeping its place."""
    prefix = f"queue.{os.getuid()}.{leasing.safe_name(key)}."
    for entry in sorted(n for n in os.listdir(directory) if n.startswith(prefix)):
        path = directory / entry
        try:
            fd, _ = shared_files.open_regular(path, os.getuid())
        except (OSError, shared_files.Untrusted):
            continue
        deadline = time.monotonic() + 1.0  # another process's probe holds a lock for microseconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:  # held by someone else: not ours to wait behind
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        path.unlink()
                    fd = -1
                    break
                time.sleep(0.01)
        if fd < 0:
            continue
        info = os.fstat(fd)
        if info.st_nlink == 0:  # removed (killed) meanwhile
            os.close(fd)
            continue
        return Ticket(path, name, request, submitted_ns, os.getuid(), info.st_ctime_ns, fd)
    return None


def remove_tickets(key: str) -> None:
    """Take job ``key`` (its run id) out of the queue: a killed job's ticket, even one its runner never took
    over, must not hold a place."""
    directory = leasing.lease_dir()
    prefix = f"queue.{os.getuid()}.{leasing.safe_name(key)}."
    for name in os.listdir(directory):
        if name.startswith(prefix):
            with contextlib.suppress(OSError):
                (directory / name).unlink()


def waiting_tickets() -> list[Ticket]:
    """Live tickets of every user, in queue order (``leases.live_tickets`` says which are live)."""
    tickets = []
    for entry in leasing.live_tickets(PROVISIONAL_S):  # their fields are checked there
        request = Request.from_json(entry.data["request"])
        tickets.append(
            Ticket(entry.path, entry.data["name"][:80], request, entry.data["submitted_ns"], entry.uid, entry.made_ns)
        )
    return sorted(tickets, key=lambda t: t.order)


def place(mine: Ticket, inventory: Inventory, book: leasing.LeaseBook) -> tuple[list[GpuInfo], str]:
    """The GPUs ``mine`` may take now (empty if none), and if none why it waits. Call under ``pick_lock()``.

    Earlier tickets are placed first on a copy of the GPUs' state, so a job never takes what an earlier one
    can use now.
    """
    held = leasing.holders([g.uuid for g in inventory.gpus], book)
    slots = [_Slot(g, held.get(g.uuid), g.memory_free or 0) for g in inventory.gpus]
    own_job = mine.path.name.rsplit(".", 2)[0] + "."  # queue.<uid>.<run id>.: another ticket of this job
    tickets = [t for t in waiting_tickets() if t.path != mine.path and not t.path.name.startswith(own_job)]
    earlier = [t for t in tickets if t.order < mine.order]
    now = time.monotonic()
    for ticket in earlier:
        chosen, _ = _choose(ticket.request, slots)
        if not chosen:
            _startable_since.pop(ticket.path, None)
            continue
        since = _startable_since.setdefault(ticket.path, now)
        if ticket.uid != os.getuid() and now - since > STALLED_S:  # a runner polls 4 times a second
            shared_files.note_ignored(
                ticket.path.name, f"its job could start {STALLED_S:.0f}s ago and did not take its GPUs"
            )
            continue
        for slot in chosen:
            slot.take(ticket.request, f"job {ticket.name}")
    for path in [p for p in _startable_since if p not in {t.path for t in earlier}]:
        del _startable_since[path]
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
            try:
                with leasing.pick_lock(exclusive=False, wait_s=poll_s * 4):  # most looks find nothing to take
                    chosen, reason = place(ticket, inventory, book)
                if chosen:
                    with leasing.pick_lock(wait_s=poll_s * 4):
                        chosen, reason = place(ticket, inventory, book)
                        if chosen and take(chosen, request, book):
                            return sorted(chosen, key=lambda g: g.nvml_index)
            except leasing.LeaseBusy as busy:  # a waiting job stays queued, however long that lasts
                reason = f"waiting for the GPU lease directory: {busy.holder} keeps its pick lock"
            if reason and reason != last:
                on_wait(reason)
                last = reason
            time.sleep(poll_s)
    finally:
        ticket.remove()

"""Leases: which process has taken which GPU, shared by every notebook and user of this machine.

A lease is a record in the lease directory (``devices.lease_directory``), ``GPU-<uuid>.<uid>.<pid>.<token>.json``:
who holds the GPU (user, pid, since, notebook, shared, reserve). A lease *is* the ``flock`` its holder keeps
on its record: the OS drops it when the holder exits, however it exits, so a dead holder's GPU is free at once,
and nobody can hold a lease in another's name. ``LeaseBook`` (one per process: ``book()``) takes and releases
this process's leases, under the pick lock (``devices.pick_lock``). ``read_view`` reads every record kind of
the lease directory at once (every live lease of every GPU, every live ticket: ``devices.tickets``) for
``devices.placement`` and ``%gpu status``.

Background jobs that declare their memory may *share* a GPU: their records say ``"shared": true`` and
``"reserve"``: the bytes they declared, held for them until they end. A shared GPU is closed to kernels and
whole-GPU jobs; another sharing job is placed on it when its free memory, less what the sharers reserved and
have not allocated yet, is enough (``devices.placement``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpumagic.devices import shared_files
from gpumagic.devices.activity import Activity, cell_activity
from gpumagic.devices.lease_directory import RECORD_NAME, lease_dir, listing
from gpumagic.devices.processes import current_user, is_same_process, process_start_time
from gpumagic.devices.tickets import PROVISIONAL_S, TicketFile, ignored_ticket_owners, live_tickets
from gpumagic.units import format_bytes, format_duration

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    """Who holds a GPU: ``mine`` is True for this process's own leases."""

    uuid: str
    user: str
    pid: int
    since: float
    host: str = ""
    notebook: str | None = None
    mine: bool = False
    shared: bool = False
    reserve: int | None = None  # bytes a sharing job declared, held for it until it ends
    uid: int = -1  # whose file the record is
    activity: Activity | None = None  # a kernel's: busy, or idle since when (``devices.activity``)

    def idle_s(self, now: float | None = None) -> float | None:
        """How long its holder (a kernel) has been idle; None while busy, or where it does not say (a job, a
        script: never idle)."""
        return self.activity.idle_s(now) if self.activity is not None else None

    def holder(self) -> str:
        """Who holds it, in words: ``this kernel``, ``bob (pid 1234, job A1)``."""
        if self.mine:
            return "this kernel"
        return f"{self.user} (pid {self.pid}" + (f", {self.notebook}" if self.notebook else "") + ")"

    def describe(self) -> str:
        when = time.strftime("%H:%M", time.localtime(self.since)) if self.since else "?"
        if self.shared:
            reserved = f", {format_bytes(self.reserve)} reserved" if self.reserve else ""
            return f"shared by {self.holder()}{reserved} since {when}"
        idle = self.idle_s()
        return f"leased by {self.holder()} since {when}" + (f", idle {idle_for(idle)}" if idle is not None else "")


@dataclass(frozen=True)
class HeldLease:
    """One lease this process holds: its record's descriptor (its ``flock`` is the lease) and path, since when,
    and whether it is shared."""

    fd: int
    path: Path
    since: float
    shared: bool
    activity_at: int | None = None  # the offset of its activity's bytes in the record, rewritten in place


class LeaseBook:
    """The leases this process holds. One per process: use ``book()``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._held: dict[str, HeldLease] = {}  # by GPU uuid
        self._atexit = False
        self.label: str | None = None  # what the records call the holder (default: the notebook's name)
        self._on_empty: list[Callable[[], None]] = []

    def held(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._held)

    def since(self, uuid: str) -> float | None:
        with self._lock:
            entry = self._held.get(uuid)
            return entry.since if entry else None

    def as_lease(self, uuid: str) -> Lease:
        """This process's lease on ``uuid`` as a record would show it."""
        since = self.since(uuid) or time.time()
        host = socket.gethostname()
        return Lease(
            uuid,
            current_user(),
            os.getpid(),
            since,
            host,
            self.holder_name(),
            True,
            self.shares(uuid),
            uid=os.getuid(),
            activity=cell_activity().now(),
        )

    def holder_name(self) -> str | None:
        """What the records call the holder: its label, or the notebook's name."""
        return self.label or os.environ.get("JPY_SESSION_NAME") or None

    def shares(self, uuid: str) -> bool:
        """True if this process holds ``uuid`` as a shared lease (a sharing job's)."""
        with self._lock:
            entry = self._held.get(uuid)
            return entry is not None and entry.shared

    def try_acquire(self, uuid: str) -> bool:
        """Take the lease on ``uuid`` if nobody holds it. Call under ``pick_lock()``."""
        return self._try_take(uuid, shared=False)

    def try_share(self, uuid: str, reserve: int) -> bool:
        """Join the jobs sharing ``uuid``, reserving ``reserve`` bytes on it, unless someone holds it whole.
        Call under ``pick_lock()``; whether the memory suffices is the caller's check (``devices.placement``)."""
        return self._try_take(uuid, shared=True, reserve=reserve)

    def _try_take(self, uuid: str, shared: bool, reserve: int | None = None) -> bool:
        """Take ``uuid``'s lease (``shared`` or whole) unless another holds it whole (or at all, for a whole one);
        True if this process holds it now."""
        _check_uuid(uuid)
        activity = cell_activity().now()  # outside this book's lock: the activity's is never taken inside it
        with self._lock:
            if uuid in self._held:
                return True
            directory = lease_dir()
            held = _live_records(directory, uuid)
            if any(not lease.shared for lease in held) if shared else bool(held):  # a share: no whole lease on it
                return False
            self._take(directory, uuid, shared, reserve, activity)
            return True

    def _take(self, directory: Path, uuid: str, shared: bool, reserve: int | None, activity: Activity | None) -> None:
        since = time.time()
        fields = self._record(uuid, since, shared, reserve)
        text = activity.text() if activity is not None else None
        if text is not None:  # the last field, so that its bytes can be rewritten in place
            fields["activity"] = text
        record = json.dumps(fields).encode()
        at = record.rindex(text.encode()) if text is not None else None
        stem = f"{uuid}.{os.getuid()}.{os.getpid()}."
        fd, path = shared_files.create_own_file(directory, stem, ".json", record, lock=True)
        self._held[uuid] = HeldLease(fd, path, since, shared, at)
        if not self._atexit:
            atexit.register(self.release_all)
            self._atexit = True

    def _record(self, uuid: str, since: float, shared: bool, reserve: int | None) -> dict:
        pid = os.getpid()
        return {
            "uuid": uuid,
            "user": current_user(),
            "uid": os.getuid(),
            "pid": pid,
            "process_start": process_start_time(pid),
            "since": since,
            "host": socket.gethostname(),
            "notebook": self.holder_name(),
            "shared": shared,
            "reserve": reserve,
        }

    def write_activity(self, activity: Activity) -> None:
        """Tell everyone this kernel's ``activity``: its bytes rewritten in place in each record it holds (one
        ``pwrite`` each; the rest of a record never changes, so no reader sees half a lease)."""
        text = activity.text().encode()
        with self._lock:
            for entry in self._held.values():
                if entry.activity_at is None:
                    continue
                try:
                    os.pwrite(entry.fd, text, entry.activity_at)
                except OSError:
                    _log.debug("cannot write the activity of %s; others see the last", entry.path, exc_info=True)

    def release(self, uuids: Iterable[str]) -> list[str]:
        released = []
        with self._lock:
            for uuid in list(uuids):
                entry = self._held.pop(uuid, None)
                if entry is None:
                    continue
                with contextlib.suppress(OSError):
                    entry.path.unlink()
                with contextlib.suppress(OSError):
                    os.close(entry.fd)
                released.append(uuid)
            emptied = bool(released) and not self._held
        if emptied:
            for listener in list(self._on_empty):
                listener()
        return released

    def when_empty(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever a release leaves this process without leases (once per listener)."""
        with self._lock:
            if listener not in self._on_empty:
                self._on_empty.append(listener)

    def release_all(self) -> list[str]:
        return self.release(self.held())


@dataclass(frozen=True)
class LeaseView:
    """The lease directory at one moment: every live lease of every GPU (this process's marked ``mine``), every
    live ticket, and the users owning tickets it ignored. Read under ``pick_lock()`` for a consistent view."""

    leases: dict[str, tuple[Lease, ...]]
    tickets: tuple[TicketFile, ...]
    ignored_ticket_owners: tuple[str, ...] = ()  # by the files' owners, whatever their names say

    def on(self, uuid: str) -> tuple[Lease, ...]:
        """The leases on ``uuid``: one holder's whole lease, or the jobs sharing it (none: free)."""
        return self.leases.get(uuid, ())


def read_view(mine: LeaseBook, provisional_s: float = PROVISIONAL_S) -> LeaseView:
    """Read every record kind of the lease directory once: leases (whole and shared) and tickets. This user's
    records whose holder is gone are removed; what gpumagic does not trust is noted (``shared_files.ignored``).
    """
    directory = lease_dir()
    own = set(mine.held())
    found = listing(directory)
    leases: dict[str, tuple[Lease, ...]] = {}
    for uuid, records in found.records.items():
        live = _live_records(directory, uuid, records)
        if uuid in own:  # our own records are read like any other; they are ours if this process holds them
            live = [dataclasses.replace(lease, mine=True) if lease.pid == os.getpid() else lease for lease in live]
        if live:
            leases[uuid] = tuple(sorted(live, key=lambda lease: (lease.since, lease.pid)))
    for uuid in own - set(leases):  # our record was removed under us: we still hold the GPU
        leases[uuid] = (mine.as_lease(uuid),)
    tickets = tuple(live_tickets(directory, found.tickets, provisional_s))
    return LeaseView(leases, tickets, ignored_ticket_owners(directory))


def _live_records(directory: Path, uuid: str, names: Iterable[str] | None = None) -> list[Lease]:
    """The records of ``uuid`` whose holder still holds them (locked), each owned by the uid its name gives.
    This user's records whose holder is gone are removed."""
    if names is None:
        names = listing(directory).records.get(uuid, ())
    live = []
    for name in names:
        match = RECORD_NAME.match(name)
        if match is None or match.group(1) != uuid:
            continue
        uid = int(match.group(2))
        path = directory / name
        pid = int(match.group(3))
        read = shared_files.read_shared(path, uid)
        if read is None:
            continue
        data, _, locked = read
        # held by the process it names, still running since it wrote it: not by whoever locked it after its death
        if not locked or not is_same_process(pid, shared_files.finite(data.get("process_start"))):
            if uid == os.getuid():
                with contextlib.suppress(OSError):
                    path.unlink()
            continue
        try:
            since = float(data.get("since") or 0.0)
            if not 0.0 <= since <= time.time() + 86400:  # NaN, inf, 1e300: no time anyone can show
                raise ValueError(since)
            lease = Lease(
                uuid,
                str(data.get("user") or shared_files.owner_name(uid))[:64],
                pid,
                since,
                shared_files.one_line(data.get("host") or "", 64),
                shared_files.one_line(data["notebook"], 120) if data.get("notebook") else None,
                shared=data.get("shared") is True,
                reserve=_bytes(data.get("reserve")),
                uid=uid,
                activity=Activity.parse(data.get("activity")),
            )
        except (TypeError, ValueError, OverflowError):
            shared_files.note_ignored(name, "a record with malformed fields")
            continue
        shared_files.trusted(name)
        if lease.user != shared_files.owner_name(uid):  # the name shown is the file owner's, whatever it says
            lease = dataclasses.replace(lease, user=shared_files.owner_name(uid))
        live.append(lease)
    return live


def idle_for(seconds: float) -> str:
    """``<1m``, ``42m``, ``3h12m``: to the minute, so that a waiting job's reason (which names it) changes at most
    once a minute, and its record with it."""
    if seconds < 60:
        return "<1m"
    return format_duration(seconds) if seconds >= 3600 else f"{int(seconds) // 60}m"


def _bytes(value: object) -> int | None:
    """``value`` if it is a plausible number of bytes (a reservation from a record), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 1 << 60:
        return value
    return None


def _check_uuid(uuid: str) -> None:
    if not re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", uuid):
        raise ValueError(f"not a GPU UUID: {uuid!r}")


_book = LeaseBook()


def book() -> LeaseBook:
    """This process's leases."""
    return _book

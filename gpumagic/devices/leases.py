"""Leases: which process has taken which GPU, shared by every notebook and user of this machine.

The lease directory (``/tmp/gpumagic-leases``, or ``GPUMAGIC_LEASE_DIR``) is shared by all users, so
everything in it may have been put there by a hostile neighbour (docs/devices.md, "Shared servers"). It must
belong to root or to this user (anyone else could remove our files) and, if others may write in it, carry
the sticky bit (1777, like ``/tmp``). Every file in it belongs to the user whose uid its name carries, and
the files of other users are read through ``shared_files`` (no links followed, no blocking, owner checked on
the open descriptor, size capped); what does not pass is ignored and named in ``%gpu status``. ::

    pick.<uid>.<pid>.<token>.lock           a process's share of the pick lock (below)
    GPU-<uuid>.<uid>.<pid>.<token>.json     a lease: who holds the GPU (user, pid, since, notebook, shared,
                                            reserve), ``flock``-ed by its holder for as long as it lasts
    queue.<uid>.<key>.<token>.json          a ticket: a background job, or a kernel in ``%gpu pick --wait``,
                                            waiting for GPUs, its place in the queue (``devices.placement``)

This module is the only reader and writer of these files: ``read_view`` reads them all at once (every live
lease of every GPU, every live ticket) for ``devices.placement`` and ``%gpu status``.

A lease *is* the ``flock`` its holder keeps on its record: the OS drops it when the holder exits, however
it exits, so a dead holder's GPU is free at once, and nobody can hold a lease in another's name. No file is
shared between users, so nobody can remove, replace or lock up a file another user's lease depends on.

The pick lock serializes inspecting (shared) and taking (exclusive) leases across all processes without a
shared file: a process locks its own ``pick`` file, then checks that no other process's ``pick`` file is
locked in a conflicting mode; if one is, it lets go and tries again after a random pause. Two processes can
never both pass (each locks before it looks), so at most one takes leases at a time.

Background jobs that declare their memory may *share* a GPU: their records say ``"shared": true`` and
``"reserve"``: the bytes they declared, held for them until they end. A shared GPU is closed to kernels and
whole-GPU jobs; another sharing job is placed on it when its free memory, less what the sharers reserved and
have not allocated yet, is enough (``devices.placement``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import json
import os
import random
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gpumagic.devices import shared_files, ticket_checks
from gpumagic.devices.processes import current_user, is_same_process, process_start_time
from gpumagic.devices.shared_files import Untrusted
from gpumagic.errors import LeaseDirectoryError
from gpumagic.units import format_bytes

DEFAULT_LEASE_DIR = "/tmp/gpumagic-leases"
LEASE_DIR_VARIABLE = "GPUMAGIC_LEASE_DIR"
PROVISIONAL_S = 30.0  # how long a queue ticket counts before its job's runner locks it
OTHERS_PROVISIONAL_S = 5.0  # ... another user's: a runner starts in a second; a forger's ticket soon stops counting
PICK_LOCK_WAIT_S = 3.0  # how long a pick or a status waits for a busy lease directory before saying so
_RECORD_NAME = re.compile(r"^((?:GPU|MIG)-[0-9A-Za-z-]+)\.(\d+)\.(\d+)\.([0-9a-f]+)\.json$")
_PICK_NAME = re.compile(r"^pick\.(\d+)\.(\d+)\.([0-9a-f]+)\.lock$")
TICKET_NAME = re.compile(r"^queue\.(\d+)\.([A-Za-z0-9_-]+)\.([0-9a-f]+)\.json$")


class LeaseBusy(LeaseDirectoryError):
    """The pick lock stayed taken by other processes for as long as the caller was willing to wait.

    Attributes:
        holder: who kept it, in words (``bob's process 1234``).
    """

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


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
        return f"leased by {self.holder()} since {when}"


def lease_dir() -> Path:
    """The lease directory, created if missing (mode 1777 like ``/tmp``; root's if root creates it).

    Raises:
        LeaseDirectoryError: it cannot be created, or another user could tamper with it.
    """
    explicit = os.environ.get(LEASE_DIR_VARIABLE)
    path = Path(explicit or DEFAULT_LEASE_DIR)
    try:
        with contextlib.suppress(FileExistsError):
            path.mkdir(parents=True, mode=0o700)
            if not explicit:  # the default is shared by every user of the machine, each keeping their own files
                os.chmod(path, 0o1777)
        info = path.lstat()
    except OSError as err:
        raise LeaseDirectoryError(
            f"cannot use the lease directory {path} ({err.strerror}); set {LEASE_DIR_VARIABLE} to a writable one"
        ) from None
    check_lease_dir(path, info)
    if info.st_uid == os.getuid() and not explicit and stat.S_IMODE(info.st_mode) != 0o1777:
        with contextlib.suppress(OSError):
            os.chmod(path, 0o1777)
    return path


def safe_lease_dir_hint(path: Path) -> str:
    return (
        f"ask an administrator to make it root's: `sudo install -d -m 1777 -o root -g root {path}` (or, when "
        f"it exists, `sudo chown root: {path} && sudo chmod 1777 {path}`), or set {LEASE_DIR_VARIABLE} to a "
        "directory of your own (leases then coordinate only your own notebooks)"
    )


def check_lease_dir(path: Path, info: os.stat_result) -> None:
    """Raise LeaseDirectoryError unless ``path`` is a directory only root or this user controls."""
    if stat.S_ISLNK(info.st_mode):
        raise LeaseDirectoryError(f"the lease directory {path} is a symbolic link; {safe_lease_dir_hint(path)}")
    if not stat.S_ISDIR(info.st_mode):
        raise LeaseDirectoryError(f"{path} is not a directory; set {LEASE_DIR_VARIABLE} to a directory")
    if info.st_uid not in (0, os.getuid()):
        raise LeaseDirectoryError(
            f"the lease directory {path} belongs to {shared_files.owner_name(info.st_uid)}, who could remove your "
            f"leases; {safe_lease_dir_hint(path)}"
        )
    if info.st_mode & (stat.S_IWOTH | stat.S_IWGRP) and not info.st_mode & stat.S_ISVTX:
        raise LeaseDirectoryError(
            f"the lease directory {path} is writable by others without the sticky bit, so anyone could remove "
            f"your leases: run `chmod +t {path}`, or {safe_lease_dir_hint(path)}"
        )


def _token() -> str:
    return secrets.token_hex(6)


def create_own_file(
    directory: Path, stem: str, suffix: str, content: bytes = b"", lock: bool = False
) -> tuple[int, Path]:
    """A new file ``<stem><random token><suffix>`` of this user in ``directory`` holding ``content``, readable by
    all (0644) once written; returns its open descriptor (``flock``-ed exclusively with ``lock``) and path.

    It is 0600 until then, so that nobody else can open it (and ``flock`` it) before its owner holds what it
    must; a name someone planted is passed over (``O_EXCL``), never used.

    Raises:
        LeaseDirectoryError: every name tried exists.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    for _ in range(10):
        path = directory / f"{stem}{_token()}{suffix}"
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            continue
        try:
            if lock:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if content:
                os.write(fd, content)
            os.fchmod(fd, 0o644)
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)
            raise
        return fd, path
    raise LeaseDirectoryError(f"cannot create a file in {directory}: every name tried exists")


class _Removed(Exception):
    """This process's pick file was removed while it held it."""


class _PickLock:
    """This process's share of the pick lock: its own ``pick`` file, and the check of everybody else's."""

    def __init__(self) -> None:
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._file: tuple[int, Path, int] | None = None  # fd, path, pid that made it (a fork makes its own)

    def _own(self, directory: Path) -> tuple[int, Path]:
        if self._file is not None and self._file[2] == os.getpid() and self._file[1].parent == directory:
            if self._file[1].exists():
                return self._file[0], self._file[1]
        if self._file is not None and self._file[2] == os.getpid():
            with contextlib.suppress(OSError):
                os.close(self._file[0])
        fd, path = create_own_file(directory, f"pick.{os.getuid()}.{os.getpid()}.", ".lock")  # others probe it
        self._file = (fd, path, os.getpid())
        return fd, path

    def seen_in(self, holders: dict[tuple[int, int], list[int]]) -> bool:
        """True if this process holds its pick lock and ``holders`` (``/proc/locks``) shows it as ``stat`` names
        its file: device and inode numbers there can be trusted (overlay and network filesystems may differ)."""
        if not self._depth or self._file is None or self._file[2] != os.getpid():
            return False
        try:
            info = os.fstat(self._file[0])
        except OSError:
            return False
        return os.getpid() in holders.get((info.st_dev, info.st_ino), [])

    @contextlib.contextmanager
    def hold(self, exclusive: bool, wait_s: float) -> Iterator[None]:
        with self._thread_lock:
            if self._depth:  # nested in this thread: already held
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            directory = lease_dir()
            for attempt in range(3):
                try:
                    fd, path = self._own(directory)
                    self._acquire(directory, fd, path, exclusive, wait_s)
                    break
                except _Removed:
                    if attempt == 2:
                        raise LeaseDirectoryError(f"something keeps removing gpumagic's files in {directory}") from None
                except OSError as err:
                    raise LeaseDirectoryError(f"cannot use the lease directory {directory} ({err.strerror})") from None
            self._depth = 1
            try:
                yield
            finally:
                self._depth = 0
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _acquire(self, directory: Path, fd: int, path: Path, exclusive: bool, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        pause = 0.001
        while True:
            conflict = None
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:  # someone is checking (or holding) our own file
                conflict = path
            if conflict is None:
                try:
                    conflict = _conflicting_pick_file(directory, path.name, exclusive)
                    if conflict is None and os.fstat(fd).st_nlink == 0:  # removed under us: make another
                        raise _Removed
                except BaseException:
                    fcntl.flock(fd, fcntl.LOCK_UN)  # never leave our share of the lock taken
                    raise
                if conflict is None:
                    return
                fcntl.flock(fd, fcntl.LOCK_UN)
            if time.monotonic() > deadline:
                who = _who_holds(conflict)
                raise LeaseBusy(
                    f"the GPU lease directory is busy: {who} has kept its pick lock for the {wait_s:g}s this "
                    "waited; try again (%gpu pick --wait 10m keeps trying)",
                    who,
                )
            time.sleep(random.uniform(0, pause))
            pause = min(pause * 2, 0.05)


def _conflicting_pick_file(directory: Path, own: str, exclusive: bool) -> Path | None:
    """The first other process's pick file locked in a mode that conflicts with ours, if any; removes this
    user's pick files of processes that are gone."""
    for name in _listdir(directory):
        match = _PICK_NAME.match(name) if name.startswith("pick.") else None
        if match is None or name == own:
            continue
        uid, pid = int(match.group(1)), int(match.group(2))
        path = directory / name
        try:
            with shared_files.opened(path, uid) as (fd, _):
                try:
                    fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                except BlockingIOError:
                    return path
                fcntl.flock(fd, fcntl.LOCK_UN)
                if uid == os.getuid() and pid != os.getpid() and process_start_time(pid) is None:
                    with contextlib.suppress(OSError):  # a dead process's file: removed only while unlocked
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        path.unlink()
        except FileNotFoundError:
            continue
        except Untrusted as why:
            shared_files.note_ignored(name, str(why))
            continue
        shared_files.trusted(name)
    return None


def _who_holds(path: Path) -> str:
    """Who holds a lock on ``path``, in words: ``bob's process 1234``."""
    try:
        info = path.stat()
        pids = shared_files.flock_holders().get((info.st_dev, info.st_ino), [])
    except OSError:
        pids = []
    match = _PICK_NAME.match(path.name)
    owner = shared_files.owner_name(int(match.group(1))) if match else "another user"
    if pids:
        return ", ".join(f"{_owner_of(pid) or owner}'s process {pid}" for pid in sorted(set(pids)))
    return f"a process of {owner}" + (f" (pid {match.group(2)})" if match else "")


def _owner_of(pid: int) -> str | None:
    """The name of the user who runs ``pid`` (whoever holds a lock, not whose file it is), if visible."""
    import psutil

    try:
        return shared_files.owner_name(psutil.Process(pid).uids().real)
    except psutil.Error:
        return None


_pick = _PickLock()


@contextlib.contextmanager
def pick_lock(exclusive: bool = True, wait_s: float | None = None) -> Iterator[None]:
    """Serialize lease inspection (shared) and lease taking (exclusive) across all processes of all users.

    Raises:
        LeaseBusy: other processes kept it for ``wait_s`` seconds (default ``PICK_LOCK_WAIT_S``).
        LeaseDirectoryError: no usable lease directory.
    """
    with _pick.hold(exclusive, PICK_LOCK_WAIT_S if wait_s is None else wait_s):
        yield


def pick_lock_seen_in(holders: dict[tuple[int, int], list[int]]) -> bool:
    """True if this process holds its share of the pick lock and ``holders`` (``/proc/locks``) names its file as
    ``stat`` does: device and inode numbers there can be trusted for this directory."""
    return _pick.seen_in(holders)


def _listdir(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError as err:
        raise LeaseDirectoryError(f"cannot read the lease directory {directory} ({err.strerror})") from None


class LeaseBook:
    """The leases this process holds. One per process: use ``book()``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._held: dict[str, tuple[int, Path, float, bool]] = {}  # uuid -> (locked record, its path, since, shared)
        self._atexit = False
        self.label: str | None = None  # what the records call the holder (default: the notebook's name)

    def held(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._held)

    def since(self, uuid: str) -> float | None:
        with self._lock:
            entry = self._held.get(uuid)
            return entry[2] if entry else None

    def as_lease(self, uuid: str) -> Lease:
        """This process's lease on ``uuid`` as a record would show it."""
        since = self.since(uuid) or time.time()
        host = socket.gethostname()
        return Lease(
            uuid, current_user(), os.getpid(), since, host, self.holder_name(), True, self.shares(uuid), uid=os.getuid()
        )

    def holder_name(self) -> str | None:
        """What the records call the holder: its label, or the notebook's name."""
        return self.label or os.environ.get("JPY_SESSION_NAME") or None

    def shares(self, uuid: str) -> bool:
        """True if this process holds ``uuid`` as a shared lease (a sharing job's)."""
        with self._lock:
            entry = self._held.get(uuid)
            return entry is not None and entry[3]

    def try_acquire(self, uuid: str) -> bool:
        """Take the lease on ``uuid`` if nobody holds it. Call under ``pick_lock()``."""
        _check_uuid(uuid)
        with self._lock:
            if uuid in self._held:
                return True
            directory = lease_dir()
            if _live_records(directory, uuid):
                return False
            self._take(directory, uuid, shared=False)
            return True

    def try_share(self, uuid: str, reserve: int) -> bool:
        """Join the jobs sharing ``uuid``, reserving ``reserve`` bytes on it, unless someone holds it whole.
        Call under ``pick_lock()``; whether the memory suffices is the caller's check (``devices.placement``)."""
        _check_uuid(uuid)
        with self._lock:
            if uuid in self._held:
                return True
            directory = lease_dir()
            if any(not lease.shared for lease in _live_records(directory, uuid)):
                return False
            self._take(directory, uuid, shared=True, reserve=reserve)
            return True

    def _take(self, directory: Path, uuid: str, shared: bool, reserve: int | None = None) -> None:
        since = time.time()
        record = json.dumps(self._record(uuid, since, shared, reserve)).encode()
        fd, path = create_own_file(directory, f"{uuid}.{os.getuid()}.{os.getpid()}.", ".json", record, lock=True)
        self._held[uuid] = (fd, path, since, shared)
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

    def release(self, uuids: Iterable[str]) -> list[str]:
        released = []
        with self._lock:
            for uuid in list(uuids):
                entry = self._held.pop(uuid, None)
                if entry is None:
                    continue
                fd, path, _, _ = entry
                with contextlib.suppress(OSError):
                    path.unlink()
                with contextlib.suppress(OSError):
                    os.close(fd)
                released.append(uuid)
        return released

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
    listing = _listing(directory)
    leases: dict[str, tuple[Lease, ...]] = {}
    for uuid, records in listing.records.items():
        live = _live_records(directory, uuid, records)
        if uuid in own:  # our own records are read like any other; they are ours if this process holds them
            live = [dataclasses.replace(lease, mine=True) if lease.pid == os.getpid() else lease for lease in live]
        if live:
            leases[uuid] = tuple(sorted(live, key=lambda lease: (lease.since, lease.pid)))
    for uuid in own - set(leases):  # our record was removed under us: we still hold the GPU
        leases[uuid] = (mine.as_lease(uuid),)
    tickets = tuple(_live_tickets(directory, listing.tickets, provisional_s))
    return LeaseView(leases, tickets, _ignored_ticket_owners(directory))


def _ignored_ticket_owners(directory: Path) -> tuple[str, ...]:
    """The owners of the queue tickets in ``directory`` that gpumagic ignores (``shared_files.ignored``), as
    the files' owners are: a file planted under another user's uid names its planter."""
    found, _ = shared_files.ignored(limit=0)
    uids = set()
    for name in found:
        if TICKET_NAME.match(name):
            with contextlib.suppress(OSError):
                uids.add(os.lstat(directory / name).st_uid)
    return tuple(sorted(shared_files.owner_name(uid) for uid in uids))


@dataclass(frozen=True)
class _Listing:
    """The names of a lease directory, sorted by kind: records by GPU UUID, and tickets."""

    records: dict[str, list[str]]
    tickets: list[str]


_OURS = ("GPU-", "MIG-", "queu", "pick")  # how the names gpumagic writes begin


def _listing(directory: Path) -> _Listing:
    """``directory``'s names by kind in one pass; the names gpumagic does not write are noted as ignored,
    cheaply: a directory with 40,000 of them is read in a few milliseconds more."""
    names = _listdir(directory)
    ours = [name for name in names if name[:4] in _OURS]
    records: dict[str, list[str]] = {}
    tickets, known = [], set()
    for name in ours:
        if match := _RECORD_NAME.match(name):
            records.setdefault(match.group(1), []).append(name)
        elif TICKET_NAME.match(name):
            tickets.append(name)
        elif not _PICK_NAME.match(name):
            continue
        known.add(name)
    present = set(names)
    shared_files.note_unknown({n for n in present - known if not n.startswith(".")}, present)
    return _Listing(records, tickets)


def _scan(directory: Path) -> dict[str, list[str]]:
    """The lease records in ``directory`` by GPU UUID; notes every name gpumagic does not write as ignored."""
    return _listing(directory).records


def _read_shared(
    path: Path, uid: int, read: Callable[[int, os.stat_result], dict] = shared_files.read_record
) -> tuple[dict, os.stat_result, bool] | None:
    """The record in ``path`` (a file of the lease directory named as ``uid``'s) as ``read`` reads it from the
    open file, its ``fstat``, and whether it is locked; None if it is gone, or untrusted (then noted as
    ignored).

    Raises:
        LeaseDirectoryError: it cannot be read for a reason of this machine (no descriptors left, I/O).
    """
    try:
        with shared_files.opened(path, uid) as (fd, info):
            return read(fd, info), info, shared_files.is_locked(fd)
    except FileNotFoundError:
        return None
    except Untrusted as why:
        shared_files.note_ignored(path.name, str(why))
        return None
    except OSError as err:
        raise LeaseDirectoryError(f"cannot read {path} ({err.strerror})") from None


def _live_records(directory: Path, uuid: str, names: Iterable[str] | None = None) -> list[Lease]:
    """The records of ``uuid`` whose holder still holds them (locked), each owned by the uid its name gives.
    This user's records whose holder is gone are removed."""
    if names is None:
        names = _scan(directory).get(uuid, ())
    live = []
    for name in names:
        match = _RECORD_NAME.match(name)
        if match is None or match.group(1) != uuid:
            continue
        uid = int(match.group(2))
        path = directory / name
        pid = int(match.group(3))
        read = _read_shared(path, uid)
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
            )
        except (TypeError, ValueError, OverflowError):
            shared_files.note_ignored(name, "a record with malformed fields")
            continue
        shared_files.trusted(name)
        if lease.user != shared_files.owner_name(uid):  # the name shown is the file owner's, whatever it says
            lease = dataclasses.replace(lease, user=shared_files.owner_name(uid))
        live.append(lease)
    return live


@dataclass(frozen=True)
class TicketFile:
    """A ticket as the lease directory holds it: a job (``kind`` "job") or a kernel in ``%gpu pick --wait``
    ("pick") waiting for GPUs. ``devices.placement`` reads what it asks; ``fd`` is the holder's locked descriptor
    (this process's tickets only)."""

    path: Path
    uid: int
    made_ns: int  # when the directory saw it made: its change time, which its writer cannot set back
    data: dict
    fd: int | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def kind(self) -> str:
        return self.data.get("kind", "job")

    @property
    def key(self) -> str:
        """Whose ticket it is: the job's run id, or ``pick-<pid>``."""
        return self.path.name.split(".")[2]

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)


def create_ticket(key: str, record: dict, lock: bool) -> TicketFile:
    """A new ticket ``queue.<uid>.<key>.<token>.json`` holding ``record``; locked by this process with ``lock``
    (a kernel writes a job's ticket unlocked at submission, and its runner takes it over: ``claim_ticket``)."""
    directory = lease_dir()
    stem = f"queue.{os.getuid()}.{safe_name(key)}."
    fd, path = create_own_file(directory, stem, ".json", json.dumps(record).encode(), lock=lock)
    made = os.fstat(fd).st_ctime_ns
    if not lock:
        os.close(fd)
        return TicketFile(path, os.getuid(), made, record)
    return TicketFile(path, os.getuid(), made, record, fd)


def claim_ticket(key: str) -> TicketFile | None:
    """Take over (lock) the unlocked ticket this user wrote for ``key``, keeping its place; None if there is none."""
    directory = lease_dir()
    prefix = f"queue.{os.getuid()}.{safe_name(key)}."
    for entry in sorted(n for n in _listdir(directory) if n.startswith(prefix)):
        path = directory / entry
        try:
            fd, _ = shared_files.open_regular(path, os.getuid())
        except (OSError, Untrusted):
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
        try:
            data = ticket_checks.checked_ticket(shared_files.read_record(fd, info))
        except (Untrusted, OSError, ValueError):
            os.close(fd)
            continue
        return TicketFile(path, os.getuid(), info.st_ctime_ns, data, fd)
    return None


def remove_tickets(key: str) -> None:
    """Take ``key``'s tickets out of the queue (a killed job's, even one its runner never took over)."""
    directory = lease_dir()
    prefix = f"queue.{os.getuid()}.{safe_name(key)}."
    for name in _listdir(directory):
        if name.startswith(prefix):
            with contextlib.suppress(OSError):
                (directory / name).unlink()


def _live_tickets(directory: Path, names: list[str], provisional_s: float) -> list[TicketFile]:
    """The tickets that count: locked by their holder, or not locked yet but made less than ``provisional_s``
    ago while a job's runner starts (``OTHERS_PROVISIONAL_S`` for other users' tickets; never for a waiting
    kernel's, which it locks as it makes it). Another user's ticket counts only if every field and its holder
    pass ``ticket_checks``. This user's dead tickets are removed; other users' suspicious ones are noted as
    ignored."""
    global _checked_tickets
    found = []
    holders = shared_files.flock_holders()
    checks = ticket_checks.TicketHolders(provisional_s)
    now = time.time_ns()
    lapsed_ns = now - (min(provisional_s, OTHERS_PROVISIONAL_S) + ticket_checks.CLOCK_SLACK_S) * 1e9
    doubtful = []  # locked by the wrong process: looked at again once, together, 20 ms later
    parsed: dict[str, tuple[tuple[int, ...], dict | str]] = {}  # this look's, replacing the last look's at its end
    for name in _worth_reading(directory, names, holders, lapsed_ns):
        uid = int(name.split(".")[1])
        path = directory / name

        def fields(fd: int, info: os.stat_result, uid: int = uid, name: str = name) -> dict:
            return _ticket_fields(fd, info, uid, name, parsed)

        read = _read_shared(path, uid, fields)
        if read is None:
            continue
        data, info, locked = read
        pids = holders.get((info.st_dev, info.st_ino), [])
        if locked and not pids:  # locked since /proc/locks was read: read it again
            holders = shared_files.flock_holders()
            pids = holders.get((info.st_dev, info.st_ino), [])
        ticket = TicketFile(path, uid, info.st_ctime_ns, data)
        if (locked or pids) and _holder_problem(ticket, pids, checks):
            doubtful.append((ticket, info))  # another process's probe (``is_locked``) holds a lock for microseconds
            continue
        if _counts(ticket, bool(locked or pids), now, provisional_s):
            found.append(ticket)
    if doubtful:  # what a hostile process holds, it still holds
        time.sleep(0.02)
        holders = shared_files.flock_holders()
        checks = ticket_checks.TicketHolders(provisional_s)  # looked at afresh
        for ticket, info in doubtful:
            pids = holders.get((info.st_dev, info.st_ino), [])
            problem = _holder_problem(ticket, pids, checks) if pids else None
            if problem is None:
                if _counts(ticket, bool(pids), now, provisional_s):
                    found.append(ticket)
            elif ticket.uid == os.getuid():  # someone else locked our ticket (before our runner could): no place
                with contextlib.suppress(OSError):
                    ticket.path.unlink()
            else:
                shared_files.note_ignored(ticket.path.name, problem)
    _checked_tickets = parsed  # a whole new dict: another thread reading the last one is not disturbed
    return found


MAX_TICKETS_PER_USER = 256  # another user's tickets read per look: a user's 257th waits 256 turns anyway


def _worth_reading(
    directory: Path, names: list[str], holders: dict[tuple[int, int], list[int]], before_ns: float
) -> list[str]:
    """The ticket names of ``names`` worth reading: this user's files; of each other user's (by the files' real
    owners, whatever the names say), the oldest ``MAX_TICKETS_PER_USER``, leaving out those held by nobody and
    made before ``before_ns``, which do not count (only where ``/proc/locks`` is seen to name this lease
    directory's files as ``stat`` does: this process's own pick lock is in it)."""
    me = os.getuid()
    trusted_locks = pick_lock_seen_in(holders)
    chosen, others = [], {}
    for name in names:
        match = TICKET_NAME.match(name)
        if match is None:
            continue
        try:
            info = os.lstat(directory / name)
        except OSError:
            continue
        if info.st_uid == me:
            chosen.append(name)
            continue
        if trusted_locks and (info.st_dev, info.st_ino) not in holders and info.st_ctime_ns < before_ns:
            continue  # another user's, held by nobody past its 5 s: it does not count, and is not even opened
        others.setdefault(info.st_uid, []).append((info.st_ctime_ns, name))
    for made in others.values():
        made.sort()
        for _, name in made[MAX_TICKETS_PER_USER:]:
            shared_files.note_ignored(name, f"one of more than {MAX_TICKETS_PER_USER} tickets of one user")
        chosen += [name for _, name in made[:MAX_TICKETS_PER_USER]]
    return chosen


# ticket name -> ((device, inode, change time, size, uid), its fields or why it is no ticket), of the last look
_checked_tickets: dict[str, tuple[tuple[int, ...], dict | str]] = {}


def _ticket_fields(
    fd: int, info: os.stat_result, uid: int, name: str, parsed: dict[str, tuple[tuple[int, ...], dict | str]]
) -> dict:
    """A ticket's checked fields (``ticket_checks.checked_ticket``) from its open file, noted in ``parsed``; a
    file not changed since the last look read it is not parsed again.

    Raises:
        Untrusted: it is not a ticket gpumagic can use.
    """
    key = (info.st_dev, info.st_ino, info.st_ctime_ns, info.st_size, uid)
    cached = _checked_tickets.get(name)
    data = cached[1] if cached is not None and cached[0] == key else None
    if data is None:
        try:
            raw = shared_files.read_record(fd, info, ticket_checks.TICKET_BYTES)
            data = ticket_checks.checked_ticket(raw, None if uid == os.getuid() else info.st_ctime_ns)
        except Untrusted as why:
            data = str(why)
        except (TypeError, ValueError, OverflowError):  # a check the file's values outwitted: still not a ticket
            data = "a ticket with malformed fields"
    parsed[name] = (key, data)
    if isinstance(data, str):
        raise Untrusted(data)
    return data


def _holder_problem(ticket: TicketFile, pids: list[int], checks: ticket_checks.TicketHolders) -> str | None:
    """Why ``pids``, holding ``ticket``'s lock, do not make it count: ours must be held by a process of ours (its
    job runner, for a job's), another user's must pass ``ticket_checks.TicketHolders``."""
    if ticket.uid != os.getuid():
        return checks.objection(ticket.path, ticket.uid, ticket.data, ticket.made_ns, pids)
    if any(_ours(pid, ticket) for pid in pids):
        return None
    return "locked by a process that is not our job runner"


def _ours(pid: int, ticket: TicketFile) -> bool:
    """True if ``pid`` is this process, or a process of this user (for a job's ticket, its job runner)."""
    import psutil

    if pid == os.getpid():
        return True
    try:
        process = psutil.Process(pid)
        argv = process.cmdline() if ticket.kind == "job" else []
        return process.uids().real == os.getuid() and (
            ticket.kind != "job" or ticket_checks.runs_runner_of(argv, ticket.key)
        )
    except psutil.Error:
        return False


def _counts(ticket: TicketFile, held: bool, now: int, provisional_s: float) -> bool:
    """Whether a ticket that passed the checks counts: held, or made within its window (removed if ours and
    not); it is then trusted."""
    mine = ticket.uid == os.getuid()
    window = provisional_s if mine else min(provisional_s, OTHERS_PROVISIONAL_S)
    if ticket.kind == "pick":  # a waiting kernel locks its ticket as it makes it: unlocked, it is gone
        window = 0.0
    if not held and now - ticket.made_ns > window * 1e9:  # its runner is gone or never came
        if mine:
            with contextlib.suppress(OSError):
                ticket.path.unlink()
        return False
    shared_files.trusted(ticket.path.name)
    return True


def _bytes(value: object) -> int | None:
    """``value`` if it is a plausible number of bytes (a reservation from a record), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 1 << 60:
        return value
    return None


def _check_uuid(uuid: str) -> None:
    if not re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", uuid):
        raise ValueError(f"not a GPU UUID: {uuid!r}")


def safe_name(text: str) -> str:
    """``text`` as a file-name part: letters, digits, ``_`` and ``-`` only."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


_book = LeaseBook()


def book() -> LeaseBook:
    """This process's leases."""
    return _book

"""Leases: which process has taken which GPU, shared by every notebook and user of this machine.

Layout of the lease directory (``/tmp/gpumagic-leases``, or ``GPUMAGIC_LEASE_DIR``), sticky and
world-writable like ``/tmp`` so that users cannot remove each other's files::

    pick.lock                    held briefly while a process inspects or takes leases
    GPU-<uuid>.lock              held (flock, exclusive) for as long as the lease lasts
    GPU-<uuid>.<user>.<pid>.json who holds it: user, uid, pid, process start, since, notebook
    queue.<ns>.<run id>.json     a background job waiting for GPUs (``gpumagic.jobs.queue``)

The lease *is* the ``flock`` on ``GPU-<uuid>.lock``: the OS drops it when the holder dies, however it dies,
so a dead holder's GPU is free again at once. The JSON record only names the holder; a record whose
process is gone, or whose file is not owned by the uid it claims, is ignored.

Background jobs that give a memory need may *share* a GPU: a shared lease is a record alone (``"shared":
true``, no flock), alive while its process is. It keeps kernels and whole-GPU jobs off the GPU; other sharing
jobs may join once every sharer has ``"settled"`` (allocated its memory).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gpumagic.devices.processes import current_user, is_same_process, process_start_time
from gpumagic.errors import LeaseDirectoryError

DEFAULT_LEASE_DIR = "/tmp/gpumagic-leases"
LEASE_DIR_VARIABLE = "GPUMAGIC_LEASE_DIR"
_PICK_LOCK_TIMEOUT_S = 10.0


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
    settled: bool = True

    def describe(self) -> str:
        when = time.strftime("%H:%M", time.localtime(self.since)) if self.since else "?"
        who = "this kernel" if self.mine else f"{self.user} (pid {self.pid}"
        if not self.mine:
            who += f", {self.notebook}" if self.notebook else ""
            who += ")"
        if self.shared:
            return f"shared by jobs of {who} since {when}" + ("" if self.settled else ", still allocating memory")
        return f"leased by {who} since {when}"


def lease_dir() -> Path:
    """The lease directory, created (mode 1777, like /tmp) if missing.

    Raises:
        LeaseDirectoryError: it cannot be created, or others could tamper with it.
    """
    explicit = os.environ.get(LEASE_DIR_VARIABLE)
    path = Path(explicit or DEFAULT_LEASE_DIR)
    try:
        path.mkdir(parents=True, exist_ok=True)
        info = path.lstat()
        if not stat.S_ISDIR(info.st_mode):
            raise LeaseDirectoryError(f"{path} is not a directory; set {LEASE_DIR_VARIABLE} to a directory")
        if info.st_uid == os.getuid() and not explicit and stat.S_IMODE(info.st_mode) != 0o1777:
            os.chmod(path, 0o1777)  # shared by all users of the machine, each keeping their own files
            info = path.lstat()
    except OSError as err:
        raise LeaseDirectoryError(
            f"cannot use the lease directory {path} ({err.strerror}); set {LEASE_DIR_VARIABLE} to a writable one"
        ) from None
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise LeaseDirectoryError(
            f"{path} is world-writable without the sticky bit, so anyone could remove leases: "
            f"run `chmod +t {path}` or set {LEASE_DIR_VARIABLE}"
        )
    return path


def _open_lock_file(path: Path) -> int:
    """A read-only descriptor of ``path``, created empty (0644) if missing.

    Read-only so that other users' lock files open too (``flock`` needs no write access); never
    ``O_CREAT`` on an existing file, which ``fs.protected_regular`` refuses in sticky directories.
    """
    for _ in range(5):
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            os.fchmod(fd, 0o644)
            return fd
        except FileExistsError:
            continue
    raise LeaseDirectoryError(f"cannot open {path}: it keeps appearing and disappearing")


@contextlib.contextmanager
def pick_lock(exclusive: bool = True) -> Iterator[None]:
    """Serialize lease inspection (shared) and lease taking (exclusive) across all processes."""
    fd = _open_lock_file(lease_dir() / "pick.lock")
    try:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + _PICK_LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, mode)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LeaseDirectoryError(
                        f"another process has held {lease_dir() / 'pick.lock'} for {_PICK_LOCK_TIMEOUT_S:.0f}s; "
                        "try again, or see which process holds it with `fuser -v` on that file"
                    ) from None
                time.sleep(0.002)
        yield
    finally:
        os.close(fd)


class LeaseBook:
    """The leases this process holds. One per process: use ``book()``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._held: dict[str, tuple[int, Path, float]] = {}  # uuid -> (lock fd or -1 if shared, record, since)
        self._atexit = False
        self.label: str | None = None  # what the records call the holder (default: the notebook's name)

    def held(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._held)

    def since(self, uuid: str) -> float | None:
        with self._lock:
            entry = self._held.get(uuid)
            return entry[2] if entry else None

    def try_acquire(self, uuid: str) -> bool:
        """Take the lease on ``uuid`` if nobody holds it. Call under ``pick_lock()``."""
        _check_uuid(uuid)
        with self._lock:
            if uuid in self._held:
                return True
            directory = lease_dir()
            fd = _open_lock_file(directory / f"{uuid}.lock")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            if _live_records(directory, uuid, _record_names(directory, uuid)):  # jobs share it
                os.close(fd)
                return False
            since = time.time()
            record = self._write_record(directory, uuid, since)
            self._remember(uuid, fd, record, since)
            return True

    def try_share(self, uuid: str) -> bool:
        """Join the jobs sharing ``uuid`` (a record, no flock) unless someone holds it whole. Call under
        ``pick_lock()``; whether the other sharers have settled and memory suffices is the caller's check."""
        _check_uuid(uuid)
        with self._lock:
            if uuid in self._held:
                return True
            directory = lease_dir()
            if _is_locked(directory / f"{uuid}.lock"):
                return False
            since = time.time()
            record = self._write_record(directory, uuid, since, shared=True, settled=False)
            self._remember(uuid, -1, record, since)
            return True

    def mark_settled(self, uuid: str) -> None:
        """Say that this process has allocated its memory on the shared GPU ``uuid``: others may join."""
        with self._lock:
            entry = self._held.get(uuid)
            if entry is None or entry[0] != -1:
                return
            self._write_record(lease_dir(), uuid, entry[2], shared=True, settled=True)

    def _remember(self, uuid: str, fd: int, record: Path, since: float) -> None:
        self._held[uuid] = (fd, record, since)
        if not self._atexit:
            atexit.register(self.release_all)
            self._atexit = True

    def release(self, uuids: Iterable[str]) -> list[str]:
        released = []
        with self._lock:
            for uuid in list(uuids):
                entry = self._held.pop(uuid, None)
                if entry is None:
                    continue
                fd, record, _ = entry
                with contextlib.suppress(OSError):
                    record.unlink()
                if fd >= 0:
                    os.close(fd)
                released.append(uuid)
        return released

    def release_all(self) -> list[str]:
        return self.release(self.held())

    def _write_record(
        self, directory: Path, uuid: str, since: float, shared: bool = False, settled: bool = True
    ) -> Path:
        user = current_user()
        pid = os.getpid()
        record = {
            "uuid": uuid,
            "user": user,
            "uid": os.getuid(),
            "pid": pid,
            "process_start": process_start_time(pid),
            "since": since,
            "host": socket.gethostname(),
            "notebook": self.label or os.environ.get("JPY_SESSION_NAME") or None,
            "shared": shared,
            "settled": settled,
        }
        path = directory / f"{uuid}.{safe_name(user)}.{pid}.json"
        publish(path, record)
        return path


def publish(path: Path, record: dict) -> None:
    """Write ``record`` as JSON at ``path`` in the lease directory, atomically and readable by all (0644)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".lease-", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def holders(uuids: Iterable[str], mine: LeaseBook) -> dict[str, Lease]:
    """The live lease on each of ``uuids`` that has one. Call under ``pick_lock()`` for a consistent view."""
    directory = lease_dir()
    wanted = list(uuids)
    own = set(mine.held())
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    records: dict[str, list[str]] = {}
    for name in names:
        if name.endswith(".json") and name.startswith(("GPU-", "MIG-")):
            records.setdefault(name.split(".", 1)[0], []).append(name)
    result: dict[str, Lease] = {}
    for uuid in wanted:
        if uuid in own:
            since = mine.since(uuid) or time.time()
            result[uuid] = Lease(
                uuid,
                current_user(),
                os.getpid(),
                since,
                socket.gethostname(),
                mine.label or os.environ.get("JPY_SESSION_NAME") or None,
                mine=True,
            )
            continue
        if not _is_locked(directory / f"{uuid}.lock"):
            sharers = _live_records(directory, uuid, records.get(uuid, ()))
            if sharers:  # no flock, but jobs share it: the earliest names them, settled only if all are
                first = min(sharers, key=lambda lease: lease.since)
                result[uuid] = dataclasses.replace(first, settled=all(s.settled for s in sharers))
            else:
                _remove_my_stale_records(directory, records.get(uuid, ()))
            continue
        exclusive = [r for r in _live_records(directory, uuid, records.get(uuid, ())) if not r.shared]
        result[uuid] = exclusive[0] if exclusive else Lease(uuid, "someone", 0, 0.0, notebook="holder starting up")
    return result


def sharers(uuid: str) -> list[Lease]:
    """The live shared leases (jobs) on ``uuid``."""
    directory = lease_dir()
    return [r for r in _live_records(directory, uuid, _record_names(directory, uuid)) if r.shared]


def _record_names(directory: Path, uuid: str) -> list[str]:
    try:
        return [n for n in os.listdir(directory) if n.startswith(uuid + ".") and n.endswith(".json")]
    except OSError:
        return []


def _is_locked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _live_records(directory: Path, uuid: str, names: Iterable[str]) -> list[Lease]:
    """The records of ``uuid`` whose holder is alive, owned by the uid they claim."""
    live = []
    for name in names:
        path = directory / name
        try:
            owner = path.lstat().st_uid
            data = json.loads(path.read_text())
            pid, uid = int(data["pid"]), int(data["uid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if owner != uid:  # someone wrote a record in another user's name
            continue
        if not is_same_process(pid, data.get("process_start")):
            continue
        live.append(
            Lease(
                uuid,
                str(data.get("user", uid)),
                pid,
                float(data.get("since", 0.0)),
                str(data.get("host", "")),
                data.get("notebook"),
                shared=bool(data.get("shared", False)),
                settled=bool(data.get("settled", True)),
            )
        )
    return live


def _remove_my_stale_records(directory: Path, names: Iterable[str]) -> None:
    """Records of dead holders are clutter; users can remove only their own (sticky directory)."""
    for name in names:
        path = directory / name
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if (
                path.lstat().st_uid == os.getuid()
                and process_start_time(int(json.loads(path.read_text())["pid"])) is None
            ):
                path.unlink()


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

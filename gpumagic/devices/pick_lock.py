"""The pick lock: inspecting (shared) and taking (exclusive) leases, one process at a time across all users.

It needs no shared file: a process locks its own ``pick`` file in the lease directory, then checks that no
other process's ``pick`` file is locked in a conflicting mode; if one is, it lets go and tries again after a
random pause. Two processes can never both pass (each locks before it looks), so at most one takes leases at
a time.

A pick holds the lock for milliseconds. Another user's process that keeps its pick file locked for longer than
``STRANGER_HOLD_S`` is stuck or hostile: it is passed over (and named in ``%gpu status`` and ``%gpu why``), so
it delays this user's picks by at most that long, never for as long as it likes (issue #37). Should it take a
lease meanwhile, the lease's own check (``leases``: a second holder of a GPU loses) keeps GPUs unshared.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from gpumagic.devices import shared_files
from gpumagic.devices.lease_directory import PICK_NAME, lease_dir, list_names
from gpumagic.devices.processes import process_start_time
from gpumagic.devices.shared_files import Untrusted
from gpumagic.errors import LeaseDirectoryError

_log = logging.getLogger(__name__)

PICK_LOCK_WAIT_S = 3.0  # how long a pick or a status waits for a busy lease directory before saying so
STRANGER_HOLD_S = 10.0  # another user's pick lock held this long (as seen here) is passed over


class LeaseBusy(LeaseDirectoryError):
    """The pick lock stayed taken by other processes for as long as the caller was willing to wait.

    Attributes:
        holder: who kept it, in words (``bob's process 1234``).
    """

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


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
        stem = f"pick.{os.getuid()}.{os.getpid()}."
        fd, path = shared_files.create_own_file(directory, stem, ".lock")  # others probe it
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
            _log.debug("the pick lock's file cannot be stat'ed; this process is taken not to hold it", exc_info=True)
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
        deadline = time.monotonic() + wait_s  # for this user's own processes: another's are passed over in time
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
            if time.monotonic() > deadline and not _strangers.waiting_on(conflict):
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
    for name in list_names(directory):
        match = PICK_NAME.match(name) if name.startswith("pick.") else None
        if match is None or name == own:
            continue
        uid, pid = int(match.group(1)), int(match.group(2))
        path = directory / name
        try:
            with shared_files.opened(path, uid) as (fd, _):
                try:
                    fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                except BlockingIOError:
                    if uid != os.getuid() and _strangers.held_too_long(path, os.fstat(fd).st_ino):
                        continue  # named as ignored by held_too_long
                    return path
                fcntl.flock(fd, fcntl.LOCK_UN)
                _strangers.seen_free(name)
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


class _StrangerHolds:
    """Other users' pick files this process found locked, and since when (the file's name and inode)."""

    def __init__(self) -> None:
        self._since: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def held_too_long(self, path: Path, inode: int) -> bool:
        """Note ``path`` seen locked now; True once it has been so, at every look, for ``STRANGER_HOLD_S``."""
        with self._lock:
            first = self._since.setdefault((path.name, inode), time.monotonic())
        held = time.monotonic() - first
        if held < STRANGER_HOLD_S:
            return False
        why = f"{_who_holds(path)} kept its pick lock for {held:.0f}s (a pick takes milliseconds): passed over"
        shared_files.note_ignored(path.name, why)
        return True

    def waiting_on(self, path: Path) -> bool:
        """True while ``path`` is another user's pick file that is not yet passed over: keep waiting for it."""
        with self._lock:
            return any(name == path.name for name, _ in self._since)

    def seen_free(self, name: str) -> None:
        with self._lock:
            for key in [k for k in self._since if k[0] == name]:
                del self._since[key]


_strangers = _StrangerHolds()


def _who_holds(path: Path) -> str:
    """Who holds a lock on ``path``, in words: ``bob's process 1234``."""
    try:
        info = path.stat()
        pids = shared_files.flock_holders().get((info.st_dev, info.st_ino), [])
    except OSError:
        pids = []
    match = PICK_NAME.match(path.name)
    owner = shared_files.owner_name(int(match.group(1))) if match else "another user"
    if pids:
        return ", ".join(f"{_owner_of(pid) or owner}'s process {pid}" for pid in sorted(set(pids)))
    return f"a process of {owner}" + (f" (pid {match.group(2)})" if match else "")


def _owner_of(pid: int) -> str | None:
    """The name of the user who runs ``pid`` (whoever holds a lock, not whose file it is), if visible."""
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

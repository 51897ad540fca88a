"""Files in a shared directory (the lease directory): others' read without trusting them, one's own made safely.

Anything there may be a trap: a symbolic link to ``/dev/zero`` or another user's secret, a FIFO that blocks
whoever opens it, a 3 GB sparse file, a record in someone else's name. Every file is opened without following
links and without blocking, checked on the open descriptor (``fstat``) to be a regular file owned by the uid
its name claims, and read with a size cap. What fails is *ignored*, never a hang, a traceback or an OOM, and
remembered (``ignored()``) so that ``%gpu status`` can name it once.

A file of one's own (``create_own_file``) is made under a fresh random name, never one someone planted, and
stays unreadable to others until it holds what it must.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import heapq
import json
import logging
import math
import os
import pwd
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpumagic.errors import LeaseDirectoryError

_log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 64 << 10  # a lease record or queue ticket is a few hundred bytes
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class Untrusted(Exception):
    """A file in a shared directory that gpumagic will not use; the message says why (a few words)."""


_ignored: dict[str, str] = {}
_ignored_lock = threading.Lock()


def note_ignored(name: str, why: str) -> None:
    with _ignored_lock:
        _ignored[name] = why


def trusted(name: str) -> None:
    """``name`` was read and used: it is no longer ignored (a file can be caught half made, or mid-probe)."""
    if name in _ignored:
        with _ignored_lock:
            _ignored.pop(name, None)


UNKNOWN = "not a file gpumagic writes"
_unknown: set[str] = set()  # names of that kind, kept apart: a directory may hold 40,000 of them


def note_unknown(names: set[str], present: set[str]) -> None:
    """The names gpumagic does not write, as last listed (``present``: every name listed; notes of files that
    are gone are dropped)."""
    global _unknown
    with _ignored_lock:
        for name in [n for n in _ignored if n not in present]:
            del _ignored[name]
        _unknown = names


def ignored(limit: int | None = None) -> tuple[dict[str, str], int]:
    """File name -> why it was ignored, for the files of the lease directory seen in its last reading (at most
    ``limit`` of the unknown names, the first by name), and how many more were left out."""
    with _ignored_lock:
        found, unknown = dict(_ignored), _unknown
    shown = unknown if limit is None or len(unknown) <= limit else heapq.nsmallest(limit, unknown)
    found.update(dict.fromkeys(shown, UNKNOWN))
    return found, len(unknown) - len(shown)


def one_line(value: object, limit: int) -> str:
    """Text from another user's file as gpumagic shows it: control characters (ANSI escapes, newlines) written
    as escapes, so none reaches a cell or a terminal, and at most ``limit`` characters."""
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe_ignored(found: dict[str, str], more: int, shown: int | None = None) -> str:
    """``ignored()``'s files as ``%gpu`` shows them, on one line: ``name (why); ...; and 3 more`` (the first
    ``shown`` by name, all with None; ``more``: files left out of ``found`` already)."""
    listed = sorted(found.items())
    kept = listed if shown is None else listed[:shown]
    left = len(listed) - len(kept) + more
    return "; ".join(f"{one_line(name, 60)} ({why})" for name, why in kept) + (f"; and {left} more" if left else "")


def finite(value: object) -> float | None:
    """``value`` if it is a finite number a float holds (a time, a size from another user's record), else None:
    ``1e999`` is Infinity, and a whole number of 400 digits no float holds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def owner_name(uid: int) -> str:
    """The login name of ``uid`` (``uid 1234`` if it has none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, owner: int | None) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path``, checked: a regular file (not a link), owned by ``owner`` if given.

    Raises:
        Untrusted: anything else. FileNotFoundError: it is gone.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise Untrusted("a symbolic link") from None
        if err.errno not in (errno.EACCES, errno.EPERM, errno.ENXIO, errno.EISDIR):
            raise  # out of descriptors, memory, an I/O error: not the file's fault, and not to be read as absent
        with contextlib.suppress(OSError):
            found = os.lstat(path).st_uid
            if owner is not None and found != owner:
                raise Untrusted(f"owned by {owner_name(found)}, named as {owner_name(owner)}'s") from None
        raise Untrusted(f"cannot be opened ({err.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Untrusted(_kind(info.st_mode))
        if owner is not None and info.st_uid != owner:
            raise Untrusted(f"owned by {owner_name(info.st_uid)}, named as {owner_name(owner)}'s")
    except BaseException:
        os.close(fd)
        raise
    return fd, info


@contextlib.contextmanager
def opened(path: Path, owner: int | None) -> Iterator[tuple[int, os.stat_result]]:
    fd, info = open_regular(path, owner)
    try:
        yield fd, info
    finally:
        os.close(fd)


def read_capped(fd: int, info: os.stat_result, limit: int = MAX_RECORD_BYTES) -> bytes:
    """At most ``limit`` bytes of an open regular file. Raises Untrusted if it holds more."""
    if info.st_size > limit:
        raise Untrusted(f"{info.st_size:,} bytes, more than a record's {limit:,}")
    data = os.pread(fd, limit + 1, 0)
    if len(data) > limit:
        raise Untrusted(f"more than a record's {limit:,} bytes")
    return data


def read_record(fd: int, info: os.stat_result, limit: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    """The JSON object in an open record file of at most ``limit`` bytes. Raises Untrusted if it is not one."""
    raw = read_capped(fd, info, limit)
    try:
        data = json.loads(raw)
    except Exception:  # noqa: BLE001 - ValueError, RecursionError (deep nesting): whatever it is, not a record
        raise Untrusted("not a JSON record") from None
    if not isinstance(data, dict):
        raise Untrusted("not a JSON record")
    return data


def is_locked(fd: int) -> bool:
    """True while another open file holds a ``flock`` on this file (probed with a shared lock, released)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def flock_holders() -> dict[tuple[int, int], list[int]]:
    """(device, inode) -> the PIDs holding a ``flock`` on it, from ``/proc/locks`` (empty where unreadable)."""
    holders: dict[tuple[int, int], list[int]] = {}
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        _log.debug("/proc/locks is unreadable; no flock holders are known", exc_info=True)
        return holders
    for line in text.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            device = os.makedev(int(major, 16), int(minor, 16))
            holders.setdefault((device, int(inode)), []).append(pid)
        except ValueError:
            continue
    return holders


def read_shared(
    path: Path, uid: int, read: Callable[[int, os.stat_result], dict] = read_record
) -> tuple[dict, os.stat_result, bool] | None:
    """The record in ``path`` (a file of the shared directory named as ``uid``'s) as ``read`` reads it from the
    open file, its ``fstat``, and whether it is locked; None if it is gone, or untrusted (then noted as
    ignored).

    Raises:
        LeaseDirectoryError: it cannot be read for a reason of this machine (no descriptors left, I/O).
    """
    try:
        with opened(path, uid) as (fd, info):
            return read(fd, info), info, is_locked(fd)
    except FileNotFoundError:
        return None
    except Untrusted as why:
        note_ignored(path.name, str(why))
        return None
    except OSError as err:
        raise LeaseDirectoryError(f"cannot read {path} ({err.strerror})") from None


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
        path = directory / f"{stem}{secrets.token_hex(6)}{suffix}"
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

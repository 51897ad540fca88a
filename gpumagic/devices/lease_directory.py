"""The lease directory: where it is, whether it is safe to use, and what the names in it mean.

The lease directory (``/tmp/gpumagic-leases``, or ``GPUMAGIC_LEASE_DIR``) is shared by all users, so
everything in it may have been put there by a hostile neighbour (docs/devices.md, "Shared servers"). It must
belong to root or to this user (anyone else could remove our files) and, if others may write in it, carry
the sticky bit (1777, like ``/tmp``). Every file in it belongs to the user whose uid its name carries, and
the files of other users are read through ``shared_files`` (no links followed, no blocking, owner checked on
the open descriptor, size capped); what does not pass is ignored and named in ``%gpu status``. ::

    pick.<uid>.<pid>.<token>.lock           a process's share of the pick lock (``devices.pick_lock``)
    GPU-<uuid>.<uid>.<pid>.<token>.json     a lease: who holds the GPU (``devices.leases``)
    queue.<uid>.<key>.<token>.json          a ticket: a job or a waiting kernel in the queue (``devices.tickets``)
    policy.toml                             the administrator's policy, root's alone (``devices.policy``)

No file is shared between users, so nobody can remove, replace or lock up a file another user's lease depends on.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from gpumagic.devices import shared_files
from gpumagic.errors import LeaseDirectoryError

DEFAULT_LEASE_DIR = "/tmp/gpumagic-leases"
LEASE_DIR_VARIABLE = "GPUMAGIC_LEASE_DIR"
RECORD_NAME = re.compile(r"^((?:GPU|MIG)-[0-9A-Za-z-]+)\.(\d+)\.(\d+)\.([0-9a-f]+)\.json$")
PICK_NAME = re.compile(r"^pick\.(\d+)\.(\d+)\.([0-9a-f]+)\.lock$")
TICKET_NAME = re.compile(r"^queue\.(\d+)\.([A-Za-z0-9_-]+)\.([0-9a-f]+)\.json$")
POLICY_NAME = "policy.toml"  # the administrator's policy (``devices.policy``)
_OURS = ("GPU-", "MIG-", "queu", "pick")  # how the names gpumagic writes begin


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
    """What to do about an unsafe lease directory ``path``, in words."""
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


def list_names(directory: Path) -> list[str]:
    """The names in the lease directory ``directory``.

    Raises:
        LeaseDirectoryError: it cannot be read.
    """
    try:
        return os.listdir(directory)
    except OSError as err:
        raise LeaseDirectoryError(f"cannot read the lease directory {directory} ({err.strerror})") from None


@dataclass(frozen=True)
class Listing:
    """The names of a lease directory, sorted by kind: records by GPU UUID, and tickets."""

    records: dict[str, list[str]]
    tickets: list[str]


def listing(directory: Path) -> Listing:
    """``directory``'s names by kind in one pass; the names gpumagic does not write are noted as ignored,
    cheaply: a directory with 40,000 of them is read in a few milliseconds more.

    Raises:
        LeaseDirectoryError: it cannot be read.
    """
    names = list_names(directory)
    ours = [name for name in names if name[:4] in _OURS]
    records: dict[str, list[str]] = {}
    tickets, known = [], set()
    for name in ours:
        if match := RECORD_NAME.match(name):
            records.setdefault(match.group(1), []).append(name)
        elif TICKET_NAME.match(name):
            tickets.append(name)
        elif not PICK_NAME.match(name):
            continue
        known.add(name)
    present = set(names)
    known.add(POLICY_NAME)  # the administrator's (``devices.policy``), which says itself what it ignores
    shared_files.note_unknown({n for n in present - known if not n.startswith(".")}, present)
    return Listing(records, tickets)

"""Queue tickets: the files in the lease directory that say who waits for GPUs, in which order.

A ticket (``queue.<uid>.<key>.<token>.json``) is a background job, or a kernel in ``%gpu pick --wait``,
waiting for GPUs; ``devices.placement`` reads what it asks and serves tickets in queue order. This module
writes this user's tickets (``create_ticket``; a job's runner takes over the one its kernel wrote:
``claim_ticket``), removes them, and reads everybody's (``live_tickets``): a ticket counts while its holder
keeps its ``flock``, or for a short provisional window after it was made while a job's runner starts. Another
user's ticket is a claim: it counts only if its fields and its holder pass ``ticket_checks``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpumagic.devices import shared_files, ticket_checks
from gpumagic.devices.lease_directory import TICKET_NAME, lease_dir, list_names
from gpumagic.devices.pick_lock import pick_lock_seen_in
from gpumagic.devices.shared_files import Untrusted

_log = logging.getLogger(__name__)

PROVISIONAL_S = 30.0  # how long a queue ticket counts before its job's runner locks it
OTHERS_PROVISIONAL_S = 5.0  # ... another user's: a runner starts in a second; a forger's ticket soon stops counting
MAX_TICKETS_PER_USER = 256  # another user's tickets read per look: a user's 257th waits 256 turns anyway


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

    def withdraw(self) -> None:
        """Out of the queue: its file goes, its descriptor stays open until ``remove`` (called once, by its owner)."""
        with contextlib.suppress(OSError):
            self.path.unlink()

    def remove(self) -> None:
        self.withdraw()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)


def safe_name(text: str) -> str:
    """``text`` as a file-name part: letters, digits, ``_`` and ``-`` only."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


def create_ticket(key: str, record: dict, lock: bool) -> TicketFile:
    """A new ticket ``queue.<uid>.<key>.<token>.json`` holding ``record``; locked by this process with ``lock``
    (a kernel writes a job's ticket unlocked at submission, and its runner takes it over: ``claim_ticket``)."""
    directory = lease_dir()
    stem = f"queue.{os.getuid()}.{safe_name(key)}."
    fd, path = shared_files.create_own_file(directory, stem, ".json", json.dumps(record).encode(), lock=lock)
    made = os.fstat(fd).st_ctime_ns
    if not lock:
        os.close(fd)
        return TicketFile(path, os.getuid(), made, record)
    return TicketFile(path, os.getuid(), made, record, fd)


def claim_ticket(key: str) -> TicketFile | None:
    """Take over (lock) the unlocked ticket this user wrote for ``key``, keeping its place; None if there is none."""
    directory = lease_dir()
    prefix = f"queue.{os.getuid()}.{safe_name(key)}."
    for entry in sorted(n for n in list_names(directory) if n.startswith(prefix)):
        path = directory / entry
        try:
            fd, _ = shared_files.open_regular(path, os.getuid())
        except (OSError, Untrusted):
            _log.debug("the ticket %s cannot be opened; it is skipped", path, exc_info=True)
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
    for name in list_names(directory):
        if name.startswith(prefix):
            with contextlib.suppress(OSError):
                (directory / name).unlink()


def live_tickets(directory: Path, names: list[str], provisional_s: float) -> list[TicketFile]:
    """The tickets of ``names`` that count: locked by their holder, or not locked yet but made less than
    ``provisional_s`` ago while a job's runner starts (``OTHERS_PROVISIONAL_S`` for other users' tickets; never
    for a waiting kernel's, which it locks as it makes it). Another user's ticket counts only if every field and
    its holder pass ``ticket_checks``. This user's dead tickets are removed; other users' suspicious ones are
    noted as ignored."""
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

        read = shared_files.read_shared(path, uid, fields)
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


def ignored_ticket_owners(directory: Path) -> tuple[str, ...]:
    """The owners of the queue tickets in ``directory`` that gpumagic ignores (``shared_files.ignored``), as
    the files' owners are: a file planted under another user's uid names its planter."""
    found, _ = shared_files.ignored(limit=0)
    uids = set()
    for name in found:
        if TICKET_NAME.match(name):
            with contextlib.suppress(OSError):
                uids.add(os.lstat(directory / name).st_uid)
    return tuple(sorted(shared_files.owner_name(uid) for uid in uids))


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
            _log.debug("the ticket %s cannot be stat'ed; it is skipped", name, exc_info=True)
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

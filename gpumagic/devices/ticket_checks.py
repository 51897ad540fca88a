"""What a queue ticket of another user must pass to count: every field checked against what can be verified.

A ticket (``queue.<uid>.<key>.<token>.json`` in the lease directory) is a file its user wrote, so everything
in it is a claim. What gpumagic can verify, it does:

- its owner: the file's owner, on the open descriptor (``shared_files``), is the uid its name gives;
- its arrival: when the directory saw it made (its change time, which its writer cannot set back);
- its fields: types and ranges (``checked_ticket``): a round of at most ``ROUND_LIMIT``, a submission no later
  than its arrival, and for a job only what jobs ask (GPUs, UUIDs, memory: no utilization or percentage);
- its holder: the process holding its ``flock`` (from ``/proc/locks``, which nobody can forge) runs as that
  user and is what the ticket says (``TicketHolders``): for a kernel in ``%gpu pick --wait``, the very process
  it names (pid and start time), started before the ticket was made; for a job, a process that runs as that
  job's runner (``python -m gpumagic.jobs.runner <run directory named as the ticket>``) and started within the
  ticket's provisional window of its making (30 s: a sweep's runners start one after another), so an old
  ticket nobody held then cannot be revived by locking it later. The runner's command line is a filter, not a
  proof: another user's ``/proc/PID/exe`` and environment cannot be read, so a module of that name on the
  ticket owner's own path passes it (issue #37). A runner that passes and never starts is bounded as a real
  one is: by the hold-up budget and the backfill bound (``devices.hold_ups``);
- its round: within the range the queue uses (``devices.placement.queue_order``).

A ticket that fails is ignored and named (``shared_files.note_ignored``), in ``%gpu status``, ``%gpu why`` and
the line of a waiting pick.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil

from gpumagic.devices.model import MAX_GPUS
from gpumagic.devices.processes import is_same_process, proc_hides_others
from gpumagic.devices.shared_files import Untrusted, finite

RUNNER = "gpumagic.jobs.runner"  # the module a job's runner runs (python -m RUNNER RUN_DIRECTORY)
TICKET_BYTES = 8 << 10  # a ticket names at most MAX_GPUS UUIDs: a few KiB
ROUND_LIMIT = 1 << 20  # rounds grow by one per round served while the queue never empties: never near this
CLOCK_SLACK_S = 2.0  # process start times (psutil: boot time + ticks) and file times may differ by this much
PID_LIMIT = 1 << 22  # Linux's pid_max at most
_PICK_KEY = re.compile(r"^pick-(\d+)$")


def checked_ticket(data: dict, made_ns: int | None = None) -> dict:
    """A ticket's fields, every one checked (``kind``, ``name``, ``request``: count, uuids, min_free, shares,
    min_free_percent, max_util, exclude; ``submitted_ns``, ``round``; a waiting kernel's ``pid`` and
    ``process_start``); with ``made_ns`` (its arrival), a submission no later than that.

    Raises:
        Untrusted: a field is missing, of the wrong type or out of range (Infinity, nested lists...).
    """
    request, name, submitted = data.get("request"), data.get("name"), data.get("submitted_ns", 0)
    if not isinstance(request, dict) or not isinstance(name, str) or not name.isprintable() or len(name) > 120:
        raise Untrusted("a ticket with malformed fields")  # its name is shown to others: one plain line
    count, uuids, min_free = request.get("count", 1), request.get("uuids") or [], request.get("min_free")
    kind, shares, turn = data.get("kind", "job"), request.get("shares", min_free is not None), data.get("round", 0)
    percent, util, exclude = request.get("min_free_percent"), request.get("max_util"), request.get("exclude") or []
    pid, started = data.get("pid"), data.get("process_start")
    if not (
        _whole(count, MAX_GPUS)
        and isinstance(uuids, list)
        and len(uuids) <= MAX_GPUS
        and all(isinstance(u, str) and re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]{1,80}", u) for u in uuids)
        and (min_free is None or _whole(min_free, 1 << 60))
        and _whole(submitted, 1 << 63)
        and kind in ("job", "pick")
        and _whole(turn, ROUND_LIMIT)
        and isinstance(shares, bool)
        and _percentage(percent)
        and _percentage(util)
        and isinstance(exclude, list)
        and len(exclude) <= MAX_GPUS
        and all(_whole(i, 1 << 16) for i in exclude)
        and (pid is None or _whole(pid, PID_LIMIT))
        and (started is None or (finite(started) is not None and 0 <= started < 1 << 40))
    ):
        raise Untrusted("a ticket with malformed fields")
    if kind == "job" and (percent is not None or util is not None):
        raise Untrusted("a job's ticket asking what no job asks (a utilization or a percentage)")
    if made_ns is not None and submitted > made_ns + CLOCK_SLACK_S * 1e9:
        raise Untrusted("a ticket submitted after it was made")
    request = {"count": count, "uuids": uuids, "min_free": min_free, "shares": shares}
    request.update(min_free_percent=percent, max_util=util, exclude=exclude)
    checked = {"kind": kind, "name": name, "request": request, "submitted_ns": submitted, "round": turn}
    if pid is not None:
        checked["pid"] = pid
    if started is not None:
        checked["process_start"] = float(started)
    return checked


def runs_runner_of(argv: list[str], key: str) -> bool:
    """True if ``argv`` reads as a gpumagic job runner's for the job ``key`` (its run directory's name), as
    ``jobs.local`` starts it: ``python -m gpumagic.jobs.runner RUN_DIRECTORY``. Anyone can run a module of that
    name: this tells a runner from other processes of the same user, nothing more."""
    return argv[1:3] == ["-m", RUNNER] and len(argv) > 3 and Path(argv[3]).name == key


class TicketHolders:
    """Checks the processes holding tickets' ``flock`` for one reading of the queue: each process is looked at
    once however many tickets it holds (a thousand forged tickets of one process cost one look)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s  # how long after it was made a job's ticket counts before its runner holds it
        self._facts: dict[tuple[int, bool], tuple[int, float | None, list[str]] | None] = {}

    def objection(self, path: Path, uid: int, data: dict, made_ns: int, pids: list[int]) -> str | None:
        """Why the processes holding the ``flock`` of a locked ticket do not make it count (None: they do).

        ``pids``: the holders ``/proc/locks`` gives for the file; this process among them is only probing it.
        """
        pids = [pid for pid in pids if pid != os.getpid()]
        key = path.name.split(".")[2] if path.name.count(".") >= 3 else ""
        if data["kind"] == "pick":
            return self._kernel_objection(key, uid, data, made_ns, pids)
        return self._runner_objection(key, uid, made_ns, pids)

    def _kernel_objection(self, key: str, uid: int, data: dict, made_ns: int, pids: list[int]) -> str | None:
        """A waiting kernel locks its ticket as it makes it: the holder must be the process it names."""
        match = _PICK_KEY.match(key)
        named = int(match.group(1)) if match else None
        pid = data.get("pid", named)
        if pid is None or (named is not None and named != pid):
            return "a waiting kernel's ticket that names no process, or two"
        if pid not in pids:
            return "held by another process than the kernel it names"
        facts = self._process(pid)
        if facts is None:
            return None  # /proc hides it (hidepid): cannot tell, so it counts (the hold-up budget bounds it)
        owner, started, _ = facts
        if owner == -1 or started is None:
            return "its kernel is gone"
        if owner != uid:
            return "locked by a process of another user"
        if started > made_ns / 1e9 + CLOCK_SLACK_S:
            return "held by a process that started after the ticket was made"
        recorded = data.get("process_start")
        if recorded is not None and not is_same_process(pid, recorded):
            return "held by another process than the one that made it (its pid was reused)"
        return None

    def _runner_objection(self, key: str, uid: int, made_ns: int, pids: list[int]) -> str | None:
        """A job's ticket is held by that job's runner, of that user, started while the ticket's place held."""
        late = False
        for pid in pids:
            facts = self._process(pid, command=True)
            if facts is None:  # hidden by hidepid: cannot tell, so it counts (the hold-up budget bounds it)
                return None
            owner, started, argv = facts
            if owner != uid or not runs_runner_of(argv, key):
                continue
            if started is not None and started > made_ns / 1e9 + self.window_s + CLOCK_SLACK_S:
                late = True
                continue
            return None
        if late:
            return "held by a runner that started after the ticket's place had lapsed"
        return "locked by a process that is not that user's gpumagic runner of that job"

    def _process(self, pid: int, command: bool = False) -> tuple[int, float | None, list[str]] | None:
        """(real uid, start time or None if it is a zombie, argv if asked) of ``pid``; (-1, None, []) if it is
        gone (a lock taken by a process that forked and exited is held by its child under its pid: the ticket's
        holder is not who it names); None if /proc hides it (hidepid): cannot tell."""
        if (pid, command) not in self._facts:
            try:
                process = psutil.Process(pid)
                with process.oneshot():
                    owner = process.uids().real
                    started = None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
                    argv = process.cmdline() if command else []
                self._facts[pid, command] = owner, started, argv
            except psutil.NoSuchProcess:
                self._facts[pid, command] = None if proc_hides_others() else (-1, None, [])
            except psutil.Error:  # AccessDenied: hidepid=1
                self._facts[pid, command] = None
        return self._facts[pid, command]


def _whole(value: object, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= high


def _percentage(value: object) -> bool:
    return value is None or (finite(value) is not None and 0 <= value <= 100)  # type: ignore[operator]

"""Placement: which GPUs a request may take now, best first, and why each other GPU may not.

One capacity model serves ``%gpu pick`` (and ``%%launch_ddp --gpus auto``, which picks) and the job queue, so a
reason reads the same everywhere:

- **qualify**: a GPU qualifies unless it is excluded, broken, in MIG mode, promised to an earlier ticket, held
  for a job that waited past the bound, held whole by someone else, shared by jobs (for a request that does not
  share), or short of memory or idle time. Its *available* memory is its free memory less what the jobs sharing
  it reserved and have not allocated yet.
- **rank**: most available memory, then least busy, then fewest processes, then lowest index.
- **explain**: every GPU's reason, naming every holder and sharer.

Requests that wait hold a ticket in the lease directory (``tickets.create_ticket``). Tickets are served in queue
order (``queue_order``): round-robin between users, by arrival within a round. A ticket that cannot start does
not hold up a later one that can (backfill), until a job's ticket has waited ``BACKFILL_BOUND_S``: then the GPUs
it could use once the leases and processes of other users on them end are held for it, and later tickets
backfill around them only. Tickets are files anyone can write: a waiting process counts how long each other
user's tickets that could start kept it from GPUs it could take, and passes that user's tickets over past a
budget (``devices.hold_ups``).

A job that declares its memory (``--min-free 25GB``) *shares*: it reserves that much on each of its GPUs until
it ends, and is placed at once where the available memory is enough; a job that declares nothing takes whole
GPUs, as a kernel does.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumagic.devices import leases as leasing
from gpumagic.devices import shared_files
from gpumagic.devices.hold_ups import HoldUp, hold_ups
from gpumagic.devices.model import GpuInfo, Inventory
from gpumagic.devices.pick_lock import pick_lock
from gpumagic.devices.policy import Policy, over_cap, read_policy
from gpumagic.devices.processes import Ancestry, process_start_time
from gpumagic.devices.ticket_checks import ROUND_LIMIT
from gpumagic.devices.tickets import TicketFile, claim_ticket, create_ticket
from gpumagic.errors import InvalidArgument
from gpumagic.units import format_bytes, format_duration, parse_duration

BACKFILL_BOUND_VARIABLE = "GPUMAGIC_BACKFILL_BOUND"
BACKFILL_BOUND_S = 600.0  # how long a ticket may be passed over by later, smaller ones before its GPUs are held
UNSEEN_GRACE_S = 30.0  # a sharer none of whose processes can be seen on its GPU is taken to have allocated then
PASSED_OVER = "they kept this process from GPUs it could take for too long"


@dataclass(frozen=True)
class Request:
    """What a kernel or job asks for: ``count`` GPUs, or exactly ``uuids``, each with ``min_free`` bytes (or
    ``min_free_percent``) free and at most ``max_util`` percent busy, none of ``exclude`` (NVML indices).

    ``shares``: a job that declared its memory: it may share a GPU with other such jobs, reserving ``min_free``
    (the default for a job's request with ``min_free``; a kernel's pick passes False).
    """

    count: int = 1
    uuids: tuple[str, ...] = ()
    min_free: int | None = None
    shares: bool = None  # type: ignore[assignment]  # None: a job's default, set below
    min_free_percent: float | None = None
    max_util: float | None = None
    exclude: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.shares is None:
            object.__setattr__(self, "shares", self.min_free is not None)

    @property
    def wants(self) -> int:
        return len(self.uuids) if self.uuids else self.count

    def describe(self) -> str:
        """``2 GPUs with 20 GiB free``."""
        text = f"{self.wants} GPU{'s' if self.wants != 1 else ''}"
        needs = []
        if self.min_free is not None:
            needs.append(f"{format_bytes(self.min_free)} {'reserved' if self.shares else 'free'}")
        if self.min_free_percent is not None:
            needs.append(f"{self.min_free_percent:g}% free")
        if self.max_util is not None:
            needs.append(f"≤{self.max_util:g}% busy")
        return text + (f" with {', '.join(needs)}" if needs else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "uuids": list(self.uuids),
            "min_free": self.min_free,
            "shares": self.shares,
            "min_free_percent": self.min_free_percent,
            "max_util": self.max_util,
            "exclude": sorted(self.exclude),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Request:
        min_free = data.get("min_free")
        return cls(
            int(data.get("count", 1)),
            tuple(data.get("uuids") or ()),
            min_free,
            bool(data.get("shares", min_free is not None)),
            data.get("min_free_percent"),
            data.get("max_util"),
            frozenset(data.get("exclude") or ()),
        )


@dataclass(frozen=True)
class Ticket:
    """A place in the queue: a job's (``kind`` "job") or a waiting kernel's ("pick"), as its file says."""

    file: TicketFile
    request: Request

    @property
    def name(self) -> str:
        return str(self.file.data.get("name", "?"))[:80]

    @property
    def kind(self) -> str:
        return self.file.kind

    @property
    def uid(self) -> int:
        return self.file.uid

    @property
    def made_ns(self) -> int:
        return self.file.made_ns

    @property
    def round(self) -> int:
        return int(self.file.data.get("round", 0))

    @property
    def submitted_ns(self) -> int:
        return int(self.file.data.get("submitted_ns", 0))

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def label(self) -> str:
        """How reasons name it: ``job A1``, ``bob's job B``, ``bob's kernel pid 12 (in %gpu pick --wait)``."""
        owner = "" if self.uid == os.getuid() else f"{shared_files.owner_name(self.uid)}'s "
        if self.kind == "pick":
            return f"{owner}kernel {self.name} (in %gpu pick --wait)"
        return f"{owner}job {self.name}"

    @classmethod
    def create(
        cls, name: str, request: Request, submitted: float, key: str, provisional: bool = False, kind: str = "job"
    ) -> Ticket:
        """A new ticket for ``key`` (a job's run id, or ``pick-<pid>``). A job's kernel writes a ``provisional``
        one at submission so the queue order is the submission order; the job's runner then takes it over
        (locks it), or writes its own if there is none."""
        if kind == "job" and not provisional:
            claimed = claim_ticket(key)
            if claimed is not None:
                return cls(claimed, request)
        record = {"kind": kind, "name": name, "request": request.to_json(), "submitted_ns": int(submitted * 1e9)}
        record.update(uid=os.getuid(), round=next_round(leasing.read_view(leasing.book())))
        if kind == "pick":  # a waiting kernel holds its own ticket: others check that it is this process
            record.update(pid=os.getpid(), process_start=process_start_time(os.getpid()))
        return cls(create_ticket(key, record, lock=not provisional), request)

    @classmethod
    def of(cls, file: TicketFile) -> Ticket:
        return cls(file, Request.from_json(file.data["request"]))

    def withdraw(self) -> None:
        self.file.withdraw()

    def remove(self) -> None:
        self.file.remove()


def queue_order(tickets: Iterable[Ticket]) -> list[Ticket]:
    """Round-robin between users, each round by arrival (when the lease directory saw the ticket made).

    A ticket's round (its ``round`` field) is the round of the first waiting ticket when it was made, plus how
    many tickets its user then had waiting: a sweep's jobs take successive rounds, and a newcomer's first job
    joins the round being served. Each user's tickets stay in arrival order, one per round. So a user with 40
    queued jobs has one served per turn, as every other user does (``turns``)."""
    return [ticket for _, ticket in turns(tickets)]


def turns(tickets: Iterable[Ticket]) -> list[tuple[int, Ticket]]:
    """Each ticket's turn, in queue order (the order ``queue_order`` gives).

    Every process orders the same tickets the same way, so no two waiters each see the other ahead. A round is
    taken within the range the queue uses. Rounds grow by one per round served while the queue never empties,
    so one beyond half ``ROUND_LIMIT`` (half a million rounds) was written by a forger, or copied from one: it
    counts as 0, and is not inherited (``next_round``). And a round counts as at most the lowest waiting round
    plus the number of tickets (rounds of tickets that wait together are never further apart). Lower, rounds
    are claims nobody can check against the queue's past (it is not on disk): a user who writes low ones gets
    earlier turns, as ``%gpu use`` gets them a free GPU without queueing; a ticket that could start and is not
    taken holds nobody up for long (``devices.hold_ups``)."""
    by_arrival = sorted(tickets, key=lambda t: (t.made_ns, t.uid, t.round, t.submitted_ns, t.path.name))
    rounds = [t.round if t.round <= ROUND_LIMIT // 2 else 0 for t in by_arrival]
    highest = min(rounds, default=0) + len(rounds)
    last: dict[int, int] = {}
    result = []
    for ticket, claimed in zip(by_arrival, rounds, strict=True):
        turn = max(min(claimed, highest), last.get(ticket.uid, -1) + 1)
        result.append((turn, ticket))
        last[ticket.uid] = turn
    return sorted(result, key=lambda pair: pair[0])  # stable: arrival within a round


def next_round(view: leasing.LeaseView) -> int:
    """The round of a ticket this user makes now: the turn of the first waiting ticket, plus this user's waiting
    ones (at most ``ROUND_LIMIT``)."""
    waiting = turns(Ticket.of(f) for f in view.tickets)
    if not waiting:
        return 0
    mine = sum(1 for _, ticket in waiting if ticket.uid == os.getuid())
    return min(waiting[0][0] + mine, ROUND_LIMIT)


def backfill_bound() -> float:
    """Seconds a ticket may be passed over before its GPUs are held for it (``GPUMAGIC_BACKFILL_BOUND``)."""
    value = os.environ.get(BACKFILL_BOUND_VARIABLE)
    if not value:
        return BACKFILL_BOUND_S
    try:
        return parse_duration(value)
    except InvalidArgument as err:
        raise InvalidArgument(f"{BACKFILL_BOUND_VARIABLE}: {err}") from None


@dataclass
class Slot:
    """A GPU as placement sees it, updated as earlier tickets take it in this round."""

    gpu: GpuInfo
    leases: tuple[leasing.Lease, ...]
    unallocated: int  # bytes the jobs sharing it reserved and have not allocated yet
    promised_to: str | None = None  # an earlier ticket takes it whole in this round
    joined_by: list[tuple[str, int]] = field(default_factory=list)  # earlier sharing tickets: (label, reserve)
    held_for: str | None = None  # a ticket that waited past the bound

    @property
    def available(self) -> int:
        """Free memory less the sharers' unallocated reservations and those of earlier tickets placed here."""
        return (self.gpu.memory_free or 0) - self.unallocated - sum(r for _, r in self.joined_by)

    def qualify(self, request: Request, own: bool) -> str | None:
        """Why ``request`` may not take this GPU (None: it may); ``own``: this process's leases do not count."""
        gpu = self.gpu
        if gpu.nvml_index in request.exclude:
            return "excluded"
        if not gpu.healthy:
            return gpu.problem
        if gpu.mig_enabled:
            return "MIG mode is on (gpumagic chooses whole GPUs)"
        others = [lease for lease in self.leases if not (own and lease.mine)]
        whole = [lease for lease in others if not lease.shared]
        if whole:
            return "; ".join(lease.describe() for lease in whole)
        kept = own and len(others) < len(self.leases)  # this kernel holds it already: it keeps it
        if self.promised_to is not None and not kept:
            return f"goes to {self.promised_to}, ahead in the queue"
        if self.held_for is not None and not kept:
            return f"held for {self.held_for}, waiting longer than {format_duration(backfill_bound())}"
        if (others or self.joined_by) and not request.shares:
            return "shared by jobs: " + describe_sharers(others, self.joined_by)
        reasons = []
        free = self.available
        if request.min_free is not None and free < request.min_free:
            pending = self.unallocated + sum(r for _, r in self.joined_by)
            after = f" after {format_bytes(pending)} reserved and not yet allocated" if pending else ""
            reasons.append(f"{format_bytes(max(free, 0))} free{after} < {format_bytes(request.min_free)} needed")
            if others or self.joined_by:
                reasons[-1] += " (shared by " + describe_sharers(others, self.joined_by) + ")"
        if request.min_free_percent is not None and gpu.memory_total:
            percent = 100 * max(free, 0) / gpu.memory_total
            if percent < request.min_free_percent:
                reasons.append(f"{percent:.0f}% free < {request.min_free_percent:g}% needed")
        if request.max_util is not None and (gpu.utilization or 0) > request.max_util:
            reasons.append(f"{gpu.utilization:.0f}% busy > {request.max_util:g}% allowed")
        return "; ".join(reasons) or None

    def take(self, request: Request, label: str) -> None:
        if request.shares:
            self.joined_by.append((label, request.min_free or 0))
        else:
            self.promised_to = label


def describe_sharers(leases: Sequence[leasing.Lease], queued: Sequence[tuple[str, int]] = ()) -> str:
    """Every sharer of a GPU with what it reserved: ``bob (pid 12, job A1) 25 GB, job A2 25 GB``."""
    parts = [lease.holder() + (f" {format_bytes(lease.reserve)}" if lease.reserve else "") for lease in leases]
    parts += [f"{label} {format_bytes(reserve)} (placed ahead in the queue)" for label, reserve in queued]
    return ", ".join(parts)


def describe_holders(leases: Sequence[leasing.Lease]) -> str:
    """Who holds a GPU, in words, every holder named (``%gpu status``); "free" if nobody."""
    if not leases:
        return "free"
    if all(lease.shared for lease in leases):
        since = min(lease.since for lease in leases)
        when = time.strftime("%H:%M", time.localtime(since)) if since else "?"
        return f"shared by jobs since {when}: {describe_sharers(leases)}"
    return "; ".join(lease.describe() for lease in leases)


def slots(inventory: Inventory, view: leasing.LeaseView) -> list[Slot]:
    """Every GPU of ``inventory`` as a slot, with its leases and its sharers' unallocated reservations."""
    parents = Ancestry()
    now = time.time()
    result = []
    for gpu in inventory.gpus:
        held = view.on(gpu.uuid)
        unallocated = 0
        for lease in held:
            if lease.shared and lease.reserve:
                own = [p for p in gpu.processes if parents.descends(p.pid, lease.pid)]
                if own and all(p.gpu_memory is not None for p in own):
                    unallocated += max(0, lease.reserve - sum(p.gpu_memory or 0 for p in own))
                elif now - lease.since < UNSEEN_GRACE_S:  # not started yet, or its processes cannot be told apart
                    unallocated += lease.reserve  # (another container's pids, a hidden /proc, no per-process memory)
        result.append(Slot(gpu, held, unallocated))
    return result


def rank(candidates: Iterable[Slot]) -> list[Slot]:
    """Best first: most available memory, then least busy, then fewest processes, then lowest index."""
    return sorted(
        candidates, key=lambda s: (-s.available, s.gpu.utilization or 0, len(s.gpu.processes), s.gpu.nvml_index)
    )


def choose(request: Request, all_slots: list[Slot], own: bool = False) -> tuple[list[Slot], dict[int, str]]:
    """The slots ``request`` qualifies for, best first, and why each other slot does not."""
    candidates = all_slots
    if request.uuids:
        by_uuid = {s.gpu.uuid: s for s in all_slots}
        candidates = [by_uuid[u] for u in request.uuids if u in by_uuid]
    good, reasons = [], {}
    for slot in candidates:
        why = slot.qualify(request, own)
        if why is None:
            good.append(slot)
        else:
            reasons[slot.gpu.nvml_index] = why
    return rank(good), reasons


class Outcome(enum.Enum):
    """What an earlier ticket does in a placement."""

    STARTS = "starts"  # it could start now, on the GPUs it takes
    WAITS = "waits"
    HOLDS = "holds"  # a job past the backfill bound: the GPUs it could use once free are held for it
    PASSED = "passed"  # its user's tickets held this process up too long: passed over


@dataclass(frozen=True)
class Served:
    """What an earlier ticket does in a placement (``outcome``), on which ``gpus``; for one that waits, ``why``
    (every GPU's reason)."""

    ticket: Ticket
    outcome: Outcome
    gpus: tuple[int, ...] = ()
    why: str = ""

    def describe(self) -> str:
        """``could start now, on GPU 0, 1``, ``waits — GPU 0: ...``, ``holds GPU 2, 3: ...``, ``passed over: ...``."""
        gpus = ", ".join(map(str, self.gpus))
        if self.outcome is Outcome.STARTS:
            return f"could start now, on GPU {gpus}"
        if self.outcome is Outcome.HOLDS:
            return f"holds GPU {gpus}: it has waited longer than {format_duration(backfill_bound())}"
        if self.outcome is Outcome.PASSED:
            return f"passed over: {PASSED_OVER}"
        return f"waits — {self.why}"


@dataclass(frozen=True)
class Placement:
    """What a request gets now: ``gpus`` (all it wants, or none), the GPUs that ``qualify``, and ``reasons``
    (NVML index -> why not) for the others; ``served``: what each earlier ticket does, in queue order;
    ``blocking``: the other users (uid) whose tickets keep this waiter from GPUs it could take, and how;
    ``holding_up``: the same once counted, by name, with the seconds they may still cost before they are
    passed over; ``ignored``: users whose tickets failed the checks."""

    request: Request
    gpus: tuple[GpuInfo, ...]
    qualify: tuple[GpuInfo, ...]
    reasons: dict[int, str]
    total: int
    served: tuple[Served, ...] = ()
    blocking: dict[int, HoldUp] = dataclasses.field(default_factory=dict)
    seeming: dict[int, HoldUp] = dataclasses.field(default_factory=dict)  # of ``blocking``: perhaps waiting
    holding_up: tuple[tuple[str, HoldUp, float], ...] = ()
    ignored: tuple[str, ...] = ()
    capped: str = ""  # why the administrator's per-user cap keeps it from any GPU (``devices.policy``)

    def explain(self) -> str:
        """Why it waits, GPU by GPU: ``waiting for 1 GPU with 25 GB reserved — GPU 0: ...; GPU 1: ...``."""
        if self.capped:
            return f"waiting for {self.request.describe()} — {self.capped}" + self.note()
        return f"waiting for {self.request.describe()} — {explain(self.reasons, self.total)}" + self.note()

    def note(self, countdown: bool = False) -> str:
        """What this process does about other users' tickets: whom it passes over, who holds it up (with
        ``countdown``, for how much longer at most: a line updated in place; a job's record is not rewritten
        every second), whose tickets it ignores."""
        passed = sorted({shared_files.owner_name(s.ticket.uid) for s in self.served if s.outcome is Outcome.PASSED})
        parts = [passing_over(passed)] if passed else []
        for name, how, left in self.holding_up:
            when = f"passed over in {left + 1:.0f}s at most" if countdown else "passed over if it lasts"
            parts.append(f"{name}'s tickets {how.value}: {when}")
        if self.ignored:
            names = ", ".join(f"{name}'s" for name in self.ignored)
            parts.append(f"ignoring {names} tickets that fail the checks (%gpu why names them)")
        return "".join(f"; {part}" for part in parts)


def passing_over(names: Sequence[str]) -> str:
    """``passing over bob's queue tickets: they kept this process ...``."""
    owners = ", ".join(f"{name}'s" for name in names)
    return f"passing over {owners} queue tickets: {PASSED_OVER}"


def explain(reasons: dict[int, str], total: int) -> str:
    """Every GPU's reason, one clause each, in index order."""
    if not reasons:
        return f"this machine has {total} GPU{'s' if total != 1 else ''}"
    return "; ".join(f"GPU {index}: {why}" for index, why in sorted(reasons.items()))


def place(
    request: Request,
    inventory: Inventory,
    view: leasing.LeaseView,
    mine: Ticket | None = None,
    keep_own: bool = True,
    waiting: bool = False,
) -> Placement:
    """What ``request`` may take now. Earlier tickets in queue order are placed first on a copy of the GPUs'
    state, so it never takes what an earlier one can use now; with no ``mine`` it comes after every ticket.
    ``keep_own``: GPUs this process holds qualify (a kernel picking again); a job's placement passes False.
    Other users this process passes over are left out (``devices.hold_ups``). For a look of a waiter (``mine``,
    or ``waiting``) that gets nothing, ``blocking`` names the other users without whose tickets it would get
    what it asks (``count_hold_ups`` counts it). Call under ``pick_lock()``, with ``view`` read there."""
    earlier = _earlier(view, mine)
    passed, unheld = left_out(earlier)
    state = slots(inventory, view)
    policy = read_policy()
    served = serve_queue(earlier, state, passed, unheld, policy)
    good, reasons = choose(request, state, own=keep_own)
    chosen = _chosen(request, good, state)
    me = os.getuid()
    taken_ahead = sum(s.ticket.request.wants for s in served if s.ticket.uid == me and s.outcome is Outcome.STARTS)
    capped = over_cap(policy, _holdings(state), me, request.wants, os.getpid() if keep_own else None, taken_ahead)
    if capped:
        chosen = []
    blocking: dict[int, HoldUp] = {}
    seeming: dict[int, HoldUp] = {}
    if (mine is not None or waiting) and not chosen and not capped:
        blocking, seeming = _holding_up(request, inventory, view, earlier, served, (passed, unheld), keep_own)
    gpus, qualify = tuple(s.gpu for s in chosen), tuple(s.gpu for s in good)
    total, ignored = len(inventory.gpus), view.ignored_ticket_owners
    return Placement(request, gpus, qualify, reasons, total, tuple(served), blocking, seeming, (), ignored, capped)


def left_out(tickets: Iterable[Ticket]) -> tuple[set[int], set[int]]:
    """The other users among the holders of ``tickets`` whose tickets this process passes over, and those for
    whose jobs it no longer holds GPUs (``devices.hold_ups``)."""
    counts = hold_ups()
    strangers = {t.uid for t in tickets if t.uid != os.getuid()}
    passed = {uid for uid in strangers if counts.passed_over(uid)}
    return passed, {uid for uid in strangers if counts.passed_over(uid, HoldUp.HOLDS)}


def count_hold_ups(placed: Placement, waiter: str, steady: bool = True) -> Placement:
    """Count ``placed.blocking`` against those users as ``waiter``'s hold-up since its last look (nobody, if
    it was placed; ``steady``: see ``HoldUps.look``); ``placed`` with ``holding_up`` (who, how, seconds left
    before they are passed over)."""
    counts = hold_ups()
    counts.look(waiter, placed.blocking, backfill_bound(), steady=steady, seeming=placed.seeming)
    name = shared_files.owner_name
    counted = sorted((uid, how) for uid, how in placed.blocking.items() if uid not in placed.seeming)
    holding_up = tuple((name(uid), how, counts.left(uid, how)) for uid, how in counted)
    return dataclasses.replace(placed, holding_up=holding_up)


def _holding_up(
    request: Request,
    inventory: Inventory,
    view: leasing.LeaseView,
    earlier: list[Ticket],
    served: list[Served],
    left_out: tuple[set[int], set[int]],
    keep_own: bool,
) -> tuple[dict[int, HoldUp], dict[int, HoldUp]]:
    """The other users without whose tickets ``request`` would be placed now, and how theirs hold it up (tickets
    that could start, or GPUs held for a job); and those of them that may only seem to, with why (``STARTS``:
    a user ahead is passed over; ``HOLDS``: one's holds are no longer kept).

    One user at a time, all their tickets taken away; if no one user's are enough, all of them together; and if
    that is not enough either, the users whose tickets start once those are gone, and so on (one person's second
    account behind the first): then those at the front hold it up. A user whose tickets start only because this
    process leaves others out (``left_out``: users passed over, users whose holds it no longer keeps) may only
    seem to: its own waiter may still be waiting behind those (``HoldUps.look`` gives it their time)."""
    me = os.getuid()

    def without(users: set[int]) -> tuple[list[Served], bool]:
        state = slots(inventory, view)
        result = serve_queue([t for t in earlier if t.uid not in users], state, *left_out)
        return result, bool(_chosen(request, choose(request, state, own=keep_own)[0], state))

    front = _active_users(served, me)
    found = {uid: how for uid, how in front.items() if without({uid})[1]}
    gone = set(front)
    while front and not found:
        result, placed = without(gone)
        if placed:
            found = front
            break
        behind = set(_active_users(result, me)) - gone
        if not behind:
            return {}, {}
        gone |= behind
    passed, unheld = left_out
    seeming: dict[int, HoldUp] = {}
    for kind, restored in ((HoldUp.HOLDS, (passed, set())), (HoldUp.STARTS, (set(), unheld))):
        if found and (passed if kind is HoldUp.STARTS else unheld):
            as_others_see = serve_queue(earlier, slots(inventory, view), *restored)
            seeming.update(dict.fromkeys(set(found) - set(_active_users(as_others_see, me)), kind))
    return found, seeming


def _active_users(served: list[Served], me: int) -> dict[int, HoldUp]:
    """The other users whose tickets start or hold GPUs in ``served``, and how (starting counts first)."""
    how: dict[int, HoldUp] = {}
    for s in served:
        if s.ticket.uid != me and s.outcome in (Outcome.STARTS, Outcome.HOLDS):
            starts = s.outcome is Outcome.STARTS or how.get(s.ticket.uid) is HoldUp.STARTS
            how[s.ticket.uid] = HoldUp.STARTS if starts else HoldUp.HOLDS
    return how


def _earlier(view: leasing.LeaseView, mine: Ticket | None) -> list[Ticket]:
    """The tickets ahead of ``mine`` in queue order (all of them, with no ``mine``)."""
    ordered = queue_order(Ticket.of(f) for f in view.tickets if mine is None or not _same_holder(f, mine.file))
    if mine is None:
        return ordered
    ordered = queue_order([*ordered, mine])
    return ordered[: ordered.index(mine)]


def _chosen(request: Request, good: list[Slot], state: list[Slot]) -> list[Slot]:
    """The best of ``good`` if there are enough of them (and every GPU named exists), else none."""
    if len(good) < request.wants:
        return []
    if request.uuids and len({s.gpu.uuid for s in state} & set(request.uuids)) < len(request.uuids):
        return []
    return good[: request.wants]


def place_and_take(
    request: Request,
    inventory: Inventory,
    take: Callable[[tuple[GpuInfo, ...]], bool],
    mine: Ticket | None = None,
    keep_own: bool = True,
    wait_s: float | None = None,
) -> Placement:
    """``place`` under the shared pick lock (most looks of a waiter find nothing to take), and only when
    something can be placed, again under the exclusive one, where ``take`` leases it and ``mine`` leaves the
    queue (its owner still calls ``remove``). The placement returned has ``gpus`` only if they were taken. What
    kept it from GPUs is counted (``count_hold_ups``), for a pick without a ticket as this process's.

    Raises:
        LeaseBusy: the pick lock stayed taken for ``wait_s``.
    """
    waiter = mine.path.name if mine is not None else f"process-{os.getpid()}"  # a pick without a ticket
    with pick_lock(exclusive=False, wait_s=wait_s):
        placed = place(request, inventory, leasing.read_view(leasing.book()), mine, keep_own, waiting=True)
    if placed.gpus:
        with pick_lock(wait_s=wait_s):
            placed = place(request, inventory, leasing.read_view(leasing.book()), mine, keep_own, waiting=True)
            if placed.gpus and take(placed.gpus):
                if mine is not None:  # out of the queue before the lock goes: an idle holder that looked between
                    mine.withdraw()  # this take and the caller's ``remove`` gave one more GPU to a waiter served
                return count_hold_ups(placed, waiter, mine is not None)
        placed = dataclasses.replace(placed, gpus=())
    return count_hold_ups(placed, waiter, mine is not None)  # what kept it from GPUs at either look counts


def _same_holder(file: TicketFile, mine: TicketFile) -> bool:
    return file.uid == mine.uid and file.key == mine.key


def serve_queue(
    earlier: list[Ticket], state: list[Slot], passed: set[int], unheld: set[int], policy: Policy | None = None
) -> list[Served]:
    """Let each earlier ticket take (on ``state``) what it would take now; hold GPUs for a job past the bound,
    unless its user is in ``unheld``. The tickets of the users in ``passed`` are passed over; those that would take
    their user past the ``policy``'s cap wait."""
    bound_ns = backfill_bound() * 1e9
    policy = read_policy() if policy is None else policy
    served = []
    taken: dict[int, int] = {}  # GPUs each user's earlier tickets take in this round
    for ticket in earlier:
        if ticket.uid in passed:
            served.append(Served(ticket, Outcome.PASSED))
            continue
        replacing = _pick_pid(ticket)
        ahead = taken.get(ticket.uid, 0)
        capped = over_cap(policy, _holdings(state), ticket.uid, ticket.request.wants, replacing, ahead)
        if capped:
            served.append(Served(ticket, Outcome.WAITS, (), capped))
            continue
        good, reasons = choose(ticket.request, state)
        if len(good) < ticket.request.wants:
            held = ()
            if ticket.kind == "job" and ticket.uid not in unheld and time.time_ns() - ticket.made_ns > bound_ns:
                held = _hold_for(ticket, state)
            outcome = Outcome.HOLDS if held else Outcome.WAITS
            served.append(Served(ticket, outcome, held, explain(reasons, len(state))))
            continue
        for slot in good[: ticket.request.wants]:
            slot.take(ticket.request, ticket.label)
        taken[ticket.uid] = taken.get(ticket.uid, 0) + ticket.request.wants
        served.append(Served(ticket, Outcome.STARTS, tuple(s.gpu.nvml_index for s in good[: ticket.request.wants])))
    return served


def _holdings(state: list[Slot]) -> Iterator[tuple[int, tuple[leasing.Lease, ...]]]:
    """Each GPU's index and leases, read only where a cap is set (``over_cap``)."""
    return ((s.gpu.nvml_index, s.leases) for s in state)


def _pick_pid(ticket: Ticket) -> int | None:
    """The kernel a waiting pick's ticket is for (its key is ``pick-<pid>``): its pick replaces its leases."""
    key = ticket.file.key
    if ticket.kind == "pick" and key.startswith("pick-") and key[5:].isdigit():
        return int(key[5:])
    return None


def _hold_for(ticket: Ticket, state: list[Slot]) -> tuple[int, ...]:
    """Hold for ``ticket`` the GPUs it could have once what other users than its own hold on them ends
    (``_once_freed``), fewest holders first; later tickets may not take them. Returns their indices. A job that
    could not start on free GPUs, or only once its own user's leases end, holds nothing. Business is ignored,
    the memory need kept; nothing is held for a request no set of GPUs here could then meet."""
    request = ticket.request
    by_uuid = {s.gpu.uuid: s for s in state}
    candidates = [
        _once_freed(s, ticket.uid)
        for s in state
        if s.held_for is None and s.promised_to is None and (not request.uuids or s.gpu.uuid in request.uuids)
    ]
    good, _ = choose(dataclasses.replace(request, max_util=None), candidates)
    if len(good) < request.wants:
        return ()
    targets = sorted(good, key=lambda s: (len(by_uuid[s.gpu.uuid].leases), s.gpu.nvml_index))[: request.wants]
    for slot in targets:
        by_uuid[slot.gpu.uuid].held_for = ticket.label
    return tuple(sorted(s.gpu.nvml_index for s in targets))


def _once_freed(slot: Slot, uid: int) -> Slot:
    """``slot`` once what other users than ``uid`` hold on it ends: their leases, and the memory their
    processes use. The same for every reader, whoever ``uid`` is, so all see the same GPUs held."""
    gpu = slot.gpu
    total = gpu.memory_total or 0
    owner = shared_files.owner_name(uid)
    kept = tuple(lease for lease in slot.leases if lease.uid == uid)
    freed = sum(p.gpu_memory or 0 for p in gpu.processes if p.user != owner)
    free = min((gpu.memory_free or 0) + freed, total)
    return Slot(dataclasses.replace(gpu, memory_free=free, memory_used=total - free), kept, 0)

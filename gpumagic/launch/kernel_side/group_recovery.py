"""Bringing a persistent group (``group.RankGroup``) back after an interrupt, a timeout, a failure or a death,
keeping what can be kept:

- an interrupt (or a cell's ``timeout``) first asks the busy ranks to stop together, before the same collective
  or DDP forward (``sync_points``); failing that, it raises KeyboardInterrupt in every busy rank; a rank still
  busy after ``grace_s`` (stuck in a collective) gets the process group's connections shut on every rank, the
  group is re-formed on a fresh rendezvous, namespaces kept; a rank still busy after that is killed and replaced;
- a rank that dies is replaced by a fresh one: the group re-forms, the state registered with ``gpumagic.keep``
  is copied to it from a healthy rank, its cells' imports and definitions run again, the notebook's names it
  had been sent are sent again, and what it lost is listed by name.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from gpumagic.launch.kernel_side.group_members import START_TIMEOUT_S, GroupError, GroupMembers, Member, RankDied
from gpumagic.launch.kernel_side.group_shipping import NameShipper
from gpumagic.launch.messages import (
    Done,
    Export,
    Interrupted,
    Leave,
    Pause,
    Paused,
    Restore,
    Restored,
    Rewrap,
    StopAt,
    ToKernel,
    Wrapped,
)
from gpumagic.launch.replay import ReplayLog
from gpumagic.launch.shared_values import sharing

# How long a living rank has to leave a broken group at the least, whatever the grace period: leaving is gpumagic's
# own teardown (destroying the group, a garbage collection over the rank's namespace), not the user's code, and a
# rank that misses it is killed and loses its namespace, though nothing in it was stuck.
LEAVE_WITHIN_S = 5.0


class GroupRecovery:
    """How a group recovers, and what it keeps for that: the cells' imports and definitions (``replay``), how
    many times the group was re-formed and how many ranks were replaced."""

    def __init__(self, members: GroupMembers, shipper: NameShipper, grace_s: float) -> None:
        self.members = members
        self.shipper = shipper
        self.grace_s = grace_s
        self.replay = ReplayLog()  # the cells' imports and definitions, for a rank that replaces a dead one
        self.needs_reform = False  # a re-form was cut short: the next call makes it
        self.reformed = 0
        self.replaced = 0

    def stop_together(self, ident: int, targets: list[Member], replies: dict[int, ToKernel]) -> int | None:
        """Stop every busy rank at one sync point (``sync_points``): before the same collective or DDP training
        forward, so that the replicas stay in step. The point asked for, or ``None`` where the ranks cannot
        agree on one (a rank made no sync point in this cell, one finished it, one waits in a collective for a
        peer that is not coming, one did not answer): the caller then interrupts them the usual way, which also
        ends their waiting."""
        busy = [m for m in targets if m.rank not in replies and m.alive]
        if len(busy) < 2 or len(busy) < len(targets):
            return None
        try:
            ask = self.members.next_ident()
            for member in busy:
                member.send(Pause(ask, ident))
            answers: dict[int, ToKernel] = {}
            self.members.gather(ask, busy, answers, 1.0, kinds=(Paused,))
            where = {rank: answer.where for rank, answer in answers.items() if isinstance(answer, Paused)}
            if len(where) < len(busy) or any(not _may_stop_together(w) for w in where.values()):
                return None
            point = max(w["made"] for w in where.values()) + 1
            for member in busy:
                member.send(StopAt(ask, ident, point))
        except KeyboardInterrupt:  # interrupted again: paused ranks wait for nobody, the signal frees them
            self.members.interrupt(busy)
            raise
        slowest = max((point - w["made"]) * (w["gap"] or w["since"]) for w in where.values())
        self.members.gather(ident, busy, replies, min(self.grace_s, max(1.0, 3 * slowest)))
        return point

    def recover(
        self, ident: int, targets: list[Member], why: str | None, notes: list[str], replies: dict[int, ToKernel]
    ) -> dict[int, ToKernel]:
        """Bring the group back after an interrupt, a timeout, a failure or a death; the replies gathered.

        Interrupted or timed out (``why``): busy ranks get SIGINT; those still busy after the grace period, the
        group's connections shut on every rank (and the group re-formed); those still busy after that, SIGKILL.
        A rank failed or died: its peers wait for it (in a collective, or in a DDP backward, which is out of
        sight), so they are freed at once: the group's connections shut, SIGINT to those not in a collective.
        Dead ranks are replaced.
        """
        members = self.members
        replies = dict(replies)
        busy = [m for m in targets if m.rank not in replies and m.alive]
        broken = False
        stuck_in: dict[int, Any] = {}
        if busy and why is None:
            stuck_in = members.collectives_of(busy)
            members.interrupt([m for m in busy if not stuck_in.get(m.rank)])
            members.break_group(ident)
            broken = True
            busy = members.gather(ident, busy, replies, self.grace_s)
        elif busy:
            members.interrupt(busy)
            busy = members.gather(ident, busy, replies, self.grace_s)
        if not broken and (busy or any(not m.alive for m in members)):
            stuck_in = {**members.collectives_of(busy), **{r: c for r, c in stuck_in.items() if c}}
            members.break_group(ident)
            broken = True
            busy = members.gather(ident, busy, replies, self.grace_s)
        if any(isinstance(r, Interrupted) and r.collective for r in replies.values()):
            broken = True  # a rank was interrupted inside a collective: its peers' sequence no longer matches
        for member in busy:
            members.kill(member)
            notes.append(f"rank {member.rank} did not stop{_in(stuck_in.get(member.rank))} and was killed")
        if broken:
            stuck = [f"rank {r}{_in(c)}" for r, c in sorted(stuck_in.items()) if c and members[r].alive]
            if stuck and why is not None:  # after a death or a failure its peers' waiting is no news
                notes.append("stuck in a collective: " + ", ".join(stuck))
            self.reform(notes, stuck_in)
        return replies

    def recover_dead(self) -> list[str]:
        """Ranks that died between cells: replace them now; notes that tell what they lost."""
        self.members.find_dead()
        notes: list[str] = []
        if self.needs_reform or any(not m.alive for m in self.members):
            self.members.break_group(-2)
            self.reform(notes, {})
        return notes

    def reform(self, notes: list[str], stuck_in: dict[int, Any]) -> None:
        """Re-form the process group: the living ranks leave the old one, dead ranks are replaced by fresh
        ones, the group forms on a new rendezvous, the kept state reaches the new ranks, and every
        DistributedDataParallel model is wrapped anew."""
        members = self.members
        self.needs_reform = True  # until it is done: cut short, the next call re-forms
        ident = members.next_ident()
        living = [m for m in members if m.alive]
        for member in living:
            member.send(Leave(ident))
        left: dict[int, ToKernel] = {}
        stuck = members.gather(ident, living, left, max(self.grace_s, LEAVE_WITHIN_S))
        for member in stuck:  # cannot even leave: killed, replaced below
            members.kill(member)
            notes.append(f"rank {member.rank} could not leave the broken group and was killed")
        dead = [m for m in members if not m.alive]
        healthy = [m for m in members if m.alive]
        for member in dead:
            notes.append(f"rank {member.rank} {member.death()}; replaced by a fresh rank")
            members.replace(member)
            self.replaced += 1
        if dead:
            members.await_ready([members[m.rank] for m in dead])
        members.form()
        self.reformed += 1
        if not dead:
            notes.append("the process group was re-formed on a fresh rendezvous; every rank kept its namespace")
        if dead:
            self._restore(dead, healthy, notes)
        held = [
            r.value for r in members.ask(list(members), Wrapped, within=START_TIMEOUT_S).values() if isinstance(r, Done)
        ]
        lists = [set(names) for names in held]
        everywhere = set.intersection(*lists) if len(lists) == len(members) else set()
        names = sorted(everywhere)
        if names:
            members.ask(list(members), Rewrap, within=START_TIMEOUT_S, names=names)
            notes.append(f"re-wrapped {', '.join(names)} in DistributedDataParallel on the new group")
        self.needs_reform = False
        stale = sorted({n for names in held for n in names} - everywhere)
        if stale:
            notes.append(
                f"{', '.join(stale)}: DistributedDataParallel on the ended group, not on every rank; wrap it again "
                "(or register it with gpumagic.keep)"
            )

    def _restore(self, dead: list[Member], healthy: list[Member], notes: list[str]) -> None:
        """Give fresh ranks back what can be had: the notebook's names the dead ranks were sent, their cells'
        imports and definitions (run again), and the kept state of a healthy rank; list what is lost."""
        members = self.members
        fresh = [members[m.rank] for m in dead]
        source = healthy[0] if healthy else None
        state, missing = members.request(source, Export) if source is not None else (None, [])
        ident = members.next_ident()
        sent: dict[int, dict[str, str]] = {}
        with sharing() as shared:  # mapped once the fresh ranks replied
            for member in fresh:
                names, sent[member.rank] = self.shipper.notebook_names(member.sent_before, shared)
                member.send(Restore(ident, names, self.replay.for_rank(member.rank), state))
            try:
                restored = members.wait(ident, fresh, time.monotonic() + START_TIMEOUT_S)
            except RankDied as died:  # the fresh rank died too: the next call replaces it again
                self.needs_reform = True
                raise GroupError(
                    f"rank {died.ranks[0]} died while taking back its state; the next call retries"
                ) from None
        for member in fresh:
            reply = restored[member.rank]
            if not isinstance(reply, Done):
                why = reply.failure().get("message")
                notes.append(f"rank {member.rank} could not take back its state: {why}")
                continue
            got = reply.value
            member.shipped = {n: d for n, d in sent[member.rank].items() if n in got.notebook}
            member.own = set(got.replayed) | set(got.kept) | set(got.modules)
            member.present = member.own | set(got.notebook)
            notes.extend(_restored_notes(member, got, source))
        if source is None and any(m.lost for m in fresh):
            notes.append("every rank was replaced: the kept state is lost with them")
        if missing:
            notes.append(f"kept names no longer defined on rank {source.rank}: {', '.join(missing)}")


def _restored_notes(member: Member, got: Restored, source: Member | None) -> list[str]:
    """What a fresh rank got back (``got``: its reply to ``Restore``), what it lost, what it could not redo."""
    notes = []
    parts = []
    if got.kept:
        parts.append(f"{_names(got.kept)} (gpumagic.keep) from rank {source.rank if source else '?'}")
    if got.replayed:
        parts.append(f"{_names(got.replayed)} (its cells' imports and definitions, run again)")
    if got.notebook:
        parts.append(f"{_names(got.notebook)} (sent from the notebook)")
    if parts:
        notes.append(f"restored on rank {member.rank}: " + "; ".join(parts))
    lost = sorted(member.lost - member.present - {"_"})  # a loop's throwaway is no loss
    if lost:
        notes.append(f"lost on rank {member.rank}: {_names(lost)}")
    unsent = sorted(member.sent_before - member.present)
    if unsent:
        notes.append(
            f"not sent to rank {member.rank} again (gone from the notebook, or no longer picklable): {_names(unsent)}"
        )
    for name, why in sorted(got.failed.items()):
        notes.append(f"rank {member.rank} could not define {name} again: {why}")
    return notes


def _may_stop_together(where: dict[str, Any] | None) -> bool:
    """A rank's answer to ``pause``: it made sync points in this cell and is not waiting in a collective for
    longer than its sync points usually take (a peer it waits for would not come)."""
    if where is None or where["made"] == 0:
        return False
    usual = 3 * where["gap"] if where["gap"] else 1.0
    return where.get("inside", 0.0) <= max(1.0, usual)


def _names(names: Collection[str], shown: int = 12) -> str:
    """Names for a note: the first ``shown``, then how many more."""
    ordered = sorted(names)
    more = len(ordered) - shown
    return ", ".join(ordered[:shown]) + (f" and {more} more" if more > 0 else "")


def _in(collective: tuple[str, float] | None) -> str:
    if not collective:
        return ""
    return f" (stuck in {collective[0]} for {time.time() - collective[1]:.1f}s)"

"""How long other users' tickets have kept this process waiting for GPUs it could take, per user.

Tickets are files anyone can write (``devices.leases``), so the queue cannot trust that a ticket ahead will
take what it is placed on. A ticket that could start is taken up by its runner or waiting kernel within a
look (they look 4 times a second); a forged one is not. So every waiting process counts, per other user, the
time it could have taken GPUs but for that user's tickets (``devices.placement`` decides when that is):

- tickets that could start: past a grace second at the start of each hold-up (a runner that is starting up),
  up to ``START_BUDGET_S`` in all;
- GPUs held for that user's job past the backfill bound: up to the bound itself (10 minutes), so a large job
  keeps its GPUs against others' waiting for the bound, and a forged one holds nobody for ever.

Past either budget, that user's tickets are passed over by this process, whatever they are called, however
often they are made anew and whatever leases that user takes meanwhile. The counts are earned back slowly
(``RECOVERY_PER_S``), so a user whose jobs start normally never gets near them, and a passed-over user counts
again once its count has fallen to half its budget (5 minutes for tickets that could start).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass

START_BUDGET_S = 10.0  # hold-up another user's tickets that could start may cost a waiter before they are passed over
GRACE_S = 1.0  # the first second of each hold-up is not counted: a runner or kernel that is just starting
RECOVERY_PER_S = 1 / 60  # seconds of a count earned back per second
LOOK_CAP_S = 5.0  # one look counts at most this much, whatever the time since the last (a process suspended)


class HoldUp(enum.Enum):
    """How another user's tickets keep a waiter from GPUs it could take."""

    STARTS = "could start and are not taken up"
    HOLDS = "hold GPUs for a job past the backfill bound"


@dataclass
class _UserCount:
    starts: float = 0.0
    holds: float = 0.0
    updated: float = 0.0
    passed_over: bool = False


class HoldUps:
    """Per user id: the hold-up its tickets have cost this process, and whether it is passed over now."""

    def __init__(self, start_budget_s: float = START_BUDGET_S) -> None:
        self.start_budget_s = start_budget_s
        self.hold_budget_s = 600.0  # the backfill bound, as the last look gave it
        self._counts: dict[int, _UserCount] = {}
        self._last_look: dict[str, float] = {}  # waiter (its ticket's file name) -> when it last looked
        self._since: dict[tuple[str, int], float] = {}  # (waiter, user) -> when that user began holding it up
        self._lock = threading.Lock()

    def look(self, waiter: str, holding_up: dict[int, HoldUp], hold_budget_s: float, now: float | None = None) -> None:
        """``waiter`` looked and found the users of ``holding_up`` keeping it from GPUs it could take: count the
        time since its last look against each, past the grace second of each hold-up."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self.hold_budget_s = hold_budget_s
            last = self._last_look.get(waiter)
            self._last_look[waiter] = now
            elapsed = 0.0 if last is None else min(max(now - last, 0.0), LOOK_CAP_S)
            for key in [k for k in self._since if k[0] == waiter and k[1] not in holding_up]:
                del self._since[key]  # that hold-up ended
            for uid, how in holding_up.items():
                began = self._since.setdefault((waiter, uid), now)
                counted = min(elapsed, max(now - began - GRACE_S, 0.0))
                if counted > 0:
                    self._charge(uid, how, counted, now)
            if len(self._last_look) > 256:  # finished waits: keep the newest
                for key in sorted(self._last_look, key=self._last_look.get)[:128]:
                    del self._last_look[key]

    def clear(self) -> None:
        """Forget every count and every look."""
        with self._lock:
            self._counts.clear()
            self._last_look.clear()
            self._since.clear()

    def passed_over(self, uid: int, now: float | None = None) -> bool:
        """True while ``uid``'s tickets are passed over by this process."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return uid in self._counts and self._settled(uid, now).passed_over

    def passed_over_users(self, now: float | None = None) -> list[int]:
        """The users whose tickets this process passes over now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return sorted(uid for uid in self._counts if self._settled(uid, now).passed_over)

    def left(self, uid: int, how: HoldUp, now: float | None = None) -> float:
        """Seconds of hold-up of kind ``how`` that ``uid``'s tickets may still cost before they are passed over
        (0 once they are); the grace second of a hold-up that just began is not in it."""
        now = time.monotonic() if now is None else now
        with self._lock:
            count = self._settled(uid, now) if uid in self._counts else _UserCount()
            if count.passed_over:
                return 0.0
            used = count.starts if how is HoldUp.STARTS else count.holds
            return max(self._budget(how) - used, 0.0)

    def seconds(self, uid: int, how: HoldUp, now: float | None = None) -> float:
        """The hold-up of kind ``how`` counted against ``uid`` now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if uid not in self._counts:
                return 0.0
            count = self._settled(uid, now)
            return count.starts if how is HoldUp.STARTS else count.holds

    def _budget(self, how: HoldUp) -> float:
        return self.start_budget_s if how is HoldUp.STARTS else self.hold_budget_s

    def _charge(self, uid: int, how: HoldUp, seconds: float, now: float) -> None:
        count = self._settled(uid, now)
        if how is HoldUp.STARTS:
            count.starts += seconds
        else:
            count.holds += seconds
        if count.starts >= self.start_budget_s or count.holds >= self.hold_budget_s:
            count.passed_over = True

    def _settled(self, uid: int, now: float) -> _UserCount:
        count = self._counts.setdefault(uid, _UserCount(updated=now))
        earned = max(now - count.updated, 0.0) * RECOVERY_PER_S
        count.starts, count.holds = max(count.starts - earned, 0.0), max(count.holds - earned, 0.0)
        count.updated = max(now, count.updated)
        if count.passed_over and count.starts <= self.start_budget_s / 2 and count.holds <= self.hold_budget_s / 2:
            count.passed_over = False
        return count


_hold_ups = HoldUps()


def hold_ups() -> HoldUps:
    """This process's count."""
    return _hold_ups

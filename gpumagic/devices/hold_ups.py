"""How long other users' tickets have kept this process waiting for GPUs it could take, per user.

Tickets are files anyone can write (``devices.tickets``), so the queue cannot trust that a ticket ahead will
take what it is placed on. A ticket that could start is taken up by its runner or waiting kernel within a
look (they look 4 times a second); a forged one is not. So every waiting process counts, per other user, the
time it could have taken GPUs but for that user's tickets (``devices.placement`` decides when that is), each
look the time since its last one:

- tickets that could start (``HoldUp.STARTS``): past a grace second per user and waiter (a runner that is
  starting up), up to ``START_BUDGET_S``; then all that user's tickets are passed over by this process,
  whatever they are called, however often they are made anew and whatever leases that user takes meanwhile;
- GPUs held for that user's job past the backfill bound (``HoldUp.HOLDS``): up to the bound itself (10
  minutes), so a large job keeps its GPUs against others' waiting for the bound; then this process no longer
  holds GPUs for that user's jobs (their turns stand).

Each count is earned back while that user holds nobody up, over ``RECOVERY_S`` (a full budget in 10 minutes),
so a user whose jobs start normally never gets near it, and a passed-over user counts again once its count has
fallen to half.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass

from gpumagic.devices.shared_files import owner_name

START_BUDGET_S = 10.0  # hold-up another user's tickets that could start may cost a waiter before they are passed over
GRACE_S = 1.0  # per user and waiter, not counted: a runner or kernel that is just starting
RECOVERY_S = 600.0  # a full budget is earned back in this long
LOOK_CAP_S = 2.0  # one look counts at most this much, whatever the time since the last (a process suspended)
_KEPT_WAITERS = 256  # looks remembered; older waits are finished
APART_RESET_S = 60.0  # a user not seen seeming to hold a waiter up this long gets a fresh window next time


class HoldUp(enum.Enum):
    """How another user's tickets keep a waiter from GPUs it could take."""

    STARTS = "could start and are not taken up"
    HOLDS = "hold GPUs for a job past the backfill bound"


@dataclass
class _Apart:
    first: float  # when the waiter first saw the user hold it up only as it seemed
    seen: float  # ... and last
    kept: float = 0.0  # hold-up kept apart since


@dataclass
class _Count:
    seconds: float = 0.0
    updated: float = 0.0
    charged: float = float("-inf")  # when it last held a waiter up
    passed_over: bool = False


class HoldUps:
    """Per user id and kind of hold-up: what its tickets have cost this process, and whether it is passed over."""

    def __init__(self, start_budget_s: float = START_BUDGET_S) -> None:
        self.budgets = {HoldUp.STARTS: start_budget_s, HoldUp.HOLDS: 600.0}  # HOLDS: the backfill bound
        self._counts: dict[tuple[int, HoldUp], _Count] = {}
        self._last_look: dict[str, float] = {}  # waiter -> when it last looked
        self._grace: dict[tuple[str, int], float] = {}  # (waiter, user) -> grace left
        self._apart: dict[tuple[str, int], _Apart] = {}  # (waiter, user that may only seem to hold it up)
        self._lock = threading.Lock()

    def look(
        self,
        waiter: str,
        holding_up: dict[int, HoldUp],
        hold_budget_s: float,
        now: float | None = None,
        steady: bool = True,
        seeming: dict[int, HoldUp] | None = None,
    ) -> None:
        """``waiter`` (a ticket's file name, or this process for a pick without one) looked and found the users
        of ``holding_up`` keeping it from GPUs it could take: count the time since its last look against each,
        once its grace with that user is spent. ``hold_budget_s``: the backfill bound now. A waiter that does
        not look ``steady`` (picks without a ticket, tried now and then) counts only when it looked again within
        ``LOOK_CAP_S``: what happened between two tries minutes apart is not known.

        The users of ``seeming`` may only seem to hold it up: their own waiters may be waiting behind a user this
        process leaves out (``seeming[uid]``: passed over, or no longer held for). For as long as such a waiter
        needs to pass a user over (grace and budget for tickets that could start), from when this waiter first
        saw the user so, their time is kept apart, and counted if they still hold it up then. The first sight
        and what was kept are forgotten once they have not been seen so for ``APART_RESET_S``, so hold-ups
        broken off now and then start nothing again."""
        now = time.monotonic() if now is None else now
        seeming = seeming or {}
        with self._lock:
            self.budgets[HoldUp.HOLDS] = hold_budget_s
            last = self._last_look.get(waiter)
            self._last_look[waiter] = now
            gap = None if last is None else max(now - last, 0.0)
            if gap is None or (not steady and gap > LOOK_CAP_S):
                gap = 0.0
            elapsed = min(gap, LOOK_CAP_S)
            for key in [k for k, apart in self._apart.items() if now - apart.seen > APART_RESET_S]:
                del self._apart[key]
            for uid, how in holding_up.items():
                grace = self._grace.get((waiter, uid), GRACE_S)
                spent = min(grace, elapsed)
                self._grace[waiter, uid] = grace - spent
                counted = elapsed - spent
                apart = self._apart.get((waiter, uid))
                if uid in seeming:
                    apart = self._apart.setdefault((waiter, uid), _Apart(first=now, seen=now))
                    apart.seen = now
                    if now - apart.first <= GRACE_S + self.budgets[HoldUp.STARTS] + LOOK_CAP_S:
                        apart.kept += counted
                        continue
                if apart is not None and apart.kept:  # its waiter has had its time, or it is no longer seeming
                    counted, apart.kept = counted + apart.kept, 0.0
                if counted > 0:
                    self._charge(uid, how, counted, now)
            if len(self._last_look) > _KEPT_WAITERS:
                for key in sorted(self._last_look, key=self._last_look.get)[: _KEPT_WAITERS // 2]:
                    del self._last_look[key]
                self._grace = {k: v for k, v in self._grace.items() if k[0] in self._last_look}

    def clear(self) -> None:
        """Forget every count and every look."""
        with self._lock:
            self._counts.clear()
            self._last_look.clear()
            self._grace.clear()
            self._apart.clear()

    def passed_over(self, uid: int, how: HoldUp = HoldUp.STARTS, now: float | None = None) -> bool:
        """True while this process passes over ``uid``'s tickets (``STARTS``), or holds no GPUs for ``uid``'s
        jobs (``HOLDS``)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return (uid, how) in self._counts and self._settled(uid, how, now).passed_over

    def passed_over_users(self, now: float | None = None) -> list[int]:
        """The users whose tickets this process passes over now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            starts = [uid for uid, how in self._counts if how is HoldUp.STARTS]
            return sorted(uid for uid in starts if self._settled(uid, HoldUp.STARTS, now).passed_over)

    def passed_over_names(self) -> tuple[str, ...]:
        """Whose tickets this process passes over now, by user name."""
        return tuple(owner_name(uid) for uid in self.passed_over_users())

    def left(self, uid: int, how: HoldUp, now: float | None = None) -> float:
        """Seconds of hold-up of kind ``how`` that ``uid``'s tickets may still cost (0 once passed over), the
        grace not in it."""
        now = time.monotonic() if now is None else now
        with self._lock:
            count = self._settled(uid, how, now) if (uid, how) in self._counts else _Count()
            return 0.0 if count.passed_over else max(self.budgets[how] - count.seconds, 0.0)

    def seconds(self, uid: int, how: HoldUp, now: float | None = None) -> float:
        """The hold-up of kind ``how`` counted against ``uid`` now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._settled(uid, how, now).seconds if (uid, how) in self._counts else 0.0

    def _charge(self, uid: int, how: HoldUp, seconds: float, now: float) -> None:
        count = self._settled(uid, how, now)
        count.seconds = min(count.seconds + seconds, self.budgets[how])  # earned back to half in 5 minutes
        count.charged = now
        if count.seconds >= self.budgets[how]:
            count.passed_over = True

    def _settled(self, uid: int, how: HoldUp, now: float) -> _Count:
        """The count earned back up to ``now``: while the user holds nobody up (no count for ``LOOK_CAP_S``),
        at a full budget per ``RECOVERY_S``."""
        count = self._counts.setdefault((uid, how), _Count(updated=now))
        budget = self.budgets[how]
        idle = max(now - max(count.updated, count.charged + LOOK_CAP_S), 0.0)
        count.seconds = max(count.seconds - idle * budget / RECOVERY_S, 0.0)
        count.updated = max(now, count.updated)
        if count.passed_over and count.seconds <= budget / 2:
            count.passed_over = False
        return count


_hold_ups = HoldUps()


def hold_ups() -> HoldUps:
    """This process's count."""
    return _hold_ups

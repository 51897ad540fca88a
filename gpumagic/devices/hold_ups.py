"""How long other users' tickets have kept this process waiting for GPUs it could take, per user.

Tickets are files anyone can write (``devices.leases``), so the queue cannot trust that a ticket ahead will
take what it is placed on. A ticket that could start is taken up by its runner or waiting kernel within a
look (they look 4 times a second); a forged one is not. So every waiting process counts, per other user, the
time it could have taken GPUs but for that user's tickets that could start; once that reaches the budget
(``BUDGET_S``), that user's tickets are passed over by this process, whatever they are called, however often
they are made anew and whatever leases that user takes meanwhile. The count is earned back slowly
(``RECOVERY_PER_S``), so a user whose jobs start normally (a fraction of a second of hold-up each) never gets
near the budget, and a passed-over user counts again once it has fallen to half the budget (5 minutes).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

BUDGET_S = 10.0  # hold-up another user's tickets may cost a waiting process before they are passed over
RECOVERY_PER_S = 1 / 60  # seconds of that count earned back per second
LOOK_CAP_S = 5.0  # one look charges at most this much, whatever the time since the last (a process suspended)


@dataclass
class _Account:
    seconds: float = 0.0
    updated: float = 0.0
    passed_over: bool = False


@dataclass
class HoldUps:
    """Per user id: the hold-up its tickets have cost this process, and whether it is passed over now."""

    budget_s: float = BUDGET_S
    _accounts: dict[int, _Account] = field(default_factory=dict)
    _last_look: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def since_last_look(self, waiter: str, now: float | None = None) -> float:
        """Seconds since ``waiter`` (a ticket's file name) last looked, at most ``LOOK_CAP_S``; 0 the first time."""
        now = time.monotonic() if now is None else now
        with self._lock:
            last = self._last_look.get(waiter)
            self._last_look[waiter] = now
            if len(self._last_look) > 256:  # finished waits' entries: keep the newest
                for key in sorted(self._last_look, key=self._last_look.get)[:128]:
                    del self._last_look[key]
        return 0.0 if last is None else min(max(now - last, 0.0), LOOK_CAP_S)

    def charge(self, uid: int, seconds: float, now: float | None = None) -> None:
        """``uid``'s tickets kept this process from GPUs it could take for ``seconds`` more."""
        now = time.monotonic() if now is None else now
        with self._lock:
            account = self._settled(uid, now)
            account.seconds += seconds
            if account.seconds >= self.budget_s:
                account.passed_over = True

    def passed_over(self, uid: int, now: float | None = None) -> bool:
        """True while ``uid``'s tickets are passed over by this process."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return uid in self._accounts and self._settled(uid, now).passed_over

    def passed_over_users(self, now: float | None = None) -> list[int]:
        """The users whose tickets this process passes over now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return sorted(uid for uid in self._accounts if self._settled(uid, now).passed_over)

    def left(self, uid: int, now: float | None = None) -> float:
        """Seconds of hold-up ``uid``'s tickets may still cost before they are passed over (0 once they are)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            account = self._settled(uid, now) if uid in self._accounts else _Account()
            return 0.0 if account.passed_over else max(self.budget_s - account.seconds, 0.0)

    def _settled(self, uid: int, now: float) -> _Account:
        account = self._accounts.setdefault(uid, _Account(updated=now))
        account.seconds = max(account.seconds - (now - account.updated) * RECOVERY_PER_S, 0.0)
        account.updated = now
        if account.passed_over and account.seconds <= self.budget_s / 2:
            account.passed_over = False
        return account


_hold_ups = HoldUps()


def hold_ups() -> HoldUps:
    """This process's count."""
    return _hold_ups

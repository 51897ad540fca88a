"""The failure model of a launch: what happened to each rank, which failure came first, and the one error
the user sees. Independent of how the processes were started (local forkserver now, elastic agents later)."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from gpumagic.errors import ReportedError


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended.

    ``phase`` is where a failure happened: ``setup`` (loading the shipped code), ``rendezvous`` (joining
    the process group), ``user code``, or ``process`` (the process died without reporting: a signal or
    ``os._exit``). ``stopped_by_launcher`` is True for ranks gpumagic stopped because another failed.
    """

    rank: int
    pid: int | None
    exitcode: int | None
    phase: str | None = None
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    timestamp: float | None = None
    stopped_by_launcher: bool = False

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.exc_type is None

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is not None and self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return f"signal {-self.exitcode}"
        return None

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: finished"
        if self.stopped_by_launcher:
            how = self.signal_name or f"exit code {self.exitcode}"
            return f"rank {self.rank}: stopped by gpumagic after the failure ({how})"
        if self.exc_type == "SystemExit":
            return f"rank {self.rank}: called sys.exit({self.message}) (exit code {self.exitcode})"
        if self.exc_type:
            return f"rank {self.rank}: raised {self.exc_type}: {self.message} (in {self.phase})"
        if self.signal_name:
            return f"rank {self.rank}: killed by {self.signal_name} (pid {self.pid})"
        return f"rank {self.rank}: exited with code {self.exitcode} without an error report (pid {self.pid})"


class LaunchError(ReportedError):
    """A launch failed. ``root_cause`` is the earliest failure; ``outcomes`` has every rank's fate.

    In a notebook it renders as the root-cause rank's own traceback followed by the other ranks' fates.
    """

    def __init__(self, outcomes: list[RankOutcome], root_cause: RankOutcome, note: str = "") -> None:
        self.outcomes = outcomes
        self.root_cause = root_cause
        self.note = note
        super().__init__(self.report())

    def headline(self) -> str:
        return f"rank {self.root_cause.rank} failed: " + self.root_cause.describe().split(": ", 1)[1]

    def report(self) -> str:
        lines = [self.headline()]
        root = self.root_cause
        if root.traceback and root.exc_type is None and root.signal_name:
            stack = root.traceback.rstrip()
            lines += ["", f"Python stack of rank {root.rank} when {root.signal_name} ended it:", stack]
        elif root.traceback:
            lines += ["", f"Traceback from rank {root.rank}:", root.traceback.rstrip()]
        lines += ["", "Ranks:"] + [f"  {self._fate(o)}" for o in sorted(self.outcomes, key=lambda o: o.rank)]
        if self.note:
            lines += ["", self.note]
        return "\n".join(lines)

    def _fate(self, outcome: RankOutcome) -> str:
        """A rank's fate; a failure that followed the root cause (a peer vanished) says so."""
        text = outcome.describe()
        root = self.root_cause
        later = outcome.timestamp is not None and root.timestamp is not None and outcome.timestamp >= root.timestamp
        if outcome is not root and not outcome.ok and not outcome.stopped_by_launcher and later:
            text += f", after rank {root.rank} failed"
        return text

    def shown(self) -> str:
        return self.report()


class LaunchInterrupted(ReportedError):
    """The user interrupted a launch; every rank was stopped."""


def root_cause(outcomes: list[RankOutcome]) -> RankOutcome | None:
    """The earliest failure that was not caused by gpumagic stopping the rank."""
    failed = [o for o in outcomes if not o.ok and not o.stopped_by_launcher]
    if not failed:
        return None
    return min(failed, key=lambda o: (o.timestamp if o.timestamp is not None else float("inf"), o.rank))

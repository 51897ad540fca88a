"""The one error a user sees when a launch fails (``LaunchError``: the root cause's own traceback, then every
rank's fate), or when they interrupt it. Each rank's outcome is run-directory data (``run_dirs.outcomes``)."""

from __future__ import annotations

from gpumagic.errors import ReportedError
from gpumagic.run_dirs.outcomes import RankOutcome


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
        return f"{self.root_cause.who} failed: " + self.root_cause.describe().split(": ", 1)[1]

    def report(self) -> str:
        lines = [self.headline()]
        root = self.root_cause
        if root.traceback and root.exc_type is None and root.signal_name:
            stack = root.traceback.rstrip()
            lines += ["", f"Python stack of rank {root.rank} when {root.signal_name} ended it:", stack]
        elif root.traceback:
            lines += ["", f"Traceback from {root.who}:", root.traceback.rstrip()]
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

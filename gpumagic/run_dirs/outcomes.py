"""How a run's ranks ended, read from its run directory after they wrote it: every rank's outcome (its own
failure report, the Python stack a fatal signal left, how its process ended), the root cause among them, and
the ranks' values. The ranks write these files (``launch.rank_side``); launchers, the Slurm job's rank 0 and
the elastic agents' notebook read them here. Independent of how the processes were started."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle

from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.signing import read_sealed

_log = logging.getLogger(__name__)

FATAL_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}  # faulthandler's
GPUMAGIC_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # gpumagic's frames: machinery


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
    host: str | None = None  # the node it ran on, for a group across an allocation's nodes
    lost: str | None = None  # why gpumagic ended it without word of its end (its node stopped answering)

    @property
    def who(self) -> str:
        """``rank 3``, or ``rank 3 (gpu02)`` where the ranks run on several nodes."""
        return f"rank {self.rank}" + (f" ({self.host})" if self.host else "")

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.exc_type is None

    @property
    def signal_name(self) -> str | None:
        return signal_of(self.exitcode)

    def describe(self) -> str:
        who = self.who
        if self.ok:
            return f"{who}: finished"
        if self.stopped_by_launcher:
            how = self.signal_name or (f"exit code {self.exitcode}" if self.exitcode is not None else None)
            return f"{who}: stopped by gpumagic after the failure" + (f" ({how})" if how else "")
        if self.exc_type == "SystemExit":
            return f"{who}: called sys.exit({self.message}) (exit code {self.exitcode})"
        if self.exc_type:
            return f"{who}: raised {self.exc_type}: {self.message} (in {self.phase})"
        if self.lost:
            return f"{who}: lost: {self.lost} (pid {self.pid})"
        if self.signal_name:
            return f"{who}: killed by {self.signal_name} (pid {self.pid})"
        return f"{who}: exited with code {self.exitcode} without an error report (pid {self.pid})"


def signal_of(exitcode: int | None) -> str | None:
    """The signal a negative exit code names (``SIGSEGV``, or ``signal 70`` for one Python does not know)."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def root_cause(outcomes: list[RankOutcome]) -> RankOutcome | None:
    """The earliest failure that was not caused by gpumagic stopping the rank."""
    failed = [o for o in outcomes if not o.ok and not o.stopped_by_launcher]
    if not failed:
        return None
    return min(failed, key=lambda o: (o.timestamp if o.timestamp is not None else float("inf"), o.rank))


@dataclass(frozen=True)
class ProcessEnd:
    """How a rank's process ended, as its launcher saw it: exit code (negative: the signal) and when."""

    pid: int | None
    exitcode: int | None
    time: float | None
    stopped_by_launcher: bool = False


def read_outcome(files: RunFiles, rank: int, attempt: int = 0, end: ProcessEnd | None = None) -> RankOutcome:
    """How ``rank`` ended in ``attempt``: its own report; else the Python stack a fatal signal left (timed by when
    the signal came, not when a launcher noticed); else how its process ended (``end``); else, with a result,
    finished; else, if its launcher saw it end (``end``) without stopping it, lost (no word, no exit code: a
    failure, lest a launch or a job read as finished), or stopped if it did; else stopped by its launcher (an
    agent or Slurm ended it because another rank failed)."""
    report = read_json(files.rank_error(rank, attempt))
    if report is not None:
        return RankOutcome(
            rank,
            report.get("pid"),
            report.get("exitcode"),
            report.get("phase"),
            report.get("type"),
            report.get("message"),
            report.get("traceback"),
            report.get("timestamp"),
            stopped_by_launcher=bool(report.get("stopped")),  # a Slurm rank that stopped when a peer failed
        )
    fatal = _fatal_stack(files.rank_fatal(rank, attempt))
    if fatal is not None and (end is None or end.exitcode is None or -end.exitcode in FATAL_SIGNALS):
        stack, died = fatal
        exitcode = end.exitcode if end is not None and end.exitcode is not None else None
        return RankOutcome(rank, end.pid if end else None, exitcode, "process", traceback=stack, timestamp=died)
    if end is not None and end.exitcode is not None:
        if end.exitcode == 0:
            return RankOutcome(rank, end.pid, 0, timestamp=end.time)
        return RankOutcome(
            rank,
            end.pid,
            end.exitcode,
            "process",
            timestamp=end.time,
            stopped_by_launcher=end.stopped_by_launcher,
        )
    if files.rank_result(rank).exists():
        return RankOutcome(rank, None, 0)
    if end is not None:  # its exit code could not be read: none is guessed (a job's record would name a signal)
        stopped = end.stopped_by_launcher
        why = None if stopped else "it ended without a result or an error report, and its exit code could not be read"
        return RankOutcome(rank, end.pid, None, "process", timestamp=end.time, stopped_by_launcher=stopped, lost=why)
    return RankOutcome(rank, None, -int(signal.SIGTERM), timestamp=time.time(), stopped_by_launcher=True)


def rank_outcomes(
    files: RunFiles, world_size: int, failures: dict[str, dict[str, Any]] | None = None
) -> list[RankOutcome]:
    """Every rank's outcome in its latest attempt (``failures``: the elastic agents' records, by rank)."""
    outcomes = []
    for rank in range(world_size):
        attempt = int(read_rank_start(files, rank).get("attempt", 0))
        failure = (failures or {}).get(str(rank))
        end = ProcessEnd(failure.get("pid"), failure.get("exitcode"), failure.get("time")) if failure else None
        outcomes.append(read_outcome(files, rank, attempt, end))
    return outcomes


def read_rank_start(files: RunFiles, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s latest start (``ranks/rank-R.json``: attempt, pid, host, time); empty before it started."""
    return read_json(files.rank_start(rank)) or {}


def read_result(files: RunFiles, rank: int) -> Any:
    """Rank ``rank``'s value (``None`` if it wrote none)."""
    path = files.rank_result(rank)
    return cloudpickle.loads(read_sealed(path, f"rank {rank}'s result ({path})")) if path.exists() else None


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file a rank wrote whole (``write_private``), or ``None`` if it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:  # not written (yet): the usual answer
        return None
    except (OSError, ValueError):
        _log.debug("%s is unreadable or not JSON; taken as absent", path, exc_info=True)
        return None


def _fatal_stack(path: Path) -> tuple[str, float] | None:
    """The Python stack ``faulthandler`` wrote when a fatal signal hit, and when (the file's change time)."""
    try:
        status = path.stat()
        if not status.st_size:
            return None
        return _tidy_stack(path.read_text(errors="replace")), status.st_mtime
    except FileNotFoundError:  # not recorded: the usual answer
        return None
    except OSError:
        _log.debug("the fatal-signal stack %s is unreadable; taken as absent", path, exc_info=True)
        return None


def _tidy_stack(dump: str) -> str:
    """``faulthandler``'s dump without gpumagic's own threads and the frames under the user's code."""
    machinery = (GPUMAGIC_ROOT, os.path.dirname(multiprocessing.__file__), threading.__file__)
    machinery += ("<string>", "<frozen ")  # <frozen runpy>: python -m ...rank_side.rank
    blocks = []
    for block in dump.strip().split("\n\n"):
        lines = block.splitlines()
        if lines and lines[0].startswith("Extension modules:"):
            continue
        frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
        users = [i for i in frames if not any(f'"{root}' in lines[i] for root in machinery)]
        if frames and not users:
            continue  # a thread of gpumagic's (the watchdog)
        blocks.append("\n".join(lines[: users[-1] + 1] if users else lines))
    return "\n\n".join(blocks)

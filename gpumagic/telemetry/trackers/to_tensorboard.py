"""A run as TensorBoard sees it: one directory under the tracker's ``logdir`` (the job's name, else the run's id),
one event file written by TensorBoard's own writer, each rank's series of a metric as tag ``loss/rank0``,
``loss/rank1``, and the run's parameters as an HParams summary. Neither TensorFlow nor torch is imported.

TensorBoard keeps scalars as float32: a float64 metric loses its last digits there (never in the run directory).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumagic.telemetry.tracking import Tracker

SUFFIX = ".gpumagic"  # event files this writer made (several attempts of one job: one each, in one directory)
QUEUE = 1 << 14  # events the writer's thread may have to write before add_event waits (a switch per event)


def series_name(metric: str, rank: int) -> str:
    """The name a rank's series of ``metric`` has in every tracker: ``loss/rank0``."""
    return f"{metric}/rank{rank}"


def parameter_value(value: Any) -> str | int | float | bool:
    """A parameter as trackers take one: numbers and booleans as they are, anything else as text."""
    return value if isinstance(value, (str, bool, int, float)) else str(value)


class TensorBoardRun:
    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.writer: Any = None
        self.event: Any = None  # tensorboard's classes, once loaded
        self.summary: Any = None
        self.hparams: Any = None
        self.writer_class: Any = None

    def load(self) -> None:
        # lazy: tensorboard (with protobuf and numpy), only for a run tracked to it
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.hparams import summary_v2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.event, self.summary, self.hparams, self.writer_class = Event, Summary, summary_v2, EventFileWriter

    def open(self, run: Any) -> dict[str, Any]:
        Event = self.event
        earlier = run.earlier.get("tensorboard") or {}
        logdir = Path(str(self.tracker.logdir))
        directory = own_directory(Path(earlier.get("logdir") or _fresh_directory(logdir, run)), logdir)
        # its writer thread takes events through a queue: 10 long by default, a thread switch every 10 events
        self.writer = self.writer_class(str(directory), max_queue_size=QUEUE, flush_secs=5, filename_suffix=SUFFIX)
        if run.params and not earlier:
            values = {str(k): parameter_value(v) for k, v in run.params.items()}
            self.writer.add_event(Event(wall_time=time.time(), summary=self.hparams.hparams_pb(values)))
        self.writer.flush()
        return {"logdir": str(directory)}

    def write(self, points: Sequence[tuple[int, str, float, float, float]]) -> None:
        Event, Summary = self.event, self.summary
        values: list[Any] = []
        added = 0
        for index, (rank, metric, step, value, when) in enumerate(points):
            values.append(Summary.Value(tag=series_name(metric, rank), simple_value=value))
            following = points[index + 1] if index + 1 < len(points) else None
            if following is None or following[4] != when or following[2] != step:  # one event per log() call
                self.writer.add_event(Event(wall_time=when, step=int(step), summary=Summary(value=values)))
                values = []
                added += 1
                if added % (QUEUE // 2) == 0:  # written before the queue fills: add_event would then wait each
                    self.writer.flush()
        self.writer.flush()

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()


def own_directory(directory: Path, logdir: Path) -> Path:
    """Make ``directory`` (below ``logdir``) and check that each of its parts below ``logdir`` is a real directory of
    this user's. A logdir is often shared (a team's ``/shared/tb``): there a link or a directory another user
    planted, or put in place of this run's between two attempts, would take the run's events where he reads them.

    Raises:
        PermissionError: a part is another user's, or not a directory (a link); the exporter names it once.
    """
    logdir.mkdir(parents=True, exist_ok=True)
    part = logdir
    for name in directory.relative_to(logdir).parts:
        part = part / name
        with contextlib.suppress(FileExistsError):
            part.mkdir()
        found = os.lstat(part)
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
            raise PermissionError(f"{part} is not a directory of yours (another user's, or a link); its run is not "
                                  "written there: choose a logdir of your own")  # fmt: skip
    return directory


def _fresh_directory(logdir: Path, run: Any) -> Path:
    """``logdir/<job name>`` (a sweep's jobs under ``logdir/<sweep>/``), or ``logdir/<run id>``; a name taken
    already (a removed job's, another user's, an earlier export's) gets the run id's end, and more if need be."""
    base = logdir / _safe(run.group) if run.group else logdir
    chosen = base / _safe(run.name)
    if run.again or os.path.lexists(chosen):  # exported again: beside the first, never into it
        chosen = base / f"{_safe(run.name)}-{run.run_id[-6:]}"
    while os.path.lexists(chosen):
        chosen = base / f"{_safe(run.name)}-{run.run_id[-6:]}-{secrets.token_hex(2)}"
    return chosen


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.,=+" else "_" for c in name) or "run"

"""``gpumagic.log``: record metrics from launched code or the kernel, cheaply enough to call every step.

A call appends its points to an in-memory array under an uncontended lock; a background thread writes them
to the run's store every 0.1 s (and at exit), so logging never waits for the disk. In a launched rank the
points go to the launch's run (``GPUMAGIC_RUN_DIR``, ``RANK``); anywhere else to a run of this process's own,
created on the first call.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from array import array
from pathlib import Path

from gpumagic.errors import GpumagicError
from gpumagic.run_dirs import private, store
from gpumagic.run_dirs.layout import RunFiles

FLUSH_INTERVAL_S = 0.1
_log = logging.getLogger(__name__)


class Recorder:
    """One process's writer for one rank of one run (``run_dir`` None: a writer that drops every point, for a
    process whose run could not be made).

    It never raises for the disk: a batch that cannot be written whole (a full disk, a quota) is cut off again
    and dropped, with one warning; writing starts again by itself once there is space.
    """

    def __init__(self, run_dir: Path | None, rank: int, problem: str = "") -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.lock = threading.Lock()
        self.points = array("d")
        self.ids: dict[str, int] = {}
        self.calls = 0
        self.total_steps: int | None = None  # the last total_steps given to log
        self.dropped = 0  # points not written
        self._unwritten: list[str] = []  # names given ids, not yet on disk
        self._write_lock = threading.Lock()
        self._problem = ""
        self._bin = self._names = None
        if run_dir is None:
            self._failed(problem)
        else:
            files = RunFiles(run_dir)
            try:
                files.metrics.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._names = private.open_private(files.metric_names(rank))
                self._bin = private.open_private(files.metric_points(rank))
            except OSError as err:
                self._failed(str(private.disk_error(err, files.metrics)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flush_periodically, name="gpumagic-log-flush", daemon=True)
        self._thread.start()

    def name_id(self, name: str) -> int:
        """The id of metric ``name``; a new name is written out before any point that uses it."""
        with self.lock:
            known = self.ids.get(name)
            if known is None:
                known = self.ids[name] = len(self.ids)
                self._unwritten.append(name)
            return known

    def flush(self) -> None:
        """Write the points logged so far as one batch (one ``write``), after the names they use."""
        with self._write_lock:
            with self.lock:
                points, self.points = self.points, array("d")
                names, self._unwritten = self._unwritten, []
            if not points and not names:
                return
            try:
                if self._bin is None or self._bin.closed:
                    raise OSError(self._problem or "closed")
                if names:
                    private.append_whole(self._names.fileno(), "".join(n + "\n" for n in names).encode())
                    names = []
                step = store.MAX_BATCH * store.FIELDS
                while points:
                    private.append_whole(self._bin.fileno(), store.encode_batch(points[:step]))
                    del points[:step]
            except OSError as err:
                self.dropped += len(points) // store.FIELDS
                with self.lock:
                    self._unwritten[:0] = names  # still needed by the points to come
                if self.run_dir is not None:
                    self._failed(str(private.disk_error(err, RunFiles(self.run_dir).metrics)))
                return
            if self._problem:
                _log.warning("gpumagic.log: writing points again; %d were dropped", self.dropped)
                self._problem = ""

    def _failed(self, problem: str) -> None:
        if not self._problem:
            self._problem = problem or "no run to write to"
            _log.warning("gpumagic.log: points are dropped until they can be written: %s", self._problem)

    def close(self) -> None:
        self._stop.set()
        self.flush()
        with self._write_lock:  # the flush thread may be writing: close between its batches, never during one
            for handle in (self._bin, self._names):
                if handle is not None:
                    handle.close()
            self._bin = self._names = None

    def _flush_periodically(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self.flush()


_recorder: Recorder | None = None
_recorder_lock = threading.Lock()


def _current() -> Recorder:
    global _recorder
    with _recorder_lock:
        if _recorder is None:
            run_dir = os.environ.get(store.RUN_DIR_VARIABLE)
            if run_dir:
                _recorder = Recorder(Path(run_dir), int(os.environ.get("RANK", "0")))
            else:
                try:
                    _recorder = Recorder(store.new_run("kernel"), 0)
                    atexit.register(store.finish_run, _recorder.run_dir, "finished")
                except GpumagicError as err:  # a full disk, an unsafe runs directory: say so once, drop the points
                    _recorder = Recorder(None, 0, str(err))
            atexit.register(flush)
        return _recorder


TOTAL_STEPS = "total_steps"  # the metric name of log's total_steps: the dashboards' ETA, not a curve


def log(step: int | None = None, *, total_steps: int | None = None, **metrics: float) -> None:
    """Record ``metrics`` (name=number) at ``step`` (default: a count of this process's ``log`` calls).
    ``total_steps``: the step the run ends at, for the dashboards' ETA (recorded when it changes).

    Takes about a microsecond and never blocks on the disk. Values may be Python numbers or one-element
    tensors (``loss`` or ``loss.item()``). On a full disk the points are dropped, with one warning, until
    there is space again: training goes on.

    Raises:
        TypeError: a metric is not a number.

    Example: ``gpumagic.log(loss=loss.item(), lr=scheduler.get_last_lr()[0])``.
    """
    recorder = _recorder or _current()
    now = time.time()
    if step is None:
        step = recorder.calls
    recorder.calls += 1
    if total_steps is not None and total_steps != recorder.total_steps:
        recorder.total_steps = total_steps
        metrics = {**metrics, TOTAL_STEPS: total_steps}
    ids = recorder.ids
    for name, value in metrics.items():
        name_id = ids.get(name)
        if name_id is None:
            name_id = recorder.name_id(name)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"gpumagic.log({name}=...) needs a number, got {type(value).__name__}") from None
        with recorder.lock:
            recorder.points.extend((now, step, name_id, number))


def flush() -> None:
    """Write what this process logged so far (called at exit, and by ranks before they end)."""
    if _recorder is not None:
        _recorder.flush()


def _forget_after_fork() -> None:
    global _recorder
    _recorder = None  # the flush thread does not survive fork; a child logging again starts its own writer


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)

"""``gpumagic.log``: record metrics from launched code or the kernel, cheaply enough to call every step.

A call appends its points to an in-memory array under an uncontended lock; a background thread writes them
to the run's store every 0.1 s (and at exit), so logging never waits for the disk. In a launched rank the
points go to the launch's run (``GPUMAGIC_RUN_DIR``, ``RANK``); anywhere else to a run of this process's own,
created on the first call.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from array import array
from pathlib import Path

from gpumagic.telemetry import store

FLUSH_INTERVAL_S = 0.1


class Recorder:
    """One process's writer for one rank of one run."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir = run_dir
        self.rank = rank
        directory = run_dir / "metrics"
        directory.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.points = array("d")
        self.ids: dict[str, int] = {}
        self.calls = 0
        self._names = open(directory / f"rank-{rank}.names", "a", encoding="utf-8")
        self._bin = open(directory / f"rank-{rank}.bin", "ab", buffering=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flush_periodically, name="gpumagic-log-flush", daemon=True)
        self._thread.start()

    def name_id(self, name: str) -> int:
        """The id of metric ``name``; a new name is written out before any point that uses it."""
        with self.lock:
            known = self.ids.get(name)
            if known is None:
                known = self.ids[name] = len(self.ids)
                self._names.write(name + "\n")
                self._names.flush()
            return known

    def flush(self) -> None:
        """Write the points logged so far as one batch (one ``write``)."""
        with self.lock:
            points, self.points = self.points, array("d")
        if points:
            self._bin.write(store._HEADER.pack(len(points) // store.FIELDS) + points.tobytes())

    def close(self) -> None:
        self._stop.set()
        self.flush()
        self._bin.close()
        self._names.close()

    def _flush_periodically(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            try:
                self.flush()
            except (OSError, ValueError):
                return


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
                _recorder = Recorder(store.new_run("kernel"), 0)
                atexit.register(store.finish_run, _recorder.run_dir, "finished")
            atexit.register(flush)
        return _recorder


def log(step: int | None = None, **metrics: float) -> None:
    """Record ``metrics`` (name=number) at ``step`` (default: a count of this process's ``log`` calls).

    Takes about a microsecond and never blocks on the disk. Values may be Python numbers or one-element
    tensors (``loss`` or ``loss.item()``).

    Raises:
        TypeError: a metric is not a number.

    Example: ``gpumagic.log(loss=loss.item(), lr=scheduler.get_last_lr()[0])``.
    """
    recorder = _recorder or _current()
    now = time.time()
    if step is None:
        step = recorder.calls
    recorder.calls += 1
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

"""The durable metrics store: one directory per run (a launch, or a kernel's own logging) under the user's
state directory. Writers append batches; readers tail them; a finished run can be reopened later.

Layout of a run directory (``gpumagic.run_dirs.layout.runs_root()/<run id>/``)::

    run.json              id, kind (ddp | kernel), created, ranks, pid, host, status, and once it ended: exit (why),
                          ended (``record_end`` writes them, ``run_end`` reads them)
    metrics/rank-N.names  metric names of rank N, one per line, in id order (written before their points)
    metrics/rank-N.bin    batches of points: uint32 count, then count x (time, step, name id, value) float64

``run_dirs.layout`` names these and every other file of a run directory.

A batch is written with one ``write`` call every 0.1 s and at exit, so a SIGKILL loses at most the last
0.1 s; a reader ignores a batch that is not complete yet. A write that fails part way (a full disk) is cut
off again, and a reader passes over a torn batch a dead writer left, so one bad batch never hides the rest.

Run directories are private to their user (0700, files 0600, whatever the umask); a runs directory other
users can write is used only if it is sticky (``chmod 1777``), since there they cannot replace a run
(``run_dirs.private``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumagic.devices.processes import process_start_time
from gpumagic.errors import DiskFull, InvalidArgument
from gpumagic.run_dirs.launch_files import remove_launch_directories
from gpumagic.run_dirs.layout import RunFiles, runs_root
from gpumagic.run_dirs.private import is_own_run, make_own_directory, private_directory, safe_root, write_private
from gpumagic.run_dirs.run_end import RunEnd, pid_space, run_end

RUN_DIR_VARIABLE = "GPUMAGIC_RUN_DIR"
_HEADER = struct.Struct("<I")
FIELDS = 4  # time, step, name id, value
MAX_BATCH = 1 << 22  # points in one batch; the writer splits larger ones, a reader takes a larger count as torn
_update_lock = threading.Lock()
_log = logging.getLogger(__name__)


def new_run(kind: str, ranks: int = 1, root: Path | None = None, **details: Any) -> Path:
    """Create a run directory (private to this user) and its ``run.json`` under ``root`` (default
    ``runs_root()``); returns its path.

    Raises:
        RunsDirectoryError: another user could write ``root`` (or a directory above it), so they could replace
            the run; or it cannot be written. DiskFull: no space for the run (nothing is left behind).
    """
    root = safe_root(root)
    path = make_own_directory(root, kind)
    files = RunFiles(path)
    try:
        private_directory(files.metrics)
        info = {
            "id": path.name,
            "kind": kind,
            "created": time.time(),
            "ranks": ranks,
            "pid": os.getpid(),
            "pid_start": process_start_time(os.getpid()),
            "pid_space": pid_space(),
            "host": socket.gethostname(),
            "status": "running",
            **details,
        }
        _write_json(files.record, info)
    except BaseException as err:
        shutil.rmtree(path, ignore_errors=True)
        if isinstance(err, DiskFull):
            raise DiskFull(root, err.reason, err.errno) from None  # the run is gone: name where it was to be
        raise
    return path


def encode_batch(points: Any) -> bytes:
    """A batch of ``rank-N.bin``: the count, then the points (an ``array("d")``, 4 values per point)."""
    return _HEADER.pack(len(points) // FIELDS) + points.tobytes()


def record_end(path: Path, status: str, why: str = "", **fields: Any) -> dict[str, Any]:
    """Record how the run ended: ``status`` (``finished``, ``failed``, ``killed`` ...), ``why`` and now, with some
    more ``fields``; ``run_end.run_end`` reads them back. Returns the record.

    Raises:
        DiskFull: no space even to rewrite ``run.json`` in place.
    """
    return update_run(path, status=status, reason="", exit=why, ended=time.time(), **fields)


def finish_run(path: Path, status: str, why: str = "") -> None:
    """Record how the run ended (``finished``, ``failed``, ``interrupted``). On a full disk it says so in the
    log and returns: what the run computed matters more than its record."""
    try:
        record_end(path, status, why)
    except DiskFull as err:
        _log.warning("gpumagic: run %s could not record its end (%s): %s", path.name, status, err)


def update_run(path: Path, **fields: Any) -> dict[str, Any]:
    """Change some fields of a run's ``run.json``, atomically, one thread of this process at a time.

    Raises:
        DiskFull: no space even to rewrite it in place.
    """
    return change_run(path, lambda info: info.update(fields))


def change_run(path: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Read a run's ``run.json``, let ``change`` change it in place and write it, all under the run's lock: a
    change that depends on what is there (one key of a field, say) never loses another writer's. Returns it.

    Raises:
        DiskFull: no space even to rewrite it in place.
    """
    with _update_lock, _record_lock(path):
        record = RunFiles(path).record
        info = json.loads(record.read_text())
        change(info)
        _write_json(record, info)
        return info


@contextlib.contextmanager
def _record_lock(path: Path) -> Iterator[None]:
    """Hold the run directory's lock while its ``run.json`` is read, changed and replaced: a job's runner and the
    kernel that submitted it both change the record, and a change made between the other's read and write was lost
    (a runner's pid lost so, its job read ``lost`` 30 s later and the jobs after it were cancelled). Where the
    directory cannot be locked (a filesystem without ``flock`` on directories) the change goes on unlocked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield  # the read below says what is wrong with the directory
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            _log.debug("run.json of %s changed without its lock: %s", path, err)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write_json(path: Path, data: dict[str, Any]) -> None:
    encoded = json.dumps(data).encode()
    try:
        write_private(path, encoded)
    except DiskFull:
        if not _rewrite_in_place(path, encoded):
            raise


def _rewrite_in_place(path: Path, data: bytes) -> bool:
    """On a full disk: rewrite ``path`` where it is when ``data`` fits in the space it already holds (a reader
    may see it half written for a moment; a record is worth it). Whether it was rewritten."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        _log.debug("%s cannot be opened to rewrite in place", path, exc_info=True)
        return False
    try:
        if len(data) > os.fstat(fd).st_blocks * 512:
            return False
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        return True
    except OSError:
        _log.debug("%s could not be rewritten in place", path, exc_info=True)
        return False
    finally:
        os.close(fd)


@dataclass
class Series:
    """One metric of one rank: parallel lists of steps, values and times (seconds since the epoch)."""

    steps: list[float]
    values: list[float]
    times: list[float]

    def __len__(self) -> int:
        return len(self.values)


class RankReader:
    """Tails one rank's metrics: each ``read()`` returns only the points written since the last one.

    A batch counts once it is whole. A torn batch (its writer died, or the disk filled, in the middle of it) is
    passed over once a whole batch follows it: the reader finds the next offset where a whole batch of points
    starts (times within ``TIME_SPAN`` of the file's first point, name ids of known names, no value below 1e-300
    but 0), and never reads the torn bytes as points.
    """

    TIME_SPAN = 1e8  # seconds (3 years) from the file's first point: a "time" further off is not a point's

    def __init__(self, directory: Path, rank: int) -> None:
        files = RunFiles(directory.parent)  # directory: a run's RunFiles.metrics
        self.bin_path = files.metric_points(rank)
        self.names_path = files.metric_names(rank)
        self.offset = 0
        self.names: list[str] = []
        self.skipped = 0  # bytes passed over: torn batches
        self._epoch: float | None = None

    def read(self) -> dict[str, Series]:
        # lazy: numpy takes a tenth of a second; `import gpumagic` stays free of it
        import numpy

        try:
            with open(self.bin_path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return {}
        chunks, used = self._batches(data)
        self.offset += used
        if not chunks:
            return {}
        points = numpy.concatenate(chunks)
        result: dict[str, Series] = {}
        for name_id in numpy.unique(points[:, 2]).astype(int):
            rows = points[points[:, 2] == name_id]
            name = self.names[name_id] if name_id < len(self.names) else f"metric{name_id}"
            result[name] = Series(rows[:, 1].tolist(), rows[:, 3].tolist(), rows[:, 0].tolist())
        return result

    def _batches(self, data: bytes) -> tuple[list[Any], int]:
        """The whole batches of ``data`` (rows of points) and how many bytes they and the torn ones took."""
        chunks, position = self._chained(data)
        while position + _HEADER.size <= len(data):
            state, rows = self._batch_at(data, position)
            if state == "whole":
                end = position + _HEADER.size + rows.nbytes
                if end + _HEADER.size > len(data) or self._batch_at(data, end)[0] != "torn":
                    chunks.append(rows)
                    position = end
                    continue
                # what follows is no batch: this one may be torn too, its count reaching into the next batch
                following = self._next_whole(data, position + 1)
                if following is None or following >= end:
                    chunks.append(rows)
                    position = end
                    continue
            elif state == "partial":
                break  # being written: read again next time
            else:
                following = self._next_whole(data, position + 1)
                if following is None:
                    break  # torn, and nothing whole after it yet
            self.skipped += following - position
            position = following
        return chunks, position

    def _chained(self, data: bytes) -> tuple[list[Any], int]:
        """The leading batches that follow one another as written, each with a plausible count, checked all at
        once (the common case; ``_batches`` looks at the rest one by one). The last stays for ``_batches``
        unless it ends the data: a torn batch's count can reach into the next one."""
        # lazy: numpy takes a tenth of a second; `import gpumagic` stays free of it
        import numpy

        spans, position = [], 0
        while position + _HEADER.size <= len(data):
            (count,) = _HEADER.unpack_from(data, position)
            end = position + _HEADER.size + count * FIELDS * 8
            if not 1 <= count <= MAX_BATCH or end > len(data):
                break
            spans.append((position, count))
            position = end
        if spans and position != len(data):
            spans.pop()
        if not spans:
            return [], 0
        chunks = [
            numpy.frombuffer(data, "<f8", count=count * FIELDS, offset=at + _HEADER.size).reshape(-1, FIELDS)
            for at, count in spans
        ]
        if self._epoch is None and self.offset == 0 and numpy.isfinite(chunks[0][0, 0]):
            self._epoch = float(chunks[0][0, 0])
        if not self._plausible(numpy.concatenate(chunks)):
            return [], 0  # one by one, then
        last, count = spans[-1]
        return chunks, last + _HEADER.size + count * FIELDS * 8

    def _batch_at(self, data: bytes, position: int) -> tuple[str, Any]:
        """``("whole", rows)``, ``("partial", None)`` (what is there so far looks right) or ``("torn", None)``."""
        # lazy: numpy takes a tenth of a second; `import gpumagic` stays free of it
        import numpy

        (count,) = _HEADER.unpack_from(data, position)
        if not 1 <= count <= MAX_BATCH:
            return "torn", None
        available = min(count, (len(data) - position - _HEADER.size) // (FIELDS * 8))
        if available == 0:
            return "partial", None
        rows = numpy.frombuffer(data, "<f8", count=available * FIELDS, offset=position + _HEADER.size)
        rows = rows.reshape(-1, FIELDS)
        if self._epoch is None and self.offset + position == 0 and numpy.isfinite(rows[0, 0]):
            self._epoch = float(rows[0, 0])
        if not self._plausible(rows):
            return "torn", None
        return ("whole" if available == count else "partial"), rows

    def _plausible(self, rows: Any) -> bool:
        # lazy: numpy takes a tenth of a second; `import gpumagic` stays free of it
        import numpy

        times, ids, values = rows[:, 0], rows[:, 2], numpy.abs(rows[:, 3])
        if not (numpy.isfinite(times).all() and numpy.isfinite(ids).all()):
            return False
        if ((values < 1e-300) & (values > 0)).any():
            return False  # a value whose upper half is the next batch's count: the last point of a torn batch
        if self._epoch is not None and numpy.abs(times - self._epoch).max() > self.TIME_SPAN:
            return False
        if ids.min() < 0 or (ids != numpy.floor(ids)).any():
            return False
        return self._known(int(ids.max()))

    def _known(self, name_id: int) -> bool:
        """Whether ``name_id`` names a metric (names are written before the points that use them)."""
        if name_id < len(self.names):
            return True
        try:
            self.names = self.names_path.read_text().splitlines()
        except (FileNotFoundError, UnicodeDecodeError):
            pass
        return name_id < len(self.names) or (not self.names and name_id < 1 << 16)

    def _next_whole(self, data: bytes, start: int) -> int | None:
        """The first offset from ``start`` at which a whole batch of points starts, or None."""
        # lazy: numpy takes a tenth of a second; `import gpumagic` stays free of it
        import numpy

        candidates: list[int] = []
        for first in range(start, min(start + _HEADER.size, len(data))):
            slots = (len(data) - first) // _HEADER.size
            if slots <= 0:
                continue
            counts = numpy.frombuffer(data, "<u4", count=slots, offset=first).astype(numpy.int64)
            offsets = first + _HEADER.size * numpy.arange(slots)
            ends = offsets + _HEADER.size + counts * FIELDS * 8
            fits = (counts >= 1) & (counts <= MAX_BATCH) & (ends <= len(data))
            candidates.extend(offsets[fits].tolist())
        for candidate in sorted(candidates):
            if self._batch_at(data, candidate)[0] == "whole":
                return candidate
        return None


@dataclass
class Run:
    """A run reopened from its directory. ``metrics()`` reads everything logged so far."""

    path: Path
    info: dict[str, Any]

    @property
    def id(self) -> str:
        return self.info["id"]

    @property
    def end(self) -> RunEnd:
        """How it ended (status, why, when), or that it is still running (``run_end``)."""
        return run_end(self.info)

    @property
    def status(self) -> str:
        """``running``, ``finished``, ``failed``, ``interrupted``, or ``lost``: its kernel died while it ran."""
        return self.end.status

    def settle(self) -> Run:
        """A launch or kernel run still marked ``running`` whose kernel is gone ended with it: record it as
        ``lost`` and remove the code and results its ranks left (the metrics stay)."""
        end = self.end
        if end.status != "lost" or self.info.get("status") == "lost":
            return self
        remove_launch_directories(RunFiles(self.path))
        try:
            self.info = record_end(self.path, end.status, end.why)
        except OSError:
            self.info = {**self.info, "status": end.status}
        return self

    def metrics(self) -> dict[int, dict[str, Series]]:
        """``{rank: {metric name: Series}}`` of every point written so far."""
        files = RunFiles(self.path)
        return {rank: RankReader(files.metrics, rank).read() for rank in files.metric_ranks()}

    def __repr__(self) -> str:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.info.get("created", 0)))
        status = "lost with its kernel" if self.status == "lost" else self.status
        return f"Run({self.id}, {self.info.get('kind')}, {self.info.get('ranks')} rank(s), {status}, {created})"


def load_run(run_id: str) -> Run:
    """Reopen a run by id (or a unique prefix of one, or a path).

    Raises:
        InvalidArgument: no such run, or the prefix matches several.
    """
    candidate = Path(run_id)
    record = RunFiles(candidate).record
    if candidate.is_dir() and record.exists():
        return Run(candidate, json.loads(record.read_text())).settle()
    root = runs_root()
    matches = (
        sorted(p for p in root.glob(f"{run_id}*") if is_own_run(p) and RunFiles(p).record.exists())
        if root.exists() and "/" not in run_id  # an id has none; a path that is no run must not glob elsewhere
        else []
    )
    if not matches:
        raise InvalidArgument(f"no run {run_id!r} in {root}; gpumagic.runs() lists them")
    if len(matches) > 1:
        raise InvalidArgument(f"{run_id!r} matches {len(matches)} runs; give more of the id")
    return Run(matches[0], json.loads(RunFiles(matches[0]).record.read_text())).settle()


def own_run_paths(kind: str = "") -> Iterator[Path]:
    """The run directories of this user in the runs directory (of ``kind``, e.g. ``"job"``, if given), in no order:
    a shared runs directory holds other users' too."""
    root = runs_root()
    if not root.exists():
        return
    for entry in os.scandir(root):
        if (not kind or f"-{kind}-" in entry.name) and is_own_run(entry):
            yield Path(entry.path)


def list_runs() -> list[Run]:
    """Every run of this user, oldest first."""
    runs = []
    for path in own_run_paths():
        try:
            runs.append(Run(path, json.loads(RunFiles(path).record.read_text())).settle())
        except (OSError, ValueError):
            _log.debug("the run %s cannot be read; left out", path, exc_info=True)
            continue
    # by creation time: names sort by the second only, then by their random part
    return sorted(runs, key=lambda run: (float(run.info.get("created") or 0.0), run.path.name))

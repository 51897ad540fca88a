"""The durable metrics store: one directory per run (a launch, or a kernel's own logging) under the user's
state directory. Writers append batches; readers tail them; a finished run can be reopened later.

Layout of a run directory (``gpumagic.telemetry.store.runs_root()/<run id>/``)::

    run.json              id, kind (ddp | kernel), created, ranks, pid, host, status, ended
    metrics/rank-N.names  metric names of rank N, one per line, in id order (written before their points)
    metrics/rank-N.bin    batches of points: uint32 count, then count x (time, step, name id, value) float64

A batch is written with one ``write`` call every 0.1 s and at exit, so a SIGKILL loses at most the last
0.1 s; a reader ignores a batch that is not complete yet.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNS_VARIABLE = "GPUMAGIC_RUNS_DIR"
RUN_DIR_VARIABLE = "GPUMAGIC_RUN_DIR"
_HEADER = struct.Struct("<I")
FIELDS = 4  # time, step, name id, value
_update_lock = threading.Lock()


def runs_root() -> Path:
    """Where runs live: ``GPUMAGIC_RUNS_DIR``, else the user's state directory (platformdirs)."""
    explicit = os.environ.get(RUNS_VARIABLE)
    if explicit:
        return Path(explicit)
    import platformdirs

    return Path(platformdirs.user_state_dir("gpumagic")) / "runs"


def new_run(kind: str, ranks: int = 1, root: Path | None = None, **details: Any) -> Path:
    """Create a run directory (private to this user) and its ``run.json`` under ``root`` (default
    ``runs_root()``); returns its path."""
    root = Path(root) if root is not None else runs_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    run_id = time.strftime("%Y%m%d-%H%M%S") + f"-{kind}-{uuid.uuid4().hex[:6]}"
    path = root / run_id
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)  # metrics and payloads are the user's own, whatever the umask
    (path / "metrics").mkdir(mode=0o700)
    info = {
        "id": run_id,
        "kind": kind,
        "created": time.time(),
        "ranks": ranks,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "status": "running",
        **details,
    }
    _write_json(path / "run.json", info)
    return path


def finish_run(path: Path, status: str, **details: Any) -> None:
    """Record how the run ended (``finished``, ``failed``, ``interrupted``)."""
    update_run(path, status=status, ended=time.time(), **details)


def update_run(path: Path, **fields: Any) -> dict[str, Any]:
    """Change some fields of a run's ``run.json``, atomically, one thread of this process at a time."""
    with _update_lock:
        info = json.loads((path / "run.json").read_text())
        info.update(fields)
        _write_json(path / "run.json", info)
        return info


def _write_json(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # writers never share it
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


@dataclass
class Series:
    """One metric of one rank: parallel lists of steps, values and times (seconds since the epoch)."""

    steps: list[float]
    values: list[float]
    times: list[float]

    def __len__(self) -> int:
        return len(self.values)


class RankReader:
    """Tails one rank's metrics: each ``read()`` returns only the points written since the last one."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.bin_path = directory / f"rank-{rank}.bin"
        self.names_path = directory / f"rank-{rank}.names"
        self.offset = 0
        self.names: list[str] = []

    def read(self) -> dict[str, Series]:
        import numpy

        try:
            with open(self.bin_path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return {}
        chunks, used = [], 0
        while used + _HEADER.size <= len(data):
            (count,) = _HEADER.unpack_from(data, used)
            size = count * FIELDS * 8
            if used + _HEADER.size + size > len(data):
                break  # a batch still being written
            chunks.append(numpy.frombuffer(data, dtype="<f8", count=count * FIELDS, offset=used + _HEADER.size))
            used += _HEADER.size + size
        self.offset += used
        if not chunks:
            return {}
        points = numpy.concatenate(chunks).reshape(-1, FIELDS)
        self._refresh_names(int(points[:, 2].max()))
        result: dict[str, Series] = {}
        for name_id in numpy.unique(points[:, 2]).astype(int):
            rows = points[points[:, 2] == name_id]
            name = self.names[name_id] if name_id < len(self.names) else f"metric{name_id}"
            result[name] = Series(rows[:, 1].tolist(), rows[:, 3].tolist(), rows[:, 0].tolist())
        return result

    def _refresh_names(self, needed: int) -> None:
        if needed < len(self.names):
            return
        try:
            self.names = self.names_path.read_text().splitlines()
        except FileNotFoundError:
            pass


@dataclass
class Run:
    """A run reopened from its directory. ``metrics()`` reads everything logged so far."""

    path: Path
    info: dict[str, Any]

    @property
    def id(self) -> str:
        return self.info["id"]

    @property
    def status(self) -> str:
        return self.info.get("status", "?")

    def metrics(self) -> dict[int, dict[str, Series]]:
        """``{rank: {metric name: Series}}`` of every point written so far."""
        directory = self.path / "metrics"
        ranks = sorted(int(p.stem.split("-")[1]) for p in directory.glob("rank-*.bin"))
        return {rank: RankReader(directory, rank).read() for rank in ranks}

    def __repr__(self) -> str:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.info.get("created", 0)))
        return f"Run({self.id}, {self.info.get('kind')}, {self.info.get('ranks')} rank(s), {self.status}, {created})"


def load_run(run_id: str) -> Run:
    """Reopen a run by id (or a unique prefix of one, or a path).

    Raises:
        InvalidArgument: no such run, or the prefix matches several.
    """
    from gpumagic.errors import InvalidArgument

    candidate = Path(run_id)
    if candidate.is_dir() and (candidate / "run.json").exists():
        return Run(candidate, json.loads((candidate / "run.json").read_text()))
    root = runs_root()
    matches = sorted(p for p in root.glob(f"{run_id}*") if (p / "run.json").exists()) if root.exists() else []
    if not matches:
        raise InvalidArgument(f"no run {run_id!r} in {root}; gpumagic.runs() lists them")
    if len(matches) > 1:
        raise InvalidArgument(f"{run_id!r} matches {len(matches)} runs; give more of the id")
    return Run(matches[0], json.loads((matches[0] / "run.json").read_text()))


def list_runs() -> list[Run]:
    """Every run of this user, oldest first."""
    root = runs_root()
    if not root.exists():
        return []
    runs = []
    for path in root.iterdir():
        try:
            runs.append(Run(path, json.loads((path / "run.json").read_text())))
        except (OSError, ValueError):
            continue
    # by creation time: names sort by the second only, then by their random part
    return sorted(runs, key=lambda run: (float(run.info.get("created") or 0.0), run.path.name))

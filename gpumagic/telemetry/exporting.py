"""Export a run's metrics to the trackers chosen with ``gpumagic.track``, from the run's files.

Each tracker of a run has a thread of its own that tails the ranks' metric files (``RankReader``) once a second
and sends what is new: the ranks never wait for a tracker, and ``gpumagic.log`` costs what it costs untracked.
The kernel follows its launches and ``%ddp`` groups; a background job is followed by a process of its own
(``python -m gpumagic.telemetry.exporting RUN_DIR``), which its runner starts outside the job's process tree, or
rank 0's task on Slurm.

A tracker that fails (unreachable, refusing, slow) stops being sent to for that run: what it failed with is kept
in ``run.json`` (``tracking``) and said once when the run ends, never per point, and the run's end waits for it at
most ``GPUMAGIC_TRACK_TIMEOUT`` seconds (3). The metrics stay in the run directory; ``gpumagic.export`` sends
them again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any, Protocol

from gpumagic.devices.processes import is_same_process, process_start_time
from gpumagic.errors import GpumagicError, InvalidArgument
from gpumagic.run_dirs import store
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.telemetry.log import TOTAL_STEPS
from gpumagic.telemetry.tracking import Tracker, trackers
from gpumagic.units import plain

POLL_S = 1.0  # how often new points are sent: the ranks write theirs every 0.1 s
TIMEOUT_VARIABLE = "GPUMAGIC_TRACK_TIMEOUT"
FINISH_WITHIN_S = 3.0  # the most a run's end waits for its trackers
LOAD_WITHIN_S = 60.0  # ... besides the import of their packages: local work, however busy the machine
ORPHANED_WAIT_S = 60.0  # how long a job's exporter waits for the end once the task that started it is gone
ENDED = ("finished", "failed", "killed", "interrupted", "cancelled", "lost")
Point = tuple[int, str, float, float, float]  # rank, metric, step, value, time (seconds since the epoch)
_log = logging.getLogger(__name__)
# one tracker's package imported at a time: two threads importing numpy's or protobuf's modules at once can meet
# in an import cycle, and Python then hands one of them a half-initialized module (an ImportError)
_IMPORTING = threading.Lock()


@dataclass(frozen=True)
class RunToExport:
    """What a tracker is told of a run: its id, the name to show, its kind (``ddp``, ``ddp-group``, ``job``), its
    parameters (the launch's options, a job's settings, a sweep's values), its sweep, and what earlier attempts of
    it were exported as (``run.json``'s ``tracking``: a resumed job goes on in the same tracker run)."""

    run_id: str
    name: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    group: str | None = None
    earlier: dict[str, Any] = field(default_factory=dict)
    again: bool = False  # ``gpumagic.export``: a new tracker run beside any earlier one (another id, directory)


class Destination(Protocol):
    """One tracker's client for one run (``telemetry.trackers``): ``load`` imports its package (one at a time);
    ``open`` returns what ``run.json`` keeps of it (its run id, path or directory); ``write`` sends points, in time
    order; ``close`` ends the run with the run's status. Each may raise anything: the exporter names it once and
    stops sending to it."""

    def load(self) -> None: ...

    def open(self, run: RunToExport) -> dict[str, Any]: ...

    def write(self, points: Sequence[Point]) -> None: ...

    def close(self, status: str) -> None: ...


def destination_for(tracker: Tracker) -> Destination:
    """The client of ``tracker``'s kind; its package is imported when it opens, in the exporter's thread."""
    # lazy: each tracker's module is read only when a run is tracked to it
    from gpumagic.telemetry.trackers import to_mlflow, to_tensorboard, to_wandb

    kinds = {"tensorboard": to_tensorboard.TensorBoardRun, "mlflow": to_mlflow.MlflowRun, "wandb": to_wandb.WandbRun}
    return kinds[tracker.kind](tracker)


class _Follower:
    """One tracker's thread for one run."""

    def __init__(self, export: Export, tracker: Tracker) -> None:
        self.export = export
        self.tracker = tracker
        self.readers: dict[int, store.RankReader] = {}
        self.problem = ""
        self.sent = 0
        self.loaded = threading.Event()  # its package imported (local work: the run's end waits for it)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._follow, name=f"gpumagic-export-{tracker.kind}", daemon=True)

    def _follow(self) -> None:
        export, client, kind = self.export, None, self.tracker.kind
        try:
            try:
                with _IMPORTING:
                    # lazy: numpy (the metric files' reader) before the trackers, which import it too
                    import numpy  # noqa: F401

                    client = destination_for(self.tracker)
                    client.load()
            except ImportError as err:
                where = f"install it where the run is exported: pip install 'gpumagic[{kind}]'"
                raise ImportError(f"{err}; {where}") from None
            finally:
                self.loaded.set()
            ref = client.open(export.run)
            export.record(kind, ref)
            while not export.stopping.wait(POLL_S):
                self._send(client)
            self._send(client)
            client.close(export.status)
            export.record(kind, {"closed": export.status, "problem": None}, keep=True)  # a late end clears a wait's
        except Exception as err:  # noqa: BLE001 - a tracker's failure never reaches the run: it is named once
            _log.debug("exporting run %s to %s failed", export.run.run_id, self.tracker.where, exc_info=True)
            self.problem = _why(err)
            export.record(kind, {"problem": self.problem}, keep=True)
            if client is not None:
                try:
                    client.close("failed" if export.status == "finished" else export.status)
                except Exception:  # noqa: BLE001 - it failed already: its own close may fail again
                    _log.debug("closing %s after its failure failed too", self.tracker.where, exc_info=True)
        finally:
            self.done.set()

    def _send(self, client: Destination) -> None:
        points = self.new_points()
        if points:
            client.write(points)
            self.sent += len(points)

    def new_points(self) -> list[Point]:
        """Every rank's points written since the last call, in time order (``total_steps`` is the dashboards')."""
        files = self.export.files
        points: list[Point] = []
        for rank in files.metric_ranks():
            reader = self.readers.get(rank)
            if reader is None:
                reader = self.readers[rank] = store.RankReader(files.metrics, rank)
            for name, series in reader.read().items():
                if name != TOTAL_STEPS:
                    points.extend(zip(repeat(rank), repeat(name), series.steps, series.values, series.times))
        points.sort(key=lambda point: point[4])
        return points


def _why(err: BaseException) -> str:
    """A failure in a few words: the error's own message, first line, at most 200 characters."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}"[:200] if text else type(err).__name__


class Export:
    """A run's metrics followed to each of ``chosen``, each in its own thread, until ``finish``."""

    def __init__(self, run_dir: Path, chosen: Sequence[Tracker], run: RunToExport) -> None:
        self.run_dir = Path(run_dir)
        self.files = RunFiles(self.run_dir)
        self.run = run
        self.status = "finished"
        self.stopping = threading.Event()
        self.followers = [_Follower(self, tracker) for tracker in chosen]

    def start(self) -> Export:
        for follower in self.followers:
            follower.thread.start()
        return self

    def record(self, kind: str, entry: dict[str, Any], keep: bool = False, unless_closed: bool = False) -> None:
        """Keep what the run was exported to ``kind`` as in ``run.json`` (``keep``: add to what is there;
        ``unless_closed``: not if its tracker run ended meanwhile), under the run's lock."""

        def change(info: dict[str, Any]) -> None:
            tracking = info.get("tracking") if isinstance(info.get("tracking"), dict) else {}
            earlier = tracking.get(kind) or {}
            if not (unless_closed and "closed" in earlier):
                info["tracking"] = {**tracking, kind: {**earlier, **entry} if keep else entry}

        try:
            store.change_run(self.run_dir, change)
        except (OSError, ValueError, GpumagicError):  # a full disk, or the run removed meanwhile
            _log.debug("run %s: what it was exported as is not recorded", self.run.run_id, exc_info=True)

    def finish(self, status: str, within: float | None = None) -> list[str]:
        """Send the last points, end each tracker's run with ``status`` and wait for them at most ``within``
        seconds (``GPUMAGIC_TRACK_TIMEOUT``, 3 s) in all, after each tracker's package is imported (local work,
        a second or two the first time in a process). Returns one line per tracker that failed or did not answer
        in time, to say once (``run.json`` keeps it too); those still sending go on in the background until the
        process ends."""
        self.status = status
        self.stopping.set()
        for follower in self.followers:
            follower.loaded.wait(LOAD_WITHIN_S)
        waited = finish_within() if within is None else within
        deadline = time.monotonic() + waited
        for follower in self.followers:
            follower.done.wait(max(0.0, deadline - time.monotonic()))
        lines = []
        for follower in self.followers:
            where, run, kind = follower.tracker.where, self.run.run_id, follower.tracker.kind
            if follower.problem:
                lines.append(f"gpumagic: {where}: {follower.problem}; run {run} was not exported there ({_again(run)})")
            elif not follower.done.is_set():
                late = {"problem": f"did not answer within {waited:g} s; may be incomplete"}
                self.record(kind, late, keep=True, unless_closed=True)  # the tracker may end it the moment after
                lines.append(f"gpumagic: {where} did not answer within {waited:g} s; run {run} may not be fully "
                             f"exported there ({_again(run)})")  # fmt: skip
        return lines


def _again(run_id: str) -> str:
    return f"its metrics stay in the run directory: gpumagic.export({run_id!r}) sends them again"


def finish_within() -> float:
    """``GPUMAGIC_TRACK_TIMEOUT`` (seconds; 3 when unset or not a number)."""
    try:
        return max(0.0, float(os.environ.get(TIMEOUT_VARIABLE) or FINISH_WITHIN_S))
    except ValueError:
        return FINISH_WITHIN_S


def start_export(
    run_dir: Path,
    kind: str,
    params: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    chosen: Sequence[Tracker] | None = None,
) -> Export | None:
    """Follow the run at ``run_dir`` to ``chosen`` (default: this process's ``trackers()``); None when there are
    none, and then nothing is read or imported. ``params``: the run's options, besides ``run.json``'s ``params``
    (a sweep's values), which are added."""
    chosen = trackers() if chosen is None else tuple(chosen)
    if not chosen:
        return None
    try:
        info = json.loads(RunFiles(run_dir).record.read_text())
    except (OSError, ValueError):
        _log.debug("run %s cannot be read; it is not exported", run_dir, exc_info=True)
        return None
    return Export(Path(run_dir), chosen, _described(Path(run_dir), info, kind, params, name)).start()


def _described(
    run_dir: Path, info: Mapping[str, Any], kind: str, params: Mapping[str, Any] | None, name: str | None
) -> RunToExport:
    return RunToExport(
        run_id=run_dir.name,
        name=name or info.get("name") or run_dir.name,
        kind=kind,
        params={**(params or {}), **{key: plain(value) for key, value in (info.get("params") or {}).items()}},
        group=info.get("sweep"),
        earlier=dict(info.get("tracking") or {}),
    )


def export(run: Any, /, *, within: float = 120.0) -> list[str]:
    """Send an ended run's or job's metrics (``run``: a job's name, a run id, a ``Job`` or a ``Run``) to the
    trackers chosen with ``gpumagic.track``, all of them, as a new run there: for a run a tracker missed (it was
    unreachable) or that ended before tracking was chosen. Waits for them at most ``within`` seconds; returns a
    line for each tracker that failed again (empty: all sent).

    Raises:
        InvalidArgument: no tracker chosen, no such run, or a run that has not ended (it is exported as it runs).
    """
    # lazy: a job's name is looked up only here
    from gpumagic.run_dirs import records

    chosen = trackers()
    if not chosen:
        raise InvalidArgument("no tracker chosen: gpumagic.track('tensorboard' | 'mlflow' | 'wandb', ...) first")
    if hasattr(run, "path"):  # a Job or a Run
        path = Path(run.path)
    elif isinstance(run, (str, os.PathLike)) and records.exists(str(run)):
        path = records.find(str(run))
    elif isinstance(run, (str, os.PathLike)):
        path = store.load_run(str(run)).path
    else:
        raise InvalidArgument(f"export takes a job's name, a run id, a Job or a Run, got {type(run).__name__}")
    loaded = store.load_run(str(path))  # settled: a run whose process died reads lost
    if loaded.status not in ENDED:
        raise InvalidArgument(f"{loaded.id} is {loaded.status}: it is exported as it runs; export it once it ended")
    described = _described(loaded.path, loaded.info, str(loaded.info.get("kind", "run")), {}, None)
    fresh = RunToExport(described.run_id, described.name, described.kind, described.params, described.group, again=True)
    return Export(loaded.path, chosen, fresh).start().finish(loaded.status, within)  # a new tracker run


def command(run_dir: Path, detach: bool = False) -> list[str]:
    """How to start the process that follows the job at ``run_dir`` (``main``; ``detach``: out of the starter's
    process tree)."""
    return [
        sys.executable,
        "-m",
        __spec__.name if __spec__ else __name__,
        *(["--detach"] if detach else []),
        str(run_dir),
    ]


def main(argv: list[str]) -> int:
    """``python -m gpumagic.telemetry.exporting [--detach] RUN_DIR``: follow a background job to the trackers
    sealed in its description until its end is recorded. A local job's runner starts it ``--detach``ed, out of the
    job's process tree: ``%jobs kill`` signals that tree, and the tracker runs (W&B's service with them) must
    outlive it to send the last points and end. A Slurm job's rank 0 task starts it in the job's step."""
    # lazy: only this process reads a job's sealed description
    from gpumagic.run_dirs import records

    detach = argv[:1] == ["--detach"]
    if len(argv) != 1 + detach:
        sys.stderr.write("usage: python -m gpumagic.telemetry.exporting [--detach] RUN_DIR\n")
        return 2
    run_dir, watched = Path(argv[-1]), os.getppid()  # the runner, or the rank's task, that started it
    born = process_start_time(watched)
    if detach and os.fork():
        os._exit(0)
    if detach:
        os.setsid()
    info = records.read(run_dir)
    if info.get("slurm_restarts"):  # a requeue: each rank moves the earlier attempt's metrics aside as it starts
        _wait_for_ranks(RunFiles(run_dir), int(info.get("ranks") or 1))
    chosen = tuple(Tracker.from_json(t) for t in records.read_spec(run_dir).track or ())
    exporting = start_export(run_dir, "job", job_parameters(info), chosen=chosen)
    if exporting is None:
        return 0
    # Slurm's SIGTERM (a requeue, a preemption, scancel) reaches the whole step: what the ranks wrote is sent and
    # the tracker runs end as killed (a requeued job's next attempt goes on in them); SIGKILL follows KillWait
    # (30 s on most clusters) later
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    gone = 0.0
    while True:
        status = records.read(run_dir).get("status", "")
        if status in ENDED:
            break
        if stopped.is_set():
            status = "killed"
            break
        if not is_same_process(watched, born):  # the end is recorded by another
            gone = gone or time.monotonic()  # process (the job's last rank), or by nobody: a lost job
            if time.monotonic() - gone > ORPHANED_WAIT_S:
                status = "lost"
                break
        stopped.wait(POLL_S)
    for line in exporting.finish(status):
        sys.stderr.write(line + "\n")
    return 0


def _wait_for_ranks(files: RunFiles, world_size: int) -> None:
    """Until every rank of this attempt started (its start file, written after it moved its earlier files)."""
    deadline = time.monotonic() + ORPHANED_WAIT_S
    while time.monotonic() < deadline and not all(files.rank_start(r).exists() for r in range(world_size)):
        time.sleep(POLL_S / 4)


JOB_PARAMETERS = ("ranks", "backend", "timeout_s", "hang_after_s", "gpus", "min_free", "executor", "description")


def job_parameters(info: Mapping[str, Any]) -> dict[str, Any]:
    """A background job's settings a tracker shows as its parameters (a sweep's values are added apart)."""
    chosen = {name: info.get(name) for name in JOB_PARAMETERS if info.get(name) not in (None, "", [], {})}
    if isinstance(info.get("slurm"), Mapping):
        chosen.update({f"slurm.{key}": value for key, value in info["slurm"].items() if value is not None})
    return chosen


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

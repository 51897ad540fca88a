"""Notifications of background jobs (``--notify TARGET``, ``GPUMAGIC_NOTIFY``): the job's end, a requeue, a long
wait for GPUs, told to whoever the user named, once per event, without delaying the job.

A target is an ``http(s)://`` URL, which receives a POST of the event as JSON, or ``cmd:COMMAND``, a shell command
that reads the same JSON on its standard input (``cmd:mail -s job me@lab.org``, a chat webhook through curl). The
JSON names the job, the event and its status, how long it ran, the best and last values of each metric of rank 0,
and for a failure the last lines of the failing rank's traceback.

Who sends: the job's runner after it recorded the end and gave back its GPUs (this machine), the rank that records a
Slurm job's end, rank 0 of a requeued Slurm attempt, the runner of a job that has waited past ``--notify-wait``.
Each event is claimed first (a file made exclusively in the job's directory), so it is sent once whoever sees it. A
sweep's jobs send nothing each: whichever ends last (after recording its own end) sends one summary, best run first.
A target that is slow or down costs at most ``TRIES`` tries of ``TIMEOUT_S`` (a command: ``COMMAND_TIMEOUT_S``)
each, after the job's end is recorded; what could not be sent is recorded once (``notify_problem``: ``%jobs`` shows
it), never raised.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpumagic.jobs.executors import executor_of
from gpumagic.launch.option_table import check_notify
from gpumagic.run_dirs import records
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.run_end import recorded_end
from gpumagic.run_dirs.store import Run
from gpumagic.telemetry.metric_kinds import higher_is_better, lower_is_better

_log = logging.getLogger(__name__)

VARIABLE = "GPUMAGIC_NOTIFY"  # every job's target when it names none (several: separated by spaces)
TRIES = 3
TIMEOUT_S = 5.0  # of an HTTP target's answer
COMMAND_TIMEOUT_S = 10.0  # of a command's
BACKOFF_S = (0.5, 1.0)  # between tries
ERROR_LINES = 15  # of the failing rank's traceback


def targets_of(notify: str | Sequence[str] | None) -> list[str]:
    """The checked targets a submission names (``None``: ``GPUMAGIC_NOTIFY``'s, if set; several are separated by
    spaces there).

    Raises:
        InvalidArgument: a target that is neither an http(s) URL nor ``cmd:COMMAND``, named.
    """
    if notify is None:
        notify = os.environ.get(VARIABLE, "").split() or None
        if notify is None:
            return []
    check_notify(notify)
    given = [notify] if isinstance(notify, str) else list(notify)
    return [str(t).strip() for t in given]


def notify(path: Path, event: str, **more: Any) -> bool:
    """Tell the job at ``path``'s targets about ``event`` (``finished``, ``failed``, ``killed``, ``requeued``,
    ``waiting`` ...), once: False if it was told already, or names no target. A sweep's job leaves its end to the
    sweep's summary. Never raises for a target: what failed is recorded in the job's ``notify_problem``."""
    try:
        info = records.read(path)
        targets = list(records.read_spec(path).notify or ())  # a command runs: from the sealed spec alone
        if not targets:
            return False
        if event in records.ENDED and info.get("sweep"):
            return _sweep_summary(info, targets)
        if not _claim(path, f"{event}.{records.attempt_of(info)}"):
            return False
        _deliver(path, targets, job_message(path, info, event, **more))
        return True
    except Exception:  # noqa: BLE001 - whatever it is, the job it tells of is not held, and it is said
        _log.warning("gpumagic: nobody could be told of job %s's %s", path.name, event)
        _log.debug("telling the targets of %s failed", path, exc_info=True)
        return False


def tell_silent_end(path: Path, info: Mapping[str, Any], status: str) -> None:
    """Whoever reads a job's state (``%jobs``, ``Job.status``) tells its targets, on a thread, of an end nobody
    recorded: a job whose runner vanished (lost), a Slurm job its time limit or a node's failure ended. The claim
    keeps it once; a job that names no target costs nothing."""
    if status not in records.ENDED or not info.get("notify") or not recorded_end(info).active:
        return
    if (RunFiles(path).notified / f"{status}.{records.attempt_of(info)}").exists():
        return
    threading.Thread(target=notify, args=(path, status), name="gpumagic-notify", daemon=True).start()


def job_message(path: Path, info: Mapping[str, Any], event: str, **more: Any) -> dict[str, Any]:
    """The JSON a target receives about one job."""
    ended = executor_of(info).end(info)  # as %jobs tells it: a job whose runner vanished is lost
    start = info.get("started") or info.get("submitted") or time.time()
    message = {
        "job": info.get("name"),
        "event": event,
        "status": ended.status,
        "why": ended.why,
        "duration_s": round(max(0.0, (info.get("ended") or time.time()) - start), 3),
        "attempt": records.attempt_of(info),
        "host": socket.gethostname(),
        "directory": str(path),
        "params": info.get("params") or {},
        "metrics": _metrics(path, info),
        **more,
    }
    if ended.status == "failed":
        message["error"] = _error_tail(path)
    return message


def _claim(path: Path, name: str) -> bool:
    """Made once: whoever makes the claim file first tells the targets."""
    claims = RunFiles(path).notified
    with contextlib.suppress(FileExistsError):
        claims.mkdir(mode=0o700)
    try:
        os.close(os.open(claims / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        return True
    except FileExistsError:
        return False


def _metrics(path: Path, info: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Rank 0's metrics: each one's last and best ``[step, value]`` (best: lowest for a loss, highest for an
    accuracy; none for a metric whose name says neither)."""
    try:
        series = Run(path, dict(info)).metrics().get(0, {})
    except (OSError, ValueError):
        _log.debug("the metrics of %s cannot be read; the message has none", path, exc_info=True)
        return {}
    found: dict[str, dict[str, Any]] = {}
    for name, points in series.items():
        values = [(s, v) for s, v in zip(points.steps, points.values, strict=True) if not math.isnan(v)]
        if not values:
            continue
        entry: dict[str, Any] = {"last": list(values[-1])}
        best = _best(name, values)
        if best is not None:
            entry["best"] = list(best)
        found[name] = entry
    return found


def _best(name: str, values: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    if lower_is_better(name):
        return min(values, key=lambda p: p[1])
    if higher_is_better(name):
        return max(values, key=lambda p: p[1])
    return None


def _error_tail(path: Path) -> str:
    try:
        lines = RunFiles(path).error.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        _log.debug("the job's error.txt cannot be read; the message has no traceback", exc_info=True)
        return ""
    return "\n".join(lines[-ERROR_LINES:])


def _sweep_summary(info: Mapping[str, Any], targets: Sequence[str]) -> bool:
    """Once every job of the sweep ``info``'s job belongs to has recorded its end: one message, best run first."""
    sweep = str(info["sweep"])
    infos = {p: i for p in records.all_jobs() if (i := _read(p)).get("sweep") == sweep}
    ends = {p: executor_of(i).end(i) for p, i in infos.items()}  # a member whose runner vanished reads lost
    if len(infos) < int(info.get("sweep_size") or 0) or any(e.active for e in ends.values()):
        return False
    home = min(infos, key=lambda p: (float(infos[p].get("submitted") or 0), p.name))
    attempts = sum(records.attempt_of(i) for i in infos.values())  # a resumed member's end is told again
    if not _claim(home, f"sweep-{sweep}.{attempts}"):
        return False
    jobs = [job_message(p, i, ends[p].status) for p, i in infos.items()]
    metric = _ranking_metric(jobs)
    jobs.sort(key=lambda j: _rank_key(j, metric))
    message = {
        "sweep": sweep,
        "event": "sweep ended",
        "jobs_total": len(jobs),
        "by_status": dict(Counter(j["status"] for j in jobs)),
        "ranked_by": metric,
        "jobs": jobs,
    }
    _deliver(home, targets, message)
    return True


def _read(path: Path) -> dict[str, Any]:
    try:
        return records.read(path)
    except (OSError, ValueError):
        _log.debug("the job at %s cannot be read; it is left out of its sweep's summary", path, exc_info=True)
        return {}


def _ranking_metric(jobs: Sequence[Mapping[str, Any]]) -> str | None:
    """The metric the sweep's runs are ranked by: the first with a best value (a loss before any other)."""
    names = [n for j in jobs for n, m in j["metrics"].items() if "best" in m]
    losses = [n for n in names if lower_is_better(n)]
    return (losses or names or [None])[0]


def _rank_key(job: Mapping[str, Any], metric: str | None) -> tuple[int, float]:
    best = (job["metrics"].get(metric) or {}).get("best") if metric else None
    if job["status"] != "finished" or best is None:
        return (1, 0.0)
    return (0, best[1] if not higher_is_better(metric or "") else -best[1])


def _deliver(path: Path, targets: Sequence[str], message: Mapping[str, Any]) -> None:
    """Send ``message`` to each target, each with ``TRIES`` tries; record the first that failed, once."""
    body = json.dumps(message, default=str).encode()
    failed = []
    for target in targets:
        why = _send(target, body)
        if why:
            failed.append(f"{target}: {why}")
            _log.warning("gpumagic: the job's notification to %s was not sent: %s", target, why)
    if failed and not records.read(path).get("notify_problem"):
        with contextlib.suppress(OSError):
            records.update(
                path, notify_problem=f"notify {failed[0]}" + (f" (+{len(failed) - 1})" if failed[1:] else "")
            )


def _send(target: str, body: bytes) -> str:
    """Empty when ``target`` took ``body``; else why not, after ``TRIES`` tries."""
    why = ""
    for attempt in range(TRIES):
        if attempt:
            time.sleep(BACKOFF_S[min(attempt - 1, len(BACKOFF_S) - 1)])
        why = _run_command(target[4:], body) if target.startswith("cmd:") else _post(target, body)
        if not why:
            return ""
    return f"{why} ({TRIES} tries)"


def _post(url: str, body: bytes) -> str:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json", "User-Agent": "gpumagic"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            response.read(1024)
        return ""
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code} {err.reason}"
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return f"unreachable ({reason})"


def _run_command(command: str, body: bytes) -> str:
    try:
        done = subprocess.run(
            command, shell=True, input=body, capture_output=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return f"the command ran past {COMMAND_TIMEOUT_S:g}s"
    except OSError as err:
        _log.debug("the notification command could not start", exc_info=True)
        return f"the command could not start ({err})"
    if done.returncode:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        return f"the command exited {done.returncode}" + (f": {said[-1][:200]}" if said else "")
    return ""

"""What Slurm says of a job, on any Slurm: the controller (``scontrol show job``) while it knows the job, then the
accounting (``sacct``) where there is one, then the job's own Slurm output (``slurmstepd``'s last words, submitit's
result files) once the controller forgot it (``MinJobAge``, 300 s by default) and nothing else remembers.

Small clusters often run without an accounting daemon: there ``sacct`` says "Slurm accounting storage is
disabled" and submitit's state, which asks only ``sacct``, says nothing useful. Every command here is Slurm's own,
asked with a timeout; none of their output reaches the cell.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpumagic.launch.allocation import parse_fields

_log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 15.0
# slurmstepd's line in a job's output when Slurm ends it: "*** JOB 12 ON n1 CANCELLED AT ... DUE TO TIME LIMIT ***"
ENDED_BY_SLURM = re.compile(r"\*\*\* (?:JOB|STEP) [\d.]+ ON \S+ CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))?(?: \*\*\*|$)")
DUE_TO = {"TIME LIMIT": "TIMEOUT", "NODE FAILURE": "NODE_FAIL", "PREEMPTION": "PREEMPTED", "JOB REQUEUE": "REQUEUED"}


@dataclass(frozen=True)
class SlurmState:
    """A job's state as Slurm tells it.

    ``state``: Slurm's word (``PENDING``, ``RUNNING``, ``COMPLETED``, ``CANCELLED``, ``TIMEOUT`` ...; ``ENDED``:
    it ended, Slurm no longer says how; ``UNKNOWN``: nobody can tell now, ``source`` says why). ``source``: who
    said it (``controller``, ``accounting``, ``its Slurm output``). ``restarts``: how often Slurm requeued it.
    """

    state: str
    source: str
    nodes: str = ""
    restarts: int = 0
    reason: str = ""


def ask(job_id: str, folder: Path | str | None) -> SlurmState:
    """The state of Slurm job ``job_id``, whose submitit files are in ``folder``."""
    known = _controller(job_id)
    if known is not None and known.state != "UNKNOWN":
        return known
    accounted = _accounting(job_id)
    if accounted is not None:
        return accounted
    return known or from_output(job_id, Path(folder) if folder else None)


def _run(*command: str) -> subprocess.CompletedProcess | None:
    if shutil.which(command[0]) is None:
        return None
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        _log.debug("%s failed to run; Slurm's answer is taken as unknown", command[0], exc_info=True)
        return None


def _controller(job_id: str) -> SlurmState | None:
    """The controller's view (``scontrol show job``); None once it forgot the job (or without scontrol here),
    ``UNKNOWN`` when it does not answer."""
    done = _run("scontrol", "show", "job", "--oneliner", job_id)
    if done is None:
        return None
    if done.returncode != 0:
        said = " ".join(done.stderr.split())
        if "Invalid job id" in said:
            return None
        return SlurmState("UNKNOWN", f"the controller does not answer ({said[:120] or done.returncode})")
    fields = parse_fields(done.stdout)
    state = fields.get("JobState", "UNKNOWN").split()[0].upper()
    reason = fields.get("Reason", "None")
    restarts = fields.get("Restarts", "0")
    return SlurmState(
        state,
        "controller",
        nodes="" if fields.get("NodeList") in (None, "(null)") else fields["NodeList"],
        restarts=int(restarts) if restarts.isdigit() else 0,
        reason="" if reason == "None" else reason,
    )


def _accounting(job_id: str) -> SlurmState | None:
    """The accounting's view (``sacct``); None where there is no accounting or it does not know the job."""
    done = _run("sacct", "--noheader", "--allocations", "--parsable2", "--jobs", job_id, "--format", "State,NodeList")
    if done is None or done.returncode != 0:
        return None
    for line in done.stdout.splitlines():
        state, _, nodes = line.partition("|")
        if state.strip():
            return SlurmState(state.split()[0].upper(), "accounting", nodes=nodes.strip())
    return None


def from_output(job_id: str, folder: Path | None) -> SlurmState:
    """How a job the controller forgot ended, from its files in ``folder``: slurmstepd's line when Slurm ended it
    (cancelled, time limit, node failure, preemption), else submitit's result of task 0 (completed or failed)."""
    if folder is None or not folder.is_dir():
        return SlurmState("ENDED", "neither the controller nor an accounting knows it, and its Slurm folder is gone")
    for log in sorted(folder.glob(f"{job_id}_*_log.*")):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            _log.debug("the Slurm log %s is unreadable; skipped", log, exc_info=True)
            continue
        found = ENDED_BY_SLURM.findall(text)
        if found:
            due = found[-1].strip()
            return SlurmState(DUE_TO.get(due, due.replace(" ", "_") or "CANCELLED"), "its Slurm output")
    result = folder / f"{job_id}_0_result.pkl"
    if result.exists():
        try:
            head = result.read_bytes()[:64]
        except OSError:
            head = b""
        return SlurmState("COMPLETED" if b"success" in head else "FAILED", "its Slurm output")
    return SlurmState("ENDED", "its Slurm output says nothing of its end")

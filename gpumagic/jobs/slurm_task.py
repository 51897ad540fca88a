"""What submitit runs in every Slurm task of a job (``jobs.slurm``): one rank of the job in its directory.

- The rank has torchrun's variables. Its group's store is served by rank 0 on a port of rank 0's own choosing
  and published in the job's directory under the attempt's token (``launch.rank_side.process_group``): never
  on a port derived from the job id, which every user can read in ``squeue`` and take first (issue #37).
- A requeued attempt first moves the earlier attempt's files aside (``keep_earlier_attempt``).
- The first rank that fails writes the attempt's stop file; every other rank stops when it sees it and says
  so (Slurm would let it wait for its peers until the group's timeout).
- The last rank to end records the job's end, whichever rank that is: a rank that ends after the others
  waited is never taken for lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import cloudpickle

from gpumagic.jobs import notify
from gpumagic.launch.failures import LaunchError
from gpumagic.launch.plan import torchrun_variables
from gpumagic.launch.rank_side.checkpoints import ATTEMPT_VARIABLE, REQUEUE_VARIABLE, time_limit_near
from gpumagic.launch.rank_side.output_routing import flush
from gpumagic.launch.rank_side.process_group import TOKEN_VARIABLE
from gpumagic.launch.rank_side.rank import run_rank
from gpumagic.launch.rank_side.runtime import exit_rank
from gpumagic.run_dirs import records
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.outcomes import rank_outcomes, read_json, root_cause
from gpumagic.run_dirs.private import write_private
from gpumagic.run_dirs.signing import PayloadRejected, read_sealed, write_sealed
from gpumagic.run_dirs.store import record_end
from gpumagic.telemetry import exporting

_log = logging.getLogger(__name__)

STOP_LOOK_S = 0.25  # how often a rank looks for its attempt's stop file
NOTIFY_WAIT_S = 30.0  # at the rank's end, for the "requeued" notification sent while it ran
STOPPED_EXIT = 128 + signal.SIGTERM


class Task:
    """What submitit runs in every Slurm task: one rank of the job in ``run_dir``. Holds only the path, so
    the code itself travels sealed in the job directory, not in submitit's pickle."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def __call__(self) -> NoReturn:
        # lazy: submitit, only for Slurm
        import submitit

        run_dir = Path(self.run_dir)
        env = submitit.JobEnvironment()
        # submitit lets the code run on through SIGTERM (for checkpoints); Slurm's SIGTERM here is scancel's or a
        # requeue's, and then the rank ends at once rather than at SIGKILL, KillWait later (30 s on many clusters)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(STOPPED_EXIT))
        rank, world_size = env.global_rank, env.num_tasks
        master = "127.0.0.1" if cluster_of(run_dir) == "local" else env.hostnames[0]
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        info = records.read(run_dir)
        attempt = records.attempt_of({**info, "slurm_restarts": restarts})  # rank 0 records the restarts below
        token = attempt_token(attempt)
        os.environ.update(
            torchrun_environment(env.job_id, rank, env.local_rank, world_size, env.num_nodes, env.node, master)
        )
        os.environ[TOKEN_VARIABLE] = token
        os.environ[ATTEMPT_VARIABLE] = str(attempt - restarts)  # restore adds Slurm's (SLURM_RESTART_COUNT)
        if restarts:  # Slurm requeued the job (preemption, node failure, scontrol requeue): this is attempt N + 1
            keep_earlier_attempt(run_dir, rank, attempt - 1)
        watch_time_limit(run_dir, info, getattr(submitit.JobEnvironment, "USR_SIG", "USR2"))
        telling: threading.Thread | None = None
        if rank == 0:
            fields: dict[str, Any] = {"slurm_restarts": restarts} if restarts else {}
            if restarts:  # an end the earlier attempt recorded is not this one's
                fields.update(slurm_attempts_kept=str(RunFiles(run_dir).attempts), exit="", ended=None)
            records.update(
                run_dir, status="running", reason="", started=time.time(), slurm_nodes=list(env.hostnames), **fields
            )
            if restarts:  # preempted, or requeued (scontrol requeue, a node's failure): its targets hear it goes on
                telling = threading.Thread(
                    target=notify.notify, args=(run_dir, "requeued"), kwargs={"requeues": restarts}, daemon=True
                )
                telling.start()
        exporter = start_exporter(run_dir) if rank == 0 else None
        watch = StopWatch(RunFiles(run_dir), rank, world_size, token) if world_size > 1 else None
        code = run_rank(run_dir)
        if telling is not None:  # told while the rank ran; a slow target holds the end a little, never the start
            telling.join(timeout=NOTIFY_WAIT_S)
        if watch is not None:
            watch.ended(code)
        record_if_last(run_dir, world_size, token)
        if exporter is not None:  # the step's end would kill it: its last points and the tracker run's end first
            with contextlib.suppress(subprocess.TimeoutExpired):
                exporter.wait(timeout=exporting.finish_within() + 2 * exporting.POLL_S)
        if code:
            sys.stderr.write(f"rank {rank} failed (exit code {code}); see {RunFiles(run_dir).error}\n")
        # as a local rank ends, without teardown: the job's end is recorded, and a fatal signal in a destructor (a
        # gloo group's) or from a daemon thread at shutdown would be recorded by faulthandler and read by a later
        # rank as this one's death; a hang there would hold the allocation. submitit's own result file is not
        # written: gpumagic reads the job's directory, and Slurm the exit code.
        exit_rank(code)


def start_exporter(run_dir: Path) -> subprocess.Popen[bytes] | None:
    """Rank 0's task: a process that follows the job's metrics to its trackers (``telemetry.exporting``), if it
    has any; off the ranks, so training never waits for a tracker."""
    try:
        if not records.read_spec(run_dir).track:
            return None
    except (PayloadRejected, OSError, ValueError):
        _log.debug("the job's description cannot be read; its metrics are not exported", exc_info=True)
        return None  # the rank refuses such a job itself, and says why
    return subprocess.Popen(exporting.command(run_dir))


def cluster_of(run_dir: Path) -> str:
    """``local`` for a job run by submitit's local stand-in (``GPUMAGIC_SLURM=local``), else ``slurm``."""
    return str(records.read(run_dir).get("slurm_cluster", "slurm"))


def attempt_token(attempt: int) -> str:
    """The token of a Slurm attempt's files (its published store, its stop file, its end's claim): its number
    among all the job's attempts, requeues and resumes alike, so none meets an earlier attempt's files."""
    return f"slurm-{attempt}"


def watch_time_limit(run_dir: Path, info: Mapping[str, Any], signal_name: str) -> None:
    """Hear Slurm's signal ahead of the time limit (``--signal``, submitit's ``USR2`` at ``signal_delay``): with
    ``requeue_on_timeout`` left, the rank's next ``gpumagic.checkpoint`` saves and requeues the job; otherwise the
    rank says once that the limit is near (submitit's own handler would raise into the user's code)."""
    number = signal.Signals.__members__.get("SIG" + signal_name.upper().removeprefix("SIG"), signal.SIGUSR2)
    allowed = int(records.read_spec(run_dir).requeue_on_timeout or 0)
    done = int(info.get("timeout_requeues") or 0)
    if allowed > done:
        os.environ[REQUEUE_VARIABLE] = f"{done + 1}/{allowed}"
        signal.signal(number, time_limit_near)
        return

    def say(*_: Any) -> None:
        why = f"its {allowed} requeue(s) are used" if allowed else "requeue_on_timeout was not asked"
        os.write(2, f"[gpumagic] the Slurm time limit is near; the job is not requeued ({why})\n".encode())

    signal.signal(number, say)


def torchrun_environment(
    job_id: str, rank: int, local_rank: int, world_size: int, nodes: int, node: int, master: str
) -> dict[str, str]:
    """The variables torchrun would set for a Slurm task. ``MASTER_PORT`` is 0 until the rank joins its group:
    then it is the port rank 0's store took (published, not derived from the public job id)."""
    return torchrun_variables(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=world_size // max(1, nodes),
        node_rank=node,
        master=(master, 0),
        run_id=str(job_id),
    )


def keep_earlier_attempt(run_dir: Path, rank: int, earlier: int) -> None:
    """Move what ``rank`` left of the attempt before this one (its log, start, result, errors, metrics; rank 0 also
    the job's result and error) into ``attempts/<earlier>/`` (that attempt's number, 1 for the first), so a
    requeued job never overwrites it. Each rank moves its own files: the ranks of the new attempt start at once.
    Checkpoints stay: the new attempt restores from them."""
    files = RunFiles(run_dir)
    kept = RunFiles(files.attempt(earlier))
    mine = [files.rank_log(rank), files.rank_start(rank), files.rank_result(rank), *files.rank_errors(rank)]
    mine += [*files.ranks.glob(f"rank-{rank}.fatal.*.txt"), files.metric_names(rank), files.metric_points(rank)]
    if rank == 0:
        mine += [files.result, files.error]
    for path in mine:
        if path.exists():
            target = kept.root / path.relative_to(files.root)
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.replace(path, target)


class StopWatch:
    """A rank of a multi-task job: when another rank of this attempt failed (its stop file), this one says it
    was stopped and ends; when this one fails, it writes the stop file for the others."""

    def __init__(self, files: RunFiles, rank: int, world_size: int, token: str) -> None:
        self.files, self.rank, self.world_size, self.token = files, rank, world_size, token
        self._lock = threading.Lock()
        self._ended = False
        threading.Thread(target=self._watch, name="gpumagic-slurm-stop", daemon=True).start()

    def ended(self, code: int) -> None:
        """This rank's code ended (``code``); a failure tells every other rank to stop."""
        with self._lock:
            self._ended = True
            if code != 0 and read_json(self.files.attempt_stop(self.token)) is None:
                write_private(self.files.attempt_stop(self.token), json.dumps({"rank": self.rank}).encode())

    def _watch(self) -> None:
        while True:
            time.sleep(STOP_LOOK_S)
            with self._lock:
                if self._ended:
                    return
                failed = stop_requested(self.files, self.token)
                if failed is None or failed == self.rank:
                    continue
                self._stop(failed)

    def _stop(self, failed: int) -> None:
        """End this rank now, its report saying it was stopped because rank ``failed`` failed."""
        message = f"stopped because rank {failed} failed"
        report = {"rank": self.rank, "pid": os.getpid(), "phase": "stopped", "type": None, "message": message,
                  "traceback": None, "timestamp": time.time(), "exitcode": STOPPED_EXIT, "stopped": True}  # fmt: skip
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        write_private(self.files.rank_error(self.rank, attempt), json.dumps(report).encode())
        sys.stderr.write(f"[gpumagic] rank {self.rank}: {message}\n")
        flush()
        record_if_last(self.files.root, self.world_size, self.token)
        os._exit(STOPPED_EXIT)


def stop_requested(files: RunFiles, token: str) -> int | None:
    """The rank whose failure stopped the attempt ``token``, or None. The directory is listed first: on NFS that
    shows a file another node just wrote."""
    path = files.attempt_stop(token)
    try:
        if path.name not in os.listdir(path.parent):
            return None
    except OSError:
        _log.debug("the attempt's stop file cannot be looked for; no stop is taken as asked", exc_info=True)
        return None
    told = read_json(path) or {}
    return told["rank"] if isinstance(told.get("rank"), int) else -1


def record_if_last(run_dir: Path, world_size: int, token: str) -> bool:
    """Record the job's end (``result.pkl``: rank 0's value, or ``{rank: value}`` with several ranks; ``error.txt``;
    the status) if every rank has ended, once: whichever rank ends last does it. True if this call recorded it."""
    files = RunFiles(run_dir)
    if not all(_has_ended(files, rank, set(os.listdir(files.ranks))) for rank in range(world_size)):
        return False
    try:
        os.close(os.open(files.attempt_end_claim(token), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False  # another rank ended at the same moment and records it
    outcomes = rank_outcomes(files, world_size)
    failure = root_cause(outcomes)
    if failure is not None:
        error = LaunchError(outcomes, failure)
        write_private(files.error, (error.report() + "\n").encode())
        record_end(run_dir, "failed", error.headline())
        notify.notify(run_dir, "failed")
        return True
    values = {
        rank: cloudpickle.loads(read_sealed(files.rank_result(rank), f"rank {rank}'s result"))
        for rank in range(world_size)
    }
    write_sealed(files.result, cloudpickle.dumps(values if world_size > 1 else values[0]))
    record_end(run_dir, "finished", "finished", exitcode=0)
    notify.notify(run_dir, "finished")
    return True


def _has_ended(files: RunFiles, rank: int, names: set[str]) -> bool:
    """Whether ``rank`` wrote its end: a result, an error report, or the stack of a fatal signal."""
    if files.rank_result(rank).name in names or any(p.name in names for p in files.rank_errors(rank)):
        return True
    fatal = files.rank_fatal(rank)
    return fatal.name in names and fatal.stat().st_size > 0

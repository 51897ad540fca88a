"""Where runs live (``runs_root``) and every path of a run directory, in one place (the model: submitit's
``JobPaths``).

A run directory is a launch's, a background job's or a kernel's own (``run_dirs.store.new_run``)::

    run.json                    the run's record: id, kind, ranks, pid, status ... (``store``)
    metrics/rank-R.names|.bin   rank R's logged metrics (``store``, ``log``)
    launch/spec.json            how the ranks run: backend, timeout, CUDA, world (sealed JSON)
    launch/payload.pkl          the code every rank runs (sealed)
    launch/stop                 written by the notebook: every node's agent stops its ranks
    launch/stop-T.json          written by the first failing rank of Slurm attempt T: the other ranks stop
    launch/ended-T              made by the rank of Slurm attempt T that records the job's end (the last to end)
    launch/store.sock           the ranks' rendezvous store on one machine (rank 0 serves it)
    launch/store-N.sock         a persistent group's store after its N-th forming
    launch/store.key            the run's secret (sealed): its stores open for this run's processes only
    launch/store-T.address      where a store served on a port of its own choosing listens (sealed; T: which)
    ranks/rank-R.log            rank R's stdout and stderr (elastic and Slurm ranks; local ranks use pipes)
    ranks/rank-R.json           rank R's latest start: attempt, pid, host, time
    ranks/rank-R.result.pkl     rank R's value (sealed)
    ranks/rank-R.error.A.json   how rank R failed in attempt A (0 first, 1 after the first restart ...)
    ranks/rank-R.fatal.A.txt    rank R's Python stack when a fatal signal (SIGSEGV, SIGABRT ...) ended attempt A
    ranks/rank-R.usage.jsonl    rank R's memory and CPU (GPU) use, sampled by its node's agent (multi-node runs)
    agents/                     elastic agents' events and logs
    checkpoints/step-N.<id>.pt  a checkpoint (``gpumagic.checkpoint``), kept across attempts and restarts
    checkpoints/step-N.seal     its seal: the file's name, size and SHA-256 under the user's key
    checkpoints/restored.json   what ``gpumagic.restore`` loaded last, and when (``run_dirs.checkpoint_files``)
    attempts/N/                 what a job's attempt N left once the next started (a resume, a Slurm requeue)
    notified/EVENT.N            made once a job's notification targets were told of EVENT in attempt N
    job.json payload.pkl output.log result.pkl error.txt kill.json runner.log .reserve   a background job's
                                (``run_dirs.records``)

Only this module spells these names; everything else asks it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

RUNS_VARIABLE = "GPUMAGIC_RUNS_DIR"


def runs_root() -> Path:
    """Where runs live: ``GPUMAGIC_RUNS_DIR``, else the user's state directory (platformdirs)."""
    explicit = os.environ.get(RUNS_VARIABLE)
    if explicit:
        return Path(explicit)
    return Path(platformdirs.user_state_dir("gpumagic")) / "runs"


@dataclass(frozen=True)
class RunFiles:
    """The files of the run directory ``root``."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # every run
    @property
    def record(self) -> Path:
        return self.root / "run.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    def metric_names(self, rank: int) -> Path:
        return self.metrics / f"rank-{rank}.names"

    def metric_points(self, rank: int) -> Path:
        return self.metrics / f"rank-{rank}.bin"

    def metric_ranks(self) -> list[int]:
        """The ranks that logged metrics."""
        return sorted(int(p.name[len("rank-") : -len(".bin")]) for p in self.metrics.glob("rank-*.bin"))

    # a launch's ranks
    @property
    def launch(self) -> Path:
        return self.root / "launch"

    @property
    def spec(self) -> Path:
        return self.launch / "spec.json"

    @property
    def payload(self) -> Path:
        return self.launch / "payload.pkl"

    @property
    def store_socket(self) -> Path:
        return self.launch / "store.sock"

    def group_store_socket(self, ident: int) -> Path:
        """A persistent group's store after its ``ident``-th forming (each re-form meets on a fresh one)."""
        return self.launch / f"store-{ident}.sock"

    @property
    def store_secret(self) -> Path:
        return self.launch / "store.key"

    def published_store(self, token: str) -> Path:
        """Where the store ``token`` names (a Slurm attempt's, an elastic round's) is published by its server."""
        return self.launch / f"store-{token}.address"

    @property
    def stop(self) -> Path:
        return self.launch / "stop"

    def attempt_stop(self, token: str) -> Path:
        """Written by the first rank of a Slurm attempt that fails: every other rank of it stops."""
        return self.launch / f"stop-{token}.json"

    def attempt_end_claim(self, token: str) -> Path:
        """Made (exclusively) by the rank of a Slurm attempt that records the job's end."""
        return self.launch / f"ended-{token}"

    @property
    def ranks(self) -> Path:
        return self.root / "ranks"

    def rank_log(self, rank: int) -> Path:
        return self.ranks / f"rank-{rank}.log"

    def rank_start(self, rank: int) -> Path:
        return self.ranks / f"rank-{rank}.json"

    def rank_result(self, rank: int) -> Path:
        return self.ranks / f"rank-{rank}.result.pkl"

    def rank_error(self, rank: int, attempt: int = 0) -> Path:
        return self.ranks / f"rank-{rank}.error.{attempt}.json"

    def rank_errors(self, rank: int) -> list[Path]:
        """Every attempt's error report of ``rank``."""
        return sorted(self.ranks.glob(f"rank-{rank}.error.*.json"))

    def rank_fatal(self, rank: int, attempt: int = 0) -> Path:
        return self.ranks / f"rank-{rank}.fatal.{attempt}.txt"

    def rank_usage(self, rank: int) -> Path:
        return self.ranks / f"rank-{rank}.usage.jsonl"

    def rank_waiting(self, rank: int) -> Path:
        """Written by a rank whose collective has waited past ``--hang-after`` (``hang_watch``)."""
        return self.ranks / f"rank-{rank}.waiting.json"

    def rank_where(self, rank: int) -> Path:
        """A rank's answer to a hang request: its collectives in flight and its Python stack."""
        return self.ranks / f"rank-{rank}.where.json"

    def rank_collective(self, rank: int) -> Path:
        """The collective a rank is in or made last (``CollectiveRecorder``): left behind if the rank dies."""
        return self.ranks / f"rank-{rank}.collective"

    @property
    def hang_request(self) -> Path:
        """Written by the launcher that saw a rank waiting: every rank answers with its ``rank_where``."""
        return self.ranks / "hang-request.json"

    def rank_debug_socket(self, rank: int) -> Path:
        """Where a rank kept alive after a failure (``--pdb``) serves its post-mortem debugger: private."""
        return self.launch / f"debug-{rank}.sock"

    @property
    def checkpoints(self) -> Path:
        """``gpumagic.checkpoint``'s files: they outlive attempts (requeues, resumes, restarts) of the run."""
        return self.root / "checkpoints"

    @property
    def restored(self) -> Path:
        """What ``gpumagic.restore`` loaded last (``run_dirs.checkpoint_files``)."""
        return self.checkpoints / "restored.json"

    @property
    def attempts(self) -> Path:
        """Where the files of a job's earlier attempts are kept (a resume, a Slurm requeue)."""
        return self.root / "attempts"

    def attempt(self, number: int) -> Path:
        """What attempt ``number`` (1: the first) left, once the next one started."""
        return self.attempts / str(number)

    @property
    def notified(self) -> Path:
        """One empty file per event a job's targets were told of (``jobs.notify``): each is told once."""
        return self.root / "notified"

    @property
    def agents(self) -> Path:
        return self.root / "agents"

    def agent_events(self, label: str) -> Path:
        return self.agents / f"{label}.events.jsonl"

    def agent_event_files(self) -> dict[str, Path]:
        """Every agent's events file, by the agent's label."""
        suffix = ".events.jsonl"
        return {p.name[: -len(suffix)]: p for p in sorted(self.agents.glob(f"*{suffix}"))}

    @property
    def notebook_agent_log(self) -> Path:
        return self.agents / "notebook-node.log"

    @property
    def torchelastic_logs(self) -> Path:
        return self.agents / "torchelastic"

    # a background job
    @property
    def job(self) -> Path:
        return self.root / "job.json"

    @property
    def job_payload(self) -> Path:
        return self.root / "payload.pkl"

    @property
    def output(self) -> Path:
        return self.root / "output.log"

    @property
    def result(self) -> Path:
        return self.root / "result.pkl"

    @property
    def error(self) -> Path:
        return self.root / "error.txt"

    @property
    def kill_request(self) -> Path:
        return self.root / "kill.json"

    @property
    def runner_log(self) -> Path:
        return self.root / "runner.log"

    @property
    def reserve(self) -> Path:
        return self.root / ".reserve"

    @property
    def slurm(self) -> Path:
        return self.root / "slurm"

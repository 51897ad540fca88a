"""Where a background job runs. An executor is a module of ``gpumagic.jobs`` with the functions of ``Executor``:
``local`` (this machine's queue) and ``slurm`` (a cluster, through submitit). A job's ``run.json`` names its
executor (none: ``local``); ``executor_of`` finds it, so nothing else compares executor names. How a job ended, or
that it is still active, is read as every run's end (``run_dirs.run_end``), with what its executor sees of it now."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, cast

from gpumagic.errors import InvalidArgument
from gpumagic.run_dirs.run_end import RunEnd

NAMES = ("local", "slurm")


class Entry(NamedTuple):
    """One job of a submission: its name (None: made unique from ``base``), shipped code and sweep point."""

    name: str | None
    base: str
    packed: bytes
    params: dict[str, Any]


@dataclass(frozen=True)
class Submission:
    """What every executor's jobs are given, checked once for all of them (``api``)."""

    ddp: int | None
    backend: str | None
    timeout_s: float
    after: list[str]
    description: str
    memory_limit: bool = False  # cap each process at its reservation (local jobs with min_free)
    hang_after_s: float = 10.0  # --hang-after of a DDP job's ranks: the report goes to the job's log
    notify: tuple[str, ...] = ()  # the targets told of the job's end (``jobs.notify``)
    notify_wait_s: float = 3600.0  # ... and of a wait for GPUs this long (0: never)
    sweep: str | None = None  # the sweep the jobs make (one summary is sent for all of them), and how many
    sweep_size: int = 0
    requeue_on_timeout: int = 0  # Slurm: near the time limit, save and requeue so many times
    track: tuple[dict[str, str], ...] = ()  # the trackers the jobs' metrics go to (``gpumagic.track``'s, sealed)

    def record(self, entry: Entry) -> dict[str, Any]:
        """The fields of ``run.json`` every executor writes for one of these jobs."""
        return {
            "after": self.after,
            "backend": self.backend,
            "timeout_s": self.timeout_s,
            "hang_after_s": self.hang_after_s,
            "params": entry.params,
            "notify": list(self.notify),  # sealed in job.json too: the runner reads its targets from there
            "notify_wait_s": self.notify_wait_s,
            "requeue_on_timeout": self.requeue_on_timeout,
            "track": list(self.track),
            **({"sweep": self.sweep, "sweep_size": self.sweep_size} if self.sweep else {}),
            "description": self.description,
            "uid": os.getuid(),
            "cwd": os.getcwd(),
        }


class Executor(Protocol):
    """The functions an executor module defines (``info``: a job's ``run.json``)."""

    def check_resources(self, gpus: int | str | None, min_free: Any, ddp: int | None, options: Any) -> Any:
        """What the jobs ask of this executor, checked before anything is written; ``submit`` takes it.

        Raises:
            InvalidArgument: an option this executor cannot honour.
        """

    def submit(self, entries: list[Entry], resources: Any, submission: Submission) -> list[Path]:
        """Take every job's name (all or none), write their directories and start them."""

    def end(self, info: Mapping[str, Any]) -> RunEnd:
        """How the job ended (finished, failed, killed, cancelled or lost) and why, or why it waits (queued,
        running), as this executor sees it now: ``run_end.run_end(info, watch)``, ``watch`` being what this
        executor sees of an active job."""

    def outputs(self, path: Path, info: Mapping[str, Any]) -> list[tuple[int | None, Path]]:
        """Its log files, each with its rank when there are several (for the ``[rank N]`` prefix)."""

    def kill(self, path: Path, info: Mapping[str, Any], grace_s: float) -> None:
        """Stop the active job (SIGTERM, then SIGKILL after ``grace_s``) and record that it was killed."""

    def resources(self, info: Mapping[str, Any]) -> str:
        """What it runs on, in a few words (``"0,2"``, ``"slurm 2×4, 4 GPU/node"``); empty for none."""


def named(name: str) -> Executor:
    """The executor called ``name``. Raises InvalidArgument for an unknown one."""
    if name not in NAMES:
        raise InvalidArgument(f"executor must be one of {', '.join(NAMES)}, got {name!r}")
    return cast(Executor, importlib.import_module(f"gpumagic.jobs.{name}"))


def executor_of(info: Mapping[str, Any]) -> Executor:
    """The executor that runs the job ``info`` describes."""
    name = info.get("executor") or "local"
    return named(name if name in NAMES else "local")


def status(info: Mapping[str, Any]) -> str:
    """The job's status, as its executor sees it now (``lost``: it should be alive but is gone)."""
    return executor_of(info).end(info).status


def why(info: Mapping[str, Any], brief: bool = False) -> str:
    """Why the job waits (queued), or why it ended, as its executor tells."""
    ended = executor_of(info).end(info)
    return ended.short if brief else ended.why

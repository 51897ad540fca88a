"""``%jobs resume`` / ``Job.resume``: a new attempt of an ended job in its own directory, on the executor it ran
on, with some options changed. The attempt's code finds the checkpoints of every earlier attempt there
(``gpumagic.restore``); ``run_dirs.records.start_attempt`` moves the earlier attempt's files aside."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpumagic.devices.placement import Request
from gpumagic.errors import InvalidArgument
from gpumagic.jobs import local, slurm
from gpumagic.jobs.executors import executor_of
from gpumagic.launch.option_table import default, option
from gpumagic.launch.options import LaunchOptions
from gpumagic.run_dirs import records
from gpumagic.units import parse_size

RESUMABLE = ("gpus", "min_free", "memory_limit", "ddp", "backend", "timeout", "hang_after", "slurm")


def resume(path: Path, changed: Mapping[str, Any]) -> int:
    """Start the next attempt of the ended job at ``path``, ``changed`` (some of ``RESUMABLE``) replacing the
    earlier attempt's options. Returns the attempt's number.

    Raises:
        InvalidArgument: the job is active or finished, or an option is malformed or does not fit its executor.
    """
    info = records.read(path)
    local.check_resumable(info["name"], executor_of(info).end(info).status)
    unknown = sorted(set(changed) - set(RESUMABLE))
    if unknown:
        raise InvalidArgument(f"resume takes {', '.join(RESUMABLE)}; not {', '.join(unknown)}")
    for name, value in changed.items():  # the table's checks, in the words a submission gets
        check = option("job", name).check
        if check is not None:
            check(value)
    spec = records.read_spec(path)
    changes = _launch_changes(spec, changed)
    if info.get("executor") == "slurm":
        if "min_free" in changed or "memory_limit" in changed:
            raise InvalidArgument("min_free and memory_limit are for this machine's queue; on Slurm give gres or gpus")
        return slurm.resume(path, info, spec, changes, changed.get("gpus"), changed.get("slurm"))
    if changed.get("slurm") is not None:
        raise InvalidArgument("slurm options are for a job that ran on Slurm; this one ran on this machine")
    if {"gpus", "min_free", "ddp"} & changed.keys():
        changes["request"] = _request(spec, changed).to_json()
    if "memory_limit" in changed:
        changes["memory_limit"] = changed["memory_limit"]
    if (
        changes.get("memory_limit", spec.memory_limit)
        and Request.from_json(changes.get("request", spec.request)).min_free is None
    ):
        raise InvalidArgument("memory_limit caps a job at the memory it declares: give min_free too")
    return local.resume(path, changes)


def _launch_changes(spec: records.JobSpec, changed: Mapping[str, Any]) -> dict[str, Any]:
    """The new ranks, backend, timeout and hang report threshold, as the job's spec holds them."""
    changes: dict[str, Any] = {}
    if "ddp" in changed:
        changes["ddp"] = changed["ddp"]
    if {"backend", "timeout", "hang_after"} & changed.keys():
        launch = LaunchOptions(
            changed.get("ddp", spec.ddp),
            backend=changed.get("backend", spec.backend),
            timeout=changed.get("timeout", spec.timeout_s or default("job", "timeout")),
            hang_after=changed.get("hang_after", spec.hang_after_s if spec.hang_after_s is not None else 0),
        )
        changes.update(backend=launch.backend, timeout_s=launch.timeout_s, hang_after_s=launch.hang_after_s)
    return changes


def _request(spec: records.JobSpec, changed: Mapping[str, Any]) -> Request:
    """The GPU request of a resumed local job: the earlier one, with the GPUs, memory or ranks ``changed``,
    checked against this machine as a submission is."""
    earlier = Request.from_json(spec.request)
    if "gpus" not in changed and "ddp" not in changed and earlier.uuids:  # the same named GPUs
        free = changed["min_free"]
        return Request(earlier.wants, earlier.uuids, parse_size(free) if free is not None else None)
    if "gpus" in changed:
        gpus = changed["gpus"]
    else:  # other ranks, one GPU each as a submission gives, unless it ran on the CPU
        gpus = earlier.wants if "ddp" not in changed else None if earlier.wants else 0
    min_free = changed.get("min_free", earlier.min_free)
    request, _ = local.check_resources(gpus, min_free, changed.get("ddp", spec.ddp), None)
    return request

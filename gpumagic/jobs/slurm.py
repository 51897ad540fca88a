"""The Slurm executor (``jobs.executors``): background jobs on a cluster, through submitit (``executor="slurm"``,
``%%launch_bg --executor slurm``).

gpumagic does not schedule anything here: it writes the job's directory as for a local job (sealed payload,
``run.json``), hands submitit a small task that names that directory, and reads the directory back. Every
Slurm task becomes one rank with the environment torchrun gives (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` = the first node) and runs the shipped code (``jobs.slurm_task``); with more than one task the
ranks form one DDP group across the allocation, on a store rank 0 serves at a port it chose and published. Output,
metrics and results come back through the job directory, so it must be on a filesystem the nodes share.

``GPUMAGIC_SLURM=local`` puts submitit's local executor in Slurm's place (one node, tasks as processes): the
same job, end to end, on a machine without Slurm.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from gpumagic.devices.processes import is_same_process, process_start_time
from gpumagic.devices.shared_files import one_line
from gpumagic.errors import InvalidArgument
from gpumagic.jobs import slurm_state
from gpumagic.jobs.executors import Entry, Submission
from gpumagic.jobs.local import check_resumable, stop_process_tree
from gpumagic.jobs.queue import Request
from gpumagic.jobs.slurm_state import SlurmState
from gpumagic.jobs.slurm_task import Task  # also gpumagic.jobs.slurm.Task, as jobs submitted before pickled it
from gpumagic.launch.plan import choose_backend
from gpumagic.run_dirs import records
from gpumagic.run_dirs.launch_files import write_spec
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.private import private_umask
from gpumagic.run_dirs.run_end import RunEnd, run_end
from gpumagic.run_dirs.signing import read_sealed
from gpumagic.run_dirs.store import record_end
from gpumagic.units import parse_duration, parse_size

LOCAL_VARIABLE = "GPUMAGIC_SLURM"
DEFAULT_TIME = "1h"
KEYS = (
    "partition",
    "time",
    "nodes",
    "tasks_per_node",
    "gpus_per_node",
    "gres",
    "cpus_per_task",
    "mem",
    "account",
    "qos",
    "constraint",
    "signal_delay",
    "additional",
)
QUEUED_STATES = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")
RUNNING_STATES = ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING")
ENDED_STATES = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "ENDED")
STATE_CACHE_S = 3.0  # scontrol answers in milliseconds; %jobs and a watch ask every job each time
CONTROLLER_GRACE_S = 5.0  # submitit's local controller, between SIGTERM and SIGKILL, whatever grace kill is given


class Target(NamedTuple):
    """Where the jobs go (``cluster()``) and what they ask for there, checked by ``check_resources``."""

    cluster: str
    gpus: int | str | None
    options: Mapping[str, Any] | None


def check_resources(
    gpus: int | str | None, min_free: Any, ddp: int | None, options: Mapping[str, Any] | None
) -> Target:
    """Where the jobs will be submitted; the Slurm ``options`` themselves are checked by ``submit``.

    Raises:
        InvalidArgument: ``min_free`` or a device spec (Slurm takes whole GPUs per node), or no Slurm here.
    """
    if min_free is not None:
        raise InvalidArgument("min_free is for this machine's queue; on Slurm ask for whole GPUs (gpus, gres)")
    if isinstance(gpus, str) and not (gpus.strip().isascii() and gpus.strip().isdigit()):
        raise InvalidArgument(f"on Slurm, gpus is a number of GPUs per node, got {gpus!r}")
    where = cluster()
    check_available(where)
    return Target(where, gpus, options)


def submit(entries: list[Entry], target: Target, submission: Submission) -> list[Path]:
    """Write the jobs' directories as for local jobs (names all or none) and submit each through submitit.

    Raises:
        InvalidArgument: a malformed Slurm option, an ``after`` job not on Slurm, or sbatch's refusal.
    """

    params, ranks = parameters("check", target.options, target.gpus, submission.ddp, target.cluster)
    if submission.after:
        params["slurm_additional_parameters"] = {
            **(params.get("slurm_additional_parameters") or {}),
            "dependency": "afterok:" + ":".join(_slurm_ids(submission.after, target.cluster)),
        }
    backend = choose_backend(submission.backend, use_cuda=uses_gpus(params))
    written = []
    with records.names_locked():
        names = records.take_names([(entry.name, entry.base) for entry in entries])
        for job_name, entry in zip(names, entries, strict=True):
            path = records.create(
                job_name,
                entry.packed,
                reserve=False,  # Slurm runs it: no runner of ours records its end
                ranks=ranks,
                executor="slurm",
                slurm_cluster=target.cluster,
                request=Request(0).to_json(),
                ddp=ranks if ranks > 1 else None,
                runner_pid=None,
                slurm_options=dict(target.options or {}),  # as given: a resume changes some and keeps the rest
                slurm_gpus=target.gpus,
                **submission.record(entry),
            )
            write_spec(RunFiles(path), _launch_spec(params, backend, ranks > 1 or bool(submission.ddp),
                                                    submission.timeout_s), entry.packed)  # fmt: skip
            written.append((job_name, path))
    for done, (job_name, path) in enumerate(written):
        try:
            fields = _submit_directory(path, {**params, "name": job_name}, target.cluster)
        except Exception as err:  # noqa: BLE001 - sbatch's own refusal (partition, limits) is the user's answer
            for _, unsent in written[done:]:  # nothing of a job Slurm never took stays on disk
                shutil.rmtree(unsent, ignore_errors=True)
            before = f" (submitted before it: {', '.join(n for n, _ in written[:done])})" if done else ""
            raise InvalidArgument(f"submitting job {job_name} failed: {_refusal(err)}{before}") from None
        records.update(path, reason=f"submitted as Slurm job {fields['slurm_job_id']}", slurm=params, **fields)
    return [path for _, path in written]


def _launch_spec(params: Mapping[str, Any], backend: str, group: bool, timeout_s: float) -> dict[str, Any]:
    """How the job's ranks run (``launch/spec.json``): their backend (with a process group), CUDA, timeout."""
    return {
        "backend": backend if group else None,
        "use_cuda": uses_gpus(params),
        "timeout_s": timeout_s,
        "threads_per_rank": int(params.get("cpus_per_task") or 1),
        "sys_path": [p for p in sys.path if p],
    }


def resume(
    path: Path, info: Mapping[str, Any], spec: records.JobSpec, changes: dict[str, Any], gpus: Any, options: Any
) -> int:
    """Submit the next attempt of the ended Slurm job at ``path`` to the cluster it ran on: ``options`` (Slurm's:
    ``{"time": "4h", "partition": "long"}``) replace the earlier ones, ``gpus`` (per node) and ``changes`` (ranks,
    backend, timeout) too; ``spec``: its sealed description. Returns the attempt's number.

    Raises:
        InvalidArgument: a malformed option, no Slurm here, or sbatch's refusal (the job then reads failed, and
            can be resumed again).
    """
    where = str(info.get("slurm_cluster") or "slurm")
    check_available(where)
    given = {**(info.get("slurm_options") or {}), **(options or {})}
    per_node = info.get("slurm_gpus") if gpus is None else gpus
    params, ranks = parameters("check", given, per_node, changes.get("ddp", info.get("ddp")), where)
    backend = choose_backend(changes.get("backend", spec.backend), use_cuda=uses_gpus(params))
    changes = {**changes, "ddp": ranks if ranks > 1 else None, "slurm_options": given, "slurm_gpus": per_node}
    packed = read_sealed(RunFiles(path).job_payload, f"job {info['name']}'s code")  # refused before anything moves
    group = ranks > 1 or bool(spec.ddp)
    timeout_s = float(changes.get("timeout_s", spec.timeout_s) or 1800.0)
    with records.names_locked():
        now = records.read(path)
        check_resumable(now["name"], end(now).status)
        attempt = records.start_attempt(path, changes)
    try:
        write_spec(RunFiles(path), _launch_spec(params, backend, group, timeout_s), packed)
        fields = _submit_directory(path, {**params, "name": now["name"]}, where)
    except Exception as err:  # noqa: BLE001 - sbatch's own refusal (partition, limits) is the user's answer
        why = f"resubmitting attempt {attempt} failed: {_refusal(err)}"
        record_end(path, "failed", why)  # it can be resumed again
        raise InvalidArgument(f"job {now['name']}: {why}") from None
    records.update(path, reason=f"submitted as Slurm job {fields['slurm_job_id']}", slurm=params, **fields)
    return attempt


def _refusal(err: BaseException) -> str:
    """sbatch's refusal on one line: its ``error:`` lines without the ``sbatch: error:`` prefixes."""

    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    errors = [line.split("error:", 1)[1].strip() for line in lines if "error:" in line] or lines
    return one_line("; ".join(errors), 300)


def _slurm_ids(after: list[str], where: str) -> list[str]:
    """The Slurm job ids of the jobs named in ``after``. Raises InvalidArgument for one that is not on Slurm."""
    if where == "local":
        raise InvalidArgument("after= needs a real Slurm cluster (GPUMAGIC_SLURM=local cannot chain jobs)")
    ids = []
    for name in after:
        info = records.read(records.find(name))
        if not info.get("slurm_job_id") or info.get("slurm_cluster") == "local":
            raise InvalidArgument(f"job {name} is not a Slurm job; a Slurm job can only run after Slurm jobs")
        ids.append(info["slurm_job_id"])
    return ids


def cluster() -> str:
    """``slurm``, or ``local`` when ``GPUMAGIC_SLURM=local`` asks for submitit's local stand-in."""
    return "local" if os.environ.get(LOCAL_VARIABLE, "").strip().lower() == "local" else "slurm"


def parameters(
    name: str, slurm: Mapping[str, Any] | None, gpus: Any, ddp: int | None, where: str = "slurm"
) -> tuple[dict[str, Any], int]:
    """submitit's ``update_parameters`` keywords for a job, and its number of ranks (nodes × tasks per node).

    ``slurm`` takes ``partition``, ``time`` ("2h", minutes), ``nodes``, ``tasks_per_node``, ``gpus_per_node``,
    ``gres`` ("gpu:a100:4", instead of ``gpus_per_node``), ``cpus_per_task``, ``mem`` ("64GB", per node),
    ``account``, ``qos``, ``constraint``, ``signal_delay`` (how long before the time limit Slurm signals the job:
    "5m", 90 s by default; ``requeue_on_timeout`` saves then) and ``additional`` (any other sbatch option:
    ``{"exclusive": True}``).
    ``gpus`` (per node) defaults to one per task; ``ddp`` (ranks in all) sets the tasks per node.

    Raises:
        InvalidArgument: an unknown key or a malformed value, named.
    """
    options = dict(slurm or {})
    unknown = sorted(set(options) - set(KEYS))
    if unknown:
        raise InvalidArgument(f"unknown Slurm option(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
    nodes = _whole(options.get("nodes", 1), "nodes", 1, 10_000)
    if where == "local" and nodes != 1:
        raise InvalidArgument("submitit's local executor (GPUMAGIC_SLURM=local) runs one node; use nodes=1")
    tasks = options.get("tasks_per_node")
    if tasks is None:
        tasks = 1 if ddp is None else _split(ddp, nodes)
    tasks = _whole(tasks, "tasks_per_node", 1, 1024)
    if ddp is not None and ddp != nodes * tasks:
        raise InvalidArgument(f"ddp={ddp} ranks, but {nodes} node(s) × {tasks} task(s) per node is {nodes * tasks}")
    time_limit = options.get("time", DEFAULT_TIME)
    minutes = float(time_limit) if _is_number(time_limit) else parse_duration(time_limit) / 60
    if minutes <= 0:
        raise InvalidArgument("time must be more than 0")
    result: dict[str, Any] = {
        "name": name,
        "timeout_min": max(1, round(minutes)),
        "nodes": nodes,
        "tasks_per_node": tasks,
        "stderr_to_stdout": True,
    }
    if options.get("gres") is not None:
        if gpus is not None or options.get("gpus_per_node") is not None:
            raise InvalidArgument("give gres or a number of GPUs per node, not both")
        result["slurm_gres"] = _text(options["gres"], "gres")
    else:
        per_node = options.get("gpus_per_node", gpus)
        per_node = tasks if per_node is None else _whole(per_node, "gpus (per node)", 0, 64)
        if per_node:
            result["gpus_per_node"] = per_node
    if options.get("cpus_per_task") is not None:
        result["cpus_per_task"] = _whole(options["cpus_per_task"], "cpus_per_task", 1, 4096)
    if options.get("mem") is not None:
        result["mem_gb"] = max(1, round(parse_size(options["mem"]) / 2**30))
    if options.get("signal_delay") is not None:  # Slurm's signal ahead of the time limit (submitit's USR2)
        delay = options["signal_delay"]
        result["slurm_signal_delay_s"] = max(1, round(float(delay) if _is_number(delay) else parse_duration(delay)))
    for key in ("partition", "account", "qos", "constraint"):
        if options.get(key) is not None:
            result[f"slurm_{key}"] = _text(options[key], key)
    additional = options.get("additional") or {}
    if not isinstance(additional, Mapping):
        raise InvalidArgument(f"additional is a dict of sbatch options, got {additional!r}")
    if additional:
        result["slurm_additional_parameters"] = {str(k).replace("-", "_"): v for k, v in additional.items()}
    return result, nodes * tasks


def uses_gpus(params: Mapping[str, Any]) -> bool:
    return bool(params.get("gpus_per_node")) or "gpu" in str(params.get("slurm_gres", ""))


def check_available(where: str) -> None:
    """Raises InvalidArgument (saying what to do) unless jobs can be submitted to ``where`` from here."""

    if importlib.util.find_spec("submitit") is None:
        raise InvalidArgument("the Slurm executor needs submitit: pip install submitit (or gpumagic[slurm])")
    missing = [c for c in ("sbatch", "srun") if where == "slurm" and shutil.which(c) is None]
    if missing:
        raise InvalidArgument(
            f"cannot submit to Slurm from here ({' and '.join(missing)} not found); run the notebook on a machine "
            f"with Slurm's commands, or set {LOCAL_VARIABLE}=local to try the job with submitit's local executor"
        )


def executor(folder: Path, where: str) -> Any:
    """submitit's executor for ``where`` (``slurm`` or ``local``). Raises InvalidArgument without Slurm."""
    try:
        # lazy: submitit, only for Slurm
        import submitit
    except ImportError:
        raise InvalidArgument("the Slurm executor needs submitit: pip install submitit") from None
    try:
        return submitit.AutoExecutor(folder=folder, cluster=where)
    except RuntimeError as err:
        raise InvalidArgument(
            f"cannot submit to Slurm from here ({err}); run the notebook on a machine with sbatch and srun, or set "
            f"{LOCAL_VARIABLE}=local to try the job with submitit's local executor"
        ) from None


def _submit_directory(path: Path, params: dict[str, Any], where: str) -> dict[str, Any]:
    """Submit the job in ``path``; the fields ``run.json`` records about it (Slurm job id, folder ...)."""

    folder = RunFiles(path).slurm
    folder.mkdir(mode=0o700, exist_ok=True)
    chosen = executor(folder, where)
    chosen.update_parameters(**params)

    # submitit copies sbatch's own output to sys.stdout/stderr (the cell); its refusal reaches the user as one
    # line (_refusal) and its "Submitted batch job N" as the job's record instead
    # umask 077: submitit's pickles and sbatch script, and (Slurm passes the umask on) the job's logs, are 0600
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), private_umask():
        job = chosen.submit(Task(str(path)))
    fields: dict[str, Any] = {"slurm_job_id": str(job.job_id), "slurm_folder": str(folder), "slurm_cluster": where}
    if where == "local":  # the local "job" is a controller process of this machine: follow it by pid
        pid = int(job.job_id)
        fields.update(runner_pid=pid, runner_start=process_start_time(pid))
    return fields


_states: dict[str, tuple[float, SlurmState]] = {}


def state(info: Mapping[str, Any]) -> SlurmState:
    """The job's Slurm state (``slurm_state.ask``: the controller, the accounting, its output), asked at most
    every ``STATE_CACHE_S`` per job."""
    job_id = str(info.get("slurm_job_id", ""))
    if info.get("slurm_cluster") == "local":
        alive = is_same_process(int(info.get("runner_pid") or 0), info.get("runner_start"))
        return SlurmState("RUNNING" if alive else "ENDED", "its controller process")
    cached = _states.get(job_id)
    if cached is not None and time.monotonic() - cached[0] < STATE_CACHE_S:
        return cached[1]
    found = slurm_state.ask(job_id, info.get("slurm_folder"))
    _states[job_id] = (time.monotonic(), found)
    return found


def end(info: Mapping[str, Any]) -> RunEnd:
    """How the job ended, or that it is active (``run_dirs.run_end``): as recorded, or as Slurm sees it while the
    record says it is active."""
    return run_end(info, _slurm_watch)


def _slurm_watch(info: Mapping[str, Any]) -> RunEnd:
    """An active job as Slurm sees it: queued (requeued), running, or ended without rank 0 recording the end."""
    recorded = str(info.get("status", "?"))
    found = state(info)
    stand_in = " (local stand-in)" if info.get("slurm_cluster") == "local" else ""
    job = f"Slurm job {info.get('slurm_job_id')}{stand_in}"
    requeued = ""
    if found.restarts:
        kept = info.get("slurm_attempts_kept")
        requeued = f"requeued by Slurm {found.restarts} time(s)" + (
            f", the earlier attempts' rank files kept in {kept}" if kept else ""
        )
    if found.restarts > int(info.get("slurm_restarts") or 0) and found.state not in ("UNKNOWN", *ENDED_STATES):
        # requeued, and the new attempt has not begun (its rank 0 records the restart): the earlier one may be ending
        return RunEnd("queued", f"{job}: {requeued}; {found.state}", brief=f"requeued, {found.state}")
    if found.state in QUEUED_STATES:
        why = f" ({found.reason})" if found.reason else ""
        if requeued:
            return RunEnd("queued", f"{job}: {requeued}; {found.state}{why}", brief=f"requeued, {found.state}")
        return RunEnd("queued", f"{job}: {found.state}{why}")
    if found.state in RUNNING_STATES:
        nodes = found.nodes or ",".join(info.get("slurm_nodes") or []) or "its nodes"
        again = f" (attempt {found.restarts + 1}: {requeued})" if requeued else ""
        status = "running" if recorded == "queued" or found.restarts else recorded
        return RunEnd(status, f"{job}: {found.state} on {nodes}{again}")
    if found.state == "UNKNOWN":
        return RunEnd(recorded, f"{job}: Slurm cannot tell its state now ({found.source})")
    told = f"{found.state}, from {found.source}" if found.source != "controller" else found.state
    ended = f"{job} ended ({told}) without recording a result; see {info.get('slurm_folder')}"
    if found.state.startswith("CANCELLED"):
        return RunEnd("killed", ended)
    return RunEnd("lost" if found.state in ("COMPLETED", "ENDED") else "failed", ended)


def outputs(path: Path, info: Mapping[str, Any]) -> list[tuple[int | None, Path]]:
    """Each rank's own log (rank given when there are several, for the ``[rank N]`` prefix)."""
    files, ranks = RunFiles(path), int(info.get("ranks") or 1)
    return [(rank if ranks > 1 else None, files.rank_log(rank)) for rank in range(ranks)]


def resources(info: Mapping[str, Any]) -> str:
    """The allocation's shape, e.g. ``slurm 2×4, 4 GPU/node``."""
    params = info.get("slurm") or {}
    shape = f"{params.get('nodes', 1)}×{params.get('tasks_per_node', 1)}"
    gpus = params.get("gpus_per_node") or params.get("slurm_gres")
    return f"slurm {shape}" + (f", {gpus} GPU/node" if isinstance(gpus, int) else f", {gpus}" if gpus else "")


def kill(path: Path, info: Mapping[str, Any], grace_s: float) -> None:
    """Cancel the job through Slurm (scancel), or stop submitit's local controller (``CONTROLLER_GRACE_S``);
    record the kill."""
    records.request_kill(path)
    pid = info.get("runner_pid")
    if info.get("slurm_cluster") == "local":  # submitit's stand-in: a controller process of this machine
        stopped = stop_process_tree(pid, CONTROLLER_GRACE_S, group=False)
        done = f"stopped submitit's local controller (pid {pid})" if stopped else "its controller had ended"
    else:
        done = cancel(info)
    records.record_killed(path, f"killed with %jobs kill: {done}")


def cancel(info: Mapping[str, Any]) -> str:
    """Cancel a Slurm job through Slurm (scancel). Returns what was done.

    Raises:
        InvalidArgument: scancel refused (its words).
    """
    job_id = str(info.get("slurm_job_id"))
    try:
        done = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise InvalidArgument(f"cannot cancel Slurm job {job_id}: scancel failed ({err})") from None
    if done.returncode != 0:
        raise InvalidArgument(f"scancel {job_id} refused: {one_line(done.stderr or done.stdout, 200)}")
    _states.pop(job_id, None)
    return f"cancelled through Slurm (scancel {job_id})"


def _whole(value: Any, what: str, lowest: int, highest: int) -> int:
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= highest:
        raise InvalidArgument(f"{what} must be a whole number from {lowest} to {highest}, got {value!r}")
    return value


def _split(ranks: int, nodes: int) -> int:
    if ranks % nodes:
        raise InvalidArgument(f"{ranks} ranks cannot be spread evenly over {nodes} nodes")
    return ranks // nodes


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value.strip()):
        raise InvalidArgument(f"{what} must be a word like 'gpu' or 'gpu:a100:4', got {value!r}")
    return value.strip()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

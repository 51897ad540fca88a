"""The local executor: jobs queued on this machine until their GPUs are free, each carried by a detached
runner (``jobs.runner``) that records its end. Killing a job ends its runner's whole process tree."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from gpumagic.devices import lease_directory, leases, pick_lock
from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.model import MAX_GPUS, Inventory
from gpumagic.devices.processes import end_processes, is_same_process
from gpumagic.devices.spec import parse_spec, resolve
from gpumagic.errors import InvalidArgument
from gpumagic.jobs import notify
from gpumagic.jobs.executors import Entry, Submission
from gpumagic.jobs.queue import Request, Ticket, place, remove_tickets
from gpumagic.launch.plan import command_environment
from gpumagic.run_dirs import records, store
from gpumagic.run_dirs.layout import RUNS_VARIABLE, RunFiles, runs_root
from gpumagic.run_dirs.private import open_private
from gpumagic.run_dirs.run_end import RunEnd, judged_here, lost, run_end
from gpumagic.units import format_bytes, parse_size

RUNNER_PID_WAIT_S = 10.0  # a job killed a moment after its submission: its runner has not written its pid yet


def check_resources(
    gpus: int | str | None, min_free: str | int | None, ddp: int | None, options: Mapping[str, Any] | None
) -> tuple[Request, Inventory | None]:
    """What the jobs ask of the queue, checked against this machine's GPUs (read for it, and returned).

    Raises:
        InvalidArgument: Slurm ``options``, a malformed request, or more than this machine has.
    """
    if options is not None:
        raise InvalidArgument("slurm options need executor='slurm' (--executor slurm)")
    return _request(gpus, min_free, ddp)


def submit(entries: list[Entry], resources: tuple[Request, Inventory | None], submission: Submission) -> list[Path]:
    """Take every name (all or none), write the jobs with their tickets and start their runners."""
    request, inventory = resources
    if request.wants:
        lease_directory.lease_dir()  # an unusable lease directory is refused before any job is written
    paths: list[Path] = []
    tickets: list[Ticket] = []
    with records.names_locked():
        names = records.take_names([(entry.name, entry.base) for entry in entries])
        try:
            for job_name, entry in zip(names, entries, strict=True):
                paths.append(
                    records.create(
                        job_name,
                        entry.packed,
                        ranks=submission.ddp or 1,
                        request=request.to_json(),
                        ddp=submission.ddp,
                        memory_limit=submission.memory_limit,
                        sys_path=[p for p in sys.path if p],
                        **submission.record(entry),
                    )
                )
                if request.wants and not submission.after:  # its place in the queue is its submission, from now
                    info = records.read(paths[-1])
                    tickets.append(
                        Ticket.create(job_name, request, info["submitted"], paths[-1].name, provisional=True)
                    )
        except BaseException:  # all or none: a sweep that cannot be written whole leaves nothing half made
            for ticket in tickets:
                ticket.remove()
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
            raise
    _say_who_waits(paths, tickets, inventory)
    for path in paths:
        _start_runner(path)
    return paths


def resume(path: Path, changes: dict[str, Any]) -> int:
    """Start the next attempt of the ended job at ``path`` with ``changes`` to its spec (``records.start_attempt``):
    it queues again, and its code restores from its checkpoints. Returns the attempt's number.

    Raises:
        InvalidArgument: it is active, or finished (``api.Job.resume`` says so first; checked again under the lock,
            against a second kernel resuming it at the same moment).
    """
    request = Request.from_json(changes.get("request") or records.read_spec(path).request)
    if request.wants:
        lease_directory.lease_dir()  # an unusable lease directory is refused before anything moves
    with records.names_locked():
        info = records.read(path)
        check_resumable(info["name"], end(info).status)
        try:
            attempt = records.start_attempt(path, changes)
            _start_runner(path)
        except BaseException as err:  # never left queued without a runner: it reads failed, and can be resumed again
            with contextlib.suppress(OSError):
                records.update(path, runner_pid=None)
                store.record_end(path, "failed", f"resuming it failed: {type(err).__name__}: {err}")
            raise
    return attempt


def check_resumable(name: str, status: str) -> None:
    """Raises InvalidArgument unless a job that is ``status`` can be resumed (it ended, without finishing)."""
    if status in records.ACTIVE:
        raise InvalidArgument(
            f"job {name} is {status}; resume starts a new attempt of an ended job (%jobs kill {name} first)"
        )
    if status == "finished":
        raise InvalidArgument(f"job {name} finished; there is nothing to resume (submit it again for a new run)")


def end(info: Mapping[str, Any]) -> RunEnd:
    """How the job ended, or that it is active: as recorded, or ``lost`` when it should be alive but its runner is
    gone (``run_dirs.run_end``)."""
    return run_end(info, _runner_watch)


def _runner_watch(info: Mapping[str, Any]) -> RunEnd | None:
    """``lost`` when the active job's runner is gone; None (as recorded) while it runs, or where this machine
    cannot tell (the job was submitted on another machine sharing the runs directory)."""
    if not judged_here(info) or runner_alive(info):
        return None
    return lost(f"runner (pid {info.get('runner_pid')})")


def outputs(path: Path, info: Mapping[str, Any]) -> list[tuple[int | None, Path]]:
    """``output.log``: the runner writes every rank's output there, prefixed."""
    return [(None, RunFiles(path).output)]


def resources(info: Mapping[str, Any]) -> str:
    """The NVML indices of its GPUs (``"0,2"``); empty while it waits, or for a CPU job."""
    return ",".join(map(str, info.get("gpus") or ()))


def kill(path: Path, info: Mapping[str, Any], grace_s: float) -> None:
    """End the job's runner and everything it started, give back its place in the queue, record the kill."""
    deadline = time.monotonic() + RUNNER_PID_WAIT_S
    while info.get("runner_pid") is None and time.monotonic() < deadline:
        time.sleep(0.05)
        info = records.read(path)
    records.request_kill(path)
    stop_process_tree(info.get("runner_pid"), grace_s)
    remove_tickets(path.name)
    records.record_killed(path, f"killed with %jobs kill (SIGKILL: still running {grace_s:g}s after SIGTERM)")
    # a runner ended by SIGKILL told nobody; one that told first is not repeated; a slow target never holds the kill
    threading.Thread(target=notify.notify, args=(path, "killed"), name="gpumagic-notify", daemon=True).start()


def runner_alive(info: Mapping[str, Any]) -> bool:
    """True while the job's runner runs (a young job whose runner has not written its pid yet counts)."""
    pid = info.get("runner_pid")
    if pid is None:
        return time.time() - float(info.get("submitted", 0)) < 30
    return is_same_process(int(pid), info.get("runner_start"))


def stop_process_tree(pid: int | None, grace_s: float, *, group: bool = True) -> bool:
    """End ``pid`` and every process it started (a job's ranks each lead their own process group, ended too)
    with the one SIGTERM-then-SIGKILL ladder; with ``group``, also the group ``pid`` leads, which may outlive
    it (a runner leads its own session and group). Returns whether ``pid`` was still running."""
    tree = _process_tree(pid) if pid else []
    pids = [p.pid for p in tree]
    end_processes(pids, groups=[pid, *pids] if group and pid else pids, grace_s=grace_s)
    return bool(tree)


def _process_tree(pid: int) -> list[Any]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _start_runner(path: Path) -> None:
    """Start the job's runner, detached (it forks again and leaves its parent, which exits at once)."""
    env = command_environment()
    env[RUNS_VARIABLE] = str(runs_root())
    with open_private(RunFiles(path).runner_log) as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpumagic.jobs.runner", str(path)],
            cwd=os.getcwd(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            close_fds=True,
        )
    process.wait(timeout=60)


def _say_who_waits(paths: list[Path], tickets: list[Ticket], inventory: Inventory | None) -> None:
    """Record at once why a new job will wait (its runner says so too, a moment later), so a ``%jobs`` run
    right after the submission already tells."""
    if not tickets or inventory is None:
        return
    try:
        with pick_lock.pick_lock(exclusive=False):
            for ticket in tickets:
                chosen, reason = place(ticket, inventory, leases.book())
                if not chosen:
                    path = next(p for p in paths if p.name in ticket.path.name)
                    records.update(path, reason=reason)
    except pick_lock.LeaseBusy:  # the runners will say why they wait
        return


def _request(gpus: int | str | None, min_free: str | int | None, ddp: int | None) -> tuple[Request, Inventory | None]:
    if gpus is None:
        gpus = ddp or 1
    if isinstance(gpus, str) and gpus.strip().isascii() and gpus.strip().isdigit():
        gpus = int(gpus.strip())
    if isinstance(gpus, bool) or not isinstance(gpus, (int, str)):
        raise InvalidArgument(f"gpus is a number of GPUs or a device spec like 'GPU:1', got {gpus!r}")
    if isinstance(gpus, int) and not 0 <= gpus <= MAX_GPUS:
        raise InvalidArgument(f"gpus must be from 0 to {MAX_GPUS}, got {gpus}")
    free = parse_size(min_free) if min_free is not None else None
    if free is not None and free <= 0:
        raise InvalidArgument("min_free must be more than 0 bytes")
    spec = parse_spec(gpus) if isinstance(gpus, str) else None
    if gpus == 0 or (spec is not None and spec.none):
        if free is not None:
            raise InvalidArgument("min_free needs GPUs; leave it out for a CPU job (gpus=0)")
        return Request(0), None
    inventory = read_inventory()
    if not inventory.gpus:
        why = f" ({inventory.problem})" if inventory.problem else ""
        raise InvalidArgument(
            f"this machine has no GPU{why}; submit with jobs_with(gpus=0) (--gpus 0) to run on the CPU, "
            "or set GPUMAGIC_SIMULATE=4xA100-80GB to try the queue with simulated GPUs"
        )
    if spec is not None:
        uuids = tuple(g.uuid for g in resolve(spec, inventory))
        wants = len(uuids)
        request = Request(wants, uuids, free)
    else:
        wants = int(gpus)
        if wants > len(inventory.gpus):
            raise InvalidArgument(f"the job asks for {wants} GPUs; this machine has {len(inventory.gpus)}")
        request = Request(wants, (), free)
    if free is not None:
        biggest = max((g.memory_total or 0) for g in inventory.gpus)
        if free > biggest:
            raise InvalidArgument(
                f"min_free {format_bytes(free)} is more than any GPU here has ({format_bytes(biggest)})"
            )
    if ddp is not None and wants % ddp:
        raise InvalidArgument(f"{wants} GPUs cannot be split evenly among {ddp} ranks; ask for a multiple of {ddp}")
    return request, inventory

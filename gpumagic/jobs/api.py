"""Background jobs: notebook code submitted as detached jobs, queued until GPUs are free, and the ``Job``
handle that lists, follows, waits for, kills and removes them, from this kernel or any later one."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpumagic.devices.model import Inventory
from gpumagic.errors import GpumagicError, InvalidArgument, KillRefused
from gpumagic.jobs import records
from gpumagic.jobs.queue import Request, Ticket, remove_tickets
from gpumagic.telemetry.run_files import RunFiles
from gpumagic.units import format_bytes, format_duration, parse_duration, parse_size

EXECUTORS = ("local", "slurm")
MAX_GPUS = 64
MAX_RANKS = 256
KILL_GRACE_S = 5.0


class JobFailed(GpumagicError):
    """A job's result was asked for, but it did not finish. Shows the job's own traceback in a notebook."""

    def __init__(self, job: Job, report: str) -> None:
        self.job = job
        self.report = report
        super().__init__(report)

    def _render_traceback_(self) -> list[str]:
        return [f"JobFailed: {self.report}"]


class Job:
    """A background job, read from its directory at every access (so it is always current)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def info(self) -> dict[str, Any]:
        """Everything ``run.json`` records (see ``jobs.records``)."""
        return records.read(self.path)

    @property
    def name(self) -> str:
        return self.info["name"]

    @property
    def status(self) -> str:
        """queued, running, finished, failed, killed, cancelled, or lost (its runner vanished)."""
        return records.effective_status(self.info)

    @property
    def reason(self) -> str:
        """Why it waits (queued), or why it ended."""
        return records.why(self.info)

    @property
    def gpus(self) -> tuple[int, ...]:
        """NVML indices of the GPUs it runs on (empty while queued, or for CPU jobs)."""
        return tuple(self.info.get("gpus") or ())

    @property
    def elapsed(self) -> float:
        """Seconds it has run (so far, or in all), or waited if it never started."""
        return records.elapsed(self.info)

    def wait(self, timeout: str | float | None = None, poll_s: float = 0.2) -> str:
        """Block until the job ends; returns its status. Raises TimeoutError after ``timeout`` ("10m", s)."""
        limit = parse_duration(timeout) if timeout is not None else None
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            status = self.status
            if status in records.ENDED:
                return status
            if deadline is not None and time.monotonic() > deadline:
                waited = f"{(limit or 0) * 1000:.0f}ms" if (limit or 0) < 1 else format_duration(limit or 0)
                raise TimeoutError(f"job {self.name} is still {status} after {waited}")
            time.sleep(poll_s)

    def result(self, timeout: str | float | None = None) -> Any:
        """The job's return value (rank 0's; ``{rank: value}`` with ``ddp``), once it has finished.

        Raises:
            JobFailed: it failed, was killed, cancelled or lost; the message has its traceback.
        """
        status = self.wait(timeout)
        if status != "finished":
            raise JobFailed(self, self._failure_report(status))
        import cloudpickle

        from gpumagic.launch.signing import read_sealed

        path = RunFiles(self.path).result
        return cloudpickle.loads(read_sealed(path, f"job {self.name}'s result ({path})"))

    def _failure_report(self, status: str) -> str:
        error = RunFiles(self.path).error
        if error.exists():
            return f"job {self.name} {status}: " + error.read_text().rstrip()
        return f"job {self.name} {status}: {self.reason}"

    def _outputs(self) -> list[tuple[int | None, Path]]:
        """Where its output is: ``output.log``, or each rank's own file for a Slurm job (rank given when there
        are several, for the ``[rank N]`` prefix)."""
        info, files = self.info, RunFiles(self.path)
        if info.get("executor") != "slurm":
            return [(None, files.output)]
        ranks = int(info.get("ranks") or 1)
        return [(rank if ranks > 1 else None, files.rank_log(rank)) for rank in range(ranks)]

    def logs(self, tail: int | None = None) -> str:
        """Its stdout and stderr so far (the last ``tail`` lines); a Slurm job's ranks one after another."""
        from gpumagic.launch.output import RankOutput

        parts: list[str] = []
        sources = self._outputs()
        sink = RankOutput(parts.append, "all", len(sources))
        for rank, path in sources:
            data = path.read_bytes() if path.exists() else b""
            if rank is None:
                parts.append(data.decode(errors="replace"))
            else:
                sink.feed(rank, data)
                sink.flush()
        text = "".join(parts)
        if tail is not None:
            text = "".join(text.splitlines(True)[-tail:] if tail else [])
        return text

    def follow(self, write: Callable[[str], None] | None = None, poll_s: float = 0.2, tail: int | None = None) -> str:
        """Write its output as it comes until it ends (an interrupt stops following, not the job); with
        ``tail``, start from the last ``tail`` lines written so far.

        Returns the job's status when following stopped.
        """
        from gpumagic.launch.output import RankOutput

        write = write or _print
        sources = self._outputs()
        offsets = {path: 0 for _, path in sources}
        if tail is not None:
            for _, path in sources:
                offsets[path] = path.stat().st_size if path.exists() else 0
            shown = self.logs(tail)  # may repeat a line written between the two reads, never miss one
            if shown:
                write(shown)
        sink = RankOutput(write, "all", len(sources))
        try:
            while True:
                ended = self.status in records.ENDED  # read before the logs: nothing written after it is missed
                for rank, path in sources:
                    try:
                        with open(path, "rb") as handle:
                            handle.seek(offsets[path])
                            data = handle.read()
                    except FileNotFoundError:
                        continue
                    offsets[path] += len(data)
                    if data and rank is None:
                        write(data.decode(errors="replace"))
                    elif data:
                        sink.feed(rank, data)
                if ended:
                    sink.flush()
                    break
                time.sleep(poll_s)
        except KeyboardInterrupt:
            pass
        return self.status

    def metrics(self) -> dict[int, dict[str, Any]]:
        """``{rank: {metric: Series}}`` of everything it has logged with ``gpumagic.log``."""
        from gpumagic.telemetry.store import Run

        return Run(self.path, self.info).metrics()

    def last_metrics(self) -> dict[str, tuple[float, float]]:
        """Rank 0's latest ``{metric: (step, value)}``."""
        rank0 = self.metrics().get(0, {})
        return {name: (s.steps[-1], s.values[-1]) for name, s in rank0.items() if len(s)}

    def kill(self, grace_s: float = KILL_GRACE_S) -> str:
        """Stop the job and its whole process tree: SIGTERM, then SIGKILL after ``grace_s``. Returns the status.

        Raises:
            InvalidArgument: it has ended already. KillRefused: another user's job.
        """
        info = self.info
        status = records.effective_status(info)
        if status in records.ENDED:
            raise InvalidArgument(f"job {info['name']} has already ended ({status}); nothing to kill")
        if RunFiles(self.path).record.stat().st_uid != os.getuid():
            raise KillRefused(f"job {info['name']} belongs to another user; only they can stop it")
        if info.get("executor") == "slurm":
            return self._cancel_on_slurm(info)
        deadline = time.monotonic() + 10
        while info.get("runner_pid") is None and time.monotonic() < deadline:  # submitted a moment ago
            time.sleep(0.05)
            info = self.info
        _write_private(RunFiles(self.path).kill_request, json.dumps({"pid": os.getpid(), "time": time.time()}))
        pid = info.get("runner_pid")
        _stop_tree(pid, _process_tree(pid) if pid else [], time.monotonic() + grace_s)
        remove_tickets(self.path.name)
        if records.read(self.path).get("status") in records.ACTIVE:
            records.update(
                self.path,
                status="killed",
                reason="",
                exit=f"killed with %jobs kill (SIGKILL: still running {grace_s:g}s after SIGTERM)",
                ended=time.time(),
            )
        return self.status

    def _cancel_on_slurm(self, info: dict[str, Any]) -> str:
        from gpumagic.jobs import slurm

        _write_private(RunFiles(self.path).kill_request, json.dumps({"pid": os.getpid(), "time": time.time()}))
        pid = info.get("runner_pid")
        if info.get("slurm_cluster") == "local":  # submitit's stand-in: a controller process of this machine
            tree = _process_tree(pid) if pid else []
            _stop_tree(None, tree, time.monotonic() + KILL_GRACE_S)
            done = f"stopped submitit's local controller (pid {pid})" if tree else "its controller had ended"
        else:
            done = slurm.cancel(info)
        if records.read(self.path).get("status") in records.ACTIVE:
            records.update(
                self.path, status="killed", reason="", exit=f"killed with %jobs kill: {done}", ended=time.time()
            )
        return self.status

    def remove(self) -> None:
        """Delete the job's directory (output, metrics, result). Raises InvalidArgument while it is active."""
        import shutil

        status = self.status
        if status in records.ACTIVE:
            raise InvalidArgument(f"job {self.name} is {status}; kill it first (%jobs kill {self.name})")
        shutil.rmtree(self.path)

    def describe(self) -> str:
        """One line: name, status, GPUs, elapsed time, why (waiting or ended), latest metrics."""
        info = self.info
        status = records.effective_status(info)
        gpus = ",".join(map(str, info.get("gpus") or ()))
        where = f" on GPU {gpus}" if gpus else " on the CPU" if info.get("started") else ""
        text = f"{info['name']}: {status}{where}, {format_duration(records.elapsed(info))}"
        reason = records.why(info)
        if status != "finished" and reason:
            text += f" ({reason})"
        latest = _format_metrics(self.last_metrics())
        return text + (f" · {latest}" if latest else "")

    def __repr__(self) -> str:
        try:
            return f"Job({self.describe()})"
        except (OSError, ValueError, KeyError):
            return f"Job({self.path.name}: removed)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Job) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)


def submit(
    fn: Callable[..., Any],
    *args: Any,
    gpus: int | str | None = None,
    name: str | None = None,
    min_free: str | int | None = None,
    ddp: int | None = None,
    after: str | Iterable[str] | Job | None = None,
    backend: str | None = None,
    timeout: str | float = "30m",
    executor: str = "local",
    slurm: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Job:
    """Run ``fn(*args, **kwargs)`` as a background job; returns its ``Job`` at once.

    ``fn`` may be defined in the notebook (it is shipped by value). The job waits in this machine's queue
    until its GPUs are free, then runs detached from the kernel: it survives interrupts, restarts and the
    kernel's end, and ``gpumagic.job(name)`` finds it from any kernel.

    Args:
        gpus: how many GPUs (default 1, or one per rank with ``ddp``; 0 runs on the CPU), or a device spec
            naming them (``"GPU:1"``, ``"0,2"``, ``"A100"``).
        name: the job's name (default: the function's, made unique).
        min_free: memory each GPU needs free (``"20GB"``); the job may then share a GPU with other jobs
            (placed once those have allocated their memory). Without it a job takes whole GPUs.
        ddp: run as a DDP group of this many ranks (process group initialized, as ``launch_ddp``).
        after: name(s) or Job(s) that must finish first; if one fails, this job is cancelled.
        backend, timeout: of the process group with ``ddp``.
        executor: ``"local"`` (this machine's queue) or ``"slurm"``: submitted through submitit with the
            options in ``slurm`` (``partition``, ``time``, ``nodes``, ``tasks_per_node``, ``gres`` ...: see
            ``gpumagic.jobs.slurm.parameters``); every task is a rank of one DDP group; ``gpus`` is per node.

    Raises:
        InvalidArgument: a malformed option, an unknown ``after`` job, a name already taken, more GPUs than
            the machine has. ShippingError: something ``fn`` needs cannot be pickled (named).
    """
    from gpumagic.launch.shipping import pack, ship_function

    packed = pack(ship_function(fn, tuple(args), dict(kwargs), rank_first=False))
    base = getattr(fn, "__name__", "job")
    return _create(
        [(name, base, packed, {})], gpus, min_free, ddp, after, backend, timeout, f"{base}()", executor, slurm
    )[0]


def submit_cell(
    source: str,
    namespace: Mapping[str, Any],
    *,
    filename: str,
    hidden: Collection[str] = (),
    name: str | None = None,
    gpus: int | str | None = None,
    min_free: str | int | None = None,
    ddp: int | None = None,
    after: str | Iterable[str] | None = None,
    backend: str | None = None,
    timeout: str | float = "30m",
    executor: str = "local",
    slurm: Mapping[str, Any] | None = None,
) -> Job:
    """A notebook cell as a background job (``%%launch_bg``): its code with the notebook names it uses; the
    value of its last expression is the job's result. Options as ``submit``'s."""
    from gpumagic.launch.shipping import pack, ship_cell

    packed = pack(ship_cell(source, namespace, filename, hidden))
    return _create([(name, "job", packed, {})], gpus, min_free, ddp, after, backend, timeout, "cell", executor, slurm)[
        0
    ]


def sweep(
    fn: Callable[..., Any],
    grid: Mapping[str, Sequence[Any]],
    gpus_per_job: int | str = 1,
    *,
    name: str | None = None,
    min_free: str | int | None = None,
    ddp: int | None = None,
    after: str | Iterable[str] | None = None,
    **fixed: Any,
) -> list[Job]:
    """One job per point of ``grid`` (every combination): ``fn(**point, **fixed)``, named ``name-k=v,...``.

    Example: ``sweep(train, {"lr": [1e-3, 1e-4], "width": [64, 128]})`` submits four jobs, queued on free GPUs.
    All names are taken together: if one exists already, no job is submitted.
    """
    from gpumagic.launch.shipping import pack, ship_function

    if not isinstance(grid, Mapping) or not grid:
        raise InvalidArgument("grid must be a non-empty dict of parameter name -> list of values")
    for key, values in grid.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidArgument(f"grid keys are argument names of fn, got {key!r}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise InvalidArgument(f"grid[{key!r}] must be a non-empty list of values, got {values!r}")
    base = name or getattr(fn, "__name__", "job")
    entries = []
    for combination in itertools.product(*grid.values()):
        point = dict(zip(grid.keys(), combination, strict=True))
        label = ",".join(f"{k}={_short(v)}" for k, v in point.items())
        packed = pack(ship_function(fn, (), {**point, **fixed}, rank_first=False))
        entries.append((_sanitize(f"{base}-{label}"), base, packed, {k: _short(v) for k, v in point.items()}))
    return _create(entries, gpus_per_job, min_free, ddp, after, None, "30m", f"{getattr(fn, '__name__', 'fn')}()")


def job(name: str) -> Job:
    """The job called ``name`` (of this user, from any kernel). Raises InvalidArgument if there is none."""
    if isinstance(name, Job):
        return name
    return Job(records.find(str(name)))


def list_jobs() -> list[Job]:
    """Every job of this user, oldest first."""
    return [Job(path) for path in records.all_jobs()]


def _create(
    entries: list[tuple[str | None, str, bytes, dict[str, Any]]],
    gpus: int | str | None,
    min_free: str | int | None,
    ddp: int | None,
    after: Any,
    backend: str | None,
    timeout: str | float,
    description: str,
    executor: str = "local",
    slurm: Mapping[str, Any] | None = None,
) -> list[Job]:
    """Validate the options once, take every name (all or none), write the jobs and start their runners."""
    from gpumagic.launch.plan import check_backend, check_timeout

    ddp = _check_ddp(ddp)
    if executor not in EXECUTORS:
        raise InvalidArgument(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if executor == "slurm":
        return _create_on_slurm(entries, gpus, min_free, ddp, after, backend, timeout, description, slurm)
    if slurm is not None:
        raise InvalidArgument("slurm options need executor='slurm' (--executor slurm)")
    request, inventory = _request(gpus, min_free, ddp)
    check_backend(backend)
    timeout_s = check_timeout(timeout)
    dependencies = _dependencies(after)
    if request.wants:
        from gpumagic.devices.leases import lease_dir

        lease_dir()  # an unusable lease directory is refused before any job is written
    paths: list[Path] = []
    tickets: list[Ticket] = []
    with records.names_locked():
        names = _take_names(entries)
        try:
            for job_name, (_, _, packed, params) in zip(names, entries, strict=True):
                paths.append(
                    records.create(
                        job_name,
                        packed,
                        ranks=ddp or 1,
                        request=request.to_json(),
                        ddp=ddp,
                        after=dependencies,
                        backend=backend,
                        timeout_s=timeout_s,
                        params=params,
                        description=description,
                        uid=os.getuid(),
                        sys_path=[p for p in sys.path if p],
                        cwd=os.getcwd(),
                    )
                )
                if request.wants and not dependencies:  # its place in the queue is its submission, from now
                    info = records.read(paths[-1])
                    tickets.append(
                        Ticket.create(job_name, request, info["submitted"], paths[-1].name, provisional=True)
                    )
        except BaseException:  # all or none: a sweep that cannot be written whole leaves nothing half made
            import shutil

            for ticket in tickets:
                ticket.remove()
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
            raise
    _say_who_waits(paths, tickets, inventory)
    for path in paths:
        _start_runner(path)
    return [Job(path) for path in paths]


def _take_names(entries: list[tuple[str | None, str, bytes, dict[str, Any]]]) -> list[str]:
    """The jobs' names: the explicit ones checked, the others made unique. Call under ``names_locked()``."""
    taken = set(records.names())  # read once: each job's run.json
    names = []
    for explicit, base, _, _ in entries:
        if explicit is not None:
            records.check_name(explicit)
            if explicit in taken:
                raise InvalidArgument(
                    f"a job named {explicit!r} exists already; choose another name, or remove it (%jobs rm {explicit})"
                )
            names.append(explicit)
        else:
            names.append(_free_name(_sanitize(base), taken))
        taken.add(names[-1])
    return names


def _create_on_slurm(
    entries: list[tuple[str | None, str, bytes, dict[str, Any]]],
    gpus: int | str | None,
    min_free: Any,
    ddp: int | None,
    after: Any,
    backend: str | None,
    timeout: str | float,
    description: str,
    options: Mapping[str, Any] | None,
) -> list[Job]:
    """Write the jobs' directories as for local jobs and submit each through submitit."""
    from gpumagic.jobs import slurm
    from gpumagic.launch.plan import check_backend, check_timeout
    from gpumagic.launch.rank import write_spec

    if min_free is not None:
        raise InvalidArgument("min_free is for this machine's queue; on Slurm ask for whole GPUs (gpus, gres)")
    if isinstance(gpus, str) and not (gpus.strip().isascii() and gpus.strip().isdigit()):
        raise InvalidArgument(f"on Slurm, gpus is a number of GPUs per node, got {gpus!r}")
    where = slurm.cluster()
    slurm.check_available(where)
    check_backend(backend)
    timeout_s = check_timeout(timeout)
    dependencies = _dependencies(after)
    params, ranks = slurm.parameters("check", options, gpus, ddp, where)  # validated before anything is written
    if dependencies:
        if where == "local":
            raise InvalidArgument("after= needs a real Slurm cluster (GPUMAGIC_SLURM=local cannot chain jobs)")
        ids = []
        for name in dependencies:
            info = records.read(records.find(name))
            if not info.get("slurm_job_id") or info.get("slurm_cluster") == "local":
                raise InvalidArgument(f"job {name} is not a Slurm job; a Slurm job can only run after Slurm jobs")
            ids.append(info["slurm_job_id"])
        extra = dict(params.get("slurm_additional_parameters") or {})
        extra["dependency"] = "afterok:" + ":".join(ids)
        params["slurm_additional_parameters"] = extra
    use_cuda = slurm.uses_gpus(params)
    jobs = []
    with records.names_locked():
        names = _take_names(entries)
        paths = []
        for job_name, (_, _, packed, point) in zip(names, entries, strict=True):
            path = records.create(
                job_name,
                packed,
                reserve=False,  # Slurm runs it: no runner of ours records its end
                ranks=ranks,
                executor="slurm",
                slurm_cluster=where,
                request=Request(0).to_json(),
                ddp=ranks if ranks > 1 else None,
                after=dependencies,
                backend=backend,
                timeout_s=timeout_s,
                params=point,
                description=description,
                uid=os.getuid(),
                cwd=os.getcwd(),
                runner_pid=None,
            )
            spec = {
                "backend": (backend or ("nccl" if use_cuda else "gloo")) if ranks > 1 or ddp else None,
                "use_cuda": use_cuda,
                "timeout_s": timeout_s,
                "threads_per_rank": int(params.get("cpus_per_task") or 1),
                "sys_path": [p for p in sys.path if p],
            }
            write_spec(RunFiles(path), spec, packed)
            paths.append((job_name, path))
    for job_name, path in paths:
        try:
            fields = slurm.submit(path, {**params, "name": job_name}, where)
        except Exception as err:  # noqa: BLE001 - sbatch's own refusal (partition, limits) is the user's answer
            records.update(path, status="failed", reason="", exit=f"submission failed: {err}", ended=time.time())
            raise InvalidArgument(f"submitting job {job_name} failed: {err}") from None
        records.update(path, reason=f"submitted as Slurm job {fields['slurm_job_id']}", slurm=params, **fields)
        jobs.append(Job(path))
    return jobs


def _say_who_waits(paths: list[Path], tickets: list[Ticket], inventory: Inventory | None) -> None:
    """Record at once why a new job will wait (its runner says so too, a moment later), so a ``%jobs`` run
    right after the submission already tells."""
    from gpumagic.devices import leases
    from gpumagic.jobs.queue import place

    if not tickets or inventory is None:
        return
    try:
        with leases.pick_lock(exclusive=False):
            for ticket in tickets:
                chosen, reason = place(ticket, inventory, leases.book())
                if not chosen:
                    path = next(p for p in paths if p.name in ticket.path.name)
                    records.update(path, reason=reason)
    except leases.LeaseBusy:  # the runners will say why they wait
        return


def _check_ddp(ddp: Any) -> int | None:
    if ddp is None:
        return None
    if isinstance(ddp, bool) or not isinstance(ddp, int) or not 1 <= ddp <= MAX_RANKS:
        raise InvalidArgument(f"ddp is the number of ranks, a whole number from 1 to {MAX_RANKS}, got {ddp!r}")
    return ddp


def _request(gpus: int | str | None, min_free: str | int | None, ddp: int | None) -> tuple[Request, Inventory | None]:
    """What the job asks of the queue, checked against this machine's GPUs (read for it, and returned)."""
    from gpumagic.devices.inventory import read_inventory
    from gpumagic.devices.spec import parse_spec, resolve

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
            f"this machine has no GPU{why}; submit with gpus=0 (--gpus 0) to run on the CPU, "
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


def _dependencies(after: Any) -> list[str]:
    if after is None:
        return []
    items = [after] if isinstance(after, (str, Job)) else list(after)
    names = []
    for item in items:
        if isinstance(item, Job):
            names.append(item.name)
            continue
        for part in str(item).split(","):
            part = part.strip()
            if part:
                records.find(part)  # raises for an unknown job
                names.append(part)
    return names


def _free_name(base: str, taken: Collection[str]) -> str:
    if base not in taken:
        return base
    for number in itertools.count(2):
        candidate = f"{base}-{number}"
        if candidate not in taken:
            return candidate
    raise AssertionError("unreachable")


def _sanitize(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.,=+-]", "_", text).lstrip("_.,=+-")[:80]
    return cleaned or "job"


def _short(value: Any) -> str:
    return value if isinstance(value, str) else repr(value) if not isinstance(value, float) else f"{value:g}"


def _start_runner(path: Path) -> None:
    """Start the job's runner, detached (it forks again and leaves its parent, which exits at once)."""
    from gpumagic.launch.plan import command_environment
    from gpumagic.telemetry.private import open_private
    from gpumagic.telemetry.store import runs_root

    env = command_environment()
    env["GPUMAGIC_RUNS_DIR"] = str(runs_root())
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


def _write_private(path: Path, text: str) -> None:
    from gpumagic.telemetry.private import write_private

    write_private(path, text.encode())


def _stop_tree(pid: int | None, tree: list[Any], deadline: float) -> None:
    """End the job: its runner's process group (``pid``: the runner leads its own session and group) and every
    process of ``tree`` (its ranks, each leading its own group, and what they started), with the one
    SIGTERM-then-SIGKILL ladder."""
    from gpumagic.devices.processes import end_processes

    grace = max(0.0, deadline - time.monotonic())
    pids = [p.pid for p in tree]
    end_processes(pids, groups=[pid, *pids] if pid else pids, grace_s=grace)


def _process_tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _format_metrics(latest: Mapping[str, tuple[float, float]]) -> str:
    if not latest:
        return ""
    step = max(s for s, _ in latest.values())
    shown = " ".join(f"{name}={value:.4g}" for name, (_, value) in list(latest.items())[:3])
    return f"{shown} @ step {step:,.0f}"


def _print(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()

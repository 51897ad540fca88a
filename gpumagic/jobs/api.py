"""Background jobs: notebook code submitted as detached jobs to an executor (``jobs.local``: this machine's
queue; ``jobs.slurm``), and the ``Job`` handle that lists, follows, waits for, kills and removes them, from this
kernel or any later one."""

from __future__ import annotations

import fnmatch
import itertools
import logging
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import cloudpickle

from gpumagic.errors import InvalidArgument, KillRefused, ReportedError
from gpumagic.jobs import attempts, executors, notify
from gpumagic.jobs.executors import Entry, Submission, executor_of
from gpumagic.launch.kernel_side.output import RankOutput
from gpumagic.launch.option_table import check_notify_wait, default, on, option
from gpumagic.launch.options import LaunchOptions
from gpumagic.launch.shipping import pack, ship_cell, ship_function
from gpumagic.run_dirs import checkpoint_files, records
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.signing import read_sealed
from gpumagic.run_dirs.store import Run
from gpumagic.telemetry.tracking import tracked_summary, trackers
from gpumagic.units import format_duration, parse_duration

_log = logging.getLogger(__name__)

KILL_GRACE_S = 5.0


class _Same:
    """Left out of ``Job.resume``: the option stays as the earlier attempt had it."""

    def __repr__(self) -> str:
        return "SAME"


SAME = _Same()
RESUMABLE = attempts.RESUMABLE
STATES = (*records.ACTIVE, *records.ENDED)  # every status a job can have


class JobFailed(ReportedError):
    """A job's result was asked for, but it did not finish. Shows the job's own traceback in a notebook."""

    def __init__(self, job: Job, report: str) -> None:
        self.job = job
        self.report = report
        super().__init__(report)


class Job:
    """A background job, read from its directory at every access (so it is always current)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def info(self) -> dict[str, Any]:
        """Everything ``run.json`` records (see ``run_dirs.records``)."""
        return records.read(self.path)

    @property
    def name(self) -> str:
        return self.info["name"]

    @property
    def status(self) -> str:
        """queued, running, finished, failed, killed, cancelled, or lost (its runner vanished)."""
        info = self.info
        status = executors.status(info)
        notify.tell_silent_end(self.path, info, status)  # an end nobody recorded is told by whoever sees it
        return status

    @property
    def reason(self) -> str:
        """Why it waits (queued), or why it ended."""
        return executors.why(self.info)

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

        path = RunFiles(self.path).result
        return cloudpickle.loads(read_sealed(path, f"job {self.name}'s result ({path})"))

    def _failure_report(self, status: str) -> str:
        error = RunFiles(self.path).error
        if error.exists():
            return f"job {self.name} {status}: " + error.read_text().rstrip()
        return f"job {self.name} {status}: {self.reason}"

    def _outputs(self) -> list[tuple[int | None, Path]]:
        """Where its executor puts its output (``output.log``; on Slurm each rank's own file), with the rank when
        there are several, for the ``[rank N]`` prefix."""
        info = self.info
        return executor_of(info).outputs(self.path, info)

    def logs(self, tail: int | None = None) -> str:
        """Its stdout and stderr so far (the last ``tail`` lines); a Slurm job's ranks one after another."""

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
        runs_on = executor_of(info)
        status = runs_on.end(info).status
        if status in records.ENDED:
            raise InvalidArgument(f"job {info['name']} has already ended ({status}); nothing to kill")
        if RunFiles(self.path).record.stat().st_uid != os.getuid():
            raise KillRefused(f"job {info['name']} belongs to another user; only they can stop it")
        runs_on.kill(self.path, info, grace_s)
        return self.status

    def resume(
        self,
        *,
        gpus: int | str | _Same | None = SAME,
        min_free: str | int | _Same | None = SAME,
        memory_limit: bool | _Same = SAME,
        ddp: int | _Same | None = SAME,
        backend: str | _Same | None = SAME,
        timeout: str | float | _Same = SAME,
        hang_after: str | float | _Same = SAME,
        slurm: Mapping[str, Any] | _Same = SAME,
    ) -> Job:
        """Start a new attempt of this ended job (killed, failed, lost, timed out, cancelled) in its directory, on
        the executor it ran on: it queues again, and its code's ``gpumagic.restore`` loads the last checkpoint any
        attempt saved. Options left out stay as they were (``slurm``: the Slurm options given replace those of the
        earlier attempt, ``{"time": "4h"}``); the earlier attempt's output, error and metrics move to
        ``attempts/N/``. Returns self.

        Example: ``gpumagic.job("A1").resume(gpus=2, timeout="2h")``.

        Raises:
            InvalidArgument: the job is active or finished, or a malformed option (named).
        """
        given = (gpus, min_free, memory_limit, ddp, backend, timeout, hang_after, slurm)
        attempts.resume(self.path, {k: v for k, v in zip(RESUMABLE, given, strict=True) if v is not SAME})
        return self

    def remove(self) -> None:
        """Delete the job's directory (output, metrics, result). Raises InvalidArgument while it is active."""

        status = self.status
        if status in records.ACTIVE:
            raise InvalidArgument(f"job {self.name} is {status}; kill it first (%jobs kill {self.name})")
        shutil.rmtree(self.path)

    def describe(self) -> str:
        """One line: name, status, GPUs, elapsed time, why (waiting or ended), latest metrics."""
        info = self.info
        ended = executor_of(info).end(info)
        gpus = ",".join(map(str, info.get("gpus") or ()))
        where = f" on GPU {gpus}" if gpus else " on the CPU" if info.get("started") else ""
        text = f"{info['name']}: {ended.status}{where}, {format_duration(records.elapsed(info))}"
        if ended.status != "finished" and ended.why:
            text += f" ({ended.why})"
        resumed = resumed_note(self.path, info)
        if resumed:
            text += f", {resumed}"
        if info.get("notify_problem"):
            text += f"; {info['notify_problem']}"
        tracked = tracked_summary(info)
        if tracked:
            text += f"; tracked: {tracked}"
        latest = format_metrics(self.last_metrics())
        return text + (f" · {latest}" if latest else "")

    def __repr__(self) -> str:
        try:
            return f"Job({self.describe()})"
        except (OSError, ValueError, KeyError):
            _log.debug("the job %s cannot be described; shown as removed", self.path.name, exc_info=True)
            return f"Job({self.path.name}: removed)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Job) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)


@dataclass(frozen=True)
class JobRequest:
    """What a submission asks for, checked once: its GPUs (a count, default 1, or a device spec), the memory it
    reserves on each (``min_free``) and whether that caps it (``memory_limit``), the jobs it waits for
    (``after``), who is told of it (``notify``, ``notify_wait``), where it runs (``executor``, ``slurm``), and the
    launch options of its DDP group (``launch``: ``nprocs`` ranks, ``backend``, ``timeout``); ``JobRequest.of``
    takes them as ``submit`` does."""

    gpus: int | str | None = default("job", "gpus")
    min_free: str | int | None = default("job", "min_free")
    memory_limit: bool = default("job", "memory_limit")
    after: Any = default("job", "after")
    notify: str | Sequence[str] | None = default("job", "notify")
    notify_wait: str | float = default("job", "notify_wait")
    requeue_on_timeout: int = default("job", "requeue_on_timeout")
    executor: str = default("job", "executor")
    slurm: Mapping[str, Any] | None = default("job", "slurm")
    launch: LaunchOptions = field(default_factory=LaunchOptions)

    def __post_init__(self) -> None:
        for entry in on("job"):  # the table's checks of the options it holds (its launch checks its own)
            if entry.check is not None and entry.name in _HELD:
                entry.check(getattr(self, entry.name))
        if self.requeue_on_timeout and self.executor != "slurm":
            raise InvalidArgument("requeue_on_timeout is for Slurm's time limit: use it with executor='slurm'")
        if self.memory_limit and self.min_free is None:
            raise InvalidArgument(
                "memory_limit caps a job at the memory it declares: give min_free too (--min-free 20GB)"
            )

    @classmethod
    def of(
        cls,
        *,
        ddp: int | None = default("job", "ddp"),
        backend: str | None = default("job", "backend"),
        timeout: str | float = default("job", "timeout"),
        hang_after: str | float = default("job", "hang_after"),
        **request: Any,
    ) -> JobRequest:
        """A request from ``submit``'s keywords: ``ddp`` (ranks), ``backend``, ``timeout`` and ``hang_after`` make
        its launch.

        Raises:
            InvalidArgument: a malformed option, named.
        """
        option("job", "ddp").check(ddp)
        return cls(launch=LaunchOptions(ddp, backend=backend, timeout=timeout, hang_after=hang_after), **request)

    @property
    def ddp(self) -> int | None:
        """The number of ranks of its DDP group; ``None``: a single process."""
        return self.launch.nprocs


_HELD = tuple(f.name for f in fields(JobRequest) if f.name != "launch")  # its options, not its launch's


@dataclass(frozen=True)
class JobSubmitter:
    """Job options kept apart from the function's arguments (as submitit's executor and ``concurrent.futures``
    keep theirs): ``jobs_with(gpus=2, name="A1").submit(train, cfg, lr=1e-3)``. Made by ``jobs_with``."""

    request: JobRequest
    name: str | None = None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Job:
        """Run ``fn(*args, **kwargs)`` as a background job with these options; returns its ``Job`` at once. Every
        keyword goes to ``fn``, ``name``, ``gpus`` or ``timeout`` included.

        Raises:
            InvalidArgument: an unknown ``after`` job, a name already taken, more GPUs than the machine has.
            ShippingError: something ``fn`` needs cannot be pickled (named).
        """
        packed = pack(ship_function(fn, tuple(args), kwargs, rank_first=False))
        base = getattr(fn, "__name__", "job")
        return _create([Entry(self.name, base, packed, {})], self.request, f"{base}()")[0]


def jobs_with(
    *,
    name: str | None = default("job", "name"),
    gpus: int | str | None = default("job", "gpus"),
    min_free: str | int | None = default("job", "min_free"),
    memory_limit: bool = default("job", "memory_limit"),
    ddp: int | None = default("job", "ddp"),
    after: str | Job | Iterable[str | Job] | None = default("job", "after"),
    notify: str | Sequence[str] | None = default("job", "notify"),
    notify_wait: str | float = default("job", "notify_wait"),
    requeue_on_timeout: int = default("job", "requeue_on_timeout"),
    backend: str | None = default("job", "backend"),
    timeout: str | float = default("job", "timeout"),
    hang_after: str | float = default("job", "hang_after"),
    executor: str = default("job", "executor"),
    slurm: Mapping[str, Any] | None = default("job", "slurm"),
) -> JobSubmitter:
    """Background jobs with these options: ``.submit(fn, /, *args, **kwargs)`` runs one, every keyword going to
    ``fn``. A job waits in this machine's queue until its GPUs are free, then runs detached from the kernel: it
    survives interrupts, restarts and the kernel's end, and ``gpumagic.job(name)`` finds it from any kernel.

    >>> gpumagic.jobs_with(gpus=1, name="A1", min_free="20GB").submit(train, cfg, lr=1e-3)  # doctest: +SKIP

    Args:
        name: the job's name (default: the function's, made unique).
        gpus: how many GPUs (default 1, or one per rank with ``ddp``; 0 runs on the CPU), or a device spec
            naming them (``"GPU:1"``, ``"0,2"``, ``"A100"``).
        min_free: the memory the job needs on each GPU (``"20GB"``): it reserves that much and may share a
            GPU with other such jobs (placed where the free memory less their unallocated reservations is
            enough). Without it a job takes whole GPUs.
        memory_limit: cap each of the job's processes at ``min_free`` on its GPU
            (``torch.cuda.set_per_process_memory_fraction``); an overrun fails naming the limit.
        ddp: run as a DDP group of this many ranks (process group initialized, as ``launch_ddp``).
        after: name(s) or Job(s) that must finish first; if one fails, this job is cancelled.
        notify: who is told when the job finishes, fails, is killed or requeued: an ``https://`` URL (a POST of
            JSON: the job, its status, duration, best and last metrics, the failure's last traceback lines) or
            ``"cmd:COMMAND"`` (the same JSON on its stdin), or a list of them; default ``$GPUMAGIC_NOTIFY``.
        notify_wait: with ``notify``, also tell once when the job has waited this long for GPUs (0: never).
        requeue_on_timeout: on Slurm, near the time limit (Slurm's signal, ``slurm={"signal_delay": "5m"}`` ahead,
            90 s by default) the job's next ``gpumagic.checkpoint`` saves and the job requeues itself, up to this
            many times; its ``gpumagic.restore`` goes on from there.
        backend, timeout: of the process group with ``ddp``.
        hang_after: with ``ddp``, a collective waiting this long writes who is stuck where to the job's log
            (0: off).
        executor: ``"local"`` (this machine's queue) or ``"slurm"``: submitted through submitit with the
            options in ``slurm`` (``partition``, ``time``, ``nodes``, ``tasks_per_node``, ``gres`` ...: see
            ``gpumagic.jobs.slurm.parameters``); every task is a rank of one DDP group; ``gpus`` is per node.

    Raises:
        InvalidArgument: a malformed option (named).
    """
    request = JobRequest.of(
        gpus=gpus,
        min_free=min_free,
        memory_limit=memory_limit,
        ddp=ddp,
        after=after,
        notify=notify,
        notify_wait=notify_wait,
        requeue_on_timeout=requeue_on_timeout,
        backend=backend,
        timeout=timeout,
        hang_after=hang_after,
        executor=executor,
        slurm=slurm,
    )
    return JobSubmitter(request, name)


def submit(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Job:
    """Run ``fn(*args, **kwargs)`` as a background job with the default options (one GPU, this machine's queue);
    returns its ``Job`` at once. Every keyword goes to ``fn``; job options go to ``jobs_with``:
    ``gpumagic.jobs_with(gpus=0, name="A1").submit(fn, *args, **kwargs)``.

    Raises:
        InvalidArgument: more GPUs than the machine has. ShippingError: ``fn`` cannot be pickled (named).
    """
    return jobs_with().submit(fn, *args, **kwargs)


def submit_cell(
    source: str,
    namespace: Mapping[str, Any],
    request: JobRequest,
    *,
    filename: str,
    hidden: Collection[str] = (),
    name: str | None = None,
) -> Job:
    """A notebook cell as a background job (``%%launch_bg``): its code with the notebook names it uses; the
    value of its last expression is the job's result. ``request``: as ``submit``'s options."""
    packed = pack(ship_cell(source, namespace, filename, hidden))
    return _create([Entry(name, "job", packed, {})], request, "cell")[0]


def sweep(
    fn: Callable[..., Any],
    grid: Mapping[str, Sequence[Any]],
    gpus_per_job: int | str = 1,
    *,
    name: str | None = None,
    min_free: str | int | None = None,
    memory_limit: bool = False,
    ddp: int | None = None,
    after: str | Iterable[str] | None = None,
    notify: str | Sequence[str] | None = None,
    **fixed: Any,
) -> list[Job]:
    """One job per point of ``grid`` (every combination): ``fn(**point, **fixed)``, named ``name-k=v,...``.

    Example: ``sweep(train, {"lr": [1e-3, 1e-4], "width": [64, 128]})`` submits four jobs, queued on free GPUs.
    All names are taken together: if one exists already, no job is submitted. ``notify`` (default
    ``$GPUMAGIC_NOTIFY``) is told once, when every job of the sweep has ended: one summary, best run first.
    """
    if not isinstance(grid, Mapping) or not grid:
        raise InvalidArgument("grid must be a non-empty dict of parameter name -> list of values")
    for key, values in grid.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidArgument(f"grid keys are argument names of fn, got {key!r}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise InvalidArgument(f"grid[{key!r}] must be a non-empty list of values, got {values!r}")
    request = JobRequest.of(
        gpus=gpus_per_job, min_free=min_free, memory_limit=memory_limit, ddp=ddp, after=after, notify=notify
    )
    base = name or getattr(fn, "__name__", "job")
    entries = []
    for combination in itertools.product(*grid.values()):
        point = dict(zip(grid.keys(), combination, strict=True))
        label = ",".join(f"{k}={_short(v)}" for k, v in point.items())
        packed = pack(ship_function(fn, (), {**point, **fixed}, rank_first=False))
        params = {k: _short(v) for k, v in point.items()}
        entries.append(Entry(records.sanitize_name(f"{base}-{label}"), base, packed, params))
    sweep_id = f"{records.sanitize_name(base)}-{secrets.token_hex(4)}"
    return _create(entries, request, f"{getattr(fn, '__name__', 'fn')}()", sweep_id)


def job(name: str) -> Job:
    """The job called ``name`` (of this user, from any kernel). Raises InvalidArgument if there is none."""
    if isinstance(name, Job):
        return name
    return Job(records.find(str(name)))


def list_jobs() -> list[Job]:
    """Every job of this user, oldest first."""
    return [Job(path) for path in records.all_jobs()]


@dataclass(frozen=True)
class JobFilter:
    """Which jobs a view shows: those whose name is one of ``names`` (each a name or a pattern: ``A-*``) and
    whose status is one of ``states``; empty: any. ``JobFilter.of`` checks what a user typed."""

    names: tuple[str, ...] = ()
    states: frozenset[str] = frozenset()

    @classmethod
    def of(cls, names: str | Iterable[str] | None = None, states: str | Iterable[str] | None = None) -> JobFilter:
        """``names``: a name or pattern, or several; ``states``: ``"running,queued"`` or a list of states.

        Raises:
            InvalidArgument: an unknown state (the message lists the valid ones), or an empty name.
        """
        wanted = [names] if isinstance(names, str) else list(names or ())
        if any(not isinstance(n, str) or not n.strip() for n in wanted):
            raise InvalidArgument(f"job names and patterns are non-empty text (A1, 'A-*'), got {wanted!r}")
        listed = states.split(",") if isinstance(states, str) else list(states or ())
        chosen = [str(s).strip().lower() for s in listed if str(s).strip()]
        unknown = [s for s in chosen if s not in STATES]
        if unknown:
            raise InvalidArgument(f"unknown job state {', '.join(map(repr, unknown))}; use one of: {', '.join(STATES)}")
        return cls(tuple(n.strip() for n in wanted), frozenset(chosen))

    def matches(self, name: str, status: str | None = None) -> bool:
        """Whether a job called ``name`` with ``status`` is shown (``status`` None: the name alone)."""
        if self.names and not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.names):
            return False
        return status is None or not self.states or status in self.states

    def describe(self) -> str:
        """``A-* · running, queued`` (empty: every job)."""
        states = ", ".join(s for s in STATES if s in self.states)
        return " · ".join(part for part in (" ".join(self.names), states) if part)


def select_jobs(names: str | Iterable[str] | None = None, states: str | Iterable[str] | None = None) -> list[Job]:
    """This user's jobs (oldest first) whose name matches one of ``names`` (a name or a pattern, ``"A-*"``) and
    whose status is one of ``states`` (``"running,queued"``); None: any.

    Raises:
        InvalidArgument: an unknown state (the message lists the valid ones).
    """
    chosen = JobFilter.of(names, states)
    selected = []
    for path in records.all_jobs():
        try:
            info = records.read(path)
            if chosen.matches(info.get("name", path.name), executors.status(info) if chosen.states else None):
                selected.append(Job(path))
        except (OSError, ValueError, KeyError):  # removed, or being written, meanwhile
            _log.debug("the job %s cannot be read; left out of the selection", path, exc_info=True)
            continue
    return selected


def _create(entries: list[Entry], request: JobRequest, description: str, sweep: str | None = None) -> list[Job]:
    """The executor checks what it is asked, takes every name (all or none), writes the jobs and starts them."""
    runs_on = executors.named(request.executor)
    resources = runs_on.check_resources(request.gpus, request.min_free, request.ddp, request.slurm)
    submission = Submission(
        request.ddp,
        request.launch.backend,
        request.launch.timeout_s,
        _dependencies(request.after),
        description,
        request.memory_limit,
        request.launch.hang_after_s,
        tuple(notify.targets_of(request.notify)),
        check_notify_wait(request.notify_wait),
        sweep,
        len(entries) if sweep else 0,
        request.requeue_on_timeout,
        tuple(tracker.to_json() for tracker in trackers()),
    )
    return [Job(path) for path in runs_on.submit(entries, resources, submission)]


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


def _short(value: Any) -> str:
    return value if isinstance(value, str) else repr(value) if not isinstance(value, float) else f"{value:g}"


def resumed_note(path: Path, info: Mapping[str, Any]) -> str:
    """``resumed from step 12,400 (attempt 2)`` when this attempt of the job restored a checkpoint; else empty."""
    restored = checkpoint_files.restored(path)
    attempt = records.attempt_of(info)
    if restored is None or restored.attempt != attempt or not restored.step:
        return ""
    return f"resumed from step {restored.step:,} (attempt {attempt})"


def format_metrics(latest: Mapping[str, tuple[float, float]]) -> str:
    """A job's latest metrics in a few words (``loss=0.31 acc=0.9 @ step 120``); empty for none."""
    if not latest:
        return ""
    step = max(s for s, _ in latest.values())
    shown = " ".join(f"{name}={value:.4g}" for name, (_, value) in list(latest.items())[:3])
    return f"{shown} @ step {step:,.0f}"


def _print(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()

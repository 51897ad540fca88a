"""A background job's directory: a run directory (``run_dirs.store``) of kind ``job`` with a few more files.

    run.json      the run's fields, plus name, request, status, reason, GPUs, runner pid, the job's process
                  pids, started, ended, exit (why it ended), exitcode, signal
    job.json      what the runner runs (name, request, ddp, backend, timeout, after, sys_path, cwd,
                  memory_limit), sealed: the runner reads these from here, never from run.json
    payload.pkl   the shipped code (cloudpickle, sealed: ``run_dirs.signing``)
    output.log    the job's stdout and stderr (``[rank N]`` prefixes with --ddp)
    result.pkl    the return value (rank 0's; ``{rank: value}`` with --ddp), sealed
    error.txt     the failure: the failing rank's traceback and every rank's fate
    kill.json     written by ``kill`` before it signals the job, so the job records who stopped it
    runner.log    the runner's own messages (empty unless gpumagic itself failed)
    .reserve      64 KiB held while the job lives, so that on a full disk the runner can still record why
                  the job failed

Only the runner writes ``run.json`` while the job lives; a job whose runner died without a word reads as
``lost``. The directory is private to its user (0700, files 0600), like every run. ``run_dirs.layout`` names
these files. This module is the job's data; how a job ended is read as every run's end (``run_dirs.run_end``),
with what its executor sees of it now (``jobs.executors``: ``local``, ``slurm``), and neither is imported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import itertools
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import platformdirs

from gpumagic.errors import DiskFull, InvalidArgument
from gpumagic.run_dirs import private, run_end, store
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.signing import PayloadRejected, read_sealed, write_sealed

_log = logging.getLogger(__name__)

ACTIVE = run_end.ACTIVE  # a job's, as every run's
ENDED = ("finished", "failed", "killed", "cancelled", "lost")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.,=+-]{0,79}$")


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What the runner runs, as sealed in the job's ``job.json``: the job's id (its directory's name) and name,
    when it was submitted, its GPU request (``jobs.queue.Request``'s JSON), its ranks (``ddp``; ``None``: one
    process), backend, process group timeout (seconds), the jobs it waits for, the kernel's ``sys.path`` and
    working directory, whether each rank is capped at its reservation, the hang report threshold (seconds),
    which attempt this is (``%jobs resume`` starts the next), and the trackers its metrics are exported to."""

    id: str
    name: str
    submitted: float
    request: dict[str, Any]
    ddp: int | None = None
    backend: str | None = None
    timeout_s: float | None = None
    after: list[str] | None = None
    sys_path: list[str] | None = None
    cwd: str | None = None
    memory_limit: bool | None = None
    hang_after_s: float | None = None
    attempt: int | None = None  # 1 (or None): the first; ``start_attempt`` counts the resumes
    notify: list[str] | None = None  # targets told of its end (``jobs.notify``): commands run, so only from here
    notify_wait_s: float | None = None
    requeue_on_timeout: int | None = None  # a Slurm job near its time limit saves and requeues itself so often
    track: list[dict[str, str]] | None = None  # the trackers its metrics go to (``telemetry.tracking``)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobSpec:
        """The spec ``job.json`` holds (fields it lacks are ``None``)."""
        return cls(**{f.name: data.get(f.name) for f in dataclasses.fields(cls)})


RUNNER_FIELDS = tuple(f.name for f in dataclasses.fields(JobSpec) if f.name != "id")  # sealed in job.json
RESERVE_BYTES = 64 << 10


def check_name(name: str) -> str:
    """Raises InvalidArgument unless ``name`` is a usable job name."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise InvalidArgument(
            f"job names are 1-80 letters, digits and _ . , = + - (starting with a letter or digit), got {name!r}"
        )
    return name


def take_names(wanted: Sequence[tuple[str | None, str]]) -> list[str]:
    """The names of new jobs, one per ``(name, base)``: each given name checked, each None made unique from
    its ``base``. Call under ``names_locked()``.

    Raises:
        InvalidArgument: a malformed name, or one a job has already.
    """
    taken = set(names())  # read once: each job's run.json
    chosen = []
    for explicit, base in wanted:
        if explicit is not None:
            check_name(explicit)
            if explicit in taken:
                raise InvalidArgument(
                    f"a job named {explicit!r} exists already; choose another name, or remove it (%jobs rm {explicit})"
                )
            chosen.append(explicit)
        else:
            chosen.append(free_name(sanitize_name(base), taken))
        taken.add(chosen[-1])
    return chosen


def free_name(base: str, taken: Collection[str]) -> str:
    """``base``, or ``base-2``, ``base-3`` ... whichever is not ``taken``."""
    if base not in taken:
        return base
    for number in itertools.count(2):
        candidate = f"{base}-{number}"
        if candidate not in taken:
            return candidate
    raise AssertionError("unreachable")


def sanitize_name(text: str) -> str:
    """``text`` made a usable job name (other characters become ``_``, at most 80)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.,=+-]", "_", text).lstrip("_.,=+-")[:80]
    return cleaned or "job"


@contextlib.contextmanager
def names_locked() -> Iterator[None]:
    """Held while a name is checked and taken, so two kernels cannot take the same name. The lock is in the
    user's own state directory: a runs directory may be shared with others, who could hold a lock there."""
    state = Path(platformdirs.user_state_dir("gpumagic"))
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(state / "jobs.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def create(name: str, packed: bytes, reserve: bool = True, **fields: Any) -> Path:
    """A new job directory holding ``packed``, status ``queued``. Call under ``names_locked()``.

    What changes what the runner runs (``RUNNER_FIELDS``) is sealed in ``job.json`` too. ``reserve``: hold
    ``RESERVE_BYTES`` for the runner's last record (a job without a runner of ours, on Slurm, needs none).

    Raises:
        DiskFull: no space for the job (nothing is left behind). RunsDirectoryError: an unsafe runs directory.
    """
    submitted = time.time()
    path = store.new_run(
        "job",
        ranks=fields.pop("ranks", 1),
        name=name,
        submitted=submitted,
        status="queued",
        reason="starting",
        **fields,
    )
    files = RunFiles(path)
    try:
        spec = {"id": path.name, "name": name, "submitted": submitted, **fields}
        write_sealed(files.job, json.dumps({k: spec.get(k) for k in ("id", *RUNNER_FIELDS)}).encode())
        write_sealed(files.job_payload, packed)
        private.write_private(files.output, b"")
        if reserve:
            _reserve(path)
    except BaseException as err:
        shutil.rmtree(path, ignore_errors=True)
        if isinstance(err, DiskFull):
            raise DiskFull(path.parent, err.reason, err.errno) from None  # the job is gone: name where it was to be
        raise
    return path


ATTEMPT_FILES = ("output.log", "error.txt", "result.pkl", "kill.json", "runner.log", "ranks", "metrics")
ATTEMPT_RESET = {"started": None, "ended": None, "exit": "", "exitcode": None, "signal": None, "gpus": [],
                 "gpu_uuids": [], "pids": None, "runner_pid": None, "runner_start": None, "hang": None,
                 "slurm_restarts": 0, "notify_problem": None}  # fmt: skip


def attempt_of(info: Mapping[str, Any]) -> int:
    """Which attempt of the job ``info`` describes is the current one: 1 for the first; each ``%jobs resume`` and
    each Slurm requeue (preemption, ``scontrol requeue``, a time-limit requeue) starts the next."""
    return int(info.get("attempt_base") or 0) + 1 + int(info.get("slurm_restarts") or 0)


def start_attempt(path: Path, changes: Mapping[str, Any]) -> int:
    """Make the ended job at ``path`` ready for its next attempt (``%jobs resume``): what the earlier attempt left
    (its output, error, result, ranks' files, metrics, kill request) moves into ``attempts/<its number>/``; its
    checkpoints stay, for the new attempt to restore; ``job.json`` is sealed again with ``changes`` (the new
    request, ranks, timeout ...) and the attempt's number, and ``run.json`` reads queued with ``changes``'
    fields. Returns the new attempt's number. Call under ``names_locked()``, once the job has ended.

    Raises:
        DiskFull: no space to write them (the earlier attempt's files stay where they were moved).
    """
    info = read(path)
    earlier = attempt_of(info)
    files = RunFiles(path)
    kept = files.attempt(earlier)
    now = time.time()
    spec = dataclasses.asdict(read_spec(path))
    spec.update({k: v for k, v in changes.items() if k in spec}, attempt=earlier + 1, submitted=now)
    kept.mkdir(mode=0o700, parents=True, exist_ok=True)  # what can fail for want of space comes first
    write_sealed(files.job, json.dumps(spec).encode())  # it queues as a new submission would
    if info.get("executor") != "slurm":  # a job without a runner of ours needs no space for its runner's record
        release_reserve(path)  # one a lost runner left
        _reserve(path)
    for name in ATTEMPT_FILES:  # renames within the directory: they take no space
        with contextlib.suppress(FileNotFoundError):
            os.replace(files.root / name, kept / name)
    private.write_private(files.output, b"")
    fields = {**ATTEMPT_RESET, **changes, **({"ranks": changes["ddp"] or 1} if "ddp" in changes else {})}
    store.update_run(path, **fields, status="queued", reason="starting", resumed=now, attempt_base=earlier)
    return earlier + 1


def read_spec(path: Path) -> JobSpec:
    """What the runner runs, from the sealed ``job.json`` of the job at ``path``.

    Raises:
        PayloadRejected: not sealed with the user's key, changed, or written for another job.
    """
    where = RunFiles(path).job
    spec = json.loads(read_sealed(where, f"the description of job {path.name} ({where})"))
    if spec.get("id") != path.name:
        raise PayloadRejected(f"{where} describes job {spec.get('id')!r}, not {path.name}; it will not be run")
    return JobSpec.from_json(spec)


def _reserve(path: Path) -> None:
    """Hold ``RESERVE_BYTES`` of the disk for the job's last record (``release_reserve`` frees them)."""
    fd = os.open(RunFiles(path).reserve, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise private.disk_error(err, path) from None
        private.write_all(fd, bytes(RESERVE_BYTES))  # a filesystem without fallocate
    finally:
        os.close(fd)


def release_reserve(path: Path) -> bool:
    """Free the space held for the job's last record; whether there was any."""
    try:
        os.unlink(RunFiles(path).reserve)
        return True
    except FileNotFoundError:
        return False


def read(path: Path) -> dict[str, Any]:
    return json.loads(RunFiles(path).record.read_text())


update = store.update_run  # change some fields of run.json, atomically


def all_jobs() -> list[Path]:
    """Every job directory of this user, in submission order."""
    found = []
    for path in store.own_run_paths("job"):
        submitted = _submitted.get(path)
        if submitted is None:
            try:
                submitted = _submitted[path] = float(read(path).get("submitted", 0))
            except (OSError, ValueError):
                _log.debug("the job %s cannot be read; left out", path, exc_info=True)
                continue
        found.append((submitted, path.name, path))
    return [path for _, _, path in sorted(found)]


_submitted: dict[Path, float] = {}  # a job's submission time never changes: read it once


def find(name: str) -> Path:
    """The directory of the job called ``name``.

    Raises:
        InvalidArgument: no such job (the message lists the jobs there are).
    """
    for path in all_jobs():
        with contextlib.suppress(OSError, ValueError):
            if read(path).get("name") == name:
                return path
    known = ", ".join(names()) or "none yet"
    raise InvalidArgument(f"no job named {name!r} (jobs: {known}); %jobs lists them")


def exists(name: str) -> bool:
    return name in names()


def names() -> list[str]:
    """The names of this user's jobs, in submission order."""
    found = []
    for path in all_jobs():
        with contextlib.suppress(OSError, ValueError):
            found.append(read(path).get("name", ""))
    return found


def request_kill(path: Path) -> None:
    """Write ``kill.json`` (this process, now) before the job is signalled, so its end names who stopped it."""
    private.write_private(RunFiles(path).kill_request, json.dumps({"pid": os.getpid(), "time": time.time()}).encode())


def record_killed(path: Path, how: str) -> None:
    """Record the job as killed (``how``: its exit), unless it recorded its own end first."""
    if run_end.recorded_end(read(path)).active:
        store.record_end(path, "killed", how)


def elapsed(info: dict[str, Any]) -> float:
    """Seconds the job has run (so far, or in all), or waited if it never started."""
    start = info.get("started") or info.get("submitted") or time.time()
    return max(0.0, (info.get("ended") or time.time()) - start)

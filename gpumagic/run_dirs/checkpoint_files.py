"""A run's checkpoints on disk (``gpumagic.checkpoint`` and ``restore`` write and read them through here).

Each checkpoint is two files in the run's ``checkpoints/`` (``run_dirs.layout``):

- ``step-N.<id>.pt``, what ``torch.save`` wrote, hashed (SHA-256) as it was written;
- ``step-N.seal``, sealed with the user's key (``run_dirs.signing``): the data file's name, size and digest, the
  step, the state's names and when it was written.

The data file is written under a temporary name, renamed, and only then is its seal written (atomically): a
checkpoint without a seal, or whose file does not match its seal (a crash mid-write, a full disk, a file changed
since), is never loaded; the one before it is (``open_verified``). Sealing the digest, not the bytes, lets a
checkpoint of many GB be sealed off the caller's path: a thread hashes the written file and seals it while training
goes on, so ``checkpoint`` costs what ``torch.save`` costs (``benchmarks/checkpoint_cost.py``), and ``settle`` waits
for the seal where it matters (the next checkpoint, ``restore``, a rank's end).

Only the newest ``KEEP`` checkpoints (by when they were written, not by step: a run restarted from step 0 keeps
its new ones) stay. Nothing here imports torch: the caller passes the function that writes.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from gpumagic.devices.processes import is_running
from gpumagic.errors import GpumagicError
from gpumagic.run_dirs import private
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.signing import PayloadRejected, read_sealed, write_sealed

_log = logging.getLogger(__name__)

KEEP = 2  # checkpoints kept: the newest, and the one before it in case the newest is damaged
READ_CHUNK = 8 << 20
_SEAL = re.compile(r"^step-(\d+)\.seal$")
_DATA = re.compile(r"^step-(\d+)\.[0-9a-f]+\.pt$")
_TEMPORARY = re.compile(r"^\.step-\d+\.(\d+)\.tmp$")


class CheckpointDamaged(GpumagicError):
    """A checkpoint's file does not match its seal (half-written, truncated, changed): it is not loaded."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One sealed checkpoint: its step, the data file the seal names, that file's size and SHA-256, the names
    of the state it holds, and when it was written (``time.time()``)."""

    step: int
    path: Path
    size: int
    sha256: str
    names: tuple[str, ...]
    written: float
    sequence: int = 0  # one more than the newest sealed before it: the order, whatever the nodes' clocks say

    @property
    def seal(self) -> Path:
        return self.path.with_name(f"step-{self.step}.seal")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What ``restore`` last loaded into a run (``restored.json``): the step, the attempt that loaded it (1: the
    first), and when."""

    step: int
    attempt: int
    time: float


def directory(run_dir: Path) -> Path:
    """The run's checkpoint directory, made private on first use.

    Raises:
        RunsDirectoryError: it is not a directory of this user's that only they can write (a file in it could be
            swapped for another user's pickle).
    """
    path = RunFiles(run_dir).checkpoints
    with contextlib.suppress(FileExistsError):
        private.private_directory(path)
    private.check_own(path)
    return path


def write(run_dir: Path, step: int, names: tuple[str, ...], save: Callable[[str], None]) -> Path:
    """A new checkpoint of ``step``: ``save(path)`` writes the data (``torch.save(state, path)``: given a path,
    torch writes through its own C++ writer, faster than through a Python file) at a temporary path, which is
    renamed into place; a thread then hashes the file and seals it, and removes the checkpoints
    beyond ``KEEP``, while the caller trains on (``settle`` waits for it: the next ``write``, ``restore`` and a
    rank's end do). Until its seal is written the new checkpoint is not loaded; the one before it is.

    Raises:
        DiskFull: no space for it (the partial file is removed; earlier checkpoints stay). OSError.
    """
    settle()  # one checkpoint sealing at a time, in order
    where = directory(run_dir)
    temporary = where / f".step-{step}.{os.getpid()}.tmp"
    final = where / f"step-{step}.{secrets.token_hex(4)}.pt"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)  # left by a process of this pid that died
        # torch.save makes the file (in a directory only this user can enter: nobody can put a link there): on
        # ext4 a file made empty first and then written is flushed to disk at its close (auto_da_alloc), 3× slower
        save(str(temporary))
        os.chmod(temporary, 0o600)
        os.replace(temporary, final)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(err, OSError):
            raise private.disk_error(err, where) from None
        raise
    global _sealing
    _sealing = threading.Thread(target=_seal, args=(final, step, names), name="gpumagic-checkpoint-seal", daemon=True)
    _sealing.start()
    return final


def settle() -> None:
    """Wait until the checkpoint this process wrote last is sealed (or known unsealable, with a warning)."""
    sealing = _sealing
    if sealing is not None and sealing is not threading.current_thread():
        sealing.join()


def _seal(path: Path, step: int, names: tuple[str, ...]) -> None:
    """Hash the checkpoint ``path`` and write its seal, then keep only the newest ``KEEP``. On a failure (a full
    disk) the checkpoint stays unsealed, and so unused, with a warning."""
    try:
        with open(path, "rb", buffering=0) as handle:
            size, digest = _digest(handle)
        earlier = sealed(path.parent.parent)
        sequence = max((e.sequence for e in earlier), default=0) + 1  # the newest: not by the nodes' clocks
        entry = Checkpoint(step, path, size, digest, names, time.time(), sequence)
        record = {"file": path.name, "step": step, "size": size, "sha256": digest, "names": list(names),
                  "written": entry.written, "sequence": sequence}  # fmt: skip
        write_sealed(entry.seal, json.dumps(record).encode())
        _prune(path.parent, [entry, *(e for e in earlier if e.seal != entry.seal)])  # a step saved again: one seal
    except Exception as err:  # noqa: BLE001 - a thread's failure: the checkpoint stays unsealed, and it is said
        _log.warning("gpumagic: the checkpoint %s could not be sealed (%s); the one before stays the latest", path, err)
        _log.debug("sealing %s failed", path, exc_info=True)


def sealed(run_dir: Path) -> list[Checkpoint]:
    """The run's checkpoints whose seal is sound, newest first, this process's own last one included (the data
    files are not read: ``open_verified`` checks them)."""
    settle()
    where = RunFiles(run_dir).checkpoints
    try:
        names = os.listdir(where)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        matched = _SEAL.match(name)
        if matched is None:
            continue
        try:
            record = json.loads(read_sealed(where / name, f"the seal {where / name}"))
            entry = Checkpoint(
                int(record["step"]),
                where / str(record["file"]),
                int(record["size"]),
                str(record["sha256"]),
                tuple(record.get("names") or ()),
                float(record["written"]),
                int(record.get("sequence") or 0),
            )
        except (PayloadRejected, OSError, ValueError, KeyError, TypeError):
            _log.warning("gpumagic: the checkpoint seal %s is unreadable or not yours; it is ignored", where / name)
            continue
        if entry.step != int(matched.group(1)) or not _DATA.match(entry.path.name):
            _log.warning("gpumagic: the checkpoint seal %s names another step's file; it is ignored", where / name)
            continue
        found.append(entry)
    return sorted(found, key=lambda e: (e.sequence, e.written, e.step), reverse=True)


@contextlib.contextmanager
def open_verified(entry: Checkpoint) -> Iterator[BinaryIO]:
    """The checkpoint's file, open, checked against its seal and rewound: read it from here (``torch.load``), so
    what was checked is what is read (the path is opened once, not followed if it is a link, and must be a file of
    this user's).

    Raises:
        CheckpointDamaged: missing, not this user's, another size, or another digest (the message names the file).
    """
    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise CheckpointDamaged(f"checkpoint {entry.path} cannot be read: {err.strerror or err}") from None
    with open(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise CheckpointDamaged(f"checkpoint {entry.path} is not a file of yours; it is not loaded")
        size, digest = _digest(handle)
        if size != entry.size or digest != entry.sha256:
            raise CheckpointDamaged(
                f"checkpoint {entry.path} does not match its seal ({size:,} bytes, {entry.size:,} sealed): it was "
                "cut short or changed after it was written"
            )
        handle.seek(0)
        yield handle


def _digest(handle: BinaryIO) -> tuple[int, str]:
    """The size and SHA-256 of what is left to read of ``handle``."""
    digest = hashlib.sha256()
    size = 0
    while chunk := handle.read(READ_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def record_restored(run_dir: Path, step: int, attempt: int) -> None:
    """Remember that ``restore`` loaded ``step`` in ``attempt``, for ``%jobs`` ("resumed from step N")."""
    data = json.dumps({"step": step, "attempt": attempt, "time": time.time()}).encode()
    directory(run_dir)
    private.write_private(RunFiles(run_dir).restored, data)


def restored(run_dir: Path) -> Restored | None:
    """What ``restore`` last loaded into the run, if it loaded anything."""
    path = RunFiles(run_dir).restored
    try:
        record = json.loads(path.read_text())
        return Restored(int(record["step"]), int(record["attempt"]), float(record["time"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        _log.debug("%s is unreadable; the job is shown as not resumed", path, exc_info=True)
        return None


def _prune(where: Path, entries: list[Checkpoint]) -> None:
    """Remove all but the newest ``KEEP`` of ``entries`` (every sealed checkpoint, newest first), data files no
    seal names, and temporary files of processes that are gone. Only the run's writing rank calls this, after
    sealing its own."""
    for entry in entries[KEEP:]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.seal)
    named = {entry.path.name for entry in entries[:KEEP]}
    for name in os.listdir(where):
        temporary = _TEMPORARY.match(name)
        unsealed = _DATA.match(name) and name not in named
        if unsealed or (temporary and not is_running(int(temporary.group(1)))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(where / name)


_sealing: threading.Thread | None = None  # the thread sealing the checkpoint written last


def _forget_after_fork() -> None:
    global _sealing
    _sealing = None  # the thread does not survive fork; the parent seals its checkpoint


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(settle)  # a script's last checkpoint is sealed before it exits (ranks settle in their flush)

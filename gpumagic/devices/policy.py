"""An administrator's policy for the shared GPUs: ``policy.toml`` in the lease directory.

::

    idle_release = "2h"      # a kernel idle this long lets its lease go to someone waiting for GPUs
    max_gpus_per_user = 2    # a pick (or job) that would take a user past 2 GPUs is refused (a job waits)

The file counts only where nobody but root can have written it: a regular file (not a link), owned by root, and
writable by nobody else. Anything else is ignored, and ``%gpu`` says so in one line. A user can always point
``GPUMAGIC_LEASE_DIR`` elsewhere: the policy binds the notebooks that share the administrator's lease directory,
as the leases themselves do (docs/devices.md, "For administrators").
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpumagic.devices import shared_files
from gpumagic.devices.lease_directory import POLICY_NAME, lease_dir
from gpumagic.devices.leases import Lease
from gpumagic.errors import InvalidArgument, LeaseDirectoryError
from gpumagic.units import format_duration, parse_duration

_log = logging.getLogger(__name__)

FIELDS = ("idle_release", "max_gpus_per_user")
MIN_IDLE_RELEASE_S = 1.0
_MAX_BYTES = 16 * 1024


@dataclass(frozen=True)
class Policy:
    """What the administrator's ``policy.toml`` sets (None: not set), where it is, and ``problem``: why it is
    ignored, or which of its lines are (one line for ``%gpu``)."""

    idle_release: float | None = None  # seconds
    max_gpus_per_user: int | None = None
    path: Path | None = None
    problem: str | None = None

    def describe(self) -> str:
        """``idle leases go to waiters after 2h; at most 2 GPUs per user``."""
        parts = []
        if self.idle_release is not None:
            parts.append(f"an idle kernel's lease goes to a waiter after {format_duration(self.idle_release)}")
        if self.max_gpus_per_user is not None:
            parts.append(f"at most {self.max_gpus_per_user} GPU{'s' if self.max_gpus_per_user != 1 else ''} per user")
        return "; ".join(parts)

    def notes(self) -> list[str]:
        """What ``%gpu`` and ``%gpu why`` say of it: what it sets, and (one line) why it or a field is ignored."""
        lines = [f"Policy ({self.path}): {self.describe()}"] if self.describe() else []
        return lines + ([f"⚠ {self.problem}"] if self.problem else [])


_cache_lock = threading.Lock()
_cache: tuple[tuple, Policy] | None = None  # (the file's identity, what it said)


def read_policy(directory: Path | None = None) -> Policy:
    """The policy in the lease directory now (none where it has no ``policy.toml``). One ``stat`` when the file
    has not changed since the last read."""
    global _cache
    try:
        directory = lease_dir() if directory is None else directory
    except LeaseDirectoryError:
        return Policy()
    path = directory / POLICY_NAME
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return Policy()
    except OSError as err:
        _log.debug("the policy %s cannot be stat'ed; it is ignored", path, exc_info=True)
        return Policy(path=path, problem=f"{path} is ignored: it cannot be read ({err.strerror})")
    with _cache_lock:
        if _cache is not None and _cache[0] == _identity(path, info):
            return _cache[1]
    policy, read = _read(path)
    with _cache_lock:
        _cache = (_identity(path, read), policy) if read is not None else None
    return policy


def _identity(path: Path, info: os.stat_result) -> tuple:
    """What tells one version of the file from another: its inode and its times and size."""
    return (str(path), info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size)


def over_cap(
    policy: Policy,
    holdings: Iterable[tuple[int, Iterable[Lease]]],
    uid: int,
    wants: int,
    replacing: int | None,
    ahead: int = 0,
) -> str:
    """Why ``wants`` more GPUs would take user ``uid`` past the administrator's ``max_gpus_per_user`` (empty if
    they would not), counting the GPUs that user leases now (``holdings``: each GPU's index and leases), but for
    those of process ``replacing`` (a kernel's pick replaces its leases), and ``ahead``, what that user's earlier
    tickets take in this round."""
    cap = policy.max_gpus_per_user
    if cap is None:
        return ""
    held = sorted(i for i, leases in holdings if any(lease.uid == uid and lease.pid != replacing for lease in leases))
    if len(held) + ahead + wants <= cap:
        return ""
    if wants > cap:
        return (
            f"the administrator's policy ({policy.path}) allows {cap} GPU{'s' if cap != 1 else ''} per user and this "
            f"asks {wants}: it cannot start here while the policy stands; ask for {cap} at most"
        )
    name = shared_files.owner_name(uid)
    plural = "s" if cap != 1 else ""
    holds = f"{name} holds {len(held)} (GPU {', '.join(map(str, held))})" if held else f"{name} holds none"
    if ahead:
        holds += f" and {ahead} more ahead in the queue"
    return (
        f"the administrator's policy ({policy.path}) allows {cap} GPU{plural} per user: {holds}, "
        f"and this asks {wants}; give some back first (%gpu release, or let a job end)"
    )


def _read(path: Path) -> tuple[Policy, os.stat_result | None]:
    """The policy ``path`` holds, and the ``fstat`` of the file read (None if none was opened)."""

    def ignored(why: str) -> Policy:
        return Policy(path=path, problem=f"{path} is ignored: {why}")

    try:
        fd, info = shared_files.open_regular(path, None)
    except FileNotFoundError:
        return Policy(), None
    except shared_files.Untrusted as why:
        return ignored(str(why)), None
    except OSError as err:
        _log.debug("the policy %s cannot be opened; it is ignored", path, exc_info=True)
        return ignored(f"it cannot be read ({err.strerror})"), None
    try:
        if info.st_uid != 0:
            return ignored(f"it belongs to {shared_files.owner_name(info.st_uid)}, not root"), info
        if stat.S_IMODE(info.st_mode) & 0o022:
            return ignored("others than root may write it (chmod go-w)"), info
        if info.st_nlink != 1:  # a hard link to another root file, made where the kernel lets anyone make one
            return ignored(f"it has {info.st_nlink} names (a hard link)"), info
        try:
            raw = shared_files.read_capped(fd, info, _MAX_BYTES)
        except shared_files.Untrusted as why:
            return ignored(str(why)), info
    finally:
        os.close(fd)
    try:
        text = raw.decode()
        fields = _toml().loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # TOMLDecodeError is a ValueError
        return ignored(f"it is not TOML ({shared_files.one_line(err, 120)})"), info
    return _policy(path, fields), info


def _policy(path: Path, fields: dict) -> Policy:
    """The policy ``fields`` set; a field with a bad value, or unknown, is left out and named in ``problem``."""
    problems = []
    idle_release = max_gpus = None
    value = fields.get("idle_release")
    if value is not None:
        try:
            idle_release = parse_duration(value, what="idle_release")
            if idle_release < MIN_IDLE_RELEASE_S:
                raise InvalidArgument(f"it must be at least {MIN_IDLE_RELEASE_S:g}s")
        except InvalidArgument as err:
            idle_release = None
            problems.append(f"idle_release = {shared_files.one_line(value, 40)!r}: {err}")
    value = fields.get("max_gpus_per_user")
    if value is not None:
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 4096:
            max_gpus = value
        else:
            problems.append(f"max_gpus_per_user must be a whole number from 0, got {shared_files.one_line(value, 40)}")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        problems.append(f"unknown field{plural} {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    problem = f"{path}: ignoring " + "; ".join(problems) if problems else None
    return Policy(idle_release, max_gpus, path, problem)


def _toml():
    """The TOML reader: the standard library's from Python 3.11, ``tomli`` before."""
    if sys.version_info >= (3, 11):
        # lazy: only where a policy file exists
        import tomllib

        return tomllib
    # lazy: only where a policy file exists, on Python 3.10
    import tomli

    return tomli

"""Files no other user can swap, read or tear: the runs directories, run directories and files of gpumagic.

- A runs root (``safe_root``) is used only where no other user can replace what is in it: it and every
  directory above belong to root or to the user and are not writable by others, unless sticky (1777).
- A run directory is made with an exclusive ``mkdir`` and checked (no link, the user's, 0700) before use.
- Files are written whole or not at all (``write_private``: a temporary file, then ``rename``), 0600 whatever
  the umask; a full disk or quota is ``DiskFull``, one line that says what to do.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import io
import logging
import os
import pwd
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from gpumagic.errors import DiskFull, RunsDirectoryError
from gpumagic.run_dirs.layout import runs_root

_log = logging.getLogger(__name__)

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Files and directories made meanwhile, by this process or the processes it starts (submitit, sbatch, which
    passes the umask on to the job), are the user's alone (umask 077). The umask is the whole process's: keep
    the block short."""
    before = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(before)


def safe_root(root: Path | None = None) -> Path:
    """``root`` (default ``runs_root()``), made if missing (0700), once it is checked to be safe: no other user
    can write it, or it is sticky (``chmod 1777``, as ``/tmp``), and the same holds for every directory above.

    Raises:
        RunsDirectoryError: unsafe, or it cannot be made. DiskFull.
    """
    root = Path(os.path.abspath(runs_root() if root is None else root))
    if not root.exists():
        _check_chain(root.parent, root)
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as err:
            raise _unwritable(err, root) from None
    _check_chain(root, root)
    return root


def _check_chain(directory: Path, root: Path) -> None:
    """Raises RunsDirectoryError unless no other user can replace ``directory``, nor any directory above it
    (along the path as given and along the path it resolves to)."""
    seen = set()
    for path in (directory, directory.resolve()):
        for each in (path, *path.parents):
            if each in seen:
                continue
            seen.add(each)
            why = _why_unsafe(each)
            if why:
                raise RunsDirectoryError(
                    f"the runs directory {root} is not safe: {why}, so another user could replace your runs and run "
                    "code as you. Use a directory only you can write (mkdir -m 700 DIR), or one an administrator made "
                    "for everyone (root-owned, chmod 1777), as GPUMAGIC_RUNS_DIR or --runs-dir"
                )


def _why_unsafe(directory: Path) -> str | None:
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return None
    except OSError as err:
        _log.debug("%s cannot be checked; it is refused", directory, exc_info=True)
        return f"{directory} cannot be checked ({err.strerror})"
    if info.st_uid not in (0, os.getuid()):
        return f"{directory} belongs to {_user_name(info.st_uid)}"
    mode = stat.S_IMODE(info.st_mode)
    if mode & stat.S_ISVTX:
        return None
    if mode & 0o002:
        return f"{directory} can be written by everyone (mode {mode:o}, not sticky)"
    if mode & 0o020 and _has_acl(directory):  # with an ACL the group bits are its mask: named users may write
        return f"{directory} has an access control list that may let other users write it (not sticky)"
    if mode & 0o020 and not _private_group(info.st_gid, info.st_uid):
        return f"{directory} can be written by group {_group_name(info.st_gid)} (mode {mode:o}, not sticky)"
    return None


def _has_acl(directory: Path) -> bool:
    try:
        os.getxattr(directory, "system.posix_acl_access")
    except OSError:  # no ACL (ENODATA), or no xattrs here at all
        _log.debug("%s has no readable ACL; taken as none", directory, exc_info=True)
        return False
    return True


def _private_group(gid: int, uid: int) -> bool:
    """Whether group ``gid`` has no member but user ``uid`` (listed, or by primary group): a group-writable
    directory of a user whose umask is 002 (a private group, or a container's ``users``) is still theirs alone."""
    try:
        user, group = pwd.getpwuid(uid).pw_name, grp.getgrgid(gid)
        primary = {entry.pw_name for entry in pwd.getpwall() if entry.pw_gid == gid}
    except KeyError:
        return False
    return (set(group.gr_mem) | primary) <= {user}


def _user_name(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def make_own_directory(root: Path, kind: str) -> Path:
    """A new directory under ``root``, checked after it is made to be this user's own, 0700, and not a link."""
    for _ in range(100):
        path = root / (time.strftime("%Y%m%d-%H%M%S") + f"-{kind}-{uuid.uuid4().hex[:6]}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue  # taken, by chance or planted: another name
        except OSError as err:
            raise _unwritable(err, root) from None
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o700)  # whatever the umask
            check_own(path, os.fstat(fd))
        finally:
            os.close(fd)
        return path
    raise RunsDirectoryError(f"cannot make a new run directory in {root}: every name tried was taken")


def check_own(path: Path, info: os.stat_result | None = None) -> None:
    """Raises RunsDirectoryError unless ``path`` is a directory (not a link) of this user that only they can
    use (0700). ``info``: its ``fstat``, where it is open already."""
    try:
        info = info or os.lstat(path)
    except OSError as err:
        raise RunsDirectoryError(f"cannot use the run directory {path}: {err.strerror}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise RunsDirectoryError(
            f"{path} is not a run directory of yours that only you can use (a directory you own, mode 700): "
            "nothing of it is trusted"
        )


def is_own_run(entry: os.DirEntry | Path) -> bool:
    """Whether ``entry`` (in a runs directory) is a directory of this user's, not a link: one of their runs.
    A runs directory shared with others lists their runs too; these are not read."""
    try:
        info = entry.stat(follow_symlinks=False) if isinstance(entry, os.DirEntry) else os.lstat(entry)
    except OSError:
        _log.debug("%s cannot be stat'ed; not taken as a run of this user's", entry, exc_info=True)
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def _unwritable(err: OSError, path: Path) -> Exception:
    if err.errno in _FULL:
        return DiskFull(path, err.strerror or str(err), err.errno)
    return RunsDirectoryError(
        f"cannot write runs in {path}: {err.strerror}; set GPUMAGIC_RUNS_DIR to a directory of yours"
    )


def disk_error(err: OSError, path: Path) -> OSError:
    """``err`` as DiskFull when the disk or quota is full (naming ``path``), else ``err`` itself."""
    if isinstance(err, DiskFull) or err.errno not in _FULL:
        return err
    return DiskFull(path, err.strerror or str(err), err.errno)


def out_of_space(path: Path | str, margin: int = 64 << 10) -> bool:
    """Whether the filesystem of ``path`` has less than ``margin`` bytes left for this user (False if unknown).
    A process that could not write even its error report (a rank) leaves no better evidence."""
    try:
        space = os.statvfs(path)
    except OSError:
        _log.debug("the free space at %s is unknown; taken as enough", path, exc_info=True)
        return False
    return space.f_bavail * space.f_frsize < margin


def private_directory(path: Path) -> None:
    try:
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)
    except OSError as err:
        raise disk_error(err, path) from None


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` at ``path`` atomically (a reader never sees half of it) in a new file of mode 0600 (which
    a umask can narrow, never widen).

    Raises:
        DiskFull: no space for it (nothing is left behind). OSError.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # writers never share it
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)  # left by a process that died: its mode is not ours to trust
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise disk_error(err, path) from None


def open_private(path: Path) -> io.FileIO:
    """``path`` opened to append, unbuffered; created 0600 if new (not followed if it is a link)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return io.FileIO(fd, "ab", closefd=True)


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` (a short write is continued; an error raises)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


def append_whole(fd: int, data: bytes) -> None:
    """Append all of ``data`` to the file open at ``fd``, or nothing: a failed or short write is cut off again,
    so a reader never finds part of a record followed by whole ones. Raises OSError (the file as it was)."""
    size = os.fstat(fd).st_size
    try:
        write_all(fd, data)
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise

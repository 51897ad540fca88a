"""Sealed pickles: what gpumagic writes for another process to unpickle (a launch's payload, a rank's result,
a job's payload and result) carries an HMAC-SHA256 under a key only this user can read, and is checked
before it is unpickled.

Unpickling runs code, so a payload on disk is a way in for whoever can write there. Run directories are
private to their user (0700); the seal keeps that promise where they are not, or when they live on a
shared filesystem (issue #6): nobody without the key can make a rank or the kernel run their pickle.

The key is ``<user state dir>/payload.key`` (32 random bytes, 0600), made on first use.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import threading
from pathlib import Path

import platformdirs

from gpumagic.errors import GpumagicError
from gpumagic.run_dirs.private import write_private

HEADER = b"GPUMAGIC-HMAC-SHA256\n"
_DIGEST = hashlib.sha256().digest_size
_lock = threading.Lock()
_cached: tuple[Path, bytes] | None = None


class PayloadRejected(GpumagicError):
    """A sealed file's seal does not match: it was changed, or written by someone without the user's key."""


def key_path() -> Path:
    return Path(platformdirs.user_state_dir("gpumagic")) / "payload.key"


def _key() -> bytes:
    """This user's key, made on first use (0600 in a 0700 directory).

    Raises:
        PayloadRejected: the key file is readable by others or not the user's (so it is no secret).
    """
    global _cached
    path = key_path()
    with _lock:
        if _cached is not None and _cached[0] == path:
            return _cached[1]
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(os.urandom(32))
        except FileExistsError:
            pass
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PayloadRejected(
                f"gpumagic's key {path} must be a file of yours that only you can read: run `chmod 600 {path}` "
                "(or delete it to make a new one)"
            )
        key = path.read_bytes()
        if len(key) < 32:
            raise PayloadRejected(f"gpumagic's key {path} is too short; delete it to make a new one")
        _cached = (path, key)
        return key


def derived_key(purpose: bytes) -> bytes:
    """A key for ``purpose`` (a store's handshake, ...), derived from this user's key so that none is reused."""
    return hmac.new(_key(), b"gpumagic key for " + purpose, hashlib.sha256).digest()


def seal(data: bytes) -> bytes:
    """``data`` with its seal in front."""
    return HEADER + hmac.new(_key(), data, hashlib.sha256).digest() + data


def unseal(blob: bytes, what: str) -> bytes:
    """The data of a sealed ``blob``, checked.

    Raises:
        PayloadRejected: not sealed, or sealed under another key, or changed since (``what`` names it).
    """
    start = len(HEADER) + _DIGEST
    if not blob.startswith(HEADER) or len(blob) < start:
        raise PayloadRejected(f"{what} is not sealed by gpumagic; it will not be unpickled")
    data = blob[start:]
    if not hmac.compare_digest(blob[len(HEADER) : start], hmac.new(_key(), data, hashlib.sha256).digest()):
        raise PayloadRejected(
            f"{what} does not carry your key's seal: it was changed after it was written, or written by someone "
            "else; it will not be unpickled"
        )
    return data


def write_sealed(path: Path, data: bytes) -> None:
    """Write ``data`` sealed, atomically (a reader never sees half of it), in a new file of mode 0600.

    Raises:
        DiskFull: no space for it (nothing is left behind).
    """
    write_private(Path(path), seal(data))


def read_sealed(path: Path, what: str) -> bytes:
    """The checked data of a file written by ``write_sealed``. Raises PayloadRejected."""
    return unseal(Path(path).read_bytes(), what)

"""A launch's files in its run directory: the sealed description and code the ranks read (``launch/spec.json``,
``launch/payload.pkl``), the run's store secret and the addresses its stores published (``launch/store.key``,
``launch/store-T.address``), and the ranks' private directories (``launch/``, ``ranks/``), gone when the launch
ends."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
from typing import Any

from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.private import private_directory
from gpumagic.run_dirs.signing import derived_key, read_sealed, write_sealed


def make_launch_directories(files: RunFiles) -> None:
    """The ranks' private directories of a run (``launch/``, ``ranks/``: 0700 whatever the umask).

    Raises:
        DiskFull: no space for them.
    """
    for directory in (files.launch, files.ranks):
        if not directory.is_dir():
            private_directory(directory)
    if not files.store_secret.exists():
        write_sealed(files.store_secret, os.urandom(32))


def store_key(files: RunFiles) -> bytes:
    """The key of this run's stores (``launch.secure_store``): the user's store key bound to the run's own secret,
    so that a proof made for one run opens no store of another (issue #37).

    Raises:
        FileNotFoundError: the run has no launch directory (it ended, or it is not a launch).
        PayloadRejected: the secret was not written with the user's key.
    """
    secret = read_sealed(files.store_secret, f"the run's store secret {files.store_secret}")
    return hmac.new(derived_key(b"gpumagic rendezvous store"), b"run\0" + secret, hashlib.sha256).digest()


def publish_store(files: RunFiles, token: str, address: str) -> None:
    """Say where the store ``token`` names listens (sealed, written whole): its server bound the address first,
    so no other user could take it before, and only the user's processes can read or write this."""
    write_sealed(files.published_store(token), address.encode())


def published_store(files: RunFiles, token: str) -> str | None:
    """The address the store ``token`` names was published at; None while it was not.

    The directory is listed first: on NFS, that makes a file another node just wrote visible here at once.

    Raises:
        PayloadRejected: the file does not carry the user's seal (written by someone else).
    """
    path = files.published_store(token)
    try:
        if path.name not in os.listdir(path.parent):
            return None
        return read_sealed(path, f"the store address {path}").decode()
    except FileNotFoundError:
        return None


def remove_launch_directories(files: RunFiles) -> None:
    """The code, results and reports of the ranks: gone once the launch ended (the metrics stay)."""
    for directory in (files.launch, files.ranks):
        shutil.rmtree(directory, ignore_errors=True)


def write_spec(files: RunFiles, spec: dict[str, Any], packed: bytes) -> None:
    """Write what the ranks of a run need, sealed: ``launch/spec.json`` and ``launch/payload.pkl``."""
    make_launch_directories(files)
    write_sealed(files.payload, packed)
    write_sealed(files.spec, json.dumps(spec, indent=1).encode())


def read_spec(files: RunFiles) -> dict[str, Any]:
    """The sealed spec of a run (raises PayloadRejected if it was changed, FileNotFoundError if absent)."""
    return json.loads(read_sealed(files.spec, f"the launch description {files.spec}"))

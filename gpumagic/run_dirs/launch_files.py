"""A launch's files in its run directory: the sealed description and code the ranks read (``launch/spec.json``,
``launch/payload.pkl``), and the ranks' private directories (``launch/``, ``ranks/``), gone when the launch ends."""

from __future__ import annotations

import json
import shutil
from typing import Any

from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.private import private_directory
from gpumagic.run_dirs.signing import read_sealed, write_sealed


def make_launch_directories(files: RunFiles) -> None:
    """The ranks' private directories of a run (``launch/``, ``ranks/``: 0700 whatever the umask).

    Raises:
        DiskFull: no space for them.
    """
    for directory in (files.launch, files.ranks):
        if not directory.is_dir():
            private_directory(directory)


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

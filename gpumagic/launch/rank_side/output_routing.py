"""Where a rank's output goes: file descriptors 1 and 2 (so C libraries' output too) to the launcher's pipe (a
local rank) or to the rank's log in the run directory (a rank under an agent or Slurm), and what the rank
printed and logged written out before it exits without interpreter teardown."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)


def route_output(local_rank: int, outputs: list[Any]) -> None:
    """Send this rank's stdout and stderr (file descriptors 1 and 2, so C libraries too) to the launcher."""
    own = outputs[local_rank]
    flush()
    os.dup2(own.fileno(), 1)
    os.dup2(own.fileno(), 2)
    for connection in outputs:
        connection.close()
    _line_buffered()


@contextmanager
def output_to(path: Path) -> Iterator[None]:
    """Send file descriptors 1 and 2 (so C libraries too) to ``path``, appended; put them back after."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        _line_buffered()
        yield
    finally:
        flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for each in (fd, *saved):
            os.close(each)


def _line_buffered() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass


def flush() -> None:
    """Write out what the rank logged and printed: before it exits without interpreter teardown."""
    telemetry = sys.modules.get("gpumagic.telemetry.log")
    if telemetry is not None:  # the points logged since the last periodic write
        try:
            telemetry.flush()
        except (OSError, ValueError):
            _log.debug("the telemetry's last points could not be written", exc_info=True)
    checkpoints = sys.modules.get("gpumagic.run_dirs.checkpoint_files")
    if checkpoints is not None:  # the last checkpoint's seal: without it the one before is the latest
        checkpoints.settle()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            _log.debug("a stream could not be flushed; what it held may be lost", exc_info=True)

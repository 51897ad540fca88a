"""How a rank tells its launcher it failed: where (the phase), the exception, the user's own traceback (from
their first frame, without gpumagic's), and when; written to ``ranks/rank-R.error.A.json`` by a launch's rank
(``run_dirs.outcomes`` reads it), sent over the pipe by a group rank."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gpumagic.run_dirs.outcomes import GPUMAGIC_ROOT
from gpumagic.run_dirs.private import write_private


def report_failure(path: Path, rank: int, phase: str, err: BaseException) -> int:
    """Write how a rank failed to ``path`` (JSON); its exit code (0 for ``sys.exit(0)``)."""
    if isinstance(err, SystemExit):
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        if code == 0:
            return 0
    elif isinstance(err, KeyboardInterrupt):
        return 128 + signal.SIGINT
    else:
        code = 1
    report = {"rank": rank, "pid": os.getpid(), **failure_report(phase, err), "exitcode": code}
    message = report["message"]
    try:
        write_private(path, json.dumps(report).encode())
    except OSError as unwritten:  # a full disk: the launcher says so, and stderr still carries the failure
        sys.stderr.write(f"rank {rank} could not record its failure: {unwritten}\n")
    sys.stderr.write(f"rank {rank} failed: {type(err).__name__}: {message}\n")
    return code


def failure_report(phase: str, err: BaseException) -> dict[str, Any]:
    """How the user's code failed, as a launcher reads it: where (``phase``), the exception, its traceback from
    the user's first frame (none for ``sys.exit``), and when."""
    exited = isinstance(err, SystemExit)
    return {
        "phase": phase,
        "type": type(err).__name__,
        "message": str(err.code) if exited else str(err),
        "traceback": None if exited else _user_traceback(err),
        "timestamp": time.time(),
    }


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's first frame on: gpumagic's own frames are noise to the user."""
    tb = err.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(GPUMAGIC_ROOT):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb or err.__traceback__))

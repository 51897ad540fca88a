"""The package's log of what it swallowed. Each module logs to ``logging.getLogger(__name__)``, under the
``gpumagic`` logger, which is quiet: no handler of gpumagic's and no level of its own, so Python's defaults keep
its debug lines out of sight and show a warning as before. With ``GPUMAGIC_DEBUG=1`` in the environment every
line goes to stderr, in the kernel and in every process gpumagic starts (ranks, agents, job runners inherit the
variable and import gpumagic, which calls ``configure``). Standard library only: every floor may import it.

Quiet, it does not even import ``logging`` (``import gpumagic`` stays about 20 ms); a ``NullHandler`` would only
have hidden the warnings Python's last resort shows, which users read today.

>>> import logging
>>> configure({"GPUMAGIC_DEBUG": "1"}); logging.getLogger("gpumagic").level == logging.DEBUG
True
>>> configure()  # back to what the environment says
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

VARIABLE = "GPUMAGIC_DEBUG"
FORMAT = "%(asctime)s gpumagic[%(process)d] %(name)s %(levelname)s: %(message)s"
_handler: Any = None  # the stderr handler, made the first time lines are wanted


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``GPUMAGIC_DEBUG`` asks for debug lines (set, and not ``0``, ``false``, ``no`` or ``off``)."""
    return environ.get(VARIABLE, "").strip().lower() not in ("", "0", "false", "no", "off")


def configure(environ: Mapping[str, str] = os.environ) -> None:
    """Quiet, or every line on stderr, as ``environ`` says now: as gpumagic is imported, and again where a
    process takes on another environment (a rank, its launch's). Calling it again changes nothing more."""
    global _handler
    if not enabled(environ) and _handler is None:
        return  # never loud here: Python's defaults are the quiet
    # lazy: logging only where lines are wanted, or were
    import logging

    package = logging.getLogger("gpumagic")
    if not enabled(environ):
        package.removeHandler(_handler)
        package.setLevel(logging.NOTSET)
        return
    if _handler is None:
        _handler = logging.StreamHandler(_CurrentStderr())
        _handler.setFormatter(logging.Formatter(FORMAT))
    if _handler not in package.handlers:
        package.addHandler(_handler)
    package.setLevel(logging.DEBUG)


class _CurrentStderr:
    """``sys.stderr`` as it is at each write: a test or a front end may swap the object after the handler is made
    (a rank points file descriptor 2 at its own log, which any object writes to)."""

    def write(self, text: str) -> Any:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


if enabled():
    configure()

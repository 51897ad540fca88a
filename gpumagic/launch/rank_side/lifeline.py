"""A rank lives and dies with the kernel that launched it: a parent-death signal, a watchdog on the kernel, and
ending the rank's whole process group (what its code started) when the kernel is gone."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from multiprocessing import forkserver

from gpumagic.devices.processes import is_running

_log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with(launcher_pid: int) -> None:
    """End this rank if the kernel that launched it dies: a parent-death signal (the forkserver's death,
    which follows the kernel's) and a watchdog on the kernel itself."""
    die_with_parent()
    _release_forkserver()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if not is_running(launcher_pid):
                end_own_group()

    threading.Thread(target=watch, name="gpumagic-watchdog", daemon=True).start()


def end_own_group() -> None:
    """The launcher is gone: end this rank and every process it started (its process group)."""
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(1)


def die_with_parent(how: int = signal.SIGKILL) -> None:
    """Have the kernel send ``how`` to this process when its parent dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, how, 0, 0, 0)
    except (OSError, AttributeError):
        _log.debug("prctl(PR_SET_PDEATHSIG) failed; this process may outlive its parent", exc_info=True)


def _release_forkserver() -> None:
    """Drop the forkserver's keep-alive pipe that multiprocessing hands every child: held by the ranks, it
    would keep the forkserver (and so the ranks, through their parent-death signal) alive after the kernel."""
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            _log.debug("the forkserver's alive pipe could not be closed; it is forgotten anyway", exc_info=True)
        server._forkserver_alive_fd = None
        server._forkserver_address = None

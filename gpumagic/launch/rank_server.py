"""The process local ranks are forked from: multiprocessing's forkserver, with torch, what DDP needs and the
heavy libraries the kernel has imported already loaded once, so that a launch costs a fork, not an import.

Preloaded: torch, torch.distributed, torch._dynamo (the first ``DistributedDataParallel()`` imports it:
about 1 s a rank otherwise), cloudpickle, the rank runtime, and of ``HEAVY_LIBRARIES`` those the kernel has
imported by the time of a launch (a library imported later restarts the server at the next launch that finds
it idle: one import then, none per rank after). Only libraries known not to start CUDA or threads at import
are preloaded; the user's own modules never are.

Imported in the server itself (it is on the preload list) this module makes the server a child subreaper and
has it end every process its ranks left behind when it exits, which it does when the kernel dies.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any

BASE_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "cloudpickle",
    "gpumagic.launch.rank",
    "gpumagic.launch.group_rank",
)
# imported by the kernel's user, these are worth importing once in the server instead of once per rank
HEAVY_LIBRARIES = (
    "numpy",
    "scipy",
    "pandas",
    "sklearn",
    "torchvision",
    "torchaudio",
    "torchmetrics",
    "transformers",
    "tokenizers",
    "datasets",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "timm",
    "einops",
    "safetensors",
    "huggingface_hub",
    "tqdm",
    "PIL",
)
SERVER_VARIABLE = "GPUMAGIC_RANK_SERVER"  # set while the kernel starts the server: the server's cue
REPORT_VARIABLE = "GPUMAGIC_RANK_SERVER_REPORT"  # where the server says which heavy libraries it has
PR_SET_CHILD_SUBREAPER = 36

_lock = threading.Lock()
_preloaded: frozenset[str] = frozenset()
_server_pid: int | None = None
_report: str | None = None  # the file the running server writes its heavy libraries to
_launches = 0  # launches of this process using the server now


def preload_list() -> list[str]:
    """What the server should have imported for a launch now: the base, and the heavy libraries the kernel
    has imported."""
    return [*BASE_PRELOAD, *(name for name in HEAVY_LIBRARIES if name in sys.modules), __name__]  # this: last


@contextlib.contextmanager
def forkserver_context() -> Any:
    """The forkserver context for one launch, its server running with ``preload_list()`` imported (restarted
    first if it lacks some and no other launch of this process uses it)."""
    global _launches
    with _lock:
        _ensure_server(preload_list())
        _launches += 1
    try:
        yield multiprocessing.get_context("forkserver")
    finally:
        with _lock:
            _launches -= 1


def _ensure_server(wanted: list[str]) -> None:
    global _preloaded, _server_pid, _report
    from multiprocessing import forkserver

    server = forkserver._forkserver
    running = getattr(server, "_forkserver_pid", None)
    if running is not None and running == _server_pid:
        if set(wanted) <= _preloaded or set(wanted) <= _preloaded | _server_has():  # the file only if needed
            return  # what the kernel has, the server has: asked for, or imported along (torch imports numpy)
    if running is not None and _launches == 0 and hasattr(server, "_stop"):
        server._stop()  # idle: restart it with the larger preload
    elif running is not None:
        return  # busy with another launch: its ranks import what is missing themselves
    import tempfile

    forkserver.set_forkserver_preload(wanted)
    if _report is not None:
        with contextlib.suppress(OSError):
            os.unlink(_report)
    remove_stale_reports()
    handle, _report = tempfile.mkstemp(prefix=f"{REPORT_PREFIX}{os.getpid()}-")  # 0600, this user's
    os.close(handle)
    os.environ.update({SERVER_VARIABLE: str(os.getpid()), REPORT_VARIABLE: _report})
    try:
        server.ensure_running()
    finally:
        os.environ.pop(SERVER_VARIABLE, None)
        os.environ.pop(REPORT_VARIABLE, None)
    _preloaded = frozenset(wanted)
    _server_pid = server._forkserver_pid


REPORT_PREFIX = "gpumagic-rank-server-"  # then the kernel's pid: the server removes it when it ends


def remove_stale_reports() -> list[str]:
    """Remove this user's rank server reports in the temp directory whose kernel is gone (a server killed
    with SIGKILL cannot remove its own; before the pid was in the name, none was removed); the names removed."""
    import tempfile

    from gpumagic.devices.processes import is_running

    removed = []
    directory = tempfile.gettempdir()
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.startswith(REPORT_PREFIX):
                continue
            pid = entry.name[len(REPORT_PREFIX) :].split("-", 1)[0]
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
                if pid.isdigit() and is_running(int(pid)):
                    continue
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed


def _server_has() -> frozenset[str]:
    """The heavy libraries the running server has imported, as it reported once its preload was done."""
    try:
        with open(_report or "") as handle:
            return frozenset(handle.read().split())
    except OSError:
        return frozenset()


def _become_rank_server() -> None:
    """In the server: adopt the processes ranks leave behind (a child subreaper), and end all of them, with
    every rank's process group, when the server exits (the kernel died or the server is restarted)."""
    import atexit
    import ctypes
    import warnings

    os.environ.pop(SERVER_VARIABLE, None)
    report = os.environ.pop(REPORT_VARIABLE, "")
    if report:  # imported last of the preload: everything else is imported now
        with contextlib.suppress(OSError), open(report, "w") as handle:
            handle.write(" ".join(name for name in HEAVY_LIBRARIES if name in sys.modules))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")  # adopted ones
    atexit.register(_end_children, os.getpid(), report)


def _end_children(server_pid: int, report: str = "") -> None:
    if os.getpid() != server_pid:  # a rank forked from the server inherits the registration
        return
    if report:
        with contextlib.suppress(OSError):
            os.unlink(report)
    for pid in _children_of(server_pid):
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # a rank leads its group: what it started is in it
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _children_of(parent: int) -> list[int]:
    from gpumagic.devices.processes import parent_pid

    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and parent_pid(int(entry)) == parent]


if os.environ.get(SERVER_VARIABLE) == str(os.getppid()):  # imported by the forkserver the kernel is starting
    _become_rank_server()

"""The process local ranks are forked from: multiprocessing's forkserver, with torch, what DDP needs and the
heavy libraries the kernel has imported already loaded once, so that a launch costs a fork, not an import.

Preloaded: torch, torch.distributed, torch._dynamo (the first ``DistributedDataParallel()`` imports it:
about 1 s a rank otherwise), cloudpickle, the rank runtime, and of ``HEAVY_LIBRARIES`` those the kernel has
imported by the time of a launch (a library imported later restarts the server at the next launch that finds
it idle: one import then, none per rank after). Only libraries known not to start CUDA or threads at import
are preloaded; the user's own modules never are.

Imported in the server itself (it is on the preload list) this module puts the server in a process group of its
own (a signal to the kernel's group, which Jupyter sends at a restart or shutdown, does not reach it), makes it a
child subreaper, and has it end every rank's process group and every process its ranks left behind when it
exits: when the kernel closes its end of the server's alive pipe (``stop_for_good``) or dies, and at a SIGTERM.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from multiprocessing import forkserver, resource_tracker, util
from typing import Any

from gpumagic.devices.processes import is_running, parent_pid, signal_processes

_log = logging.getLogger(__name__)

BASE_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "cloudpickle",
    "gpumagic.launch.rank_side.rank",
    "gpumagic.launch.rank_side.group_rank",
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
END_WITHIN_S = 2.0  # how long an ending server keeps killing what its ranks left behind

_lock = threading.Lock()
_preloaded: frozenset[str] = frozenset()
_server_pid: int | None = None
_report: str | None = None  # the file the running server writes its heavy libraries to
_launches = 0  # launches of this process using the server now
_started = False  # whether this process ever started a rank server


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
    global _preloaded, _server_pid, _report, _started

    server = forkserver._forkserver
    running = getattr(server, "_forkserver_pid", None)
    if running is not None and running == _server_pid:
        if set(wanted) <= _preloaded or set(wanted) <= _preloaded | _server_has():  # the file only if needed
            return  # what the kernel has, the server has: asked for, or imported along (torch imports numpy)
    if running is not None and _launches == 0:
        _stop_unlocked()  # idle: restart it with the larger preload
    elif running is not None:
        return  # busy with another launch: its ranks import what is missing themselves

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
    _started = True


def started() -> bool:
    """Whether this process started a rank server (then its end stops it, and multiprocessing's resource tracker;
    a process that never launched leaves the user's own forkserver and tracker alone)."""
    return _started


def stop_for_good(grace_s: float = 2.0) -> None:
    """End the rank server of this process for good (the process is ending): every rank still running from it
    and what they left behind end with it. Waits ``grace_s`` seconds for it to exit, then kills it.

    A launch afterwards (or one that another thread makes meanwhile: a cell still running as the kernel is
    shut down) fails at once with RuntimeError, instead of starting a server this process would leave behind.
    """

    forkserver._forkserver.ensure_running = _refuse_to_start  # type: ignore[method-assign]
    with _lock:
        _stop_unlocked(grace_s)


def _refuse_to_start() -> None:
    raise RuntimeError("this process is ending (its kernel was asked to shut down): no rank can start now")


def _stop_unlocked(grace_s: float = 2.0) -> None:
    """Stop the server: closing the kernel's end of its alive pipe makes it exit and end its children."""
    global _preloaded, _server_pid, _report

    server = forkserver._forkserver
    with server._lock:
        pid, alive, address = server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address
        if pid is None:
            return
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    with contextlib.suppress(OSError):
        os.close(alive)
    if not _reaped(pid, grace_s):  # stuck: end its ranks from here (with their groups), then the server
        _kill_with_groups(_children_of(pid))
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        _reaped(pid, 5.0)
    if address and not util.is_abstract_socket_namespace(address):
        with contextlib.suppress(OSError):
            os.unlink(address)
    if _report is not None:
        with contextlib.suppress(OSError):
            os.unlink(_report)
    _preloaded, _server_pid, _report = frozenset(), None, None


def stop_resource_tracker(grace_s: float = 1.0) -> None:
    """Let multiprocessing's resource tracker end and reap it (it ignores SIGTERM; it ends when the last holder
    of its pipe closes it: the kernel here, the ranks by ending); killed after ``grace_s`` seconds if another
    process still holds it. For the kernel's end: ipykernel waits for its children then."""

    tracker = resource_tracker._resource_tracker
    if not tracker._lock.acquire(timeout=grace_s):
        return
    try:
        fd, pid = tracker._fd, tracker._pid
        tracker._fd = tracker._pid = None
    finally:
        tracker._lock.release()
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
    if pid is not None and not _reaped(pid, grace_s):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        _reaped(pid, 5.0)


def _reaped(pid: int, within_s: float) -> bool:
    """Wait up to ``within_s`` seconds for this process's child ``pid`` to exit, and reap it; True if it did
    (or is no child of this process)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


REPORT_PREFIX = "gpumagic-rank-server-"  # then the kernel's pid: the server removes it when it ends


def remove_stale_reports() -> list[str]:
    """Remove this user's rank server reports in the temp directory whose kernel is gone (a server killed
    with SIGKILL cannot remove its own; before the pid was in the name, none was removed); the names removed."""

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
        _log.debug("the rank server's report %s is unreadable; taken as nothing imported", _report, exc_info=True)
        return frozenset()


def _become_rank_server() -> None:
    """In the server: lead a process group of its own, adopt the processes ranks leave behind (a child
    subreaper), and end all of them, with every rank's process group, when the server exits (the kernel closed
    its alive pipe or died, a SIGTERM came, or the server is restarted)."""

    os.environ.pop(SERVER_VARIABLE, None)
    report = os.environ.pop(REPORT_VARIABLE, "")
    if report:  # imported last of the preload: everything else is imported now
        with contextlib.suppress(OSError), open(report, "w") as handle:
            handle.write(" ".join(name for name in HEAVY_LIBRARIES if name in sys.modules))
    # out of the kernel's group: Jupyter and ipykernel signal that group (SIGTERM, SIGKILL) at a restart or a
    # shutdown, which killed the server before it could end what the ranks started; the server ends when the
    # kernel does, by its alive pipe
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")  # adopted ones
    server_pid = os.getpid()
    signal.signal(signal.SIGTERM, functools.partial(_exit_on_sigterm, server_pid))  # to run the atexit below
    os.register_at_fork(after_in_child=functools.partial(_default_sigterm_if_forked_by, server_pid))
    atexit.register(_end_children, server_pid, report)


def _exit_on_sigterm(server_pid: int, signum: int, frame: Any) -> None:
    if os.getpid() == server_pid:
        raise SystemExit(128 + signum)
    signal.signal(signum, signal.SIG_DFL)  # a rank forked just before it reset the handler: as if it had
    os.kill(os.getpid(), signum)


def _default_sigterm_if_forked_by(server_pid: int) -> None:
    if os.getppid() == server_pid:  # a rank, not what a rank forks (a user's handler stays theirs)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _end_children(server_pid: int, report: str = "") -> None:
    if os.getpid() != server_pid:  # a rank forked from the server inherits the registration
        return
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut this short
    if report:
        with contextlib.suppress(OSError):
            os.unlink(report)
    _end_descendants()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)  # the rest of an exit with torch imported takes most of a second, and the server has nothing to save


def _end_descendants(within_s: float = END_WITHIN_S) -> None:
    """In the server: kill every child with its process group (a rank leads its group: what it started is in
    it), and reap them, until none is left, for at most ``within_s`` seconds. What left a rank's group is
    adopted by the server (a child subreaper) as the rank ends, and is killed at the next look. A child counts
    as ended once reaped: a process whose first thread has ended shows as a zombie while its other threads
    still run, and hands its children over only when the last one ends."""
    deadline = time.monotonic() + within_s
    while True:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        children = _children_of(os.getpid())
        if not children or time.monotonic() >= deadline:
            return
        _kill_with_groups(children)
        time.sleep(0.01)


def _kill_with_groups(pids: list[int]) -> None:
    """SIGKILL to each process and to the group it leads, if it leads one (a rank: what it started is in it)."""

    signal_processes(pids, pids, signal.SIGKILL)


def _children_of(parent: int) -> list[int]:

    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and parent_pid(int(entry)) == parent]


if os.environ.get(SERVER_VARIABLE) == str(os.getppid()):  # imported by the forkserver the kernel is starting
    _become_rank_server()

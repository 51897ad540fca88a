"""What runs inside each rank: die with the launcher, route output, set the environment, join the process
group, run the shipped code, and report a value or a structured failure.

Imported by the forkserver (with torch preloaded) and, for pickling by reference, by the kernel: so it
imports nothing heavy at module level.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from gpumagic.launch.plan import LaunchPlan

PR_SET_PDEATHSIG = 1


def run_rank(local_rank: int, plan: LaunchPlan, outputs: list[Any], listener: Any) -> None:
    """The target of every rank process (``local.run_local`` starts it with the rank's local index)."""
    _die_with(plan.launcher_pid)
    _route_output(local_rank, outputs)
    rank = plan.global_rank(local_rank)
    os.environ.update(plan.environment(local_rank))
    if rank != 0 and listener is not None:
        listener.close()
        listener = None
    phase = "setup"
    try:
        import cloudpickle
        import torch

        torch.set_num_threads(plan.threads_per_rank)
        from gpumagic.launch.signing import read_sealed

        payload_path = Path(plan.job_dir, "payload.pkl")
        payload = cloudpickle.loads(read_sealed(payload_path, f"the code sent to the ranks ({payload_path})"))
        payload.prepare()
        device = torch.device("cpu")
        if plan.backend is not None:  # spawn's code chooses its devices itself, as under mp.spawn
            if plan.use_cuda:
                torch.cuda.set_device(0)
                device = torch.device("cuda", 0)
            phase = "rendezvous"
            join_process_group(
                plan.backend, plan.master_addr, plan.master_port, rank, plan.world_size, plan.timeout_s, listener
            )
        phase = "user code"
        value = payload.run(rank_namespace(rank, local_rank, plan.world_size, device))
        from gpumagic.launch.signing import write_sealed

        write_sealed(Path(plan.job_dir, f"rank-{rank}.result.pkl"), cloudpickle.dumps(value))
        if plan.backend is not None:
            leave_process_group()
    except BaseException as err:  # noqa: BLE001 - every way a rank ends must be reported
        code = report_failure(Path(plan.job_dir), f"rank-{rank}.error.json", rank, phase, err)
        _flush()
        os._exit(code)
    _flush()
    os._exit(0)  # skip interpreter teardown: a finished rank must not hang in a library's destructor


def rank_namespace(rank: int, local_rank: int, world_size: int, device: Any) -> dict[str, Any]:
    """The names a ``%%launch_ddp`` cell finds defined: ``rank``, ``local_rank``, ``world_size``, ``device``,
    ``dist`` (``torch.distributed``) and ``gpumagic`` (so ``gpumagic.log`` works without an import)."""
    import torch.distributed as dist

    import gpumagic

    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "device": device,
        "dist": dist,
        "gpumagic": gpumagic,
    }


def join_process_group(
    backend: str,
    addr: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    listener: Any = None,
    served_prefix: str | None = None,
) -> None:
    """Join the process group through a TCPStore at ``addr:port``. Rank 0 serves it: on ``listener`` (a socket
    bound already) when given, else on a socket it binds to ``addr`` itself, never on every interface.
    ``served_prefix``: an elastic agent serves the store already; every rank is a client under that prefix."""
    import datetime
    import socket

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if served_prefix is not None:
        client = dist.TCPStore(addr, port, world_size, False, timeout=timeout)
        store = dist.PrefixStore(served_prefix, client)
    elif rank == 0:
        if listener is None:
            listener = socket.create_server((addr, port), backlog=256)
        store = dist.TCPStore(addr, port, world_size, True, timeout=timeout, master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def report_failure(directory: Path, name: str, rank: int, phase: str, err: BaseException) -> int:
    """Write how a rank failed to ``directory/name`` (JSON); its exit code (0 for ``sys.exit(0)``)."""
    if isinstance(err, SystemExit):
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        if code == 0:
            return 0
        message = str(err.code)
    elif isinstance(err, KeyboardInterrupt):
        return 128 + signal.SIGINT
    else:
        code = 1
        message = str(err)
    report = {
        "rank": rank,
        "pid": os.getpid(),
        "phase": phase,
        "type": type(err).__name__,
        "message": message,
        "traceback": None if isinstance(err, SystemExit) else _user_traceback(err),
        "timestamp": time.time(),
        "exitcode": code,
    }
    try:
        _write(directory / name, json.dumps(report).encode())
    except OSError as unwritten:  # a full disk: the launcher says so, and stderr still carries the failure
        sys.stderr.write(f"rank {rank} could not record its failure: {unwritten}\n")
    sys.stderr.write(f"rank {rank} failed: {type(err).__name__}: {message}\n")
    return code


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's first frame on: gpumagic's own frames are noise to the user."""
    own = os.path.dirname(os.path.abspath(__file__))
    tb = err.__traceback__
    while tb is not None and os.path.dirname(os.path.abspath(tb.tb_frame.f_code.co_filename)) == own:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb or err.__traceback__))


def _write(final: Path, data: bytes) -> None:
    """Atomically, private to the user (0600). Raises DiskFull (an OSError) when there is no room."""
    from gpumagic.telemetry.private import write_private

    write_private(final, data)


def _die_with(launcher_pid: int) -> None:
    """End this rank if the kernel that launched it dies: a parent-death signal (the forkserver's death,
    which follows the kernel's) and a watchdog on the kernel itself."""
    die_with_parent()

    _release_forkserver()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if not _running(launcher_pid):
                os._exit(1)

    threading.Thread(target=watch, name="gpumagic-watchdog", daemon=True).start()


def die_with_parent(how: int = signal.SIGKILL) -> None:
    """Have the kernel send ``how`` to this process when its parent dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, how, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _release_forkserver() -> None:
    """Drop the forkserver's keep-alive pipe that multiprocessing hands every child: held by the ranks, it
    would keep the forkserver (and so the ranks, through their parent-death signal) alive after the kernel."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None
        server._forkserver_address = None


def _running(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def _route_output(local_rank: int, outputs: list[Any]) -> None:
    """Send this rank's stdout and stderr (file descriptors 1 and 2, so C libraries too) to the launcher."""
    own = outputs[local_rank]
    _flush()
    os.dup2(own.fileno(), 1)
    os.dup2(own.fileno(), 2)
    for connection in outputs:
        connection.close()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass


def _flush() -> None:
    telemetry = sys.modules.get("gpumagic.telemetry.log")
    if telemetry is not None:  # the points logged since the last periodic write
        try:
            telemetry.flush()
        except (OSError, ValueError):
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass

"""Stopping one of your own GPU processes (``%gpu kill``, ``gpumagic.kill``): the checks against what the GPUs
show, then ``processes.kill_own_process`` (SIGTERM, then SIGKILL)."""

from __future__ import annotations

from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.processes import KillReport, kill_own_process
from gpumagic.errors import InvalidArgument, KillRefused


def kill_gpu_process(pid: int, timeout: float = 5.0) -> KillReport:
    """Stop ``pid``, one of your own processes on a GPU: SIGTERM, then SIGKILL after ``timeout`` seconds.

    Raises:
        InvalidArgument: not a positive whole number. KillRefused: another user's process, a simulated one, a
        process on no GPU, or this kernel itself.
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise InvalidArgument(f"a PID is a positive whole number, got {pid!r}")
    processes = [p for g in read_inventory().gpus for p in g.processes]
    simulated = [p for p in processes if p.pid == pid and p.simulated]
    if simulated:
        raise KillRefused(
            f"PID {pid} is a simulated process of {simulated[0].user}; gpumagic stops only your own processes"
        )
    return kill_own_process(pid, {p.pid for p in processes}, timeout)

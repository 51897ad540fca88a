"""A real Jupyter kernel whose CPU use the benchmarks measure from outside (psutil), shared by
telemetry.py and jobs.py."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any


class MeasuredKernel:
    """``client`` runs code in the kernel; ``cpu_percent_over(seconds)`` is its CPU use, % of one core."""

    def __init__(self, client: Any, pid: int) -> None:
        import psutil

        self.client = client
        self.process = psutil.Process(pid)

    def run(self, code: str) -> None:
        self.client.execute_interactive(code, timeout=60, output_hook=lambda message: None)  # its output unread

    def cpu_percent_over(self, seconds: float) -> float:
        before, began = self.process.cpu_times(), time.monotonic()
        time.sleep(seconds)
        after = self.process.cpu_times()
        spent = (after.user - before.user) + (after.system - before.system)
        return 100 * spent / (time.monotonic() - began)


@contextlib.contextmanager
def measured_kernel(env: dict[str, str]) -> Iterator[MeasuredKernel]:
    """Start a python3 kernel with ``env``; shut it down at the end."""
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env=env)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        yield MeasuredKernel(client, manager.provisioner.process.pid)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)

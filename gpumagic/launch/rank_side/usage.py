"""Each node's agent samples the resources of its own ranks into the run directory
(``ranks/rank-R.usage.jsonl``: one JSON line per sample, ``{"time", "memory", "busy"}``), so the notebook's
dashboard draws every node's ranks, not only those on the kernel's machine.

Memory is MiB, ``busy`` percent: the rank's resident memory and CPU use, or on a CUDA run the GPU memory NVML
names for its process and its GPU's utilization.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.outcomes import read_rank_start
from gpumagic.run_dirs.private import open_private
from gpumagic.units import MIB

_log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0


def start_sampling(
    run_dir: Path, world_size: int, use_cuda: bool, interval_s: float = SAMPLE_INTERVAL_S
) -> threading.Event:
    """Sample this node's ranks of ``run_dir`` (of ``world_size``) every ``interval_s`` in a daemon thread; set the
    event to stop."""
    stop = threading.Event()
    sampler = _Sampler(RunFiles(run_dir), world_size, use_cuda)
    threading.Thread(target=sampler.run, args=(stop, interval_s), name="gpumagic-usage", daemon=True).start()
    return stop


class _Sampler:
    def __init__(self, files: RunFiles, world_size: int, use_cuda: bool) -> None:
        self.files = files
        self.world_size = world_size
        self.use_cuda = use_cuda
        self.host = socket.gethostname()
        self.processes: dict[int, Any] = {}  # rank -> its psutil.Process (this attempt's)

    def run(self, stop: threading.Event, interval_s: float) -> None:
        while not stop.wait(interval_s):
            try:  # sampling must never end the agent
                self.sample()
            except Exception:  # noqa: BLE001
                _log.debug("a sample of the node's ranks failed; skipped", exc_info=True)

    def _local_ranks(self) -> dict[int, int]:
        """rank -> pid of the ranks whose latest start was on this node."""
        starts = {rank: read_rank_start(self.files, rank) for rank in range(self.world_size)}
        return {r: s["pid"] for r, s in starts.items() if s.get("host") == self.host and isinstance(s.get("pid"), int)}

    def sample(self) -> None:
        ranks = self._local_ranks()
        gpus = self._gpu_use() if self.use_cuda else {}
        now = time.time()
        for rank, pid in ranks.items():
            process = self.processes.get(rank)
            if process is None or process.pid != pid:
                try:
                    process = self.processes[rank] = psutil.Process(pid)
                    process.cpu_percent(None)  # counted from now: the next sample has a rate
                except psutil.Error:
                    continue
                continue
            try:
                if pid in gpus:
                    memory, busy = gpus[pid]
                else:
                    memory, busy = process.memory_info().rss / MIB, process.cpu_percent(None)
            except psutil.Error:
                continue
            line = json.dumps({"time": now, "memory": round(memory, 1), "busy": round(busy, 1)}) + "\n"
            with open_private(self.files.rank_usage(rank)) as handle:
                handle.write(line.encode())

    def _gpu_use(self) -> dict[int, tuple[float, float]]:
        """pid -> (its GPU memory in MiB, its GPU's utilization) for the processes NVML names."""
        # lazy: NVML only for CUDA runs
        from gpumagic.devices.inventory import read_inventory

        use = {}
        try:
            for gpu in read_inventory().gpus:
                for process in gpu.processes:
                    if process.gpu_memory is not None:
                        use[process.pid] = (process.gpu_memory / MIB, float(gpu.utilization or 0.0))
        except Exception:  # noqa: BLE001
            _log.debug("the GPU inventory cannot be read; the ranks' GPU use is left out", exc_info=True)
        return use

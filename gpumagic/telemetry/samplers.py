"""Samplers: GPU state over time, as plain values the widgets turn into curves."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.model import GpuInfo, Inventory


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment. Memory in bytes; ``memory_mine`` is what this kernel and its children use."""

    time: float
    nvml_index: int
    memory_used: float
    memory_mine: float
    memory_total: float
    utilization: float
    temperature: float

    @property
    def memory_others(self) -> float:
        return max(0.0, self.memory_used - self.memory_mine)


class GpuSampler:
    """Reads the inventory and turns it into ``GpuSample``s; ``read`` is swappable for tests."""

    def __init__(self, read: Callable[[], Inventory] | None = None) -> None:
        self.read = read or read_inventory

    def sample(self) -> tuple[Inventory, list[GpuSample]]:
        inventory = self.read()
        mine = _own_process_tree()
        now = time.time()
        samples = [_sample(now, gpu, mine) for gpu in inventory.gpus if gpu.healthy]
        return inventory, samples


def _sample(now: float, gpu: GpuInfo, mine: set[int]) -> GpuSample:
    own = sum(p.gpu_memory or 0 for p in gpu.processes if p.pid in mine)
    return GpuSample(
        time=now,
        nvml_index=gpu.nvml_index,
        memory_used=float(gpu.memory_used or 0),
        memory_mine=float(own),
        memory_total=float(gpu.memory_total or 0),
        utilization=float(gpu.utilization or 0.0),
        temperature=float(gpu.temperature or 0.0),
    )


def _own_process_tree() -> set[int]:
    try:
        me = psutil.Process()
        return {os.getpid()} | {p.pid for p in me.children(recursive=True)}
    except psutil.Error:
        return {os.getpid()}

"""The pick policy: which GPUs qualify for a request, why the others do not, and which are best."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpumagic.devices.leases import Lease
from gpumagic.devices.model import GpuInfo
from gpumagic.units import format_bytes


@dataclass(frozen=True)
class Requirements:
    """What a GPU needs to qualify. ``min_free`` is bytes; ``min_free_percent`` and ``max_util`` percent."""

    min_free: int | None = None
    min_free_percent: float | None = None
    max_util: float | None = None
    exclude: frozenset[int] = field(default_factory=frozenset)

    def describe(self) -> str:
        parts = []
        if self.min_free is not None:
            parts.append(f"≥{format_bytes(self.min_free)} free")
        if self.min_free_percent is not None:
            parts.append(f"≥{self.min_free_percent:g}% free")
        if self.max_util is not None:
            parts.append(f"≤{self.max_util:g}% busy")
        return ", ".join(parts)


def shortfall(gpu: GpuInfo, needs: Requirements, lease: Lease | None) -> str | None:
    """Why ``gpu`` does not qualify (``None`` if it does). A lease held by anyone else disqualifies."""
    reasons = []
    if gpu.nvml_index in needs.exclude:
        return "excluded"
    if not gpu.healthy:
        return gpu.problem
    if gpu.mig_enabled:
        reasons.append("MIG mode is on (gpumagic chooses whole GPUs)")
    if lease is not None and not lease.mine:
        reasons.append(lease.describe())
    free = gpu.memory_free
    if needs.min_free is not None and (free is None or free < needs.min_free):
        reasons.append(f"{format_bytes(free)} free < {format_bytes(needs.min_free)} needed")
    if needs.min_free_percent is not None and gpu.memory_total:
        percent = 100 * (free or 0) / gpu.memory_total
        if percent < needs.min_free_percent:
            reasons.append(f"{percent:.0f}% free < {needs.min_free_percent:g}% needed")
    if needs.max_util is not None and (gpu.utilization or 0) > needs.max_util:
        reasons.append(f"{gpu.utilization:.0f}% busy > {needs.max_util:g}% allowed")
    return "; ".join(reasons) or None


def rank(gpus: list[GpuInfo]) -> list[GpuInfo]:
    """Best first: most free memory, then least busy, then fewest processes, then lowest index."""
    return sorted(
        gpus,
        key=lambda g: (-(g.memory_free or 0), g.utilization or 0, len(g.processes), g.nvml_index),
    )


def assess(
    gpus: list[GpuInfo], needs: Requirements, leases: Mapping[str, Lease]
) -> tuple[list[GpuInfo], dict[int, str]]:
    """(qualifying GPUs best first, {nvml index: why not} for the rest)."""
    qualifying, reasons = [], {}
    for gpu in gpus:
        why = shortfall(gpu, needs, leases.get(gpu.uuid))
        if why is None:
            qualifying.append(gpu)
        else:
            reasons[gpu.nvml_index] = why
    return rank(qualifying), reasons

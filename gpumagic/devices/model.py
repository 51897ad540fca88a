"""Plain values describing GPUs: what the NVML boundary and the simulator return, and all the rest reads.

Index kinds are named for what they count: ``nvml_index`` is the number nvidia-smi and ``%gpu`` show
(PCI bus order); ``cuda:N`` numbers are relative to ``CUDA_VISIBLE_DEVICES`` and appear only in visibility.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_GPUS = 64  # the most GPUs one pick or job asks for, names or excludes


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU.

    ``user`` and ``command`` are ``None`` when the process cannot be inspected (another container's PID
    namespace, or it has exited: then ``alive`` is False). ``gpu_memory`` is bytes, ``None`` if unknown.
    ``utilization``: the most of the GPU's time it kept busy over the last seconds, percent; ``None`` where NVML
    does not tell (simulated: its CPU use).
    """

    pid: int
    gpu_memory: int | None
    user: str | None = None
    command: str | None = None
    alive: bool = True
    simulated: bool = False
    utilization: float | None = None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU at one moment. Fields the driver does not support are ``None``.

    Memory is in bytes, utilization in percent, temperature in degrees Celsius, power in watts.
    """

    nvml_index: int
    uuid: str
    name: str
    pci_bus_id: str | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    memory_free: int | None = None
    memory_reserved: int | None = None
    utilization: float | None = None
    memory_utilization: float | None = None
    temperature: float | None = None
    power: float | None = None
    power_limit: float | None = None
    mig_enabled: bool | None = None
    processes: tuple[GpuProcess, ...] = ()
    problem: str | None = None
    simulated: bool = False

    @property
    def healthy(self) -> bool:
        """False when the GPU is lost or could not be read at all."""
        return self.problem is None

    @property
    def short_name(self) -> str:
        """The name without the vendor prefix: ``NVIDIA A100-SXM4-80GB`` -> ``A100-SXM4-80GB``."""
        return self.name.removeprefix("NVIDIA ").strip()


@dataclass(frozen=True)
class Inventory:
    """All GPUs of this machine, as read at ``taken_at`` (``time.time()``).

    ``source`` is ``"nvml"``, ``"simulated"`` or ``"none"``; with ``"none"`` (or a broken driver) ``problem``
    says what is wrong and what to do.
    """

    gpus: tuple[GpuInfo, ...]
    source: str
    taken_at: float
    driver_version: str | None = None
    problem: str | None = None
    simulation: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def simulated(self) -> bool:
        return self.source == "simulated"

    def __iter__(self) -> Iterator[GpuInfo]:
        return iter(self.gpus)

    def __len__(self) -> int:
        return len(self.gpus)

    def __getitem__(self, nvml_index: int) -> GpuInfo:
        for gpu in self.gpus:
            if gpu.nvml_index == nvml_index:
                return gpu
        raise IndexError(f"no GPU {nvml_index}: this machine has {self.describe_indices()}")

    def by_uuid(self, uuid: str) -> GpuInfo | None:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None

    def describe_indices(self) -> str:
        if not self.gpus:
            return "no GPUs"
        indices = [g.nvml_index for g in self.gpus]
        return f"GPUs {indices[0]}-{indices[-1]}" if len(indices) > 1 else f"GPU {indices[0]}"

    def __repr__(self) -> str:
        label = f" [simulated: {self.simulation}]" if self.simulated else ""
        if self.problem and not self.gpus:
            return f"Inventory(no GPUs: {self.problem})"
        names = ", ".join(f"{g.nvml_index}: {g.short_name}" for g in self.gpus)
        return f"Inventory({len(self.gpus)} GPUs: {names}){label}"

"""Which GPUs CUDA will show this kernel and the processes it starts.

CUDA reads ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` once, when the driver starts in a process
(``torch.cuda.is_available()`` is enough to start it). Before that, setting them here decides what
``cuda:0`` is; after it, only processes started later follow them (``cuda_state`` tells which is the case).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.model import GpuInfo, Inventory

VISIBLE = "CUDA_VISIBLE_DEVICES"
ORDER = "CUDA_DEVICE_ORDER"
_UNSET = object()
_original: dict[str, object] = {}  # the variables as they were before gpumagic first changed them


@dataclass(frozen=True)
class Visibility:
    """What ``cuda:0``, ``cuda:1``, ... are: ``nvml_indices[k]`` is the GPU that ``cuda:k`` means.

    ``certain`` is False when CUDA's own order (fastest first) may differ from NVML's.
    """

    nvml_indices: tuple[int, ...]
    variable: str | None
    certain: bool = True
    note: str | None = None

    def cuda_index(self, nvml_index: int) -> int | None:
        try:
            return self.nvml_indices.index(nvml_index)
        except ValueError:
            return None

    def describe(self) -> str:
        if not self.nvml_indices:
            seen = "no GPU (CPU only)"
        else:
            seen = ", ".join(f"cuda:{k}=GPU {i}" for k, i in enumerate(self.nvml_indices))
        where = f"{VISIBLE}={_abbreviate(self.variable)}" if self.variable is not None else f"{VISIBLE} unset"
        text = f"this kernel sees {seen} ({where})"
        return text + (f"; {self.note}" if self.note else "")


def _abbreviate(variable: str) -> str:
    """``GPU-75e34fc8-de96-...,GPU-2d42...`` -> ``GPU-75e34fc8…,GPU-2d42b636…`` for one-line messages."""
    return ",".join(
        v[:12] + "…" if len(v) > 13 and v.upper().startswith(("GPU-", "MIG-")) else v for v in variable.split(",")
    )


def current_visibility(inventory: Inventory) -> Visibility:
    """How CUDA will number ``inventory``'s GPUs given this process's environment now."""
    variable = os.environ.get(VISIBLE)
    pci_order = os.environ.get(ORDER, "FASTEST_FIRST").upper() == "PCI_BUS_ID"
    order_note = None if pci_order else f"{ORDER} is not PCI_BUS_ID, so CUDA may number GPUs differently than NVML"
    if variable is None:
        homogeneous = len({g.name for g in inventory.gpus}) <= 1
        return Visibility(
            tuple(g.nvml_index for g in inventory.gpus),
            None,
            pci_order or homogeneous,
            None if pci_order or homogeneous else order_note,
        )
    indices: list[int] = []
    certain = True
    for token in (t.strip() for t in variable.split(",")):
        gpu = _resolve_token(token, inventory)
        if gpu is None or gpu.nvml_index in indices:
            break  # CUDA stops at the first entry it cannot use
        if token.isascii() and token.isdigit() and not pci_order:
            certain = False
        indices.append(gpu.nvml_index)
    return Visibility(tuple(indices), variable, certain, None if certain else order_note)


def hides_every_gpu() -> bool:
    """True when ``CUDA_VISIBLE_DEVICES`` shows CUDA no GPU whatever the machine has (empty, or ``-1``)."""
    variable = os.environ.get(VISIBLE)
    if variable is None:
        return False
    first = variable.split(",")[0].strip()
    return not first or (first.startswith("-") and first[1:].isascii() and first[1:].isdigit())


def _resolve_token(token: str, inventory: Inventory) -> GpuInfo | None:
    if token.isascii() and token.isdigit():  # "²".isdigit() is True, int("²") fails
        position = int(token)
        return inventory.gpus[position] if position < len(inventory.gpus) else None
    if token.upper().startswith("GPU-"):
        matches = [g for g in inventory.gpus if g.uuid.lower().startswith(token.lower())]
        return matches[0] if len(matches) == 1 else None
    return None


def show_only(gpus: Sequence[GpuInfo]) -> dict[str, str]:
    """Make ``gpus`` (and only them) visible to CUDA, numbered in NVML order; returns what was set.

    UUIDs, not indices, so the numbering cannot drift if a GPU is added, lost or reordered.
    """
    _remember_original()
    ordered = sorted(gpus, key=lambda g: g.nvml_index)
    values = {ORDER: "PCI_BUS_ID", VISIBLE: ",".join(g.uuid for g in ordered)}
    os.environ.update(values)
    return values


def restore() -> None:
    """Put ``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER`` back as they were before gpumagic changed them."""
    for name, value in _original.items():
        if value is _UNSET:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)
    _original.clear()


def _remember_original() -> None:
    if not _original:
        for name in (VISIBLE, ORDER):
            _original[name] = os.environ.get(name, _UNSET)


def visible_gpus() -> Visibility:
    """Which GPU each ``cuda:N`` of this kernel is, given ``CUDA_VISIBLE_DEVICES`` now (``gpumagic.visible_gpus``).

    Raises:
        InvalidArgument: ``CUDA_VISIBLE_DEVICES`` or ``GPUMAGIC_SIMULATE`` is malformed.
    """
    return current_visibility(read_inventory())

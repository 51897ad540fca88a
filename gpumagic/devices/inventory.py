"""Which inventory this kernel reads: simulated when ``GPUMAGIC_SIMULATE`` is set, NVML otherwise."""

from __future__ import annotations

import os

from gpumagic.devices import nvml, simulate
from gpumagic.devices.model import Inventory
from gpumagic.errors import NoGpuError

SIMULATE_VARIABLE = "GPUMAGIC_SIMULATE"


def read_inventory() -> Inventory:
    """Every GPU of this machine now (simulated ones if ``GPUMAGIC_SIMULATE`` is set).

    Raises:
        InvalidArgument: ``GPUMAGIC_SIMULATE`` is malformed.
    """
    spec = os.environ.get(SIMULATE_VARIABLE, "").strip()
    if spec:
        return simulate.read_inventory(spec)
    return nvml.read_inventory()


def require_gpus(inventory: Inventory) -> Inventory:
    """``inventory`` if it has GPUs.

    Raises:
        NoGpuError: it has none; the message says why and what to do.
    """
    if not inventory.gpus:
        raise NoGpuError(f"No GPUs to choose from: {inventory.problem or 'none found'}")
    return inventory

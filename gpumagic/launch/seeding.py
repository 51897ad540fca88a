"""Seeding every random number generator a notebook uses, for this kernel and the processes it starts."""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from dataclasses import dataclass

from gpumagic.errors import InvalidArgument

SEED_VARIABLE = "GPUMAGIC_SEED"
DETERMINISTIC_VARIABLE = "GPUMAGIC_DETERMINISTIC"  # "1": the seed was set with --deterministic
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class SeedReport:
    seed: int
    seeded: tuple[str, ...]
    deterministic: bool

    def __repr__(self) -> str:
        text = f"Seeded {', '.join(self.seeded)} with {self.seed}"
        if self.deterministic:
            text += "; deterministic algorithms on (cudnn.benchmark off, CUBLAS_WORKSPACE_CONFIG=:4096:8)"
        return text

    _repr_pretty_ = lambda self, printer, cycle: printer.text(repr(self))  # noqa: E731 - IPython hook


def seed(value: int, *, deterministic: bool = False) -> SeedReport:
    """Seed Python's ``random``, NumPy (if installed), torch on the CPU and on every CUDA device.

    CUDA devices are seeded lazily by torch, so this never initializes CUDA. ``deterministic=True`` also
    asks torch for deterministic algorithms and turns cuDNN autotuning off. The seed is exported as
    ``GPUMAGIC_SEED`` (and ``PYTHONHASHSEED``) for the processes this kernel starts.

    Raises:
        InvalidArgument: ``value`` is not an integer in 0..2**32-1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise InvalidArgument(f"a seed is a whole number from 0 to {MAX_SEED}, got {value!r}")
    seeded = ["python"]
    random.seed(value)
    if "numpy" in sys.modules or importlib.util.find_spec("numpy") is not None:
        # lazy: numpy is heavy; only the data of a view needs it
        import numpy

        numpy.random.seed(value)
        seeded.append("numpy")
    if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
        # lazy: torch takes seconds to import; only rank processes need it
        import torch

        torch.manual_seed(value)  # also queues the seed for every CUDA device without starting CUDA
        seeded.append("torch (CPU and all CUDA devices)")
        if deterministic:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
            torch.use_deterministic_algorithms(True, warn_only=False)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
    os.environ[SEED_VARIABLE] = str(value)
    os.environ[DETERMINISTIC_VARIABLE] = "1" if deterministic else "0"
    os.environ["PYTHONHASHSEED"] = str(value)
    return SeedReport(value, tuple(seeded), deterministic)

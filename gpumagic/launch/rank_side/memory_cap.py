"""A background job's ``--memory-limit`` inside its ranks: the CUDA caching allocator capped at the memory the
job declared with ``--min-free``, and an out-of-memory error there that names the cap and what to do."""

from __future__ import annotations

import os
from typing import Any

from gpumagic.units import format_bytes

MEMORY_LIMIT_VARIABLE = "GPUMAGIC_MEMORY_LIMIT"  # bytes a job's rank may allocate on its GPU (--memory-limit)


def cap_memory(torch: Any) -> None:
    """Cap this rank's CUDA caching allocator at the job's reservation, when it asked for ``--memory-limit``."""
    limit = memory_limit()
    if limit:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), 0)


def memory_limit() -> int | None:
    """The job's ``--memory-limit`` in bytes, from the rank's environment (None: no cap)."""
    value = os.environ.get(MEMORY_LIMIT_VARIABLE, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def name_memory_limit(err: BaseException) -> BaseException:
    """An out-of-memory error of a capped job, its message naming the cap and what to do; others unchanged."""
    limit = memory_limit()
    if limit is None or type(err).__name__ != "OutOfMemoryError":
        return err
    cap = format_bytes(limit)
    first = str(err).split("\n", 1)[0]
    err.args = (
        f"the job ran out of its --memory-limit of {cap}, the memory it declared with --min-free {cap} ({first}); "
        "declare more with --min-free, or lower its batch size",
    )
    return err

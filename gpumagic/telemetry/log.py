"""``gpumagic.log``: record metrics from launched code.

Until the telemetry store lands (issue #4) this accepts and validates its arguments and records nothing,
so training code can call it every step today and start producing curves later without changes.
"""

from __future__ import annotations

import numbers


def log(step: int | None = None, **metrics: float) -> None:
    """Record ``metrics`` (name=number) at ``step``. Cheap to call every step; never raises for a value.

    Raises:
        TypeError: a metric is not a number (a tensor with one element is fine: use ``loss.item()``).
    """
    for name, value in metrics.items():
        if not isinstance(value, numbers.Real) and not hasattr(value, "item"):
            raise TypeError(f"gpumagic.log({name}=...) needs a number, got {type(value).__name__}")

"""Parsing and printing of the sizes, durations and percentages users type."""

from __future__ import annotations

import math
import re
from typing import Any

from gpumagic.errors import InvalidArgument

GIB = 1 << 30
MIB = 1 << 20
MAX_SIZE = 1 << 60  # 1 EiB: far beyond any GPU or host, and still an exact float and an int64
MAX_DURATION_S = 100 * 365 * 86400.0  # 100 years; threading and time_t reject waits not far beyond

_SIZE_UNITS = {
    "": GIB,  # a bare number is GiB, the unit people mean by "20" next to an 80 GB GPU
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": MIB,
    "mb": MIB,
    "mib": MIB,
    "g": GIB,
    "gb": GIB,
    "gib": GIB,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")
_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_size(text: str | int | float) -> int:
    """Bytes in a size such as ``20GB``, ``512MiB`` or ``20`` (GiB).

    GPU vendors write GB for GiB (an "80GB" A100 has 80 GiB), so GB and GiB both mean 2**30 bytes.

    >>> parse_size("20GB") == 20 * 2**30
    True

    Raises:
        InvalidArgument: the text is not a size.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if (isinstance(text, float) and not math.isfinite(text)) or text < 0:
            raise InvalidArgument(f"size must be a non-negative number of bytes, got {_shown(text)}")
        size = text
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise InvalidArgument(f"{_shown(text)} is not a size: write it like 20GB, 512MB or 1.5TB")
        size = float(match.group(1)) * _SIZE_UNITS[unit]  # inf for 400 digits
    if size > MAX_SIZE:
        raise InvalidArgument(f"{_shown(text)} is too large a size: at most 1 EiB ({MAX_SIZE} bytes)")
    return int(size)


def parse_size_or_percent(text: str | int | float, total: int | None = None) -> tuple[int | None, float | None]:
    """A size in bytes, or a percentage (``50%``) of each GPU's memory: returns (bytes, percent)."""
    if isinstance(text, str):
        match = _PERCENT_RE.match(text)
        if match:
            percent = float(match.group(1))
            if percent > 100:
                raise InvalidArgument(f"{_shown(text)} is more than 100% of a GPU's memory")
            return None, percent
    return parse_size(text), None


def parse_percent(text: str | int | float) -> float:
    """A percentage 0-100 from ``80``, ``80%`` or ``80.5``.

    Raises:
        InvalidArgument: not a number between 0 and 100.
    """
    if isinstance(text, int) and not isinstance(text, bool) and not 0 <= text <= 100:
        raise InvalidArgument(f"{_shown(text)} is not between 0 and 100%")  # float() of 400 digits overflows
    raw = str(text).strip().removesuffix("%").strip()
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgument(f"{_shown(text)} is not a percentage: write it like 50 or 50%") from None
    if not 0 <= value <= 100:
        raise InvalidArgument(f"{_shown(text)} is not between 0 and 100%")
    return value


def parse_duration(text: str | int | float, *, at_most: float = MAX_DURATION_S, what: str = "a duration") -> float:
    """Seconds in a duration such as ``30s``, ``10m``, ``1h30m`` or ``90`` (seconds).

    ``at_most``: the longest accepted, in seconds (100 years unless given); ``what`` names it in the error.

    Raises:
        InvalidArgument: the text is not a duration, or one longer than ``at_most``.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = text
    else:
        compact = str(text).strip().replace(" ", "")
        parts = list(_DURATION_RE.finditer(compact))
        if not compact or "".join(p.group(0) for p in parts) != compact:
            raise InvalidArgument(f"{_shown(text)} is not a duration: write it like 30s, 10m, 2h or 1h30m")
        seconds = sum(float(p.group(1)) * _DURATION_UNITS[(p.group(2) or "").lower() or None] for p in parts)
    if (isinstance(seconds, float) and math.isnan(seconds)) or seconds < 0:
        raise InvalidArgument(f"{_shown(text)} is not a duration of zero or more seconds")
    if seconds > min(at_most, MAX_DURATION_S):
        raise InvalidArgument(f"{_shown(text)} is too long for {what}: at most {_longest(at_most)}")
    return float(seconds)


def _longest(seconds: float) -> str:
    """A limit as people say it: ``100 years``, ``7d``, ``30m``."""
    if seconds >= 365 * 86400:
        return f"{seconds / (365 * 86400):g} years"
    if seconds >= 86400 and seconds % 86400 == 0:
        return f"{seconds / 86400:g}d"
    return format_duration(seconds)


def _shown(text: object, limit: int = 60) -> str:
    """``text`` as errors quote it: its repr, cut short so that 400 digits stay a readable line."""
    if isinstance(text, int) and text.bit_length() > 64:  # repr() of an int over 4300 digits raises
        return f"a {round(text.bit_length() * math.log10(2))}-digit number"
    raw = str(text)
    if len(raw) <= limit:
        return repr(text)
    return f"{raw[: limit - 20]!r}... ({len(raw)} characters)"


def format_bytes(n: int | None) -> str:
    """``81920 MiB`` -> ``80.0 GiB``; ``None`` (unknown) -> ``?``."""
    if n is None:
        return "?"
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= MIB:
        return f"{n / MIB:.0f} MiB"
    return f"{n} B"


def format_duration(seconds: float) -> str:
    """``3725`` -> ``1h02m``; ``42`` -> ``42s``."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def as_number(value: Any) -> float | None:
    """``value`` as a float where it is a number or a number's text (never a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return float(value if isinstance(value, (int, float)) else str(value))
    except ValueError:
        return None


def plain(value: Any) -> Any:
    """A value typed as text as a table of numbers wants it: ``"32"`` -> 32, ``"0.01"`` -> 0.01, text as it is.

    >>> [plain(v) for v in ("32", "0.01", "adam", "nan", 2)]
    [32, 0.01, 'adam', 'nan', 2]
    """
    if isinstance(value, str):
        number = as_number(value)
        if number is not None and math.isfinite(number):
            return int(number) if re.fullmatch(r"[+-]?\d+", value.strip()) else number
    return value

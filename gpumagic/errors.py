"""The errors gpumagic raises.

Two channels, as in the style guide: ``UsageError`` (IPython's, raised by the magics) for bad input, and
the typed errors below for work that could not be done. Each message says what to do next.
"""

from __future__ import annotations

from collections.abc import Mapping


class GpumagicError(Exception):
    """Base class of every error gpumagic raises on purpose."""


class ReportedError(GpumagicError):
    """An error whose message is the whole story: IPython shows ``Type: message`` alone, without the kernel-side
    traceback (which would only show gpumagic's own frames). Subclasses with a longer report override ``shown``."""

    def shown(self) -> str:
        """What the notebook shows after the error's type name."""
        return str(self)

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self.shown()}"]


class InvalidArgument(GpumagicError, ValueError):
    """An argument a user typed is malformed (a size, a duration, a device spec, ...)."""


class NoGpuError(GpumagicError):
    """No GPU inventory can be read: no NVIDIA driver/NVML and no simulation."""


class NotEnoughGpusError(GpumagicError):
    """Fewer GPUs qualify than were asked for.

    Attributes:
        wanted: how many GPUs were asked for.
        chosen: NVML indices of the GPUs that did qualify.
        reasons: NVML index -> why that GPU did not qualify.
    """

    def __init__(
        self, wanted: int, chosen: tuple[int, ...], reasons: Mapping[int, str], note: str = "", why: str = ""
    ) -> None:
        self.wanted = wanted
        self.chosen = chosen
        self.reasons = dict(reasons)
        message = f"Only {len(chosen)} of the {wanted} GPUs asked for qualify{note}"
        if why:  # one line, as every refusal a magic shows: GPU by GPU (``devices.placement.explain``), then what to do
            message += f" ({why}). Lower --min-free/--max-util, free a GPU, or add --wait 10m to wait for one."
        else:
            message += "."
        super().__init__(message)


class GpuCapError(GpumagicError):
    """A pick would take its user past the administrator's ``max_gpus_per_user`` (``policy.toml``)."""


class GpuLeasedError(GpumagicError):
    """A GPU named explicitly is leased by another notebook or process."""


class LeaseDirectoryError(GpumagicError):
    """The shared lease directory is missing, unsafe or not writable."""


class KillRefused(GpumagicError):
    """``kill`` was asked to signal a process gpumagic must not touch."""


class RunsDirectoryError(ReportedError):
    """The runs directory (``GPUMAGIC_RUNS_DIR``, ``--runs-dir``) is one another user could write to, or a run
    directory in it is not this user's own: nothing is written there."""


class DiskFull(ReportedError, OSError):
    """A file of a run could not be written: the disk (or the user's quota) is full.

    Attributes:
        path: the file or directory that could not be written. reason: the system's words (``strerror``).
    """

    def __init__(self, path: object, reason: str = "No space left on device", code: int = 28) -> None:
        self.path = str(path)
        self.reason = reason
        self.message = f"disk full: {path} ({reason}); free space or set GPUMAGIC_RUNS_DIR"
        super().__init__(code, self.message)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple:
        return type(self), (self.path, self.reason, self.errno)

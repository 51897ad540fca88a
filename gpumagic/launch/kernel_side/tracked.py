"""A launch's or ``%ddp`` group's run followed to the trackers chosen with ``gpumagic.track`` (``telemetry.exporting``),
with the launch's options as the tracker run's parameters, and what failed said once when it ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from gpumagic.launch.options import LaunchOptions
from gpumagic.telemetry.exporting import Export, start_export

UNSHOWN = ("port", "runs_dir", "output", "process_group", "pdb", "rdzv_endpoint")  # how it ran, not what


def launch_parameters(launch: LaunchOptions, **resolved: Any) -> dict[str, Any]:
    """The launch's options as a tracker shows them, with what they resolved to (``resolved``: ranks, backend)."""
    given = {f.name: getattr(launch, f.name) for f in fields(launch) if f.init and f.name not in UNSHOWN}
    return {name: value for name, value in {**given, **resolved}.items() if value is not None}


def follow(run_dir: Path, kind: str, launch: LaunchOptions, **resolved: Any) -> Export | None:
    """Start exporting the run at ``run_dir`` to this kernel's trackers (None: none chosen)."""
    return start_export(run_dir, kind, launch_parameters(launch, **resolved))


def end(export: Export | None, status: str, say: Callable[[str], None]) -> None:
    """Finish ``export`` with the run's ``status`` (waiting a few seconds at most) and ``say`` each tracker that
    failed, once. An interrupt stops the waiting only: the run's results are the user's all the same."""
    if export is None:
        return
    try:
        lines = export.finish(status)
    except KeyboardInterrupt:  # the run ended already: its results and record stand, the sending goes on behind
        say("gpumagic: interrupted while the trackers took the run's last points; they go on in the background")
        return
    for line in lines:
        say(line)

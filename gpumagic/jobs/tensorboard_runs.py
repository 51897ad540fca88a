"""TensorBoard runs in a comparison (``gpumagic.compare("old_runs/")``): the runs a directory holds, and each one's
scalars and hyperparameters, read with TensorBoard's own reader.

A directory holding ``events.out.tfevents.*`` files is one run; a directory holding none is a tree of runs: each
folder below it that holds event files is one, named by its path from the given directory on (``tb/lr-0.1``).
gpumagic's own exporter writes each rank's series of a metric as ``loss/rank0``, ``loss/rank1``, ...: rank 0
stands for a run, as for gpumagic's runs, so ``loss/rank0`` is read as ``loss`` and the other ranks are left
out; a tag without a ``/rankN`` ending (``train/loss``, written by torch's ``SummaryWriter``) is kept as it is.
Hyperparameters come from an HParams session start (``hparams_pb``), if the run has one.

Finding runs only lists directories; TensorBoard itself is imported when a run is read, so ``import gpumagic``
and ``%jobs`` never load it.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumagic.errors import InvalidArgument
from gpumagic.run_dirs.store import Series

EVENT_PREFIX = "events.out.tfevents."
RANK_TAG = re.compile(r"^(.+)/rank(\d+)$")
INSTALL = "reading TensorBoard runs needs its package: pip install 'gpumagic[tensorboard]'"
_log = logging.getLogger(__name__)
MAX_DEPTH = 6  # folders below the one given that are looked into for runs (a sweep's tree is 2 or 3 deep)
MAX_FOLDERS = 10_000  # folders looked into at most: a path typed by mistake (`..`, `/`) costs a moment, not minutes


@dataclass(frozen=True)
class TensorBoardRun:
    """One TensorBoard run: the directory holding its event files, and its name in a comparison."""

    path: Path
    name: str


@dataclass
class TensorBoardScalars:
    """What a comparison shows of a TensorBoard run: rank 0's ``{metric: Series}``, its hyperparameters, and
    the seconds from its first point to its last."""

    metrics: dict[str, Series]
    params: dict[str, Any]
    duration: float


def holds_events(directory: str | Path) -> bool:
    """Whether ``directory`` holds event files itself (not below)."""
    try:
        return any(entry.name.startswith(EVENT_PREFIX) and entry.is_file() for entry in os.scandir(directory))
    except OSError:
        _log.debug("%s cannot be listed: no TensorBoard run", directory, exc_info=True)
        return False


def find_runs(directory: str | Path) -> list[TensorBoardRun]:
    """The TensorBoard runs under ``directory``: itself, if it holds event files, else every folder below it that
    does (at most ``MAX_DEPTH`` deep, hidden ones left out, ``MAX_FOLDERS`` looked into at most), in the order of
    their names. An empty list where there are none (or no such directory).

    >>> find_runs("/no/such/directory")
    []
    """
    top = Path(os.path.abspath(directory))
    label = top.name or str(top)
    if holds_events(top):
        return [TensorBoardRun(top, label)]
    found = []
    visited = 0
    for folder, subfolders, files in os.walk(top):
        visited += 1
        if visited > MAX_FOLDERS:  # `..` or `/` typed by mistake: a moment, not a walk of the whole disk
            _log.debug("stopped looking for TensorBoard runs under %s after %d folders", top, MAX_FOLDERS)
            break
        deep = len(Path(folder).relative_to(top).parts) >= MAX_DEPTH
        subfolders[:] = [] if deep else sorted(name for name in subfolders if not name.startswith("."))
        if any(name.startswith(EVENT_PREFIX) for name in files):
            relative = Path(folder).relative_to(top).as_posix()
            found.append(TensorBoardRun(Path(folder), f"{label}/{relative}"))
    return found


def metric_name(tag: str) -> str | None:
    """The metric a scalar's tag stands for in a comparison: rank 0's without its rank (``loss/rank0`` ->
    ``loss``), None for another rank's, any other tag as it is.

    >>> [metric_name(tag) for tag in ("loss/rank0", "loss/rank1", "train/loss")]
    ['loss', None, 'train/loss']
    """
    ranked = RANK_TAG.match(tag)
    if ranked is None:
        return tag
    return ranked.group(1) if int(ranked.group(2)) == 0 else None


def read_run(run: TensorBoardRun) -> TensorBoardScalars:
    """Every point of ``run``'s scalars (TensorBoard's reader keeps them all, not a sample), by metric, and its
    hyperparameters.

    Raises:
        InvalidArgument: TensorBoard is not installed (the message says how to install it).
    """
    try:
        # lazy: TensorBoard takes a fifth of a second to import; `import gpumagic` and %jobs stay free of it
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise InvalidArgument(INSTALL) from None
    accumulator = EventAccumulator(str(run.path), size_guidance={"scalars": 0})  # 0: every point
    accumulator.Reload()
    metrics: dict[str, Series] = {}
    for tag in accumulator.Tags()["scalars"]:
        name = metric_name(tag)
        if name is not None and name not in metrics:
            events = accumulator.Scalars(tag)
            steps, values = [float(e.step) for e in events], [float(e.value) for e in events]
            metrics[name] = Series(steps, values, [float(e.wall_time) for e in events])
    times = [t for series in metrics.values() for t in series.times]
    duration = max(times) - min(times) if times else 0.0
    return TensorBoardScalars(metrics, hyperparameters(accumulator), duration)


def hyperparameters(accumulator: Any) -> dict[str, Any]:
    """The hyperparameters of a loaded ``EventAccumulator``'s HParams session start, by name; {} without one."""
    # lazy: TensorBoard's protobufs; read_run has imported TensorBoard already
    from google.protobuf.message import DecodeError
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    try:
        contents = accumulator.PluginTagToContent("hparams")
    except KeyError:  # no HParams summary in this run
        return {}
    found: dict[str, Any] = {}
    for content in contents.values():
        try:
            data = HParamsPluginData.FromString(content)
        except DecodeError:
            _log.debug("an HParams summary of %s cannot be read; left out", accumulator.path, exc_info=True)
            continue
        if data.HasField("session_start_info"):
            values = data.session_start_info.hparams
            found.update({name: _plain(values[name]) for name in sorted(values)})
    return {name: value for name, value in found.items() if value is not None}


def _plain(value: Any) -> Any:
    """A ``google.protobuf.Value`` as Python: text, a bool, or a number (an int where it is whole: the protobuf
    keeps no ints, and ``32`` reads better than ``32.0``); None for another kind."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        return int(number) if number.is_integer() and abs(number) < 2**53 else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    return None

"""A simulated GPU inventory for machines without NVIDIA GPUs (laptops, CI, the binder demo).

Chosen explicitly with ``GPUMAGIC_SIMULATE``: a spec such as ``4xA100-80GB`` or
``2xA100-80GB,2xV100-16GB``, or the path of a JSON file that also describes load and other users'
processes (format in ``docs/simulation.md``). Everything it returns is marked ``simulated``.

Real processes count too: a process whose ``CUDA_VISIBLE_DEVICES`` names a simulated GPU (as every process
started after ``%gpu pick`` does) uses that GPU's memory with its resident memory and its utilization with
its CPU use, so picking, queueing and dashboards behave as on a real server.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from gpumagic.devices.lease_directory import LEASE_DIR_VARIABLE
from gpumagic.devices.model import GpuInfo, GpuProcess, Inventory
from gpumagic.devices.processes import read_stat
from gpumagic.errors import InvalidArgument
from gpumagic.units import GIB, parse_percent, parse_size

_log = logging.getLogger(__name__)

# Memory (GiB) and board power (W) of the models people name without a size.
KNOWN_MODELS: dict[str, tuple[int, int]] = {
    "A100": (80, 400),
    "H100": (80, 700),
    "H200": (141, 700),
    "B200": (180, 1000),
    "V100": (32, 300),
    "A10": (24, 150),
    "A30": (24, 165),
    "A40": (48, 300),
    "L4": (24, 72),
    "L40S": (48, 350),
    "T4": (16, 70),
    "A6000": (48, 300),
    "RTX4090": (24, 450),
    "RTX3090": (24, 350),
}
SPEC_FORMS = "4xA100-80GB, 2xA100-80GB,2xV100-16GB, 8xH100, or the path of a JSON file"
_GROUP_RE = re.compile(
    r"^(?:(\d+)\s*[x×*]\s*)?([A-Za-z][A-Za-z0-9]*)(?:-(\d+(?:\.\d+)?)\s*(?:GB|GiB|G))?$", re.IGNORECASE
)
_UUID_NAMESPACE = uuidlib.UUID("6f1c6c4e-3d1e-4a55-9d2c-8a4f5e0b7a10")


@dataclass(frozen=True)
class SimulatedGpu:
    """A GPU as the spec or file describes it: its fixed load before gpumagic's own processes."""

    name: str
    memory_total: int
    memory_used: int = 0
    utilization: float = 0.0
    temperature: float = 34.0
    power: float = 60.0
    power_limit: float = 400.0
    processes: tuple[GpuProcess, ...] = ()
    lost: bool = False


def read_inventory(spec: str) -> Inventory:
    """The simulated inventory for ``spec``, with gpumagic-started processes counted in.

    Raises:
        InvalidArgument: the spec or its JSON file is malformed.
    """
    gpus = _parse_cached(spec)
    uuids = [_uuid(spec, i) for i in range(len(gpus))]
    usage = _scan.usage({uuid: i for i, uuid in enumerate(uuids)})
    result = []
    for index, (sim, uuid) in enumerate(zip(gpus, uuids, strict=True)):
        if sim.lost:
            result.append(GpuInfo(index, uuid, sim.name, problem="GPU is lost (simulated)", simulated=True))
            continue
        own = [dataclasses.replace(p, utilization=_scan.cpu_percent(p.pid)) for p in usage.get(index, ())]
        used = min(sim.memory_total, sim.memory_used + sum(p.gpu_memory or 0 for p in own))
        extra = sum(p.utilization or 0.0 for p in own)  # what gpumagic's own processes add
        busy = min(100.0, sim.utilization + extra)
        result.append(
            GpuInfo(
                nvml_index=index,
                uuid=uuid,
                name=sim.name,
                pci_bus_id=f"00000000:{0x17 + 0x10 * index:02X}:00.0",
                memory_total=sim.memory_total,
                memory_used=used,
                memory_free=sim.memory_total - used,
                memory_reserved=0,
                utilization=round(busy, 1),
                memory_utilization=round(100 * used / sim.memory_total, 1) if sim.memory_total else 0.0,
                temperature=sim.temperature + min(extra, 100.0) / 4,
                power=min(sim.power_limit, sim.power + sim.power_limit * min(extra, 100.0) / 150),
                power_limit=sim.power_limit,
                mig_enabled=False,
                processes=sim.processes + tuple(own),
                simulated=True,
            )
        )
    label = spec if not _looks_like_file(spec) else Path(spec).name
    return Inventory(tuple(result), "simulated", time.time(), driver_version="simulated", simulation=label)


def parse_spec(spec: str) -> tuple[SimulatedGpu, ...]:
    """The GPUs a ``GPUMAGIC_SIMULATE`` value describes.

    >>> [g.name for g in parse_spec("2xA100-40GB")]
    ['NVIDIA A100-40GB', 'NVIDIA A100-40GB']

    Raises:
        InvalidArgument: malformed spec or file.
    """
    if _looks_like_file(spec):
        return _parse_file(Path(spec).expanduser())
    gpus: list[SimulatedGpu] = []
    for group in filter(None, (g.strip() for g in spec.split(","))):
        gpus += _parse_group(group, spec)
    if not gpus:
        raise InvalidArgument(f"GPUMAGIC_SIMULATE={spec!r} describes no GPU; write it like {SPEC_FORMS}")
    if len(gpus) > 64:
        raise InvalidArgument(f"GPUMAGIC_SIMULATE={spec!r} describes {len(gpus)} GPUs; 64 is the most")
    return tuple(gpus)


def _parse_group(group: str, spec: str) -> list[SimulatedGpu]:
    match = _GROUP_RE.match(group)
    if not match:
        raise InvalidArgument(f"GPUMAGIC_SIMULATE={spec!r}: cannot read {group!r}; write it like {SPEC_FORMS}")
    count = int(match.group(1) or 1)
    model = match.group(2).upper()
    known = KNOWN_MODELS.get(model)
    if match.group(3):
        memory_gib = float(match.group(3))
    elif known:
        memory_gib = known[0]
    else:
        raise InvalidArgument(
            f"GPUMAGIC_SIMULATE={spec!r}: give {model}'s memory ({model}-24GB) or use a known model: "
            + ", ".join(KNOWN_MODELS)
        )
    if not 1 <= count <= 64 or memory_gib <= 0:
        raise InvalidArgument(f"GPUMAGIC_SIMULATE={spec!r}: {group!r} needs 1-64 GPUs of more than 0 GB")
    name = f"NVIDIA {model}-{memory_gib:g}GB"
    limit = float(known[1]) if known else 300.0
    return [SimulatedGpu(name, int(memory_gib * GIB), power_limit=limit, power=limit * 0.15)] * count


def _parse_file(path: Path) -> tuple[SimulatedGpu, ...]:
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise InvalidArgument(f"GPUMAGIC_SIMULATE: cannot read {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise InvalidArgument(f"GPUMAGIC_SIMULATE: {path} is not valid JSON ({err})") from None
    entries = data.get("gpus") if isinstance(data, dict) else None
    if isinstance(entries, str):
        return parse_spec(entries)
    if not isinstance(entries, list) or not entries:
        raise InvalidArgument(f'GPUMAGIC_SIMULATE: {path} needs a non-empty list under "gpus" (docs/simulation.md)')
    gpus: list[SimulatedGpu] = []
    for number, entry in enumerate(entries):
        try:
            gpus += _parse_entry(entry)
        except (InvalidArgument, TypeError, ValueError, KeyError) as err:
            raise InvalidArgument(f"GPUMAGIC_SIMULATE: {path}, GPU entry {number}: {err}") from None
    return tuple(gpus)


def _parse_entry(entry: dict[str, Any]) -> list[SimulatedGpu]:
    if not isinstance(entry, dict):
        raise TypeError("each GPU must be a JSON object")
    base = _parse_group(str(entry.get("model", "A100-80GB")), str(entry.get("model")))[0]
    total = parse_size(entry["memory"]) if "memory" in entry else base.memory_total
    processes = tuple(
        GpuProcess(
            pid=int(p["pid"]),
            gpu_memory=parse_size(p.get("memory", 0)),
            user=str(p.get("user", "someone")),
            command=str(p.get("command", "python")),
            alive=True,
            simulated=True,
        )
        for p in entry.get("processes", ())
    )
    held = sum(p.gpu_memory or 0 for p in processes)
    used = parse_size(entry["used"]) if "used" in entry else held
    utilization = parse_percent(entry.get("utilization", 55 if processes else 0))
    limit = float(entry.get("power_limit", base.power_limit))
    gpu = SimulatedGpu(
        name=str(entry.get("name", base.name)),
        memory_total=total,
        memory_used=min(total, max(used, held)),
        utilization=utilization,
        temperature=float(entry.get("temperature", 34 + utilization / 3)),
        power=float(entry.get("power", limit * (0.15 + 0.6 * utilization / 100))),
        power_limit=limit,
        processes=processes,
        lost=bool(entry.get("lost", False)),
    )
    return [gpu] * int(entry.get("count", 1))


def _looks_like_file(spec: str) -> bool:
    return spec.endswith(".json") or os.sep in spec


_cache_lock = threading.Lock()
_cache: dict[tuple[str, float], tuple[SimulatedGpu, ...]] = {}


def _parse_cached(spec: str) -> tuple[SimulatedGpu, ...]:
    mtime = 0.0
    if _looks_like_file(spec):
        try:
            mtime = Path(spec).expanduser().stat().st_mtime
        except OSError:
            _log.debug("the simulation file %s cannot be stat'ed; read without its change time", spec, exc_info=True)
    key = (spec, mtime)
    with _cache_lock:
        if key not in _cache:
            _cache.clear()
            _cache[key] = parse_spec(spec)
        return _cache[key]


def _uuid(spec: str, index: int) -> str:
    """A stable UUID per (spec, index), so every kernel simulating the same server agrees on leases. A server is
    its spec and its lease directory: with ``GPUMAGIC_LEASE_DIR`` set, its path is part of the UUID, so two
    simulated servers with their own lease directories (tests side by side, two demos) do not see each other's
    processes on their GPUs; with the default directory (every user's) the UUIDs are the spec's alone."""
    label = spec if not _looks_like_file(spec) else str(Path(spec).expanduser().resolve())
    explicit = os.environ.get(LEASE_DIR_VARIABLE)
    if explicit:
        label += f"@{os.path.realpath(explicit)}"
    return f"GPU-{uuidlib.uuid5(_UUID_NAMESPACE, f'{label}#{index}')}"


class _ProcessScan:
    """Finds this machine's processes whose ``CUDA_VISIBLE_DEVICES`` names a simulated GPU.

    A process's initial environment changes only when it execs, so each PID's match is read once and cached
    under its identity (start time, command name, environment's address): a scan that looked at a child between
    ``fork`` and ``exec`` (when it still shows its parent's environment) reads it again after the ``exec``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._matches: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}  # pid -> (identity, visible ids)
        self._cpu: dict[int, tuple[float, float, float]] = {}  # pid -> (cpu seconds, monotonic time, percent)

    def usage(self, uuid_to_index: dict[str, int]) -> dict[int, list[GpuProcess]]:
        found: dict[int, list[GpuProcess]] = {}
        with self._lock:
            live = self._refresh()
            for pid, visible in live.items():
                index = self._first_simulated(visible, uuid_to_index)
                if index is None:
                    continue
                try:
                    proc = psutil.Process(pid)
                    with proc.oneshot():
                        rss = proc.memory_info().rss
                        user = proc.username()
                        command = " ".join(proc.cmdline()) or proc.name()
                except (psutil.Error, KeyError):
                    continue
                found.setdefault(index, []).append(GpuProcess(pid, rss, user, command, True, False))
        return found

    def cpu_percent(self, pid: int) -> float:
        """CPU use of ``pid`` in percent of one core since the last look (since its start, at first)."""
        try:
            proc = psutil.Process(pid)
            times = proc.cpu_times()
            spent, now = times.user + times.system, time.monotonic()
            with self._lock:
                previous = self._cpu.get(pid)
                if previous is None:
                    rate = 100.0 * spent / max(time.time() - proc.create_time(), 1e-3)
                elif now - previous[1] < 0.2:  # too soon for a fair measure: keep the last one
                    return previous[2]
                else:
                    rate = 100.0 * max(0.0, spent - previous[0]) / (now - previous[1])
                self._cpu[pid] = (spent, now, min(100.0, rate))
                return min(100.0, rate)
        except psutil.Error:
            return 0.0

    def _refresh(self) -> dict[int, tuple[str, ...]]:
        me = os.getpid()
        live: dict[int, tuple[str, ...]] = {}
        try:
            names = os.listdir("/proc")
        except OSError:
            _log.debug("/proc cannot be listed; no simulated GPU process is seen", exc_info=True)
            return live
        seen = set()
        for name in names:
            if not name.isdigit() or int(name) == me:
                continue
            pid = int(name)
            stamp = _identity(pid)
            if stamp is None:
                continue
            seen.add(pid)
            cached = self._matches.get(pid)
            if cached is None or cached[0] != stamp:
                cached = (stamp, _visible_devices_of(pid))
                self._matches[pid] = cached
            if cached[1]:
                live[pid] = cached[1]
        for gone in set(self._matches) - seen:
            del self._matches[gone]
            self._cpu.pop(gone, None)
        return live

    @staticmethod
    def _first_simulated(visible: tuple[str, ...], uuid_to_index: dict[str, int]) -> int | None:
        # A process uses the first GPU it sees (cuda:0), as a PyTorch rank or script does by default.
        first = visible[0] if visible else ""
        for uuid, index in uuid_to_index.items():
            if first and uuid.startswith(first):
                return index
        return None


def _identity(pid: int) -> tuple[str, ...] | None:
    """What tells ``pid``'s current program apart from an earlier one of the same PID, or from the same process
    before it called ``exec``: its start time, command name and the address of its environment (all from
    ``/proc/PID/stat``; the address reads 0 for processes this user may not inspect). None if it is gone."""
    stat = read_stat(pid)
    if stat is None:
        return None
    command, fields = stat[0].decode(errors="replace"), [f.decode() for f in stat[1]]
    if len(fields) < 49:  # before Linux 3.5: no environment address
        return (command, *fields[19:20])
    return (command, fields[19], fields[47], fields[48])  # fields 2, 22, 50 and 51 of proc(5)


def _visible_devices_of(pid: int) -> tuple[str, ...]:
    """The GPU UUIDs in ``pid``'s initial ``CUDA_VISIBLE_DEVICES`` (unreadable or unset: none)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):  # ended, or another user's: the usual answers
        return ()
    except OSError:
        _log.debug("/proc/%d/environ is unreadable; the process is taken to see no simulated GPU", pid, exc_info=True)
        return ()
    marker = b"CUDA_VISIBLE_DEVICES="
    if marker not in environ:
        return ()
    for entry in environ.split(b"\0"):
        if entry.startswith(marker):
            value = entry[len(marker) :].decode(errors="replace")
            return tuple(v.strip() for v in value.split(",") if v.strip().startswith("GPU-"))
    return ()


_scan = _ProcessScan()

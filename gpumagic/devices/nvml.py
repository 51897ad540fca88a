"""The one module that calls NVML (``pynvml``, from the nvidia-ml-py distribution).

NVML is initialized lazily under a lock and shut down at exit. Versioned calls are probed once and the
newest that works is kept. Fields a GPU does not support come back as ``None``; NVML errors become a clear
``problem`` on the inventory (no driver, no permission) or on one GPU (lost, unreadable).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from typing import Any

from gpumagic.devices.model import GpuInfo, GpuProcess, Inventory
from gpumagic.devices.processes import describe_process

_log = logging.getLogger(__name__)

_lock = threading.Lock()
_nvml: Any = None  # the pynvml module once initialized
_init_problem: tuple[float, str] | None = None  # (when, why) of the last failed initialization
_RETRY_INIT_AFTER_S = 10.0
_PROCESS_SAMPLES_S = 5.0  # per-process utilization: the samples of this many seconds back
_memory_v2_works: bool | None = None
_process_call: str | None = None

_PROCESS_CALLS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)
_SIMULATE_HINT = "to try gpumagic without GPUs, set GPUMAGIC_SIMULATE=4xA100-80GB (%env in a notebook)"


def read_inventory() -> Inventory:
    """Read every GPU through NVML. Never raises for driver trouble: see ``Inventory.problem``."""
    with _lock:
        nv, problem = _initialized()
        if nv is None:
            return Inventory((), "none", time.time(), problem=problem)
        try:
            count = nv.nvmlDeviceGetCount()
            driver = _text(_optional(nv, nv.nvmlSystemGetDriverVersion))
        except nv.NVMLError as err:
            return Inventory((), "none", time.time(), problem=f"NVML could not count the GPUs: {err}")
        gpus = tuple(_read_gpu(nv, index) for index in range(count))
        problem = None if gpus else "the NVIDIA driver is loaded but reports no GPUs"
        return Inventory(gpus, "nvml", time.time(), driver_version=driver, problem=problem)


def reset() -> None:
    """Forget the loaded library and probes (the next read imports ``pynvml`` again)."""
    global _nvml, _init_problem, _memory_v2_works, _process_call
    with _lock:
        _shutdown_locked()
        _init_problem = None
        _memory_v2_works = None
        _process_call = None


def _initialized() -> tuple[Any, str | None]:
    global _nvml, _init_problem
    if _nvml is not None:
        return _nvml, None
    if _init_problem and time.monotonic() - _init_problem[0] < _RETRY_INIT_AFTER_S:
        return None, _init_problem[1]
    try:
        # lazy: loads libnvidia-ml, which only a GPU question needs
        import pynvml as nv
    except ImportError:
        _init_problem = (
            time.monotonic(),
            f"the nvidia-ml-py package is missing (pip install nvidia-ml-py); {_SIMULATE_HINT}",
        )
        return None, _init_problem[1]
    try:
        nv.nvmlInit()
    except nv.NVMLError as err:
        _init_problem = (time.monotonic(), _explain_init_error(nv, err))
        return None, _init_problem[1]
    except OSError as err:  # a broken libnvidia-ml that loads but fails in ctypes
        _init_problem = (time.monotonic(), f"NVML failed to load ({err}); {_SIMULATE_HINT}")
        return None, _init_problem[1]
    _nvml = nv
    atexit.register(_shutdown_at_exit)
    return nv, None


def _explain_init_error(nv: Any, err: Exception) -> str:
    code = getattr(err, "value", None)
    if code == nv.NVML_ERROR_LIBRARY_NOT_FOUND:
        return (
            "no NVIDIA GPU or driver found (libnvidia-ml.so.1 is missing). On a GPU server, install the "
            f"NVIDIA driver; {_SIMULATE_HINT}"
        )
    if code == nv.NVML_ERROR_DRIVER_NOT_LOADED:
        return (
            "the NVIDIA driver is installed but not running (no GPU, or its kernel module did not load): "
            f"check `nvidia-smi` and `dmesg`; {_SIMULATE_HINT}"
        )
    if code == nv.NVML_ERROR_NO_PERMISSION:
        return "no permission to talk to the NVIDIA driver: ask an administrator for access to /dev/nvidia*"
    return f"NVML failed to start ({err}); check `nvidia-smi`"


def _shutdown_locked() -> None:
    global _nvml
    if _nvml is not None:
        try:
            _nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a broken driver must not fail the caller
            _log.debug("nvmlShutdown failed; NVML is dropped anyway", exc_info=True)
        _nvml = None


def _shutdown_at_exit() -> None:
    with _lock:
        _shutdown_locked()


def _read_gpu(nv: Any, index: int) -> GpuInfo:
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nv.nvmlDeviceGetUUID(handle))
        name = _text(nv.nvmlDeviceGetName(handle))
    except nv.NVMLError as err:
        return GpuInfo(index, f"unknown-{index}", "unreadable GPU", problem=_explain_gpu_error(nv, err))
    try:
        return _read_handle(nv, index, handle, uuid, name)
    except nv.NVMLError as err:  # a required field failed: the GPU is lost or broken
        return GpuInfo(index, uuid, name, problem=_explain_gpu_error(nv, err))


def _read_handle(nv: Any, index: int, handle: Any, uuid: str, name: str) -> GpuInfo:
    pci = _optional(nv, nv.nvmlDeviceGetPciInfo, handle)
    total, used, free, reserved = _memory(nv, handle)
    rates = _optional(nv, nv.nvmlDeviceGetUtilizationRates, handle)
    temperature = _optional(nv, nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
    power_mw = _optional(nv, nv.nvmlDeviceGetPowerUsage, handle)
    limit_mw = _optional(nv, nv.nvmlDeviceGetEnforcedPowerLimit, handle)
    mig = _optional(nv, nv.nvmlDeviceGetMigMode, handle)
    return GpuInfo(
        nvml_index=index,
        uuid=uuid,
        name=name,
        pci_bus_id=_text(pci.busId) if pci is not None else None,
        memory_total=total,
        memory_used=used,
        memory_free=free,
        memory_reserved=reserved,
        utilization=float(rates.gpu) if rates is not None else None,
        memory_utilization=float(rates.memory) if rates is not None else None,
        temperature=float(temperature) if temperature is not None else None,
        power=power_mw / 1000 if power_mw is not None else None,
        power_limit=limit_mw / 1000 if limit_mw is not None else None,
        mig_enabled=bool(mig[0]) if mig is not None else None,
        processes=_with_utilization(nv, handle, _processes(nv, handle)),
    )


def _with_utilization(nv: Any, handle: Any, processes: tuple[GpuProcess, ...]) -> tuple[GpuProcess, ...]:
    """``processes`` with how busy each kept the GPU over the last ``_PROCESS_SAMPLES_S`` seconds, where the
    driver tells (``nvmlDeviceGetProcessUtilization``: its samples, max of each process's SM share; none: idle)."""
    if not processes:
        return processes
    since_us = int((time.time() - _PROCESS_SAMPLES_S) * 1e6)
    try:
        samples = nv.nvmlDeviceGetProcessUtilization(handle, since_us)
    except nv.NVMLError as err:
        if getattr(err, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
            raise
        if getattr(err, "value", None) not in (nv.NVML_SUCCESS, nv.NVML_ERROR_NOT_FOUND):
            return processes  # not supported, no permission: unknown
        samples = []  # no sample since then: nobody kept it busy
    except AttributeError:  # an nvidia-ml-py without the call
        return processes
    busiest: dict[int, float] = {}
    for sample in samples:
        pid = int(sample.pid)
        busiest[pid] = max(busiest.get(pid, 0.0), float(sample.smUtil))
    return tuple(dataclasses.replace(p, utilization=busiest.get(p.pid, 0.0)) for p in processes)


def _memory(nv: Any, handle: Any) -> tuple[int, int, int, int | None]:
    """(total, used, free, reserved) in bytes; v2 counts driver-reserved memory apart from "used"."""
    global _memory_v2_works
    if _memory_v2_works is not False and hasattr(nv, "nvmlMemory_v2"):
        try:
            info = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
            _memory_v2_works = True
            return int(info.total), int(info.used), int(info.free), int(info.reserved)
        except TypeError:  # an nvidia-ml-py too old to take version=
            _memory_v2_works = False
        except nv.NVMLError as err:
            if getattr(err, "value", None) not in (nv.NVML_ERROR_FUNCTION_NOT_FOUND, nv.NVML_ERROR_NOT_SUPPORTED):
                raise
            _memory_v2_works = False
    info = nv.nvmlDeviceGetMemoryInfo(handle)
    return int(info.total), int(info.used), int(info.free), None


def _processes(nv: Any, handle: Any) -> tuple[GpuProcess, ...]:
    global _process_call
    calls = (_process_call,) if _process_call else _PROCESS_CALLS
    for call in calls:
        function = getattr(nv, call, None)
        if function is None:
            continue
        try:
            raw = function(handle)
        except nv.NVMLError as err:
            if getattr(err, "value", None) == nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                continue
            if getattr(err, "value", None) in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_NO_PERMISSION):
                return ()
            raise
        _process_call = call
        result = []
        for entry in raw:
            facts = describe_process(int(entry.pid))
            memory = entry.usedGpuMemory
            result.append(
                GpuProcess(
                    pid=int(entry.pid),
                    gpu_memory=int(memory) if memory is not None else None,
                    user=facts.user,
                    command=facts.command,
                    alive=facts.alive,
                )
            )
        return tuple(result)
    return ()


def _optional(nv: Any, function: Any, *args: Any) -> Any:
    """The call's value, or ``None`` where this GPU or driver does not support it."""
    try:
        return function(*args)
    except nv.NVMLError as err:
        if getattr(err, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
            raise
        return None


def _explain_gpu_error(nv: Any, err: Exception) -> str:
    code = getattr(err, "value", None)
    if code == nv.NVML_ERROR_GPU_IS_LOST:
        return "GPU is lost (fell off the bus): it needs a reset or a reboot; ask an administrator"
    if code == nv.NVML_ERROR_NO_PERMISSION:
        return "no permission to read this GPU"
    return f"unreadable: {err}"


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value

"""A fake of the ``pynvml`` API (nvidia-ml-py) for tests: the calls gpumagic makes, with values shaped as
the real library returns them (``str`` UUIDs and names, ``bytes``-or-``str`` bus ids, ctypes-like structs
with the same field names, memory in bytes, power in milliwatts, errors as ``NVMLError`` subclasses with
``.value`` codes).

Which machine it fakes comes from a scenario: ``configure(dict)`` in-process, or, when a process imports it
first on ``PYTHONPATH``, ``FAKE_NVML_SCENARIO`` (``default``, ``no-driver``, or a JSON file). Without one, and
with ``FAKE_NVML_UNSTATED`` naming a file, it answers as a machine without a driver and appends the reading
process to that file (tests/conftest.py fails the test that did it). Every call is recorded in ``calls``.

As on real drivers, ``nvmlInit`` loads the CUDA driver library without starting CUDA: the stand-in
``libcuda.so.1`` (built from ``libcuda.c``) named by ``FAKE_NVML_LIBCUDA``.
"""

from __future__ import annotations

import ctypes
import json
import os
import string
import sys
import typing
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
NVML_TEMPERATURE_GPU = 0
nvmlMemory_v2 = 0x02000028


class NVMLError(Exception):
    _valClassMapping: typing.ClassVar[dict[int, type]] = {}
    _errcode_to_string: typing.ClassVar[dict[int, str]] = {}

    def __new__(cls, value):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value):
        super().__init__(value)

    def __str__(self):
        return {v: k for k, v in globals().items() if k.startswith("NVML_ERROR_")}.get(self.value, "Unknown Error")


def _make_error_classes():
    namespace = globals()
    for name in [n for n in list(namespace) if n.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        value = namespace[name]

        def new(cls, *args, _value=value):
            return NVMLError.__new__(cls, _value)

        cls = type(class_name, (NVMLError,), {"__new__": new})
        namespace[class_name] = cls
        NVMLError._valClassMapping[value] = cls


_make_error_classes()
NVMLError._errcode_to_string.update({v: k for k, v in globals().items() if k.startswith("NVML_ERROR_")})


def nvmlExceptionClass(code):
    return NVMLError._valClassMapping[code]


def nvmlErrorString(code):
    return NVMLError._errcode_to_string.get(code, "Unknown Error")


GIB = 1 << 30
# Shapes recorded from nvidia-smi -q / NVML on an 8-GPU A100 server and a V100 box (values rounded).
DEFAULT_SCENARIO = {
    "driver": "550.54.15",
    "gpus": [
        {
            "name": "NVIDIA A100-SXM4-80GB",
            "uuid": "GPU-0f4ea0c3-6ad2-1b4e-c3f1-6b2e0d9c1a01",
            "busId": b"00000000:07:00.0",
            "total": 80 * GIB,
            "used": 2 * GIB,
            "reserved": 512 << 20,
            "gpu_util": 3,
            "mem_util": 1,
            "temperature": 33,
            "power": 61234,
            "power_limit": 400000,
            "mig": [0, 0],
            "processes": [{"pid": 999991, "usedGpuMemory": 1536 << 20}],
        },
        {
            "name": "NVIDIA A100-SXM4-80GB",
            "uuid": "GPU-7b21c6de-91a0-44f3-8e0b-2c94f1d0aa02",
            "busId": b"00000000:0F:00.0",
            "total": 80 * GIB,
            "used": 60 * GIB,
            "reserved": 512 << 20,
            "gpu_util": 97,
            "mem_util": 60,
            "temperature": 71,
            "power": 382000,
            "power_limit": 400000,
            "mig": [0, 0],
            "processes": [{"pid": 999992, "usedGpuMemory": None}],
        },
        {
            "name": "NVIDIA A100-SXM4-80GB",
            "uuid": "GPU-c3d5f0aa-1234-4c56-9abc-def012345603",
            "busId": b"00000000:47:00.0",
            "total": 80 * GIB,
            "used": 0,
            "reserved": 512 << 20,
            "gpu_util": 0,
            "mem_util": 0,
            "temperature": 30,
            "power": 55000,
            "power_limit": 400000,
            "mig": [0, 0],
            "processes": [],
            "unsupported": ["temperature", "power"],
        },
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-lost0000-0000-0000-0000-000000000004", "lost": True},
    ],
}

NO_DRIVER = {"init_error": "LIBRARY_NOT_FOUND", "gpus": []}
calls: list[str] = []
_scenario: dict = {}
_initialized = False


def configure(scenario: dict | None = None) -> None:
    """Fake this machine; ``None`` reads the environment (see the module's docstring)."""
    global _scenario, _initialized
    if scenario is None:
        named = os.environ.get("FAKE_NVML_SCENARIO")
        unstated = os.environ.get("FAKE_NVML_UNSTATED")
        if named == "default":
            scenario = DEFAULT_SCENARIO
        elif named == "no-driver":
            scenario = NO_DRIVER
        elif named:
            with open(named) as handle:
                scenario = json.load(handle)
        elif unstated:
            scenario = dict(NO_DRIVER, unstated=unstated)
        else:
            scenario = DEFAULT_SCENARIO
    _scenario = _decode(scenario)
    _initialized = False
    calls.clear()


def _decode(scenario):
    scenario = json.loads(json.dumps(scenario, default=lambda b: b.decode()))
    for gpu in scenario.get("gpus", []):
        if isinstance(gpu.get("busId"), str) and gpu.get("busId_bytes", True):
            gpu["busId"] = gpu["busId"].encode()
    return scenario


def _record(name):
    calls.append(name)
    if name not in ("nvmlInit", "nvmlShutdown") and not _initialized:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def _gpu(handle, field=None):
    gpu = _scenario["gpus"][handle.index]
    if gpu.get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    if field and field in gpu.get("unsupported", ()):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return gpu


def nvmlInitWithFlags(flags):
    nvmlInit()


def nvmlInit():
    global _initialized
    calls.append("nvmlInit")
    if _scenario.get("unstated"):
        with open(_scenario["unstated"], "a") as reads:
            reads.write(f"  pid {os.getpid()}: {' '.join(sys.argv)[:200]}\n")
    error = _scenario.get("init_error")
    if error:
        raise NVMLError(globals()[f"NVML_ERROR_{error}"])
    driver = os.environ.get("FAKE_NVML_LIBCUDA")
    if driver:
        ctypes.CDLL(driver)  # loaded, as the real libnvidia-ml loads libcuda.so.1; cuInit is not called
    _initialized = True


def nvmlShutdown():
    global _initialized
    _record("nvmlShutdown")
    _initialized = False


def nvmlSystemGetDriverVersion():
    _record("nvmlSystemGetDriverVersion")
    return _scenario.get("driver", "550.54.15")


def nvmlDeviceGetCount():
    _record("nvmlDeviceGetCount")
    return len(_scenario["gpus"])


def nvmlDeviceGetHandleByIndex(index):
    _record("nvmlDeviceGetHandleByIndex")
    if not 0 <= index < len(_scenario["gpus"]):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if _scenario["gpus"][index].get("lost_handle"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return SimpleNamespace(index=index)


def nvmlDeviceGetUUID(handle):
    _record("nvmlDeviceGetUUID")
    return _scenario["gpus"][handle.index]["uuid"]


def nvmlDeviceGetName(handle):
    _record("nvmlDeviceGetName")
    return _scenario["gpus"][handle.index]["name"]


def nvmlDeviceGetPciInfo(handle):
    _record("nvmlDeviceGetPciInfo")
    return SimpleNamespace(busId=_gpu(handle)["busId"], domain=0, bus=0, device=0)


def nvmlDeviceGetMemoryInfo(handle, version=None):
    _record(f"nvmlDeviceGetMemoryInfo(version={version})")
    gpu = _gpu(handle, "memory")
    total, used, reserved = gpu["total"], gpu["used"], gpu.get("reserved", 0)
    if version:
        if not _scenario.get("memory_v2", True):
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        return SimpleNamespace(version=version, total=total, reserved=reserved, used=used, free=total - used - reserved)
    return SimpleNamespace(total=total, used=used + reserved, free=total - used - reserved)


def nvmlDeviceGetUtilizationRates(handle):
    _record("nvmlDeviceGetUtilizationRates")
    gpu = _gpu(handle, "utilization")
    return SimpleNamespace(gpu=gpu["gpu_util"], memory=gpu["mem_util"])


def nvmlDeviceGetTemperature(handle, sensor):
    _record("nvmlDeviceGetTemperature")
    return _gpu(handle, "temperature")["temperature"]


def nvmlDeviceGetPowerUsage(handle):
    _record("nvmlDeviceGetPowerUsage")
    return _gpu(handle, "power")["power"]


def nvmlDeviceGetEnforcedPowerLimit(handle):
    _record("nvmlDeviceGetEnforcedPowerLimit")
    return _gpu(handle, "power")["power_limit"]


def nvmlDeviceGetMigMode(handle):
    _record("nvmlDeviceGetMigMode")
    return list(_gpu(handle, "mig")["mig"])


def _processes(handle, api):
    _record(f"nvmlDeviceGetComputeRunningProcesses{api}")
    if api == "_v3" and _scenario.get("process_api") == "v2":
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
    gpu = _gpu(handle, "processes")
    return [
        SimpleNamespace(
            pid=p["pid"], usedGpuMemory=p.get("usedGpuMemory"), gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
        )
        for p in gpu.get("processes", [])
    ]


def nvmlDeviceGetProcessUtilization(handle, timeStamp):
    """One sample per process with ``sm_util`` in the scenario; none: NVML's NOT_FOUND, as on real drivers."""
    _record("nvmlDeviceGetProcessUtilization")
    if _scenario.get("process_utilization") == "unsupported":
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    gpu = _gpu(handle, "processes")
    samples = [
        SimpleNamespace(pid=p["pid"], timeStamp=timeStamp + 1, smUtil=p["sm_util"], memUtil=0, encUtil=0, decUtil=0)
        for p in gpu.get("processes", [])
        if "sm_util" in p
    ]
    if not samples:
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return samples


def nvmlDeviceGetComputeRunningProcesses_v3(handle):
    return _processes(handle, "_v3")


def nvmlDeviceGetComputeRunningProcesses_v2(handle):
    return _processes(handle, "_v2")


def nvmlDeviceGetComputeRunningProcesses(handle):
    return _processes(handle, "")


configure()

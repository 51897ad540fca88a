"""The NVML boundary against the fake ``pynvml``: fields, fallbacks, errors turned into clear states."""

import subprocess
import sys

import pytest

from gpumagic.devices import nvml
from gpumagic.units import GIB


def test_reads_every_field_as_plain_values(fake_nvml):
    inventory = nvml.read_inventory()
    assert inventory.source == "nvml" and inventory.driver_version == "550.54.15" and len(inventory) == 4
    first = inventory[0]
    assert first.uuid == "GPU-0f4ea0c3-6ad2-1b4e-c3f1-6b2e0d9c1a01"
    assert first.pci_bus_id == "00000000:07:00.0"  # bytes from the library become text
    assert (first.memory_total, first.memory_used, first.memory_reserved) == (80 * GIB, 2 * GIB, 512 << 20)
    assert first.memory_free == 80 * GIB - 2 * GIB - (512 << 20)
    assert (first.utilization, first.temperature, first.power, first.power_limit) == (3.0, 33.0, 61.234, 400.0)
    assert first.mig_enabled is False and first.healthy


def test_unsupported_fields_are_none_not_errors(fake_nvml):
    third = nvml.read_inventory()[2]
    assert third.temperature is None and third.power is None and third.power_limit is None
    assert third.healthy and third.memory_total == 80 * GIB


def test_a_lost_gpu_is_a_state_with_advice(fake_nvml):
    lost = nvml.read_inventory()[3]
    assert not lost.healthy and "lost" in lost.problem and "reset" in lost.problem
    assert lost.memory_total is None


def test_dead_and_unreadable_processes(fake_nvml):
    inventory = nvml.read_inventory()
    dead = inventory[0].processes[0]
    assert dead.pid == 999991 and dead.alive is False and dead.gpu_memory == 1536 << 20
    assert inventory[1].processes[0].gpu_memory is None  # NVML_VALUE_NOT_AVAILABLE


def test_live_processes_get_user_and_command(fake_nvml):
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"], stdout=subprocess.PIPE
    )
    try:
        # running Python: just after Popen it may still be in exec, with no command line yet (read as "python")
        assert child.stdout.readline() == b"up\n"
        scenario = fake_nvml.DEFAULT_SCENARIO | {}
        scenario["gpus"] = [dict(scenario["gpus"][0], processes=[{"pid": child.pid, "usedGpuMemory": GIB}])]
        fake_nvml.configure(scenario)
        process = nvml.read_inventory()[0].processes[0]
        assert process.alive and "time.sleep(30)" in process.command and process.user
    finally:
        child.kill()
        child.wait()


def test_versioned_calls_are_probed_once_then_fall_back(fake_nvml):
    scenario = dict(fake_nvml.DEFAULT_SCENARIO, memory_v2=False, process_api="v2")
    fake_nvml.configure(scenario)
    first = nvml.read_inventory()[0]
    assert first.memory_reserved is None and first.memory_used == 2 * GIB + (512 << 20)
    calls_after_first = list(fake_nvml.calls)
    fake_nvml.calls.clear()
    nvml.read_inventory()
    assert calls_after_first.count("nvmlDeviceGetMemoryInfo(version=33554472)") == 1
    assert "nvmlDeviceGetMemoryInfo(version=33554472)" not in fake_nvml.calls
    assert "nvmlDeviceGetComputeRunningProcesses_v3" not in fake_nvml.calls
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in fake_nvml.calls


def test_init_is_lazy_and_happens_once(fake_nvml):
    assert "nvmlInit" not in fake_nvml.calls
    nvml.read_inventory()
    nvml.read_inventory()
    assert fake_nvml.calls.count("nvmlInit") == 1


@pytest.mark.parametrize(
    ("error", "advice"),
    [
        ("LIBRARY_NOT_FOUND", "no NVIDIA GPU or driver found"),
        ("DRIVER_NOT_LOADED", "not running"),
        ("NO_PERMISSION", "no permission"),
        ("UNKNOWN", "NVML failed to start"),
    ],
)
def test_driver_problems_become_a_clear_inventory_problem(fake_nvml, error, advice):
    fake_nvml.configure(dict(fake_nvml.DEFAULT_SCENARIO, init_error=error))
    inventory = nvml.read_inventory()
    assert inventory.gpus == () and inventory.source == "none" and advice in inventory.problem


def test_no_driver_points_at_simulation(no_gpu_machine):
    assert "GPUMAGIC_SIMULATE=4xA100-80GB" in nvml.read_inventory().problem


NO_LIBNVIDIA_ML = """
import ctypes
loader = ctypes.CDLL
def without_the_driver(name, *args, **kwargs):
    if name and "nvidia-ml" in str(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")
    return loader(name, *args, **kwargs)
ctypes.CDLL = without_the_driver
from gpumagic.devices import nvml
inventory = nvml.read_inventory()
print(inventory.source, '|', inventory.problem)
"""


def test_the_real_nvidia_ml_py_on_a_machine_without_the_driver_says_so():
    """The real nvidia-ml-py where libnvidia-ml.so.1 cannot be loaded (as on this machine and CI, and made so on a
    GPU machine): a clear state, no exception."""
    from conftest import machine_environment

    out = subprocess.run(
        [sys.executable, "-c", NO_LIBNVIDIA_ML], capture_output=True, text=True, env=machine_environment(), check=True
    ).stdout
    assert out.startswith("none |") and "libnvidia-ml.so.1 is missing" in out and "GPUMAGIC_SIMULATE" in out

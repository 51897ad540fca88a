"""What cuda:N means for this kernel, and telling when CUDA has already fixed it."""

import subprocess
import sys
import textwrap

import pytest

import gpumagic
from gpumagic.devices.cuda_state import cuda_initialized


@pytest.mark.parametrize(
    ("value", "order", "indices", "certain"),
    [
        (None, "PCI_BUS_ID", (0, 1, 2, 3), True),
        ("2,0", "PCI_BUS_ID", (2, 0), True),
        ("2,0", None, (2, 0), False),  # CUDA's fastest-first order may differ from NVML's
        ("", "PCI_BUS_ID", (), True),
        ("-1", "PCI_BUS_ID", (), True),
        ("1,7,2", "PCI_BUS_ID", (1,), True),  # CUDA stops at the first invalid entry
        ("1,1", "PCI_BUS_ID", (1,), True),
        ("0,²", "PCI_BUS_ID", (0,), True),  # a digit to str.isdigit, not to int() or CUDA
    ],
)
def test_cuda_numbering(simulated, monkeypatch, value, order, indices, certain):
    if value is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    if order:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    seen = gpumagic.visible_gpus()
    assert seen.nvml_indices == indices and seen.certain == certain


def test_uuid_prefixes_count(simulated, monkeypatch):
    uuids = [g.uuid for g in gpumagic.gpus()]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{uuids[3][:12]},{uuids[1]}")
    assert gpumagic.visible_gpus().nvml_indices == (3, 1)
    assert "cuda:0=GPU 3, cuda:1=GPU 1" in gpumagic.visible_gpus().describe()


def test_this_process_has_not_started_cuda():
    assert cuda_initialized() is None


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (CUDA starts once per process); its stdout."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


STAND_IN = "ctypes.CDLL(os.environ['FAKE_NVML_LIBCUDA'])"  # tests/fakes/libcuda.c, as nvmlInit loads the driver


def test_a_loaded_driver_that_never_started_leaves_the_kernel_free_to_choose(simulated):
    out = run_python(
        f"""
        import ctypes, os, gpumagic
        from gpumagic.devices.cuda_state import cuda_initialized, loaded_drivers
        {STAND_IN}
        print(loaded_drivers() == [os.environ['FAKE_NVML_LIBCUDA']], cuda_initialized())
        picked = gpumagic.pick(1)
        print(repr(picked))
        print(os.environ['CUDA_VISIBLE_DEVICES'] == picked.uuids[0])
        """
    )
    loaded, picked, moved = out.splitlines()
    assert loaded == "True None"
    assert picked.startswith("Picked GPU 0") and "Too late" not in picked
    assert moved == "True"


def test_once_the_driver_started_a_pick_says_it_is_too_late(simulated):
    out = run_python(
        f"""
        import ctypes, os, gpumagic
        from gpumagic.devices.cuda_state import cuda_initialized
        assert {STAND_IN}.cuInit(0) == 0
        print(cuda_initialized())
        print(repr(gpumagic.pick(1)))
        """
    )
    assert out.startswith("CUDA has started in this kernel (torch.cuda.is_available() or another CUDA call")
    assert "Too late for this kernel" in out and "processes it starts from now on will use 0" in out


def test_a_driver_that_is_not_loaded_is_never_loaded_to_answer():
    out = run_python(
        """
        import os
        from gpumagic.devices.cuda_state import cuda_initialized, driver_status, loaded_drivers
        print(driver_status(os.environ['FAKE_NVML_LIBCUDA']), cuda_initialized(), loaded_drivers())
        """
    )
    assert out.split() == ["None", "None", "[]"]


def test_importing_torch_does_not_count_as_started():
    out = run_python(
        "import torch, gpumagic; torch.randn(3).sum()\n"
        "from gpumagic.devices.cuda_state import cuda_initialized; print(cuda_initialized())"
    )
    assert out.strip() == "None"

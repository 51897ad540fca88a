"""What cuda:N means for this kernel, and telling when CUDA has already fixed it."""

import subprocess
import sys
import textwrap

import pytest

import gpumagic
from gpumagic.devices.visibility import cuda_initialized


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


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    """An empty shared library named like the CUDA driver: loading it is what CUDA's start looks like."""
    directory = tmp_path_factory.mktemp("libcuda")
    source = directory / "empty.c"
    source.write_text("int cuInit(unsigned int flags) { return 0; }\n")
    library = directory / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def test_a_loaded_cuda_driver_is_detected(fake_libcuda, simulated):
    code = textwrap.dedent(
        f"""
        import ctypes, gpumagic
        from gpumagic.devices.visibility import cuda_initialized
        assert cuda_initialized() is None
        ctypes.CDLL({str(fake_libcuda)!r})
        print(cuda_initialized())
        print(repr(gpumagic.pick(1)))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "the CUDA driver is loaded in this kernel" in out
    assert "Too late for this kernel" in out and "processes it starts from now on will use 0" in out


def test_importing_torch_does_not_count_as_started(simulated):
    code = (
        "import torch, gpumagic; torch.randn(3).sum()\n"
        "from gpumagic.devices.visibility import cuda_initialized; print(cuda_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"

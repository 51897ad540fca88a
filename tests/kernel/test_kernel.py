"""%gpu in real IPython kernels (jupyter_client): imports, output, races between kernels, dead kernels."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

pytestmark = pytest.mark.kernel
HEAVY = ("torch", "bokeh", "pynvml", "numpy", "ipywidgets", "jupyter_bokeh")


def loaded(kernel, names=HEAVY):
    out = kernel.ok(f"import sys, json; print(json.dumps([m for m in {list(names)!r} if m in sys.modules]))").stdout
    return json.loads(out)


def test_import_is_light_in_a_fresh_process():
    code = f"import sys, gpumagic; print([m for m in {list(HEAVY)!r} if m in sys.modules])"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


def test_loading_the_extension_imports_nothing_heavy(start_kernel):
    kernel = start_kernel()
    before = loaded(kernel)
    kernel.ok("%load_ext gpumagic")
    assert loaded(kernel) == before == []
    kernel.ok("%gpu help")
    assert loaded(kernel) == []


def test_status_pick_and_release_in_a_kernel(start_kernel):
    kernel = start_kernel(GPUMAGIC_SIMULATE="4xA100-80GB")
    kernel.ok("%load_ext gpumagic")
    status = kernel.ok("%gpu")
    assert status.html and "<table" in status.html[0] and "SIMULATED" in status.html[0]
    assert "4 GPUs · SIMULATED" in status.text[0]
    picked = kernel.ok("%gpu pick 2 --min-free 20GB")
    assert "Picked GPU 0, 1" in picked.text[0] and "[simulated]" in picked.text[0]
    env = kernel.ok(
        "import os; print(os.environ['CUDA_DEVICE_ORDER'], os.environ['CUDA_VISIBLE_DEVICES'].count('GPU-'))"
    )
    assert env.stdout.split() == ["PCI_BUS_ID", "2"]
    assert loaded(kernel, ("torch", "bokeh", "pynvml")) == []  # status and pick on simulation need none
    bad = kernel.run("%gpu use 7")
    assert bad.error[0] == "UsageError" and "there is no GPU 7" in bad.error[1]
    assert "Released GPU 0, 1" in kernel.ok("%gpu release").text[0]


def test_fake_nvml_in_a_kernel(start_kernel, fake_nvml):
    kernel = start_kernel()
    kernel.ok("%load_ext gpumagic")
    status = kernel.ok("%gpu status").text[0]
    assert "4 GPUs · driver 550.54.15" in status and "GPU is lost" in status
    assert "pid 999991 (not visible here" in status
    assert "Picked GPU 0, 2" in kernel.ok("%gpu pick 2").text[0]
    assert "fakes" in kernel.ok("import pynvml; print(pynvml.__file__)").stdout


def test_a_fresh_kernel_on_a_real_driver_picks_freely_until_cuda_starts(start_kernel, fake_nvml):
    """nvmlInit loads libcuda.so.1 (here the stand-in driver, as the real one on GPU machines) without starting
    CUDA: no warning and the pick moves the kernel; once cuInit ran (torch.cuda.is_available()), it warns."""
    kernel = start_kernel()
    kernel.ok("%load_ext gpumagic\nimport ctypes, os")
    status = kernel.ok("%gpu").text[0]
    driver = os.environ["FAKE_NVML_LIBCUDA"]
    assert driver in open(f"/proc/{kernel.pid}/maps").read()  # loaded by %gpu's nvmlInit, as on a GPU server
    assert "⚠" not in status and "CUDA has started" not in status
    picked = kernel.ok("sel = %gpu pick 1\nprint(repr(sel), os.environ['CUDA_VISIBLE_DEVICES'] == sel.uuids[0])")
    assert picked.stdout.startswith("Picked GPU 2") and picked.stdout.strip().endswith("True")
    assert len(picked.stdout.splitlines()) == 1  # no warning line
    kernel.ok(f"assert ctypes.CDLL({driver!r}).cuInit(0) == 0")  # what torch.cuda.is_available() does
    lines = kernel.ok("%gpu pick 1").text[0].splitlines()
    assert len(lines) == 2 and lines[0].startswith("Picked GPU 2")
    assert lines[1].startswith("⚠ Too late for this kernel: CUDA has started in this kernel")
    assert "⚠ CUDA has started in this kernel" in kernel.ok("%gpu").text[0]


RACE = """
from IPython.core.error import UsageError
try:
    print('got', ','.join(get_ipython().run_line_magic('gpu', 'pick 2').uuids))
except UsageError:
    print('got')
"""


def test_two_kernels_racing_never_share_a_gpu(start_kernel):
    kernels = [start_kernel(GPUMAGIC_SIMULATE="3xA100-80GB") for _ in range(2)]
    for kernel in kernels:
        kernel.ok("%load_ext gpumagic")
    for _ in range(25):
        outputs = [None, None]

        def race(i, outputs=outputs):
            outputs[i] = kernels[i].ok(RACE).stdout.split()

        threads = [threading.Thread(target=race, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sets = [set(o[1].split(",")) if len(o) > 1 else set() for o in outputs]
        assert not sets[0] & sets[1]
        assert sorted(map(len, sets)) == [0, 2]
        for kernel in kernels:
            kernel.ok("%gpu release")


def kernel_pid(kernel):
    return int(kernel.ok("import os; print(os.getpid())").stdout)


def test_a_killed_kernels_lease_is_reclaimed(start_kernel):
    holder, other = start_kernel(GPUMAGIC_SIMULATE="4xA100-80GB"), start_kernel(GPUMAGIC_SIMULATE="4xA100-80GB")
    for kernel in (holder, other):
        kernel.ok("%load_ext gpumagic")
    holder.ok("%gpu pick 3")
    pid = kernel_pid(holder)
    assert f"pid {pid}" in other.ok("%gpu").text[0]
    assert "leased by" in other.run("%gpu pick 2").error[1]
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(10) if psutil.pid_exists(pid) else None
    assert "leased by" not in other.ok("%gpu").text[0]
    assert "Picked GPU 0, 1, 2, 3" in other.ok("%gpu pick 4").text[0]


def test_a_kernel_that_shuts_down_gives_its_leases_back(start_kernel, isolated_leases):
    kernel = start_kernel(GPUMAGIC_SIMULATE="4xA100-80GB")
    kernel.ok("%load_ext gpumagic\n%gpu pick 2")
    assert len(list(isolated_leases.glob("GPU-*.json"))) == 2
    kernel.client.shutdown()  # a clean shutdown request: atexit runs
    deadline = time.time() + 15
    while list(isolated_leases.glob("GPU-*.json")) and time.time() < deadline:
        time.sleep(0.1)
    assert not list(isolated_leases.glob("GPU-*.json"))


def test_pick_wait_updates_one_line_then_succeeds(start_kernel):
    holder, waiter = start_kernel(GPUMAGIC_SIMULATE="2xA100-80GB"), start_kernel(GPUMAGIC_SIMULATE="2xA100-80GB")
    holder.ok("%load_ext gpumagic\n%gpu pick 2")
    waiter.ok("%load_ext gpumagic")
    releaser = threading.Timer(3.0, lambda: holder.ok("%gpu release"))
    releaser.start()
    started = time.monotonic()
    result = waiter.ok("%gpu pick 1 --wait 60s")
    releaser.join()
    assert time.monotonic() - started >= 2.5
    assert any(t.startswith("Waiting for 1 GPU(s), 0 qualify") for t in result.text)
    assert result.text[-1].startswith("Picked GPU 0")

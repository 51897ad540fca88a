"""Hang triage with NCCL on real GPUs (``pytest -m gpu``): torch's flight recorder is read on an NCCL rank (one
GPU is enough), and with two GPUs a rank waiting for a sleeping peer is reported with both ranks' lines. NCCL
takes one rank per GPU. Skipped, with the reason, where there is no NVIDIA driver, GPU or CUDA torch.
"""

import time

import pytest

from tests.kernel.test_hangs_and_debugging import report_delay

pytestmark = [pytest.mark.gpu, pytest.mark.kernel, pytest.mark.usefixtures("real_gpu")]


def test_the_flight_recorder_is_read_on_an_nccl_rank(start_kernel):
    kernel = start_kernel()
    kernel.ok("%load_ext gpumagic")
    kernel.ok("%ddp start -n 1 --gpus auto --no-dashboard", timeout=240)
    kernel.ok(
        "%%ddp -o seen\nimport torch\nfrom gpumagic.launch.rank_side import hang_watch\n"
        "t = torch.ones(256, device=device)\ndist.all_reduce(t)\ntorch.cuda.synchronize()\n"
        "last = hang_watch.last_finished()\n(dist.get_backend(), last['op'], last['backend'], last['tensor'])",
        timeout=120,
    )
    assert kernel.ok("print(seen[0])").stdout.strip() == "('nccl', 'all_reduce', 'nccl', 'Float[256]')"
    failed = kernel.run("%%ddp\nscale = 3\nbad = torch.ones(2, device=device) @ torch.ones(3, device=device)")
    assert failed.error is not None
    session = kernel.run("%ddp debug 0", answers=["p scale", "q"])
    assert "3" in session.stdout.splitlines()
    kernel.ok("%ddp stop")


def test_two_nccl_ranks_a_waiting_rank_is_reported_with_its_peers_line(start_kernel, real_gpu):
    if real_gpu["gpus"] < 2:
        pytest.skip(f"NCCL takes one rank per GPU: two ranks need two GPUs, this machine has {real_gpu['gpus']}")
    kernel = start_kernel()
    kernel.ok("%load_ext gpumagic")
    kernel.ok("%ddp start -n 2 --gpus auto --no-dashboard --output all --hang-after 3s", timeout=240)
    kernel.ok("%%ddp\nimport time, torch\nt = torch.ones(1024, device=device)\ndist.all_reduce(t)", timeout=120)
    begun = time.monotonic()
    result = kernel.ok(
        "%%ddp\nif rank == 0:\n    print('entering', flush=True)\n    dist.all_reduce(t)\n    t.sum().item()\n"
        "else:\n    time.sleep(10)\n    dist.all_reduce(t)\n    t.sum().item()",
        timeout=120,
    )
    delay = report_delay(result, "entering")
    print(
        f"NCCL: report {delay:.2f}s after rank 0 entered all_reduce (threshold 3s); "
        f"cell {time.monotonic() - begun:.1f}s"
    )
    assert delay <= 3 + 2
    assert "nccl all_reduce" in result.stdout and "time.sleep(10)" in result.stdout
    kernel.ok("%ddp stop")

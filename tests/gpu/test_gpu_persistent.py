"""A persistent NCCL group (``%ddp``) on real GPUs (``pytest -m gpu``): a kept DDP model trains on the GPU across
cells; a collective that ignores the interrupt is aborted and the group re-formed, the model re-wrapped on the
new communicator; a rank killed with SIGKILL is replaced on its GPU. With two GPUs or more, also a collective
one rank skipped, an interrupted DDP loop stopping every rank at one step, and a replaced rank that gets the
kept model from its peer. NCCL allows one rank per GPU: a one-GPU machine runs the one-rank cases.

Skipped, with the reason, where there is no NVIDIA driver, GPU or CUDA build of torch (see ``real_gpu``).
"""

import os
import signal
import time

import pytest

from tests.kernel.test_persistent import LOOP  # the CPU tests' DDP training loop

pytestmark = [pytest.mark.gpu, pytest.mark.kernel, pytest.mark.usefixtures("real_gpu")]

BUILD = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(1 + rank)
x, y = torch.randn(64, 256, device=device), torch.randn(64, 1, device=device)
steps = 0
gpumagic.keep(model, optimizer)
"""
STEPS = """
for _ in range(n):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    steps += 1
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
(steps, str(weights.device), dist.get_backend(), weights.sum().item())
"""


def started(start_kernel, ranks: int, grace: str = "1s"):
    kernel = start_kernel()
    kernel.ok("%load_ext gpumagic\nimport gpumagic, os, time")
    begun = time.monotonic()
    kernel.ok(f"%ddp start -n {ranks} --gpus auto --grace {grace} --no-dashboard", timeout=240)
    kernel.ok("%%ddp\nimport torch\nt = torch.ones(1, device=device)\ndist.all_reduce(t)", timeout=120)
    print(f"\n{ranks} NCCL rank(s): start -> first all_reduce {time.monotonic() - begun:.2f} s")
    return kernel


def test_a_kept_ddp_model_trains_on_the_gpu_through_an_aborted_collective_and_a_replaced_rank(start_kernel):
    kernel = started(start_kernel, 1, grace="3s")  # an NCCL abort takes its time
    kernel.ok("n = 5")
    kernel.ok("%%ddp\n" + BUILD)
    kernel.ok("%%ddp -o first\n" + STEPS)
    steps, device, backend, _ = eval(kernel.ok("print(first[0])").stdout)
    assert (steps, device, backend) == (5, "cuda:0", "nccl")

    # a collective loop that ignores the interrupt: the group's communicators are aborted, the group re-formed
    stuck = (
        "%%ddp --timeout 1s\nimport signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "while True:\n    dist.all_reduce(t)\n    torch.cuda.synchronize()"
    )
    begun = time.monotonic()
    result = kernel.run(stuck, timeout=120)
    took = time.monotonic() - begun
    assert result.error is not None and result.error[0] == "CellInterrupted", result.error
    print(result.error[1])
    assert "re-formed on a fresh rendezvous" in result.error[1] and "re-wrapped model" in result.error[1]
    print(f"aborted and re-formed: the cell returned {took:.2f} s after it started (timeout 1 s, grace 3 s)")
    kernel.ok("%%ddp -o second\n" + STEPS)
    steps, device, backend, _ = eval(kernel.ok("print(second[0])").stdout)
    assert (steps, device, backend) == (10, "cuda:0", "nccl")
    assert "re-formed 1 times" in kernel.ok("%ddp status").all_text

    # the rank killed: replaced on the GPU, its imports and definitions run again
    pid = int(kernel.ok("print(gpumagic.ddp_group().pids[0])").stdout)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    begun = time.monotonic()
    out = kernel.ok("%%ddp -o third\n(torch.cuda.is_initialized(), dist.get_backend(), DDP.__name__)", timeout=120)
    print(f"replaced: the next cell returned in {time.monotonic() - begun:.2f} s")
    assert "replaced by a fresh rank" in out.stdout and "every rank was replaced" in out.stdout, out.stdout
    assert kernel.ok("print(third[0])").stdout.strip() == "(True, 'nccl', 'DistributedDataParallel')"
    kernel.ok("%ddp stop")


def test_two_nccl_ranks_stop_together_recover_a_skipped_collective_and_replace_a_rank(start_kernel, real_gpu):
    if real_gpu["gpus"] < 2:
        pytest.skip(f"NCCL takes one rank per GPU: two ranks need two GPUs, this machine has {real_gpu['gpus']}")
    kernel = started(start_kernel, 2)
    kernel.ok("n = 3")
    kernel.ok("%%ddp\n" + BUILD)
    kernel.client.execute("%%ddp\n" + LOOP)
    time.sleep(2.0)
    reply, _ = kernel.interrupt()
    assert "every rank stopped before the same collective or DDP forward" in reply["evalue"], reply
    kernel.ok("%%ddp -o now\n" + STEPS)
    now = eval(kernel.ok("print(now)").stdout)
    assert now[0] == now[1], now

    kernel.client.execute("%%ddp\nif rank == 0:\n    dist.all_reduce(torch.ones(1, device=device))")
    time.sleep(1.0)
    begun = time.monotonic()
    reply, _ = kernel.interrupt()
    print(f"2 ranks: a skipped collective re-formed {time.monotonic() - begun:.2f} s after the interrupt")
    assert "re-formed on a fresh rendezvous" in reply["evalue"], reply

    pid = int(kernel.ok("print(gpumagic.ddp_group().pids[1])").stdout)
    result = kernel.run(f"%%ddp\nif rank == 1:\n    os.kill({pid}, 9)\ndist.barrier()", timeout=120)
    assert "restored on rank 1: model, optimizer (gpumagic.keep) from rank 0" in result.error[1], result.error
    kernel.ok("%%ddp -o after\n" + STEPS)
    after = eval(kernel.ok("print(after)").stdout)
    assert after[0][1:] == after[1][1:] and after[1][1] == "cuda:0", after
    kernel.ok("%ddp stop")

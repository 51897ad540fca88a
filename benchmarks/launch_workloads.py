"""Workloads shared by benchmarks/launch.py: importable, so plain mp.spawn and torchrun can run them too."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

_FIRST_DDP_FRESH = """
import os, sys
sys.path.insert(0, {here!r})
import torch, torch.distributed as dist
from launch_workloads import first_ddp_seconds
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
if {on_gpu}:
    torch.cuda.set_device(0)
dist.init_process_group("nccl" if {on_gpu} else "gloo", rank=0, world_size=1)
print(first_ddp_seconds({on_gpu}))
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def join_group_and_leave(rank: int | None = None, world_size: int | None = None) -> int:
    """The smallest DDP job: a barrier in an initialized process group. Joins one itself if needed."""
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    dist.barrier()
    result = dist.get_rank()
    if own:
        dist.destroy_process_group()
    return result


def first_ddp_seconds(on_gpu: bool = False) -> float:
    """How long the first DistributedDataParallel() of this process takes (the process group is initialized);
    ``on_gpu``: of a model on cuda:0, which is created (with the CUDA context) before the clock starts."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = nn.Linear(8, 1).to("cuda:0" if on_gpu else "cpu")
    if on_gpu:
        torch.cuda.synchronize()
    started = time.perf_counter()
    DDP(model)
    elapsed = time.perf_counter() - started
    dist.barrier()
    return elapsed


def first_ddp_seconds_in_a_fresh_process(on_gpu: bool = False) -> float:
    """``first_ddp_seconds`` in a new interpreter that has imported torch and made its process group of one
    (gloo, or NCCL on cuda:0 with ``on_gpu``): what a rank pays without the forkserver's preloads."""
    code = _FIRST_DDP_FRESH.format(here=os.path.dirname(os.path.abspath(__file__)), port=free_port(), on_gpu=on_gpu)
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def train(steps: int = 300, width: int = 256, batch: int = 64) -> float:
    """A DDP training loop of a 3-layer MLP on random data; returns steps per second after warm-up."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randn(batch, 1)
    for _ in range(20):  # warm-up
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    dist.barrier()
    return steps / (time.perf_counter() - start)


def accelerate_job() -> None:
    """The same barrier through accelerate (what notebook_launcher expects to run)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.wait_for_everyone()


if __name__ == "__main__":  # under torchrun
    import sys

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rate = train(int(sys.argv[1]))
    if dist.get_rank() == 0:
        print(f"steps_per_s {rate}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads can abort the process at interpreter teardown ("terminate called without an active
    # exception"); gpumagic's ranks skip teardown the same way.
    os._exit(0)

"""A persistent NCCL group (``%ddp``) on a real GPU: how long its paths take, one rank per GPU.

    python benchmarks/persistent_gpu.py [--repeat 3]

- start -> first ``all_reduce``: ``gpumagic.ranks(N, gpus="auto")`` then a cell that all-reduces a CUDA
  tensor; cold (the first group of the process: it starts the rank server) and warm (a second group, the
  server running), the goal being <= 2 s warm on one GPU;
- re-form: the process group's NCCL communicators aborted (what an interrupt does to a collective stuck past
  the grace period), a fresh rendezvous and communicator, and the kept DDP model re-wrapped on it; goal <= 3 s;
- replacement: a rank killed with SIGKILL, detected, a fresh rank started on the same GPU, the group formed
  again and the next cell run.

Each figure is the median of ``--repeat`` runs, with the device named. Needs an NVIDIA GPU and a CUDA torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time

BUILD = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 1024, device=device), torch.randn(256, 1, device=device)
gpumagic.keep(model, optimizer)
"""
STEP = """
optimizer.zero_grad()
torch.nn.functional.mse_loss(model(x), y).backward()
optimizer.step()
torch.cuda.synchronize()
"""
ALL_REDUCE = "t = torch.ones(1, device=device)\ndist.all_reduce(t)\nt.item()"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=0, help="ranks, one per GPU (default: every GPU)")
    options = parser.parse_args()
    import torch

    import gpumagic
    from gpumagic.devices.processes import is_running

    ranks = options.ranks or len(gpumagic.gpus().gpus)  # NCCL: one rank per GPU
    rows: list[tuple[str, str]] = []
    starts = []
    for attempt in range(options.repeat + 1):
        started = time.perf_counter()
        group = gpumagic.ranks(ranks, gpus="auto", output="none", grace=1.0)
        group.exec("import torch\n" + ALL_REDUCE, namespace={})
        starts.append(time.perf_counter() - started)
        if attempt < options.repeat:
            group.close()
    rows.append(("start -> first all_reduce, cold (starts the rank server)", f"{starts[0]:.2f} s"))
    rows.append(("start -> first all_reduce, warm, median", f"{statistics.median(starts[1:]):.2f} s"))
    nprocs, backend = group.nprocs, group.backend

    group.exec(BUILD, namespace={"gpumagic": gpumagic})
    group.exec(STEP, namespace={})
    reforms = []
    for _ in range(options.repeat):
        notes: list[str] = []
        started = time.perf_counter()
        group.members.break_group(-2)  # what an interrupt past the grace period does
        group.recovery.reform(notes, {})
        group.exec(STEP, namespace={})
        reforms.append(time.perf_counter() - started)
    rows.append(
        (
            "re-form (abort, new communicator, DDP re-wrapped) + a step, median",
            f"{statistics.median(reforms):.2f} s",
        )
    )

    replaced = []
    for _ in range(options.repeat):
        victim = group.pids[-1]
        os.kill(victim, signal.SIGKILL)
        while is_running(victim):
            time.sleep(0.01)
        started = time.perf_counter()
        group.exec(ALL_REDUCE, namespace={})  # the dead rank is replaced before the cell runs
        replaced.append(time.perf_counter() - started)
        assert victim not in group.pids
    rows.append(("a SIGKILLed rank replaced on its GPU + a cell, median", f"{statistics.median(replaced):.2f} s"))
    group.close()

    width = max(len(name) for name, _ in rows)
    print(
        f"persistent NCCL group: {nprocs} rank(s), {backend}, {torch.cuda.get_device_name(0)}, "
        f"torch {torch.__version__}, {options.repeat} runs each"
    )
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    main()

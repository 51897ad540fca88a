"""Persistent ranks against a fresh launch per cell, side by side in one run, 2 ranks on the CPU (gloo).

    python benchmarks/persistent.py [--cells 200] [--launches 20] [--grace 5]

- trivial cell round trip: ``group.exec("rank")`` on a running group (what ``%%ddp`` does) against
  ``launch_ddp`` of the same trivial function (a fresh group per cell, warm forkserver, what ``%%launch_ddp``
  does); target <= 5 ms median for the persistent cell. ipyparallel's ``%px`` on 2 engines when installed.
- cell start -> first step: a training cell on a model built by an earlier cell (persistent) against a cell
  that builds the model, wraps it in DDP and steps (fresh launch); the time from the call to the end of the
  first optimizer step on rank 0.
- interrupt of a rank stuck in ``all_reduce`` (rank 1 skips it): from the interrupt to the call's return, with the
  default grace period; target <= grace + 2 s; then a collective on the same group, namespaces intact.
- 100 cells on one group: the kernel-side process's RSS growth (target < 10 MB) and open descriptors.

Every group runs on the CPU with gloo, on a GPU machine too.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
from importlib.metadata import version

import psutil

BUILD = """
import torch, time
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randn(64, 1)
"""
STEP = """
optimizer.zero_grad()
torch.nn.functional.mse_loss(model(x), y).backward()
optimizer.step()
time.time()
"""


def trivial() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def first_step_fresh() -> float:
    """A fresh launch's cell: build the model, wrap it, one step; when the step ended."""
    namespace: dict = {}
    exec(BUILD, namespace)
    exec(STEP.replace("time.time()", "ended = time.time()"), namespace)
    return namespace["ended"]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def ipyparallel_rows(cells: int) -> list[tuple[str, str]]:
    try:
        import ipyparallel
    except ImportError:
        return [("ipyparallel %px on 2 engines", "not installed here: not measured")]
    with ipyparallel.Cluster(n=2, log_level=40) as client:
        view = client[:]
        view.execute("rank = 0", block=True)
        samples = []
        for _ in range(cells):
            started = time.perf_counter()
            view.execute("rank", block=True)
            samples.append(time.perf_counter() - started)
    return [("ipyparallel %px on 2 engines, trivial cell, median", ms(statistics.median(samples)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--grace", type=float, default=5.0)
    options = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import gpumagic

    rows: list[tuple[str, str]] = []
    started = time.perf_counter()
    group = gpumagic.ranks(2, gpus="none", output="none", grace=options.grace)
    rows.append(("start a group of 2 ranks (cold: starts the rank server)", f"{time.perf_counter() - started:.2f} s"))

    # trivial cells
    for _ in range(10):
        group.exec("rank", namespace={})
    samples = []
    for _ in range(options.cells):
        t = time.perf_counter()
        group.exec("rank", namespace={})
        samples.append(time.perf_counter() - t)
    persistent = statistics.median(samples)
    rows.append(("persistent %%ddp trivial cell, median", ms(persistent)))
    rows.append(("persistent %%ddp trivial cell, p95", ms(sorted(samples)[int(0.95 * len(samples)) - 1])))
    gpumagic.launch_ddp(trivial, 2, gpus="none", output="none")
    fresh = []
    for _ in range(options.launches):
        t = time.perf_counter()
        gpumagic.launch_ddp(trivial, 2, gpus="none", output="none")
        fresh.append(time.perf_counter() - t)
    rows.append(("fresh %%launch_ddp trivial cell (warm), median", ms(statistics.median(fresh))))
    rows.append(("ratio fresh / persistent", f"{statistics.median(fresh) / persistent:.0f}x"))
    rows.extend(ipyparallel_rows(options.cells))

    # cell start -> first step
    group.exec(BUILD, namespace={})
    group.exec(STEP, namespace={})  # the first step of a DDP model pays its own set-up: not this cell's
    persistent_first = []
    for _ in range(10):
        t = time.time()
        ended = group.exec(STEP, namespace={})[0]
        persistent_first.append(ended - t)
    fresh_first = []
    for _ in range(5):
        t = time.time()
        ended = gpumagic.launch_ddp(first_step_fresh, 2, gpus="none", output="none")[0]
        fresh_first.append(ended - t)
    rows.append(
        ("cell start -> first step, persistent (model built before), median", ms(statistics.median(persistent_first)))
    )
    rows.append(
        ("cell start -> first step, fresh launch (build + DDP + step), median", ms(statistics.median(fresh_first)))
    )

    # interrupt of a stuck all_reduce
    group.exec("kept = rank + 100", namespace={})
    interrupted = {}

    def interrupt() -> None:
        interrupted["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Timer(1.0, interrupt).start()
    try:
        group.exec("if rank == 0:\n    dist.all_reduce(torch.ones(1))", namespace={})
        rows.append(("interrupt of a stuck all_reduce", "NOT INTERRUPTED"))
    except gpumagic.CellInterrupted:
        took = time.monotonic() - interrupted["at"]
        rows.append((f"interrupt of a stuck all_reduce -> cell returned (grace {options.grace:g} s)", f"{took:.2f} s"))
    after = group.exec("t = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), kept)", namespace={})
    rows.append(("next cell's all_reduce and namespaces", str(after)))

    # 100 cells: growth
    me = psutil.Process()
    group.exec("n = 0", namespace={})
    before = (me.memory_info().rss, me.num_fds(), me.num_threads())
    for _ in range(100):
        group.exec("n += 1\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(n)", namespace={})
    grown = (me.memory_info().rss - before[0]) / 2**20
    rows.append(("100 cells: kernel-side RSS growth", f"{grown:.1f} MB"))
    rows.append(
        ("100 cells: descriptors, threads before -> after", f"{before[1:]} -> {(me.num_fds(), me.num_threads())}")
    )
    group.close()

    width = max(len(name) for name, _ in rows)
    print(f"persistent ranks, 2 gloo ranks on {os.cpu_count()} CPUs, torch {version('torch')}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    main()

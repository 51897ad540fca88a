"""The cost of gpumagic.log against torch's SummaryWriter.add_scalar and a plain print, in one run.

    python benchmarks/telemetry.py [--calls 200000]

Per-call cost: median over batches of 1,000 calls of one scalar. Throughput: points per second sustained
for ``--seconds`` (the background writer included), each logger writing to a temporary directory.
Targets (issue #4): under 2 µs per call, at least 500,000 points/s per process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def per_call_us(function, calls: int) -> float:
    batches = []
    for start in range(0, calls, 1000):
        began = time.perf_counter()
        for i in range(start, start + 1000):
            function(i)
        batches.append((time.perf_counter() - began) / 1000)
    return statistics.median(batches) * 1e6


def throughput(function, seconds: float) -> float:
    count, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        for i in range(1000):
            function(i)
        count += 1000
    return count / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=2.0)
    options = parser.parse_args()
    os.environ["GPUMAGIC_RUNS_DIR"] = tempfile.mkdtemp(prefix="gpumagic-bench-runs-")

    import gpumagic

    log = gpumagic.log
    loggers = {"gpumagic.log(loss=x)": lambda i: log(loss=i * 0.5)}
    try:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(tempfile.mkdtemp(prefix="gpumagic-bench-tb-"))
        loggers["SummaryWriter.add_scalar('loss', x, i)"] = lambda i: writer.add_scalar("loss", i * 0.5, i)
    except ImportError:
        writer = None
        print("tensorboard is not installed (pip install tensorboard): SummaryWriter not measured")
    devnull = open(os.devnull, "w")
    loggers["print('loss', x) to /dev/null"] = lambda i: print("loss", i * 0.5, file=devnull)

    rows = []
    for name, function in loggers.items():
        rows.append((name, per_call_us(function, options.calls), throughput(function, options.seconds)))
    devnull.close()
    if writer is not None:
        writer.close()

    width = max(len(r[0]) for r in rows)
    print(f"{'logger':<{width}}  {'µs/call (median)':>16}  {'points/s':>12}")
    for name, cost, rate in rows:
        print(f"{name:<{width}}  {cost:>16.2f}  {rate:>12,.0f}")
    ours = rows[0]
    print(f"\ngpumagic.log per call / 2 µs target: {ours[1] / 2:.2f}; throughput / 500k target: {ours[2] / 5e5:.2f}")
    for name, cost, _ in rows[1:]:
        print(f"vs {name}: {cost / ours[1]:.1f}x the cost per call")
    print(f"(python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()

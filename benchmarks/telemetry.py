"""The cost of gpumagic.log against torch's SummaryWriter.add_scalar and a plain print, in one run.

    python benchmarks/telemetry.py [--calls 200000]

Per-call cost: median over batches of 1,000 calls of one scalar. Throughput: points per second sustained
for ``--seconds`` (the background writer included), each logger writing to a temporary directory.
Targets (issue #4): under 2 µs per call, at least 500,000 points/s per process. Then the kernel's CPU use,
idle and while ``%gpu watch`` streams 8 simulated GPUs at 2 Hz (target: under 2% of one core).
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


def log_cost_in_a_rank(calls: int, seconds: float) -> tuple[float, float]:
    """The same measure inside a rank started by gpumagic.launch_ddp (its points go to the launch's run)."""
    import gpumagic

    log = gpumagic.log
    function = lambda i: log(loss=i * 0.5)  # noqa: E731
    return per_call_us(function, calls), throughput(function, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--watch-seconds", type=float, default=20.0, help="kernel CPU measure; 0 skips it")
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
    in_rank = gpumagic.launch_ddp(
        log_cost_in_a_rank, 1, args=(options.calls, options.seconds), gpus="none", output="none"
    )[0]
    rows.insert(1, ("gpumagic.log(loss=x) in a launched rank", *in_rank))
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
    if options.watch_seconds > 0:
        watch_cost(options.watch_seconds)


def watch_cost(seconds: float) -> None:
    """The kernel's CPU use, in % of one core, idle and while %gpu watch streams 8 simulated GPUs at 2 Hz."""
    from kernel_cpu import measured_kernel

    env = dict(os.environ, GPUMAGIC_SIMULATE="8xA100-80GB", GPUMAGIC_LEASE_DIR=tempfile.mkdtemp())
    with measured_kernel(env) as kernel:
        kernel.run("%load_ext gpumagic")
        idle = kernel.cpu_percent_over(seconds)
        kernel.run("%gpu watch --interval 0.5")
        time.sleep(1.0)
        watching = kernel.cpu_percent_over(seconds)
    print(
        f"\nkernel CPU, % of one core over {seconds:g}s: idle {idle:.2f}; while %gpu watch streams 8 simulated "
        f"GPUs at 2 Hz {watching:.2f}; the dashboard's own share {watching - idle:.2f} (target < 2)"
    )


if __name__ == "__main__":
    main()

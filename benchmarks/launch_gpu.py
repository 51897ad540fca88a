"""NCCL launch costs on one real GPU, side by side in one run (needs an NVIDIA GPU and a CUDA torch).

    python benchmarks/launch_gpu.py [--repeat 10] [--cold-runs 3]

- cold: the first gpumagic launch in a fresh process, 1 rank with NCCL (forkserver start, CUDA context,
  process group, a DDP() of a small model on the GPU);
- warm: later launches of the same in that process;
- the first DDP() inside a warm-launched rank (torch._dynamo preloaded in the forkserver) against the same
  call in a fresh process that has imported torch and made its NCCL group (it imports torch._dynamo then).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

COLD = """
import sys, time
sys.path.insert(0, {here!r})
t = time.perf_counter()
import gpumagic
from launch_workloads import first_ddp_seconds
gpumagic.launch_ddp(first_ddp_seconds, 1, args=(True,), output="none")
print(time.perf_counter() - t)
"""


def seconds_of(code: str) -> float:
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--cold-runs", type=int, default=3)
    options = parser.parse_args()
    from launch_workloads import first_ddp_seconds, first_ddp_seconds_in_a_fresh_process

    import gpumagic

    if not [g for g in gpumagic.gpus().gpus if not g.simulated]:
        sys.exit("no NVIDIA GPU here: this benchmark needs one (benchmarks/launch.py measures the CPU)")
    cold = [seconds_of(COLD.format(here=str(HERE))) for _ in range(options.cold_runs)]
    warm, in_rank = [], []
    for _ in range(options.repeat):
        started = time.perf_counter()
        in_rank.append(gpumagic.launch_ddp(first_ddp_seconds, 1, args=(True,), output="none")[0])
        warm.append(time.perf_counter() - started)
    fresh = [first_ddp_seconds_in_a_fresh_process(True) for _ in range(options.cold_runs)]
    rows = [
        ("gpumagic cold launch, 1 NCCL rank (fresh process)", statistics.median(cold)),
        ("gpumagic warm relaunch, 1 NCCL rank", statistics.median(warm)),
        ("first DDP() of a GPU model in a rank of a warm relaunch", statistics.median(in_rank)),
        ("first DDP() of a GPU model in a fresh process with torch imported", statistics.median(fresh)),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{gpumagic.gpus().gpus[0].name}; medians: cold of {options.cold_runs}, warm of {options.repeat}")
    for name, value in rows:
        print(f"{name:<{width}}  {value:>8.3f} s")
    print(f"\nfirst DDP() in a rank / in a fresh process: {rows[2][1] / rows[3][1]:.3f}")


if __name__ == "__main__":
    main()

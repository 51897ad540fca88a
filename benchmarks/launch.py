"""Launch costs and training throughput, side by side in one run, 2 ranks on this machine's CPU (gloo).

    python benchmarks/launch.py [--repeat 20] [--steps 300] [--skip-accelerate]

- cold: the first gpumagic launch in a fresh process (starts the forkserver, which imports torch);
- warm: later launches in the same process (a fork of the torch-loaded forkserver); target < 0.15 s;
- gpumagic with start_method=spawn, plain torch.multiprocessing.spawn of an importable function, and
  accelerate's notebook_launcher (fork), all running the same barrier job;
- the first DistributedDataParallel() in a rank of a warm relaunch (torch._dynamo preloaded in the forkserver)
  against the same call in a fresh process that has imported torch (it imports torch._dynamo then);
- steady-state DDP training throughput of one loop under gpumagic and under torchrun; target ratio >= 0.98.

Every launcher runs its ranks on the CPU with gloo, on a GPU machine too.
"""

from __future__ import annotations

import argparse
import os
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
from launch_workloads import join_group_and_leave
gpumagic.launch_ddp(join_group_and_leave, 2, output="none")
print(time.perf_counter() - t)
"""


def timed(function, repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return samples


def torchrun_rate(steps: int) -> float:
    from launch_workloads import free_port

    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, len(os.sched_getaffinity(0)) // 2)))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(HERE / "launch_workloads.py"),
        str(steps),
    ]
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("steps_per_s")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cold-runs", type=int, default=3)
    parser.add_argument("--throughput-runs", type=int, default=3)
    parser.add_argument("--skip-accelerate", action="store_true")
    options = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo for every launcher, also on a GPU machine

    import torch.multiprocessing as mp
    from launch_workloads import (
        accelerate_job,
        first_ddp_seconds,
        first_ddp_seconds_in_a_fresh_process,
        free_port,
        join_group_and_leave,
        train,
    )

    import gpumagic

    rows: list[tuple[str, float, str]] = []
    cold = [
        float(
            subprocess.run(
                [sys.executable, "-c", COLD.format(here=str(HERE))], capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(options.cold_runs)
    ]
    rows.append(("gpumagic cold launch (fresh process: forkserver start + torch import)", statistics.median(cold), "s"))

    gpumagic.launch_ddp(join_group_and_leave, 2, output="none")
    warm = timed(lambda: gpumagic.launch_ddp(join_group_and_leave, 2, output="none"), options.repeat)
    rows.append(("gpumagic warm relaunch (forkserver)", statistics.median(warm), "s"))
    spawned = timed(
        lambda: gpumagic.launch_ddp(join_group_and_leave, 2, output="none", start_method="spawn"),
        max(3, options.repeat // 4),
    )
    rows.append(("gpumagic with start_method=spawn", statistics.median(spawned), "s"))

    in_rank = [gpumagic.launch_ddp(first_ddp_seconds, 2, output="none")[0] for _ in range(max(3, options.repeat // 4))]
    fresh = [first_ddp_seconds_in_a_fresh_process() for _ in range(options.cold_runs)]
    rows.append(("first DDP() in a rank of a warm relaunch", statistics.median(in_rank), "s"))
    rows.append(("first DDP() in a fresh process with torch imported", statistics.median(fresh), "s"))

    def plain_spawn() -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        mp.spawn(join_group_and_leave, args=(2,), nprocs=2, join=True)

    rows.append(
        (
            "torch.multiprocessing.spawn, importable function",
            statistics.median(timed(plain_spawn, max(3, options.repeat // 4))),
            "s",
        )
    )

    accelerate_note = None
    if not options.skip_accelerate:
        try:
            from accelerate import notebook_launcher

            def launch_accelerate() -> None:
                notebook_launcher(accelerate_job, num_processes=2, use_port=str(free_port()))

            rows.append(
                (
                    "accelerate notebook_launcher (fork)",
                    statistics.median(timed(launch_accelerate, max(3, options.repeat // 4))),
                    "s",
                )
            )
        except ImportError:
            accelerate_note = "accelerate is not installed: pip install accelerate (or .[bench])"

    ours, theirs = [], []
    for _ in range(options.throughput_runs):  # alternate, so drift of the machine hits both alike
        ours.append(gpumagic.launch_ddp(train, 2, args=(options.steps,), output="none")[0])
        theirs.append(torchrun_rate(options.steps))
    rows.append(("DDP training under gpumagic (median steps/s)", statistics.median(ours), "steps/s"))
    rows.append(("same loop under torchrun (median steps/s)", statistics.median(theirs), "steps/s"))

    width = max(len(name) for name, _, _ in rows)
    for name, value, unit in rows:
        print(f"{name:<{width}}  {value:>10.3f} {unit}")
    warm_median = rows[1][1]
    print(f"\nwarm relaunch / 0.15 s target: {warm_median / 0.15:.2f}")
    print(f"warm relaunch vs torch.multiprocessing.spawn: {rows[5][1] / warm_median:.1f}x faster")
    print(f"first DDP() in a rank / in a fresh process: {rows[3][1] / rows[4][1]:.3f}")
    print(f"throughput gpumagic / torchrun: {statistics.median(ours) / statistics.median(theirs):.3f} (target >= 0.98)")
    if accelerate_note:
        print(accelerate_note)


if __name__ == "__main__":
    main()

"""Background jobs: how soon a job's code runs, and what following 8 jobs costs the kernel, in one run.

    python benchmarks/jobs.py [--repeats 5] [--watch-seconds 20]

1. Submit to the job's first line, with a free GPU (simulated): ``gpumagic.submit`` returns, the runner
   detaches, takes its place in the queue and a lease, and starts the job (a fresh ``spawn`` process that
   imports torch). Side by side: the same first line in a bare ``python -c "import torch"`` subprocess (the
   floor any fresh process pays) and ``subprocess.Popen`` of a script, as people do today.
2. Without a free slot: one GPU, held by a job; a second job waits. Measured from the moment the first job's
   code ends to the second job's first line (the queue's reaction), next to today's fixed ``sleep 5``.
3. The kernel's CPU use, idle and while ``%jobs watch`` follows 8 jobs that each log 20 points a second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def first_line() -> float:
    import time

    return time.time()


def hold_then_stamp(seconds: float) -> float:
    import time

    time.sleep(seconds)
    return time.time()


def submit_to_code(repeats: int) -> None:
    import gpumagic

    returned, running = [], []
    for _ in range(repeats):
        began = time.time()
        job = gpumagic.submit(first_line, name=None)
        returned.append(time.time() - began)
        job.wait("2m")
        running.append(job.result() - began)
        job.remove()
    bare = []
    for _ in range(repeats):
        began = time.time()
        out = subprocess.run(
            [sys.executable, "-c", "import time, torch; print(time.time())"], capture_output=True, text=True
        )
        bare.append(float(out.stdout) - began)
    print(f"submit -> job's first line, free GPU, median of {repeats}:")
    returns_ms = statistics.median(returned) * 1000
    print(f"  gpumagic.submit returns in        {returns_ms:8.1f} ms (the kernel is free again)")
    print(f"  job's first line runs after       {statistics.median(running):8.3f} s")
    print(f"  bare `python -c 'import torch'`   {statistics.median(bare):8.3f} s (a fresh process's floor)")
    print(f"  ratio gpumagic / bare process     {statistics.median(running) / statistics.median(bare):8.2f}")


def waiting_to_code(repeats: int) -> None:
    import gpumagic

    reactions = []
    os.environ["GPUMAGIC_SIMULATE"] = "1xA100-80GB"
    for _ in range(repeats):
        holder = gpumagic.submit(hold_then_stamp, 3.0)
        while holder.status == "queued":
            time.sleep(0.01)
        waiting = gpumagic.submit(first_line)
        freed = holder.result()
        waiting.wait("2m")
        reactions.append(waiting.result() - freed)
        holder.remove()
        waiting.remove()
    os.environ["GPUMAGIC_SIMULATE"] = "4xA100-80GB"
    median = statistics.median(reactions)
    print(f"\nno free GPU: the holder's code ends -> the waiting job's first line, median of {repeats}:")
    print(f"  gpumagic queue                    {median:8.3f} s")
    print("  today: `sleep 5` between jobs        5.000 s (and no check that the GPU is really free)")
    print(f"  ratio gpumagic / sleep 5          {median / 5:8.2f}")


WATCHED_JOB = """
import time
for step in range(100000):
    gpumagic.log(step=step, loss=1.0 / (step + 1))
    time.sleep(0.05)
"""


def watch_cost(seconds: float) -> None:
    """The kernel's CPU, % of one core, idle and while %jobs watch follows 8 jobs logging 20 points/s each."""
    from kernel_cpu import measured_kernel

    import gpumagic

    os.environ["GPUMAGIC_SIMULATE"] = "8xA100-80GB"
    try:
        with measured_kernel(dict(os.environ)) as kernel:
            kernel.run("%load_ext gpumagic")
            for number in range(8):
                kernel.run(f"%%launch_bg --name w{number}\n{WATCHED_JOB}")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and sum(j.status == "running" for j in gpumagic.list_jobs()) < 8:
                time.sleep(0.2)
            time.sleep(2.0)
            idle = kernel.cpu_percent_over(seconds)
            kernel.run("watch = %jobs watch --interval 1s\nwatch")
            time.sleep(2.0)
            watching = kernel.cpu_percent_over(seconds)
        points = sum(len(s) for j in gpumagic.list_jobs() for s in j.metrics().get(0, {}).values())
        print(
            f"\nkernel CPU, % of one core over {seconds:g}s, 8 jobs logging 20 points/s each ({points:,} points "
            f"so far): idle {idle:.2f}; while %jobs watch follows them (1 s refresh) {watching:.2f}; "
            f"the watch's own share {watching - idle:.2f}"
        )
    finally:
        for job in gpumagic.list_jobs():
            if job.status in ("queued", "running"):
                job.kill(grace_s=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--watch-seconds", type=float, default=20.0, help="kernel CPU measure; 0 skips it")
    options = parser.parse_args()
    os.environ["GPUMAGIC_RUNS_DIR"] = tempfile.mkdtemp(prefix="gpumagic-bench-runs-")
    os.environ["GPUMAGIC_LEASE_DIR"] = tempfile.mkdtemp(prefix="gpumagic-bench-leases-")
    os.environ["GPUMAGIC_SIMULATE"] = "4xA100-80GB"
    submit_to_code(options.repeats)
    waiting_to_code(options.repeats)
    if options.watch_seconds > 0:
        watch_cost(options.watch_seconds)


if __name__ == "__main__":
    main()

"""Background jobs: how soon a job's code runs, and what following 8 jobs costs the kernel, in one run.

    python benchmarks/jobs.py [--repeats 5] [--watch-seconds 20] [--watch-jobs 8] [--baseline REV] [--fair-seconds 60]

1. Submit to the job's first line, with a free GPU (simulated): ``gpumagic.submit`` returns, the runner
   detaches, takes its place in the queue and a lease, and starts the job (a fresh ``spawn`` process that
   imports torch). Side by side: the same first line in a bare ``python -c "import torch"`` subprocess (the
   floor any fresh process pays) and ``subprocess.Popen`` of a script, as people do today.
2. Without a free slot: one GPU, held by a job; a second job waits. Measured from the moment the first job's
   code ends to the second job's first line (the queue's reaction), next to today's fixed ``sleep 5``.
3. The kernel's CPU use, idle and while ``%jobs watch`` follows 8 jobs that each log 20 points a second
   (``--watch-jobs``: the test suite's smoke run follows 2).
4. Sharing (issue #16), on the simulated inventory at 1/20 of the issue's scale (this machine has 24 GiB of
   memory, and a simulated GPU's memory is its processes' resident memory): four jobs that each allocate about
   1 GiB and declare 1.25 GiB (``--min-free``) on one 4 GiB GPU; when each starts after the submission.
5. Fairness (issue #16): 6 processes ("kernels") on 4 simulated GPUs, each looping ``pick(1, wait="20s")``,
   hold 1 s, ``release()``, pick again at once; picks per kernel and the longest wait.

With ``--baseline REV``, scenarios 4 and 5 also run with gpumagic as it was at that git revision, side by side.
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
        job = gpumagic.jobs_with(name=None).submit(first_line)
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


def watch_cost(seconds: float, jobs: int) -> None:
    """The kernel's CPU, % of one core, idle and while %jobs watch follows ``jobs`` jobs logging 20 points/s each."""
    from kernel_cpu import measured_kernel

    import gpumagic

    os.environ["GPUMAGIC_SIMULATE"] = f"{max(jobs, 1)}xA100-80GB"
    try:
        with measured_kernel(dict(os.environ)) as kernel:
            kernel.run("%load_ext gpumagic")
            for number in range(jobs):
                kernel.run(f"%%launch_bg --name w{number}\n{WATCHED_JOB}")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and sum(j.status == "running" for j in gpumagic.list_jobs()) < jobs:
                time.sleep(0.2)
            time.sleep(2.0)
            idle = kernel.cpu_percent_over(seconds)
            kernel.run("watch = %jobs watch --interval 1s\nwatch")
            time.sleep(2.0)
            watching = kernel.cpu_percent_over(seconds)
        points = sum(len(s) for j in gpumagic.list_jobs() for s in j.metrics().get(0, {}).values())
        print(
            f"\nkernel CPU, % of one core over {seconds:g}s, {jobs} jobs logging 20 points/s each ({points:,} points "
            f"so far): idle {idle:.2f}; while %jobs watch follows them (1 s refresh) {watching:.2f}; "
            f"the watch's own share {watching - idle:.2f}"
        )
    finally:
        for job in gpumagic.list_jobs():
            if job.status in ("queued", "running"):
                job.kill(grace_s=2)


SHARING = """
import json, os, sys, tempfile, time
os.environ.update(GPUMAGIC_SIMULATE="1xT4-4GB", GPUMAGIC_RUNS_DIR=tempfile.mkdtemp(),
                  GPUMAGIC_LEASE_DIR=tempfile.mkdtemp())
import gpumagic

def hold(seconds):
    import time
    block = bytearray(700 << 20)  # with the rank's own ~300 MiB: about 1 GiB resident
    gpumagic.log(loss=1.0)
    time.sleep(seconds)
    return len(block)

if __name__ == "__main__":
    began = time.time()
    jobs = [gpumagic.jobs_with(min_free="1.25GB", name=f"share{n}").submit(hold, float(sys.argv[1])) for n in range(4)]
    for job in jobs:
        job.wait("5m")
    print(json.dumps({"starts": [job.info["started"] - began for job in jobs],
                      "ends": [job.info["ended"] - began for job in jobs],
                      "status": [job.status for job in jobs]}))
"""

FAIRNESS = """
import json, multiprocessing, os, sys, tempfile, time

def kernel(seconds, out):
    import gpumagic
    from gpumagic.errors import NotEnoughGpusError
    picks, waits, end = 0, [], time.monotonic() + seconds
    while time.monotonic() < end:
        asked = time.monotonic()
        try:
            gpumagic.pick(1, wait="20s")
        except NotEnoughGpusError:
            waits.append(time.monotonic() - asked)
            continue
        waits.append(time.monotonic() - asked)
        picks += 1
        time.sleep(1.0)
        gpumagic.release()  # and pick again at once
    out.put((picks, max(waits)))

if __name__ == "__main__":  # one lease directory for all six (spawn's children inherit the environment)
    os.environ.update(GPUMAGIC_SIMULATE="4xA100-80GB", GPUMAGIC_LEASE_DIR=tempfile.mkdtemp())
    out = multiprocessing.get_context("spawn").Queue()
    kernels = [multiprocessing.get_context("spawn").Process(target=kernel, args=(float(sys.argv[1]), out))
               for _ in range(6)]
    for k in kernels:
        k.start()
    results = [out.get() for _ in kernels]
    for k in kernels:
        k.join()
    print(json.dumps({"picks": sorted(r[0] for r in results), "longest_wait": max(r[1] for r in results)}))
"""


def _packages(baseline: str | None) -> list[tuple[str, dict[str, str]]]:
    """(label, environment) for this checkout and, with ``baseline``, gpumagic at that revision."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = [("this checkout", {**os.environ, "PYTHONPATH": here})]
    if baseline:
        where = tempfile.mkdtemp(prefix="gpumagic-baseline-")
        archive = subprocess.run(
            ["git", "-C", here, "archive", baseline, "gpumagic"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
        result.insert(0, (f"gpumagic at {baseline}", {**os.environ, "PYTHONPATH": where}))
    return result


def _run_script(code: str, env: dict[str, str], *args: str) -> dict:
    import json

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(code)
    # run from the script's directory: a forkserver puts its working directory first on its path, and from the
    # checkout that would import this checkout's gpumagic into a baseline's ranks
    out = subprocess.run(
        [sys.executable, script.name, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(script.name),
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def sharing(hold_s: float, baseline: str | None) -> None:
    print("\nsharing: 4 jobs of ~1 GiB declaring 1.25 GiB on one 4 GiB simulated GPU (the issue's 4 x 20 GiB")
    print(f"declaring 25 GB on 80 GB, at 1/20), each held {hold_s:g} s; seconds from submission to each job's start,")
    print("and its end:")
    for label, env in _packages(baseline):
        result = _run_script(SHARING, env, str(hold_s))
        starts = " ".join(f"{t:5.1f}" for t in result["starts"])
        ends = " ".join(f"{t:5.1f}" for t in result["ends"])
        print(f"  {label:28} starts {starts}   ends {ends}   {'/'.join(set(result['status']))}")


def fairness(seconds: float, baseline: str | None) -> None:
    print(f"\nfairness: 6 kernels, 4 simulated GPUs, {seconds:g} s of pick(1, wait='20s') / hold 1 s / release /")
    print("pick again at once; GPUs each kernel got, fewest first, and the longest any pick waited:")
    for label, env in _packages(baseline):
        result = _run_script(FAIRNESS, env, str(seconds))
        picks = " ".join(f"{n:3d}" for n in result["picks"])
        print(f"  {label:28} picks {picks}   longest wait {result['longest_wait']:5.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--watch-seconds", type=float, default=20.0, help="kernel CPU measure; 0 skips it")
    parser.add_argument("--watch-jobs", type=int, default=8, help="jobs the watch follows in the kernel CPU measure")
    parser.add_argument("--baseline", metavar="REV", help="sharing and fairness also with gpumagic at this revision")
    parser.add_argument("--fair-seconds", type=float, default=60.0, help="length of the fairness scenario")
    parser.add_argument("--hold-seconds", type=float, default=6.0, help="how long each sharing job holds its memory")
    parser.add_argument("--only", choices=["sharing", "fairness"], help="run only this scenario")
    options = parser.parse_args()
    if options.only == "sharing":
        sharing(options.hold_seconds, options.baseline)
        return
    if options.only == "fairness":
        fairness(options.fair_seconds, options.baseline)
        return
    os.environ["GPUMAGIC_RUNS_DIR"] = tempfile.mkdtemp(prefix="gpumagic-bench-runs-")
    os.environ["GPUMAGIC_LEASE_DIR"] = tempfile.mkdtemp(prefix="gpumagic-bench-leases-")
    os.environ["GPUMAGIC_SIMULATE"] = "4xA100-80GB"
    submit_to_code(options.repeats)
    waiting_to_code(options.repeats)
    if options.watch_seconds > 0:
        watch_cost(options.watch_seconds, options.watch_jobs)
    sharing(options.hold_seconds, options.baseline)
    fairness(options.fair_seconds, options.baseline)


if __name__ == "__main__":
    main()

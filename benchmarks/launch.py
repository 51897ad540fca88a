"""Launch costs and training throughput, side by side in one run, 2 ranks on this machine's CPU (gloo).

    python benchmarks/launch.py [--repeat 20] [--steps 300] [--min-runs 3] [--skip-accelerate]
                                [--dashboard-launches 200]
    python benchmarks/launch.py --only-dashboard     # the dashboard section alone

- cold: the first gpumagic launch in a fresh process (starts the forkserver, which imports torch);
- warm: later launches in the same process (a fork of the torch-loaded forkserver); target < 0.15 s;
- gpumagic with start_method=spawn, plain torch.multiprocessing.spawn of an importable function, and
  accelerate's notebook_launcher (fork), all running the same barrier job;
- the first DistributedDataParallel() in a rank of a warm relaunch (torch._dynamo preloaded in the forkserver)
  against the same call in a fresh process that has imported torch (it imports torch._dynamo then);
- steady-state DDP training throughput of one loop under gpumagic and under torchrun; target ratio >= 0.98;
- launch with dashboard: in a real ipykernel, ``%%launch_ddp -n 2 --gpus none`` with and without
  ``--no-dashboard`` (30 launches each after 3 warm-ups, interleaved, timed in the kernel); target: the
  dashboard adds < 20 ms to a launch. Then N launches with the dashboard (--dashboard-launches, 200): the
  kernel's RSS growth, target < 10 MB over 200 launches, and its live ipywidgets, target: no growth per launch.

Every launcher runs its ranks on the CPU with gloo, on a GPU machine too.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
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

# Defined in the kernel: each launch is its own execute request (one dashboard per cell, as in a notebook),
# timed inside the kernel around the magic alone.
KERNEL_HELPERS = """
import gc, time, warnings
import ipywidgets, psutil

def _launch_seconds(line):
    started = time.perf_counter()
    get_ipython().run_cell_magic("launch_ddp", line, "x = rank")
    return time.perf_counter() - started

def _widget_count():
    with warnings.catch_warnings():  # ipywidgets 8.1 deprecates Widget.widgets (the same dict as _instances)
        warnings.simplefilter("ignore", DeprecationWarning)
        return len(ipywidgets.Widget.widgets)

def _rss_mb():
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20

def _settle(most_s=5.0):
    # the dashboard's own thread may still be closing the last launch's widgets
    deadline, last = time.monotonic() + most_s, None
    while time.monotonic() < deadline and _widget_count() != last:
        last = _widget_count()
        time.sleep(0.5)
"""
WITH_DASHBOARD, WITHOUT_DASHBOARD = "-n 2 --gpus none", "-n 2 --gpus none --no-dashboard"
DASHBOARD_WARMUPS = 3


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


class _Kernel:
    """A real ipykernel (jupyter_client) with CPU ranks and a temporary runs directory; ``value(code, expr)``
    runs ``code``, then returns ``expr`` evaluated in the kernel. Every iopub message is read, so the kernel
    never waits on its output."""

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager

        self.runs = tempfile.mkdtemp(prefix="gpumagic-bench-runs-")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "GPUMAGIC_", "JPY_"))}
        env.update(CUDA_VISIBLE_DEVICES="", GPUMAGIC_RUNS_DIR=self.runs)
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(env=env, extra_arguments=["--HistoryManager.enabled=False"])
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def value(self, code: str, expression: str = "None") -> object:
        import ast

        reply = self.client.execute_interactive(
            code, timeout=300, output_hook=lambda message: None, user_expressions={"value": expression}
        )
        self.drain()  # messages of earlier cells (a dashboard's thread) that execute_interactive skipped
        content = reply["content"]
        if content["status"] != "ok":
            raise RuntimeError(f"{code!r} failed in the kernel: {content.get('ename')}: {content.get('evalue')}")
        result = content["user_expressions"]["value"]
        if result["status"] != "ok":
            raise RuntimeError(f"{expression!r} failed in the kernel: {result.get('ename')}: {result.get('evalue')}")
        return ast.literal_eval(result["data"]["text/plain"])

    def drain(self) -> None:
        while True:
            try:
                self.client.get_iopub_msg(timeout=0)
            except queue.Empty:
                return

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)
        shutil.rmtree(self.runs, ignore_errors=True)


def p95(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=20, method="inclusive")[18]


def dashboard_rows(launches: int, timed: int = 30) -> tuple[list[tuple[str, float, str]], list[str]]:
    """Rows and ratio lines of the launch-with-dashboard section (one real kernel)."""
    kernel = _Kernel()
    try:
        kernel.value("%load_ext gpumagic\n" + KERNEL_HELPERS)
        samples: dict[str, list[float]] = {WITH_DASHBOARD: [], WITHOUT_DASHBOARD: []}
        for number in range(DASHBOARD_WARMUPS + timed):
            order = (WITH_DASHBOARD, WITHOUT_DASHBOARD) if number % 2 else (WITHOUT_DASHBOARD, WITH_DASHBOARD)
            for line in order:  # interleaved, each first in turn, so drift of the machine hits both alike
                seconds = kernel.value(f"_t = _launch_seconds({line!r})", "_t")
                if number >= DASHBOARD_WARMUPS:
                    samples[line].append(seconds)
        kernel.value("_settle()")
        rss_before, widgets_before = kernel.value("", "(_rss_mb(), _widget_count())")
        for _ in range(launches):
            kernel.value(f"_launch_seconds({WITH_DASHBOARD!r})")
        kernel.value("_settle()")
        rss_after, widgets_after = kernel.value("", "(_rss_mb(), _widget_count())")
    finally:
        kernel.close()

    ms = {line: [1000 * s for s in values] for line, values in samples.items()}
    added = statistics.median(ms[WITH_DASHBOARD]) - statistics.median(ms[WITHOUT_DASHBOARD])
    growth = rss_after - rss_before
    rows = [
        ("%%launch_ddp -n 2 in a kernel, with dashboard (median)", statistics.median(ms[WITH_DASHBOARD]), "ms"),
        ("%%launch_ddp -n 2 in a kernel, with dashboard (p95)", p95(ms[WITH_DASHBOARD]), "ms"),
        ("same with --no-dashboard (median)", statistics.median(ms[WITHOUT_DASHBOARD]), "ms"),
        ("same with --no-dashboard (p95)", p95(ms[WITHOUT_DASHBOARD]), "ms"),
        ("the dashboard adds to a launch (difference of medians)", added, "ms"),
        (f"kernel RSS before {launches} launches with dashboard", rss_before, "MB"),
        (f"kernel RSS after {launches} launches with dashboard", rss_after, "MB"),
        (f"kernel RSS growth over {launches} launches", growth, "MB"),
        (f"live ipywidgets before {launches} launches", widgets_before, "widgets"),
        (f"live ipywidgets after {launches} launches", widgets_after, "widgets"),
    ]
    per_launch = (widgets_after - widgets_before) / launches if launches else 0.0
    over_200 = growth * 200 / launches if launches else 0.0
    scaled = "" if launches == 200 else f", scaled from {launches} launches: {over_200:.2f} MB"
    lines = [
        f"the dashboard adds {added:.1f} ms to a launch; / 20 ms target: {added / 20:.2f}",
        f"kernel RSS growth per 200 launches / 10 MB target: {over_200 / 10:.2f}{scaled}",
        f"live ipywidgets per launch: {per_launch:+.2f} (target: no growth)",
    ]
    return rows, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cold-runs", type=int, default=3)
    parser.add_argument("--throughput-runs", type=int, default=3)
    parser.add_argument("--skip-accelerate", action="store_true")
    parser.add_argument("--min-runs", type=int, default=3, help="the fewest runs of each slow launcher (a median)")
    parser.add_argument("--dashboard-launches", type=int, default=200, metavar="N", help="RSS/widget growth over N")
    parser.add_argument("--dashboard-timed", type=int, default=30, metavar="N", help="launches timed each way")
    parser.add_argument("--skip-dashboard", action="store_true", help="no launch-with-dashboard section")
    parser.add_argument("--only-dashboard", action="store_true", help="the launch-with-dashboard section alone")
    options = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo for every launcher, also on a GPU machine
    if options.only_dashboard:
        rows, lines = dashboard_rows(options.dashboard_launches, options.dashboard_timed)
        print_rows(rows)
        print("\n" + "\n".join(lines))
        return

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
    slow_runs = max(options.min_runs, options.repeat // 4)  # the slower launchers, fewer times
    spawned = timed(
        lambda: gpumagic.launch_ddp(join_group_and_leave, 2, output="none", start_method="spawn"),
        slow_runs,
    )
    rows.append(("gpumagic with start_method=spawn", statistics.median(spawned), "s"))

    in_rank = [gpumagic.launch_ddp(first_ddp_seconds, 2, output="none")[0] for _ in range(slow_runs)]
    fresh = [first_ddp_seconds_in_a_fresh_process() for _ in range(options.cold_runs)]
    rows.append(("first DDP() in a rank of a warm relaunch", statistics.median(in_rank), "s"))
    rows.append(("first DDP() in a fresh process with torch imported", statistics.median(fresh), "s"))

    def plain_spawn() -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        mp.spawn(join_group_and_leave, args=(2,), nprocs=2, join=True)

    rows.append(
        (
            "torch.multiprocessing.spawn, importable function",
            statistics.median(timed(plain_spawn, slow_runs)),
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
                    statistics.median(timed(launch_accelerate, slow_runs)),
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

    dashboard_lines: list[str] = []
    launch_rows = len(rows)
    if not options.skip_dashboard:
        more, dashboard_lines = dashboard_rows(options.dashboard_launches, options.dashboard_timed)
        rows += more

    print_rows(rows)
    rows = rows[:launch_rows]
    warm_median = rows[1][1]
    print(f"\nwarm relaunch / 0.15 s target: {warm_median / 0.15:.2f}")
    print(f"warm relaunch vs torch.multiprocessing.spawn: {rows[5][1] / warm_median:.1f}x faster")
    print(f"first DDP() in a rank / in a fresh process: {rows[3][1] / rows[4][1]:.3f}")
    print(f"throughput gpumagic / torchrun: {statistics.median(ours) / statistics.median(theirs):.3f} (target >= 0.98)")
    for line in dashboard_lines:
        print(line)
    if accelerate_note:
        print(accelerate_note)


def print_rows(rows: list[tuple[str, float, str]]) -> None:
    width = max(len(name) for name, _, _ in rows)
    for name, value, unit in rows:
        figure = f"{value:>10d}" if isinstance(value, int) else f"{value:>10.3f}"
        print(f"{name:<{width}}  {figure} {unit}")


if __name__ == "__main__":
    main()

"""The live dashboards' cost in the kernel, side by side in one run.

    python benchmarks/dashboards.py [--seconds 30] [--baseline REV]

- kernel CPU, % of one core, measured from outside (psutil) on a real kernel: idle, then while ``%gpu watch``
  streams 8 simulated GPUs at 2 Hz (target: the dashboard's own share <= 2 %), then at 10 Hz; with
  ``--baseline REV``, the same for gpumagic as it was at that git revision, side by side;
- a page that connects (a reload, a reopened notebook) gets the plots whole: the time to serialize them with
  the full history (600 samples of 8 GPUs), during which the pusher waits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def kernel_cpu(seconds: float, baseline: str | None = None) -> None:
    from kernel_cpu import measured_kernel

    env = dict(os.environ, GPUMAGIC_SIMULATE="8xH100-80GB", GPUMAGIC_LEASE_DIR=tempfile.mkdtemp())
    label = "this checkout"
    if baseline is not None:  # that revision's package, first on the kernel's path
        import subprocess

        where = tempfile.mkdtemp(prefix="gpumagic-baseline-")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        archive = subprocess.run(
            ["git", "-C", root, "archive", baseline, "gpumagic"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
        env["PYTHONPATH"] = where
        label = f"gpumagic at {baseline}"
    with measured_kernel(env) as kernel:
        kernel.run("%load_ext gpumagic")
        time.sleep(1.0)
        idle = kernel.cpu_percent_over(seconds)
        kernel.run("watch = %gpu watch --interval 0.5")
        time.sleep(3.0)  # past the start and the one catch-up re-send
        at_2hz = kernel.cpu_percent_over(seconds)
        kernel.run("watch.close()\nwatch = %gpu watch --interval 0.1")
        time.sleep(3.0)
        at_10hz = kernel.cpu_percent_over(seconds)
        kernel.run("watch.close()")
    print(f"{label}: kernel CPU, % of one core, over {seconds:g} s each (8 simulated GPUs):")
    print(f"  idle kernel                      {idle:6.2f}")
    print(
        f"  %gpu watch at 2 Hz               {at_2hz:6.2f}   the dashboard's own share {at_2hz - idle:.2f}"
        " (target <= 2)"
    )
    print(f"  %gpu watch at 10 Hz              {at_10hz:6.2f}   the dashboard's own share {at_10hz - idle:.2f}")


def page_connects() -> None:
    os.environ["GPUMAGIC_SIMULATE"] = "8xH100-80GB"
    from gpumagic.widgets.gpu_watch import GpuWatch

    watch = GpuWatch(interval=0.01, history=600, push_interval=0.05)
    while len(watch.series(0, "time")) < 600:
        time.sleep(0.1)
    watch.stop()
    times = []
    for _ in range(20):
        began = time.perf_counter()
        state = watch.plots.get_state()
        times.append(time.perf_counter() - began)
    size = len(state["render_bundle"])
    print(
        "a page connecting: the plots with 600 samples of 8 GPUs serialized in "
        f"{statistics.median(times) * 1000:.1f} ms (median of 20), {size / 1e6:.2f} MB of state"
    )
    watch.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--baseline", metavar="REV", help="also measure gpumagic as it was at this git revision")
    options = parser.parse_args()
    if options.baseline:
        kernel_cpu(options.seconds, options.baseline)
    kernel_cpu(options.seconds)
    page_connects()


if __name__ == "__main__":
    main()

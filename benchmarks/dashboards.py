"""The live dashboards' cost in the kernel, side by side in one run.

    python benchmarks/dashboards.py [--seconds 30] [--baseline REV]

- kernel CPU, % of one core, measured from outside (psutil) on a real kernel: idle, then while ``%gpu watch``
  streams 8 simulated GPUs at 2 Hz (target: the dashboard's own share <= 2 %), then at 10 Hz; with
  ``--baseline REV``, the same for gpumagic as it was at that git revision, side by side;
- a page that connects (a reload, a reopened notebook) gets the plots whole: the time to serialize them with
  the full history (600 samples of 8 GPUs), during which the pusher waits;
- the still picture that stands in where the rich view cannot draw (issue 38): kernel CPU during a 2-rank
  launch logging 100 steps/s per rank, its dashboard with the picture (no page has said its plots drew: a
  blocking cell, a JupyterHub without jupyter_bokeh) and without (the page said "rich"), side by side; the
  picture's share is the difference (target <= 2 % of one core at 1 Hz).
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


STILL_LAUNCH = (
    "%%launch_ddp -n 2 --no-wait --gpus none\nimport time\n"
    "for step in range(10_000_000):\n    gpumagic.log(step=step, loss=1.0 / (step + 1) + rank)\n    time.sleep(0.01)\n"
)


def still_picture_cost(seconds: float) -> None:
    from kernel_cpu import measured_kernel

    def ask(kernel, expression: str) -> str:
        said: list[str] = []

        def hook(message: dict) -> None:
            if message["msg_type"] == "stream":
                said.append(message["content"]["text"])

        kernel.client.execute_interactive(f"print({expression})", timeout=60, output_hook=hook)
        return "".join(said).strip()

    env = dict(
        os.environ,
        GPUMAGIC_LEASE_DIR=tempfile.mkdtemp(),
        GPUMAGIC_RUNS_DIR=tempfile.mkdtemp(prefix="gpumagic-bench-runs-"),
        CUDA_VISIBLE_DEVICES="",
    )
    results = {}
    with measured_kernel(env) as kernel:
        kernel.run("%load_ext gpumagic\nimport gpumagic\nfrom gpumagic.launch.kernel_side.session import SESSION")
        for case in ("rich view only", "with the picture"):
            kernel.run(STILL_LAUNCH)
            deadline = time.monotonic() + 60
            while ask(kernel, "SESSION.last_dashboard.plots is not None") != "True":
                if time.monotonic() > deadline:
                    raise SystemExit("the launch's dashboard never went live")
                time.sleep(0.2)
            if case == "rich view only":  # what ipywidgets does with the page's answer (FRAME_JS)
                kernel.run("SESSION.last_dashboard._frame.answer.set_state({'value': 'rich'})")
            time.sleep(2.0)
            before = int(ask(kernel, "SESSION.last_dashboard._frame.stills"))
            cpu = kernel.cpu_percent_over(seconds)
            drawn = int(ask(kernel, "SESSION.last_dashboard._frame.stills")) - before
            points = ask(kernel, "SESSION.last_dashboard.points")
            results[case] = (cpu, drawn, points)
            kernel.run("SESSION.last_dashboard.cancel.set()")
            while ask(kernel, "SESSION.last_dashboard.running") != "False":
                time.sleep(0.2)
    print(f"a launch dashboard, 2 ranks logging 100 steps/s each: kernel CPU, % of one core, over {seconds:g} s")
    for case, (cpu, drawn, points) in results.items():
        print(f"  {case:<18} {cpu:6.2f}   pictures drawn {drawn} ({drawn / seconds:.2f}/s), {points} points")
    share = results["with the picture"][0] - results["rich view only"][0]
    print(f"  the picture's share {share:.2f} % of one core (target <= 2)")


def picture_draw_time() -> None:
    """The still picture of a full launch dashboard: 8 ranks, a loss of 2,000 points each (raw and smoothed,
    linear and log tabs) and 600 resource samples each."""
    import threading

    from gpumagic.widgets.launch_dashboard import LaunchDashboard
    from gpumagic.widgets.picture import picture_of

    dashboard = LaunchDashboard(history=2000)
    dashboard.nprocs = 8
    dashboard._samples = {
        rank: {"time": [0.5 * i for i in range(600)], "memory": [100.0 + i for i in range(600)], "busy": [50.0] * 600}
        for rank in range(8)
    }
    dashboard._build_figures()
    for rank in range(8):
        dashboard._add_metric("loss", rank, list(range(2000)), [1.0 / (i + 1) + rank for i in range(2000)])
    lock = threading.RLock()
    times = []
    for _ in range(20):
        began = time.perf_counter()
        picture = picture_of(dashboard.layout, lock)
        times.append(time.perf_counter() - began)
    print(
        "the still picture of a dashboard of 8 ranks (2,000 loss points and 600 samples each): drawn in "
        f"{statistics.median(times) * 1000:.1f} ms (median of 20), {len(picture) / 1000:.0f} kB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--baseline", metavar="REV", help="also measure gpumagic as it was at this git revision")
    parser.add_argument("--still-seconds", type=float, default=20.0, help="the still picture's cost; 0 skips it")
    parser.add_argument("--skip-watch", action="store_true", help="measure the still picture only")
    options = parser.parse_args()
    if not options.skip_watch:
        if options.baseline:
            kernel_cpu(options.seconds, options.baseline)
        kernel_cpu(options.seconds)
        page_connects()
    picture_draw_time()
    if options.still_seconds > 0:
        still_picture_cost(options.still_seconds)


if __name__ == "__main__":
    main()

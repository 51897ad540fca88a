"""What tracking costs (issue #43), measured side by side in one run.

    python benchmarks/tracking.py [--calls 200000] [--rounds 3] [--points 100000] [--launches 3]
                                  [--kinds tensorboard,mlflow,wandb]

1. ``gpumagic.log`` per call in a launched rank, with nothing tracked and with the launch exported to
   TensorBoard, MLflow (a file store) and W&B (offline) at once by the kernel, in alternating rounds. The ranks
   never talk to a tracker: the kernel reads their files.
2. How fast the exporter sends points to each tracker (a run of ``--points`` points per rank, 2 ranks).
3. What a launch's end costs with an MLflow server that refuses connections, and with one that takes them and
   never answers (the end waits ``GPUMAGIC_TRACK_TIMEOUT``, 3 s, then names it), against nothing tracked.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from telemetry import per_call_us


def log_cost_in_a_rank(calls: int, trackers: int) -> float:
    """Measured once the kernel's exporters are up (``run.json`` names each tracker's run): their start (importing
    mlflow and wandb, W&B's service) is a second or two of CPU at a launch's start, not its steady cost."""
    import json
    import os
    import time

    import gpumagic

    record = os.path.join(os.environ["GPUMAGIC_RUN_DIR"], "run.json")
    deadline = time.monotonic() + 60
    while len(json.load(open(record)).get("tracking") or {}) < trackers and time.monotonic() < deadline:
        gpumagic.log(loss=0.0)  # points for the exporters to send while they open
        time.sleep(0.05)
    log = gpumagic.log
    return per_call_us(lambda i: log(loss=i * 0.5), calls)


def quick_rank() -> int:
    import gpumagic

    gpumagic.log(0, loss=1.0)
    return 0


def choose(kinds: list[str], base: Path, mlflow_uri: str | None = None) -> None:
    from gpumagic.telemetry import tracking

    tracking.track(None)
    for kind in kinds:
        if kind == "tensorboard":
            tracking.track("tensorboard", logdir=str(base / "tb"))
        elif kind == "mlflow":
            tracking.track("mlflow", tracking_uri=mlflow_uri or str(base / "mlruns"))
        else:
            tracking.track("wandb", project="bench", mode="offline", dir=str(base / "wb"))


def log_cost(base: Path, calls: int, rounds: int, kinds: list[str]) -> None:
    import gpumagic

    os.environ["GPUMAGIC_TRACK_TIMEOUT"] = "600"  # each launch's end waits for its export: none runs on behind

    costs: dict[str, list[float]] = {"nothing tracked": [], f"exported to {' + '.join(kinds)}": []}
    for round_number in range(rounds):
        order = list(costs) if round_number % 2 == 0 else list(reversed(costs))  # each first in every other round
        for label in order:
            tracked = [] if label == "nothing tracked" else kinds
            choose(tracked, base)
            arguments = (calls, len(tracked))
            costs[label].append(gpumagic.launch_ddp(log_cost_in_a_rank, 1, arguments, gpus="none", output="none")[0])
    del os.environ["GPUMAGIC_TRACK_TIMEOUT"]
    print(f"gpumagic.log in a launched rank, µs per call (median of {rounds} launches of {calls:,} calls; tracked:")
    print("  measured once the kernel's exporters had opened their runs)")
    medians = {label: statistics.median(values) for label, values in costs.items()}
    for label, value in medians.items():
        print(f"  {label:<50} {value:6.2f}   (each: {', '.join(f'{v:.2f}' for v in costs[label])})")
    untracked, tracked = medians.values()
    print(f"  ratio tracked / untracked: {tracked / untracked:.3f}\n")


def export_rate(base: Path, points: int, kinds: list[str]) -> None:
    from gpumagic.run_dirs import store
    from gpumagic.telemetry import exporting, tracking
    from gpumagic.telemetry.log import Recorder

    print(f"the exporter's pace: a run of 2 ranks x {points:,} points, sent after it ended")
    for kind in kinds:
        run = store.new_run("ddp", ranks=2)
        recorders = [Recorder(run, rank) for rank in range(2)]
        for step in range(points):  # the ranks in step, as DDP keeps them
            now = time.time()
            for recorder in recorders:
                recorder.points.extend((now, step, recorder.name_id("loss"), 1.0 / (step + 1)))
        for recorder in recorders:
            recorder.close()
        store.finish_run(run, "finished")
        choose([kind], base)
        began = time.perf_counter()
        lines = exporting.Export(run, tracking.trackers(), exporting._described(run, {}, "ddp", {}, None))
        problems = lines.start().finish("finished", 600)
        took = time.perf_counter() - began
        said = f"   ({problems[0]})" if problems else ""
        print(f"  {kind:<12} {took:7.2f} s   {2 * points / took:>10,.0f} points/s{said}")
    print()


def launch_end(base: Path, launches: int) -> None:
    import gpumagic

    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # takes connections (the kernel's backlog) and never answers
    cases = {
        "nothing tracked": None,
        "MLflow refusing connections": f"http://127.0.0.1:{refused.getsockname()[1]}",
        "MLflow taking connections, never answering": f"http://127.0.0.1:{silent.getsockname()[1]}",
    }
    times: dict[str, list[float]] = {label: [] for label in cases}
    choose([], base)
    gpumagic.launch_ddp(quick_rank, 1, gpus="none", output="none")  # the rank server's start is not measured
    first = "mlflow" not in sys.modules
    choose(["mlflow"], base, cases["MLflow refusing connections"])
    began = time.perf_counter()
    gpumagic.launch_ddp(quick_rank, 1, gpus="none", output="none")
    imported = time.perf_counter() - began  # the end waits for the tracker's package to be imported, once
    for round_number in range(launches):
        order = list(cases) if round_number % 2 == 0 else list(reversed(cases))
        for label in order:
            choose([] if cases[label] is None else ["mlflow"], base, cases[label])
            began = time.perf_counter()
            gpumagic.launch_ddp(quick_rank, 1, gpus="none", output="none")
            times[label].append(time.perf_counter() - began)
    print(f"a launch of 1 rank from start to return, median of {launches} (s)")
    baseline = statistics.median(times["nothing tracked"])
    for label, values in times.items():
        value = statistics.median(values)
        print(f"  {label:<45} {value:6.2f}   adds {value - baseline:+.2f} s")
    if first:
        print(f"  (the first launch tracked to MLflow in this process, importing mlflow: {imported:.2f} s)")
    refused.close()
    silent.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--kinds", default="tensorboard,mlflow,wandb", help="the trackers of parts 1 and 2")
    options = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gpumagic-bench-tracking-"))
    os.environ["GPUMAGIC_RUNS_DIR"] = str(base / "runs")
    os.environ.setdefault("WANDB_CACHE_DIR", str(base / "wandb-cache"))
    os.environ.setdefault("WANDB_CONFIG_DIR", str(base / "wandb-config"))
    os.environ.setdefault("WANDB_DATA_DIR", str(base / "wandb-data"))
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    kinds = [kind.strip() for kind in options.kinds.split(",") if kind.strip()]
    log_cost(base, options.calls, options.rounds, kinds)
    export_rate(base, options.points, kinds)
    launch_end(base, options.launches)
    print(f"(python {sys.version.split()[0]}; files in {base})")


if __name__ == "__main__":
    main()

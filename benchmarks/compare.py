"""The comparison of runs (``gpumagic.compare``) at scale, in the kernel's process.

    python benchmarks/compare.py [--runs 1000] [--points 1000] [--repeat 3]

Writes ``--runs`` finished runs of ``--points`` points of two metrics (loss, acc) each, with the real writers
(a run directory and a ``Recorder``, as a training process writes them), over a grid of hyperparameters. Then,
median of ``--repeat``:

- read: ``gpumagic.compare(runs)`` from disk (every run's record and metrics; the table's rows);
- build: the view (``comparison.widget``): the Bokeh document (table, parallel coordinates, thinned curves),
  serialized once (its render bundle), and the ipywidgets around it;
- render: what a page showing it receives: the widget's state as JSON (``get_state``, what ipywidgets sends),
  and, for comparison, the same document through ``bokeh.embed.json_item``;

and build + render against the target of 1 s for 1,000 runs of 1,000 points.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from array import array

TARGET_S = 1.0


def write_runs(count: int, points: int) -> list:
    from gpumagic.run_dirs import store
    from gpumagic.telemetry.log import Recorder

    now = time.time()
    runs = []
    for i in range(count):
        lr, width = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2][i % 5], [32, 64, 128][(i // 5) % 3]
        params = {"lr": str(lr), "width": str(width), "opt": ["adam", "sgd"][(i // 15) % 2], "seed": str(i // 30)}
        path = store.new_run("kernel", params=params)
        recorder = Recorder(path, 0)
        loss, acc = recorder.name_id("loss"), recorder.name_id("acc")
        rows = array("d")
        for step in range(points):
            rows.extend(
                (now + step, step, loss, lr * width / (step + 1) + i / 1e4, now + step, step, acc, step / points)
            )
        recorder.points = rows
        recorder.close()
        store.finish_run(path, "finished")
        runs.append(path)
    return runs


def timed(function, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        began = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - began)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--points", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ["GPUMAGIC_RUNS_DIR"] = tempfile.mkdtemp(prefix="gpumagic-compare-bench-")
    os.environ.setdefault("GPUMAGIC_LEASE_DIR", tempfile.mkdtemp(prefix="gpumagic-compare-leases-"))
    import gpumagic
    from gpumagic.run_dirs.store import list_runs

    began = time.perf_counter()
    write_runs(args.runs, args.points)
    print(f"wrote {args.runs} runs x {args.points} points x 2 metrics in {time.perf_counter() - began:.1f} s")
    runs = list_runs()
    gpumagic.compare(runs[:5]).widget  # noqa: B018 - imports bokeh, ipywidgets, numpy once, outside the figures

    read_s, comparison = timed(lambda: gpumagic.compare(runs), args.repeat)

    def build():
        comparison.close()
        return comparison.widget

    build_s, _ = timed(build, args.repeat)
    model = comparison._model
    state_s, state = timed(lambda: model.get_state()["render_bundle"], args.repeat)
    from bokeh.embed import json_item

    layout = comparison.layout()
    embed_s, _ = timed(lambda: json_item(layout), args.repeat)
    size = len(state) if isinstance(state, (str, bytes)) else len(str(state))
    drawn = sum(len(xs) for source in comparison.curve_sources.values() for xs in source.data["xs"])
    logged = args.runs * args.points * len(comparison.metrics)
    total = build_s + state_s
    print(f"{args.runs} runs x {args.points} points, median of {args.repeat}:")
    print(f"  read from disk (gpumagic.compare)      {read_s * 1000:8.0f} ms")
    print(f"  build the view (Bokeh + ipywidgets)    {build_s * 1000:8.0f} ms")
    print(f"  first render: widget state serialized  {state_s * 1000:8.0f} ms   {size / 1e6:.1f} MB")
    print(f"  first render: bokeh.embed.json_item    {embed_s * 1000:8.0f} ms")
    print(f"  points drawn / logged                  {drawn:8d} / {logged} ({drawn / logged:.1%})")
    ratio = total / TARGET_S
    print(f"  build and first render                 {total * 1000:8.0f} ms   ratio to the 1 s target {ratio:.2f}")
    print(f"  with the read from disk                {(read_s + total) * 1000:8.0f} ms")
    comparison.close()


if __name__ == "__main__":
    main()

"""The steady-state cost of hang triage (``--hang-after``), on against off, side by side in one run, 2 ranks on
the CPU (gloo).

    python benchmarks/hang_watch.py [--rounds 8] [--steps 120] [--calls 1000] [--cells 1000] [--quick] [--no-fill]

``hang_after="10s"`` (on, the default) against ``hang_after=0`` (off). On, each rank sets torch's flight recorder
to 2,000 entries (torch 2.13's default too: off, the ranks have one as well), wraps ``torch.distributed``'s
collectives with ``CollectiveRecorder`` (written into a mapped file; its cost per call is measured alone) and runs
a watch thread that looks every 0.25 s (the recorder's call, the default group's sequence number; torch's flight
recorder only once that number has stood still past the threshold); the launcher polls the run directory.
Every measure rotates off, on and off again, each first in turn, so drift of the machine hits all alike.

- DDP training: one ``launch_ddp`` per setting and round (start-up not timed). Each rank first fills torch's
  flight recorder to its 2,000 entries (barriers on a group of the rank alone: a run past ~1,000 DDP steps has a
  full one, and the watch's read grows with it; ``--no-fill`` skips this), then trains a 3-layer MLP (~2.1M
  parameters, batch 32) ``--steps`` steps after warm-up: steps/s from the median step, the slowest rank's.
  Then ``--calls`` explicit ``dist.all_reduce`` of 256 floats (the Python-level path the recorder wraps):
  calls/s from the median call. Then the time of one look of the watch (``HangWatch.waiting``, 4 times a
  second) and of one read of torch's flight recorder (``hang_watch.in_flight``, which the watch does only when
  collectives stop) with the recorder as it is.
- a trivial ``%%ddp`` cell: ``group.exec("1")`` on one persistent group per setting, all open, ``--cells``
  timed each after warm-up, in rotating chunks of ``--chunk``: median and p90. Then, per round, a cell of
  ``--cell-calls`` ``dist.all_reduce`` of 256 floats, calls/s from the median call (a group's ranks wrap
  collectives either way, for their sync points: on adds the mapped file, the watch thread and the flight
  recorder's reads).
- ``CollectiveRecorder`` alone in this process, around a no-op, per call.

Per measure: the median over rounds off and on, on/off of those medians, off again/off (the same setting run a
second time in every round: how far noise alone moves a ratio on this machine), and the spread of the per-round
(or per-chunk) on/off ratios: min..max and their interquartile range. Target: on within 1 % of off, or no
further from it than off is from itself.

Every rank runs on the CPU with gloo, on a GPU machine too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import timeit
from importlib.metadata import version
from pathlib import Path
from typing import Any

SETTINGS = {"off": 0, "on": "10s", "off again": 0}  # off against itself: how far noise alone moves a ratio
WIDTH, BATCH = 1024, 32  # 3 Linear layers: 2 x 1024^2 + 1024 x 10, ~2.1M parameters
SMALL = 256  # floats in each explicit all_reduce
FILL = 2000  # torch's flight recorder's entries (TORCH_FR_BUFFER_SIZE: hang triage's, and torch 2.13's default)

CELL_ALL_REDUCES = (
    f"import statistics\nt = torch.ones({SMALL})\nfor _ in range(50):\n    dist.all_reduce(t)\ndist.barrier()\n"
    "took = []\nfor _ in range(n):\n    began = time.perf_counter()\n    dist.all_reduce(t)\n"
    "    took.append(time.perf_counter() - began)\n1 / statistics.median(took)"
)
CELL_FILL = (
    "import os, threading, time, torch\n"
    "own, _ = dist.new_subgroups(group_size=1)\nfor _ in range(fill):\n    dist.barrier(group=own)\n"
    "(os.environ.get('TORCH_FR_BUFFER_SIZE'), getattr(dist.all_reduce, '_gpumagic_replaced', False), "
    "any(t.name == 'gpumagic-hang-watch' for t in threading.enumerate()))"
)


def train_and_all_reduce(steps: int, warmup: int, calls: int, fill: int) -> dict[str, Any]:
    """In one rank of a launch: the flight recorder filled with ``fill`` entries, DDP steps/s after ``warmup``
    steps, explicit all_reduces/s, one look of the hang watch (ms); and what of the hang triage runs here (the
    flight recorder's size variable, whether all_reduce is wrapped, the watch thread)."""
    import threading

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gpumagic.launch.rank_side.hang_watch import HangWatch, in_flight
    from gpumagic.run_dirs.layout import RunFiles

    if fill:
        own, _ = dist.new_subgroups(group_size=1)
        for _ in range(fill):
            dist.barrier(group=own)
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 10)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    dist.barrier()
    step_times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - began)
    dist.barrier()
    steps_per_s = 1 / statistics.median(step_times)  # the median step: a 2-core machine's hiccups left out

    t = torch.ones(SMALL)
    for _ in range(50):
        dist.all_reduce(t)
    dist.barrier()
    call_times = []
    for _ in range(calls):
        began = time.perf_counter()
        dist.all_reduce(t)
        call_times.append(time.perf_counter() - began)
    all_reduces_per_s = 1 / statistics.median(call_times)
    dist.barrier()

    paired = None  # with the recorder on: the same calls through it and around it, in alternating blocks
    original = getattr(dist.all_reduce, "__wrapped__", None)
    if original is not None:
        through, around = [], []
        for block in range(max(2, 2 * (calls // 50))):
            function, times = (dist.all_reduce, through) if block % 2 == 0 else (original, around)
            for _ in range(50):
                began = time.perf_counter()
                function(t)
                times.append(time.perf_counter() - began)
        paired = (statistics.median(around), statistics.median(through))
    dist.barrier()

    started = time.perf_counter()
    for _ in range(3):
        in_flight()
    read = (time.perf_counter() - started) / 3
    watch = HangWatch(RunFiles(os.environ["GPUMAGIC_RUN_DIR"]), dist.get_rank(), 10.0)  # not started: timed here
    started = time.perf_counter()
    for _ in range(1000):
        watch.waiting()
    look = (time.perf_counter() - started) / 1000
    return {
        "steps": steps_per_s,
        "all_reduces": all_reduces_per_s,
        "look": look,
        "read": read,
        "paired": paired,
        "parameters": sum(p.numel() for p in model.parameters()),
        "runs": (
            os.environ.get("TORCH_FR_BUFFER_SIZE"),
            getattr(dist.all_reduce, "_gpumagic_replaced", False),
            any(thread.name == "gpumagic-hang-watch" for thread in threading.enumerate()),
        ),
    }


def quiet(text: str) -> None:
    """Where rank output and gpumagic's notes go: nowhere (the figures are this benchmark's output)."""


def orders(rounds: int) -> list[tuple[str, ...]]:
    """Each round's order of the settings, rotated from round to round (each goes first in turn)."""
    names = list(SETTINGS)
    return [tuple(names[number % len(names) :] + names[: number % len(names)]) for number in range(rounds)]


def quartiles(ratios: list[float]) -> tuple[float, float]:
    """The first and third quartiles of per-round ratios (their min and max with fewer than 4)."""
    if len(ratios) < 4:
        return min(ratios), max(ratios)
    first, _, third = statistics.quantiles(ratios, n=4, method="inclusive")
    return first, third


def spread(ratios: list[float]) -> str:
    if len(ratios) < 4:
        return f"{min(ratios):.3f}..{max(ratios):.3f}"
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{min(ratios):.3f}..{max(ratios):.3f} (IQR {quartiles[0]:.3f}..{quartiles[2]:.3f})"


def ratio_row(
    name: str, off: list[float], on: list[float], again: list[float], figure: str, slower: str
) -> tuple[str, ...]:
    """A measure's row: median off, median on, on/off of the medians, off again/off (the noise), spread of the
    per-round on/off ratios; ``slower`` says which way is worse (``higher`` for times, ``lower`` for rates)."""
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    median_off = statistics.median(off)
    return (
        name,
        figure.format(median_off),
        figure.format(statistics.median(on)),
        f"{statistics.median(on) / median_off:.3f}",
        f"{statistics.median(again) / median_off:.3f}",
        spread(ratios),
        slower,
        quartiles(ratios),
    )


def runs(seen: set) -> str:
    return " / ".join(str(found) for found in sorted(seen, key=str))


def launch_rows(options: argparse.Namespace) -> tuple[list[tuple[str, ...]], dict[str, str]]:
    """DDP training and explicit all_reduces, one launch per setting and round."""
    import gpumagic

    def launch(setting: str, steps: int, warmup: int, calls: int, fill: int) -> dict[int, dict[str, Any]]:
        return gpumagic.launch_ddp(
            train_and_all_reduce,
            2,
            args=(steps, warmup, calls, fill),
            gpus="none",
            output="none",
            write=quiet,
            hang_after=SETTINGS[setting],
        )

    started = time.perf_counter()
    for setting in SETTINGS:  # the forkserver's start, and each setting's first launch: not timed
        launch(setting, 2, 2, 10, 0)
    first = time.perf_counter() - started
    measures = ("steps", "all_reduces", "look", "read")
    per_round: dict[str, dict[str, list[float]]] = {s: {m: [] for m in measures} for s in SETTINGS}
    seen: dict[str, set] = {s: set() for s in SETTINGS}
    paired: list[tuple[float, float]] = []
    parameters = 0
    for order in orders(options.rounds):
        for setting in order:
            result = launch(setting, options.steps, options.warmup, options.calls, options.fill)
            for measure in ("steps", "all_reduces"):
                per_round[setting][measure].append(min(r[measure] for r in result.values()))
            per_round[setting]["look"].append(max(r["look"] for r in result.values()))
            per_round[setting]["read"].append(max(r["read"] for r in result.values()))
            seen[setting].update(r["runs"] for r in result.values())
            if setting == "on":
                paired.extend(r["paired"] for r in result.values())
            parameters = result[0]["parameters"]
    rows = [
        ratio_row(
            f"DDP training, MLP {parameters / 1e6:.1f}M params, batch {BATCH} (steps/s)",
            per_round["off"]["steps"],
            per_round["on"]["steps"],
            per_round["off again"]["steps"],
            "{:.1f}",
            "lower",
        ),
        ratio_row(
            f"dist.all_reduce of {SMALL} floats in a launch (calls/s)",
            per_round["off"]["all_reduces"],
            per_round["on"]["all_reduces"],
            per_round["off again"]["all_reduces"],
            "{:.0f}",
            "lower",
        ),
    ]
    off, on = (statistics.median(per_round[s]["all_reduces"]) for s in ("off", "on"))
    around, through = (statistics.median(pair[i] for pair in paired) for i in (0, 1))
    looks = [look for setting in SETTINGS for look in per_round[setting]["look"]]
    reads = [read for setting in SETTINGS for read in per_round[setting]["read"]]
    recorder = f"{FILL} entries and more" if options.fill else "not filled first"
    notes = {
        "first launches (forkserver start, each setting once)": f"{first:.1f} s",
        "all_reduce in a launch, on: the same rank's calls around the recorder and through it (median)": (
            f"{around * 1e6:.1f} us and {through * 1e6:.1f} us: the recorder adds {(through - around) * 1e6:+.1f} us"
        ),
        "all_reduce in a launch: on adds per call (from the medians)": f"{(1 / on - 1 / off) * 1e6:+.1f} us "
        f"(of {1e6 / off:.0f} us)",
        "one look of the hang watch while collectives go on (median, slowest rank)": (
            f"{statistics.median(looks) * 1e6:.1f} us; 4 a second: {statistics.median(looks) * 400:.4f} % of a core"
        ),
        f"one read of torch's flight recorder, {recorder} (only when the sequence number stands still)": (
            f"{statistics.median(reads) * 1000:.2f} ms"
        ),
        "in the launches' ranks, off: (TORCH_FR_BUFFER_SIZE, all_reduce wrapped, watch thread)": runs(
            seen["off"] | seen["off again"]
        ),
        "in the launches' ranks, on: (TORCH_FR_BUFFER_SIZE, all_reduce wrapped, watch thread)": runs(seen["on"]),
    }
    return rows, notes


def group_rows(options: argparse.Namespace) -> tuple[list[tuple[str, ...]], dict[str, str]]:
    """A trivial ``%%ddp`` cell, and all_reduces in a cell, on one persistent group per setting."""
    import gpumagic

    started = time.perf_counter()
    groups = {s: gpumagic.ranks(2, gpus="none", output="none", write=quiet, hang_after=v) for s, v in SETTINGS.items()}
    try:
        found = {s: group.exec(CELL_FILL, namespace={"fill": options.fill}) for s, group in groups.items()}
        opened = time.perf_counter() - started
        for group in groups.values():
            for _ in range(options.cell_warmup):
                group.exec("1", namespace={})
        cells: dict[str, list[float]] = {s: [] for s in SETTINGS}
        chunk_medians: dict[str, list[float]] = {s: [] for s in SETTINGS}
        for order in orders(max(2, options.cells // options.chunk)):
            for setting in order:
                group = groups[setting]
                samples = []
                for _ in range(options.chunk):
                    began = time.perf_counter()
                    group.exec("1", namespace={})
                    samples.append(time.perf_counter() - began)
                cells[setting].extend(samples)
                chunk_medians[setting].append(statistics.median(samples))
        all_reduces: dict[str, list[float]] = {s: [] for s in SETTINGS}
        for order in orders(options.rounds):
            for setting in order:
                rates = groups[setting].exec(CELL_ALL_REDUCES, namespace={"n": options.cell_calls})
                all_reduces[setting].append(min(rates.values()))
    finally:
        for group in groups.values():
            group.close()

    median = {s: statistics.median(cells[s]) * 1000 for s in SETTINGS}
    p90 = {s: statistics.quantiles(cells[s], n=10, method="inclusive")[8] * 1000 for s in SETTINGS}
    per_chunk = [b / a for a, b in zip(chunk_medians["off"], chunk_medians["on"], strict=True)]
    trivial = f'trivial %%ddp cell, group.exec("1") ({len(cells["off"])} each, in chunks of {options.chunk}'
    rows = [
        (
            f"{trivial}), median (ms)",
            f"{median['off']:.3f}",
            f"{median['on']:.3f}",
            f"{median['on'] / median['off']:.3f}",
            f"{median['off again'] / median['off']:.3f}",
            spread(per_chunk) + " per chunk",
            "higher",
            quartiles(per_chunk),
        ),
        (
            f"{trivial}), p90 (ms)",
            f"{p90['off']:.3f}",
            f"{p90['on']:.3f}",
            f"{p90['on'] / p90['off']:.3f}",
            f"{p90['off again'] / p90['off']:.3f}",
            "",
            "",
            None,
        ),
        ratio_row(
            f"dist.all_reduce of {SMALL} floats in a %%ddp cell (calls/s)",
            all_reduces["off"],
            all_reduces["on"],
            all_reduces["off again"],
            "{:.0f}",
            "lower",
        ),
    ]
    notes = {
        "start both groups, fill their flight recorders": f"{opened:.1f} s",
        "in the group's ranks, off: (TORCH_FR_BUFFER_SIZE, all_reduce wrapped, watch thread)": runs(
            set(found["off"].values()) | set(found["off again"].values())
        ),
        "in the group's ranks, on: (TORCH_FR_BUFFER_SIZE, all_reduce wrapped, watch thread)": runs(
            set(found["on"].values())
        ),
    }
    return rows, notes


def recorder_alone() -> dict[str, str]:
    """``CollectiveRecorder`` around a no-op named all_reduce, into a mapped file, against the no-op itself."""
    import torch

    from gpumagic.launch.rank_side.hang_watch import CollectiveRecorder

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    folder = tempfile.mkdtemp(prefix="gpumagic-bench-recorder-")
    try:
        wrapped = CollectiveRecorder(Path(folder) / "rank-0.collective")._wrap(all_reduce)
        tensor = torch.ones(SMALL)
        number = 20_000
        bare = min(timeit.repeat(lambda: all_reduce(tensor), number=number, repeat=5)) / number
        recorded = min(timeit.repeat(lambda: wrapped(tensor), number=number, repeat=5)) / number
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"CollectiveRecorder around a no-op, per call, in this process": f"{(recorded - bare) * 1e6:.1f} us"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="launches per setting, interleaved")
    parser.add_argument("--steps", type=int, default=120, help="timed DDP steps in each launch")
    parser.add_argument("--warmup", type=int, default=15, help="DDP steps before the timed ones")
    parser.add_argument("--calls", type=int, default=1000, help="timed all_reduces in each launch")
    parser.add_argument("--cells", type=int, default=1000, help="trivial cells timed per setting")
    parser.add_argument("--chunk", type=int, default=25, help="trivial cells timed in a row, then the other setting")
    parser.add_argument("--cell-warmup", type=int, default=30, help="trivial cells before the timed ones")
    parser.add_argument("--cell-calls", type=int, default=1000, help="all_reduces in each timed %%%%ddp cell")
    parser.add_argument(
        "--no-fill",
        dest="fill",
        action="store_const",
        const=0,
        default=FILL,
        help="do not fill torch's flight recorder before timing",
    )
    parser.add_argument("--skip-group", action="store_true", help="no %%%%ddp section")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds, fewer steps, calls and cells")
    options = parser.parse_args()
    if options.quick:
        options.rounds, options.steps, options.warmup, options.calls = 2, 40, 5, 500
        options.cells, options.cell_warmup, options.cell_calls = 200, 10, 300
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, also on a GPU machine
    made = []
    for name, prefix in (
        ("GPUMAGIC_RUNS_DIR", "gpumagic-bench-runs-"),
        ("GPUMAGIC_LEASE_DIR", "gpumagic-bench-leases-"),
    ):
        if name not in os.environ:
            os.environ[name] = tempfile.mkdtemp(prefix=prefix)
            made.append(os.environ[name])

    started = time.perf_counter()
    try:
        rows, notes = launch_rows(options)
        if not options.skip_group:
            more, more_notes = group_rows(options)
            rows += more
            notes |= more_notes
        notes |= recorder_alone()
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
    took = time.perf_counter() - started

    print(
        f"hang triage, hang_after={SETTINGS['on']!r} (on) against 0 (off): 2 gloo ranks on {os.cpu_count()} CPUs, "
        f"torch {version('torch')}, {options.rounds} rounds interleaved, flight recorder "
        f"{'filled first' if options.fill else 'not filled first'}; {took:.0f} s"
    )
    header = ("measure", "off", "on", "on/off", "off/off", "per-round on/off: min..max")
    table = [header, *(row[:6] for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for row in table:
        cells = [row[0].ljust(widths[0]), *(v.rjust(w) for v, w in zip(row[1:5], widths[1:5], strict=True)), row[5]]
        print("  " + "  ".join(cells).rstrip())
    width = max(len(name) for name in notes)
    for name, value in notes.items():
        print(f"  {name:<{width}}  {value}")
    print()
    for name, _, _, ratio, control, _, slower, iqr in rows:
        if iqr is None:  # the p90 row: no per-round figure to judge it by
            continue
        cost = float(ratio) if slower == "higher" else 1 / float(ratio)  # > 1: on is slower
        noise = float(control) if slower == "higher" else 1 / float(control)
        low, high = sorted(r if slower == "higher" else 1 / r for r in iqr)
        if abs(cost - 1) <= 0.01:
            verdict = "within 1 %"
        elif low <= 1 <= high or abs(cost - 1) <= abs(noise - 1):
            verdict = (
                f"not measurable: the middle half of the per-round ratios spans {low:.3f}..{high:.3f}, and off "
                f"against itself moved {(noise - 1) * 100:+.1f} %"
            )
        else:
            verdict = f"COSTS {(cost - 1) * 100:+.1f} % (off against itself: {(noise - 1) * 100:+.1f} %)"
        print(f"{name.split(' (')[0]}: time each, on/off {cost:.3f} ({(cost - 1) * 100:+.1f} %): {verdict}")


if __name__ == "__main__":
    main()

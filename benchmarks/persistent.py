"""Persistent ranks against a fresh launch per cell, side by side in one run, 2 ranks on the CPU (gloo).

    python benchmarks/persistent.py [--cells 200] [--launches 20] [--grace 5]

- trivial cell round trip: ``group.exec("rank")`` on a running group (what ``%%ddp`` does) against
  ``launch_ddp`` of the same trivial function (a fresh group per cell, warm forkserver, what ``%%launch_ddp``
  does); target <= 5 ms median for the persistent cell. ipyparallel's ``%px`` on 2 engines when installed.
- cell start -> first step: a training cell on a model built by an earlier cell (persistent) against a cell
  that builds the model, wraps it in DDP and steps (fresh launch); the time from the call to the end of the
  first optimizer step on rank 0.
- interrupt of a rank stuck in ``all_reduce`` (rank 1 skips it): from the interrupt to the call's return, with the
  default grace period; target <= grace + 2 s; then a collective on the same group, namespaces intact.
- 100 cells on one group: the kernel-side process's RSS growth (target < 10 MB) and open descriptors.

    python benchmarks/persistent.py --long-session [--cells 1000] [--points 13] [--pause 0.02] [--no-dashboard]

- a long session (issue 25): ``%ddp start -n 2`` in a real kernel, its dashboard on as in a notebook, then
  ``--cells`` ``%%ddp`` cells that each ``gpumagic.log`` ``--points`` steps of two metrics (400 cells: 5,200
  points per rank and metric). At cells 1, 100, 400 and 1,000 (and the last): the cell's time in the kernel
  (IPython's pre/post_run_cell) and its round trip from the client, each as the median of the 10 cells up to
  there, beside the first cell's; the dashboard thread's CPU per cell; a trivial ``%%ddp`` cell there (median
  of 5). Then the kernel's CPU and its messages while the group idles, and after ``%ddp stop``: how long until
  no gpumagic thread is left, the kernel's idle CPU. Target: per-cell cost at 1,000 cells equal to the first
  cells' within noise; idle CPU about 0 %.

Every group runs on the CPU with gloo, on a GPU machine too.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
from importlib.metadata import version
from typing import Any

import psutil

BUILD = """
import torch, time
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randn(64, 1)
"""
STEP = """
optimizer.zero_grad()
torch.nn.functional.mse_loss(model(x), y).backward()
optimizer.step()
time.time()
"""


def trivial() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def first_step_fresh() -> float:
    """A fresh launch's cell: build the model, wrap it, one step; when the step ended."""
    namespace: dict = {}
    exec(BUILD, namespace)
    exec(STEP.replace("time.time()", "ended = time.time()"), namespace)
    return namespace["ended"]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def ipyparallel_rows(cells: int) -> list[tuple[str, str]]:
    try:
        import ipyparallel
    except ImportError:
        return [("ipyparallel %px on 2 engines", "not installed here: not measured")]
    with ipyparallel.Cluster(n=2, log_level=40) as client:
        view = client[:]
        view.execute("rank = 0", block=True)
        samples = []
        for _ in range(cells):
            started = time.perf_counter()
            view.execute("rank", block=True)
            samples.append(time.perf_counter() - started)
    return [("ipyparallel %px on 2 engines, trivial cell, median", ms(statistics.median(samples)))]


LONG_CELL = (
    "%%ddp\nfor _ in range({points}):\n    gpumagic.log(loss=1.0 / (len(seen) + 1) + rank, lr=0.1)\n    seen.append(0)"
)
TIMING_HOOKS = """
import threading, time
cell_times = []
def _started(info):
    cell_times.append(-time.perf_counter())
def _ended(result):
    if cell_times and cell_times[-1] < 0:
        cell_times[-1] += time.perf_counter()
get_ipython().events.register("pre_run_cell", _started)
get_ipython().events.register("post_run_cell", _ended)
"""
GPUMAGIC_THREADS = "print(*[t.name for t in threading.enumerate() if t.name.startswith('gpumagic')], sep=',')"


def thread_cpu(process: psutil.Process, thread: int | None) -> float:
    """CPU seconds of one of ``process``'s threads (0 where there is none)."""
    return next((t.user_time + t.system_time for t in process.threads() if t.id == thread), 0.0)


def long_session(options: argparse.Namespace) -> None:
    """Many logging cells on one group with its dashboard, in a real kernel: per-cell cost and idle CPU."""
    import tempfile

    from kernel_cpu import measured_kernel

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        GPUMAGIC_LEASE_DIR=tempfile.mkdtemp(prefix="gpumagic-bench-leases-"),
        GPUMAGIC_RUNS_DIR=tempfile.mkdtemp(prefix="gpumagic-bench-runs-"),
        PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    )
    checkpoints = sorted({c for c in (1, 100, 400, 1000) if c <= options.cells} | {options.cells})
    cell = LONG_CELL.format(points=options.points)
    with measured_kernel(env) as kernel:
        client = kernel.client

        def run(code: str) -> str:
            out: list[str] = []

            def collect(message: dict) -> None:
                if message["msg_type"] == "stream":
                    out.append(message["content"]["text"])
                elif message["msg_type"] == "error":
                    raise RuntimeError(f"{code!r}: {message['content']['evalue']}")

            client.execute_interactive(code, timeout=120, output_hook=collect)
            return "".join(out)

        run("%load_ext gpumagic\nimport gpumagic, threading")
        run(f"%ddp start -n 2{' --no-dashboard' if options.no_dashboard else ''}")
        run("%%ddp\nseen = []")
        dashboard = "gpumagic.launch.kernel_side.session.SESSION.group_dashboard"
        thread = run(f"d = {dashboard}\nprint(d._thread.native_id if d is not None else '')").strip()
        thread_id = int(thread) if thread else None
        run(TIMING_HOOKS)
        rows: list[tuple[str, ...]] = []
        trips: list[float] = []
        kinds: list[str] = []  # of each timed cell: the session's, or a trivial one at a checkpoint
        busy = [thread_cpu(kernel.process, thread_id)]
        started = time.monotonic()
        for number in range(1, options.cells + 1):
            began = time.perf_counter()
            run(cell)
            trips.append(time.perf_counter() - began)
            kinds.append("session")
            busy.append(thread_cpu(kernel.process, thread_id))
            if number in checkpoints:
                rows.append((str(number), _trivial_cells(run)))
                kinds.extend(["trivial"] * 5)
            time.sleep(options.pause)
        took = time.monotonic() - started
        run('get_ipython().events.unregister("pre_run_cell", _started)')
        times = [float(t) for t in run("print(*cell_times)").split()]
        session = [t for t, kind in zip(times, kinds, strict=False) if kind == "session"]

        def window(values: list[float], end: int) -> float:
            return statistics.median(values[max(0, end - 10) : end])

        first_ran, first_trip = window(session, 1), window(trips, 1)
        print(
            f"long session: {options.cells} %%ddp cells of {options.points} steps x 2 metrics on 2 gloo ranks, "
            f"dashboard {'off' if options.no_dashboard else 'on'}, {options.pause * 1000:.0f} ms between cells, "
            f"{os.cpu_count()} CPUs; {took:.1f} s"
        )
        header = ("cell", "ran, median of 10", "x first", "round trip", "x first", "dashboard CPU/cell", "trivial cell")
        table = [header]
        previous = 0
        for number, trivial in rows:
            end = int(number)
            ran, trip = window(session, end), window(trips, end)
            per_cell = (busy[end] - busy[previous]) / (end - previous)  # since the last checkpoint
            previous = end
            table.append(
                (
                    number,
                    ms(ran),
                    f"{ran / first_ran:.2f}",
                    ms(trip),
                    f"{trip / first_trip:.2f}",
                    ms(per_cell),
                    trivial,
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        for row in table:
            print("  " + "  ".join(value.rjust(width) for value, width in zip(row, widths, strict=True)))
        print(f"  dashboard thread CPU over the session: {busy[-1] - busy[0]:.2f} s of {took:.1f} s")

        time.sleep(2.0)  # the last points drawn; the group idles from here
        _messages_over(client, 0.2)  # what was sent meanwhile
        messages = _messages_over(client, 3.0)
        attached = "no dashboard" if options.no_dashboard else "dashboard attached"
        print(f"  group idle, {attached}: kernel CPU {kernel.cpu_percent_over(3.0):.1f} % of a core, ", end="")
        print(f"{len(messages)} messages in 3 s ({', '.join(sorted(set(messages))) or 'none'})")
        stopped = time.monotonic()
        run("%ddp stop")
        left = run(GPUMAGIC_THREADS).strip()
        while left and time.monotonic() - stopped < 30:
            time.sleep(0.1)
            left = run(GPUMAGIC_THREADS).strip()
        print(f"  %ddp stop -> no gpumagic thread left: {time.monotonic() - stopped:.2f} s (left: {left or 'none'})")
        time.sleep(1.0)
        print(f"  after %ddp stop: kernel CPU {kernel.cpu_percent_over(3.0):.1f} % of a core (over 3 s)")


def _trivial_cells(run: Any) -> str:
    """A trivial ``%%ddp`` cell's round trip, the median of 5."""
    samples = []
    for _ in range(5):
        began = time.perf_counter()
        run("%%ddp\nx = rank")
        samples.append(time.perf_counter() - began)
    return ms(statistics.median(samples))


def _messages_over(client: Any, seconds: float) -> list[str]:
    """The types of the messages the kernel publishes over ``seconds`` (none asked for)."""
    seen = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            seen.append(client.get_iopub_msg(timeout=left)["msg_type"])
        except Exception:  # noqa: BLE001 - queue.Empty: nothing more within the time
            break
    return seen


LOOP = """
steps = 0
while True:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    steps += 1
"""
SYNC_POINTS = """
import gpumagic.launch.rank_side.group_rank as _rank
from torch.nn.parallel import DistributedDataParallel as _DDP
from gpumagic.launch.rank_side.sync_points import track_ddp_forwards as _track
_points = _rank._this_rank.sync
if counting:
    _track(_points)
    _points.__dict__.pop("enter", None)
else:
    _DDP.forward = getattr(_DDP.forward, "__wrapped__", _DDP.forward)
    _points.enter = lambda: None
"""
TIMED_STEPS = (
    "started = time.perf_counter()\nfor _ in range(n):\n"
    + "".join(f"    {line}\n" for line in STEP.strip().splitlines()[:-1])
    + "time.perf_counter() - started"
)
TIMED_ALL_REDUCES = (
    "t = torch.ones(1)\nstarted = time.perf_counter()\nfor _ in range(n):\n    dist.all_reduce(t)\n"
    "time.perf_counter() - started"
)


def interrupt_together_rows(group: Any) -> list[tuple[str, str]]:
    """A DDP training loop interrupted three times: how long until the cell returned, and whether every rank
    stopped at the same step with the same weights."""
    import gpumagic

    group.exec(BUILD, namespace={})
    took, alike = [], []
    for delay in (0.7, 1.0, 1.3):
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        try:
            group.exec(LOOP, namespace={})
        except gpumagic.CellInterrupted as stopped:
            took.append(time.monotonic() - started - delay)
            alike.append("every rank stopped before the same" in str(stopped))
        state = group.exec("(steps, sum(p.detach().double().sum().item() for p in model.parameters()))", namespace={})
        alike[-1] = alike[-1] and state[0] == state[1]
    return [
        ("interrupt of a DDP loop -> cell returned, median of 3", f"{statistics.median(took):.2f} s"),
        ("  ... every rank at the same step, same weights", f"{sum(alike)} of {len(alike)}"),
    ]


def sync_point_cost_rows(group: Any, cells: int) -> list[tuple[str, str]]:
    """What counting sync points (for interrupts that stop every rank at one step) costs: one count alone, and
    DDP steps and 1-float all_reduces timed on the ranks with and without, alternating, six times each."""
    group.exec(BUILD + "\nimport time", namespace={})
    timed: dict[tuple[str, bool], list[float]] = {}
    for round_ in range(6):
        for counting in (True, False) if round_ % 2 else (False, True):  # neither always first
            group.exec(SYNC_POINTS, namespace={"counting": counting})
            for name, code, n in (("step", TIMED_STEPS, 200), ("all_reduce", TIMED_ALL_REDUCES, 2000)):
                seconds = max(group.exec(code, namespace={"n": n}).values())
                timed.setdefault((name, counting), []).append(seconds / n)
    group.exec(SYNC_POINTS, namespace={"counting": True})
    import timeit

    from gpumagic.launch.rank_side.sync_points import SyncPoints

    points = SyncPoints()
    points.start_cell(1)
    alone = min(timeit.repeat(points.enter, number=100_000, repeat=5)) / 100_000
    rows = [("one sync point counted (SyncPoints.enter), alone", f"{alone * 1e9:.0f} ns")]
    for name, unit in (("step", "DDP step (256-wide MLP)"), ("all_reduce", "all_reduce of 1 float")):
        on, off = statistics.median(timed[(name, True)]), statistics.median(timed[(name, False)])
        rows.append(
            (f"{unit}: counting sync points / not, median", f"{on * 1e6:.1f} / {off * 1e6:.1f} us ({on / off:.3f}x)")
        )
    return rows


NOTEBOOK_CLASSES = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, width, depth=2):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.layers(x))
""" + "".join(
    f"""
class Block{i}(Block):
    def __init__(self, width=64):
        super().__init__(width, depth={i % 3 + 1})
        self.scale = nn.Parameter(torch.ones(width) * {i})

    def forward(self, x):
        return super().forward(x) * self.scale
"""
    for i in range(7)
)


def notebook_classes_rows(group: Any, cells: int) -> list[tuple[str, str]]:
    """A trivial cell that uses 7 notebook classes (nn.Module subclasses, as a notebook defines them), against one
    that uses none: sent once, then checked by their change keys, not pickled on every cell."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(NOTEBOOK_CLASSES, namespace)
    uses = "(" + ", ".join(f"Block{i}" for i in range(7)) + ")\nrank"
    timed: dict[str, list[float]] = {"uses": [], "plain": []}
    group.exec(uses, namespace=namespace)
    for _ in range(cells):
        for name, code in (("uses", uses), ("plain", "rank")):
            started = time.perf_counter()
            group.exec(code, namespace=namespace)
            timed[name].append(time.perf_counter() - started)
    uses_ms, plain_ms = statistics.median(timed["uses"]), statistics.median(timed["plain"])
    return [("trivial cell using 7 notebook classes / using none, median", f"{ms(uses_ms)} / {ms(plain_ms)}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=None, help="cells (200; 1000 with --long-session)")
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--long-session", action="store_true", help="many logging cells with the dashboard")
    parser.add_argument("--points", type=int, default=13, help="--long-session: steps each cell logs")
    parser.add_argument("--pause", type=float, default=0.02, help="--long-session: seconds between cells")
    parser.add_argument("--no-dashboard", action="store_true", help="--long-session: %%ddp start --no-dashboard")
    options = parser.parse_args()
    if options.long_session:
        options.cells = options.cells or 1000
        long_session(options)
        return
    options.cells = options.cells or 200
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import gpumagic

    rows: list[tuple[str, str]] = []
    started = time.perf_counter()
    group = gpumagic.ranks(2, gpus="none", output="none", grace=options.grace)
    rows.append(("start a group of 2 ranks (cold: starts the rank server)", f"{time.perf_counter() - started:.2f} s"))

    # trivial cells
    for _ in range(10):
        group.exec("rank", namespace={})
    samples = []
    for _ in range(options.cells):
        t = time.perf_counter()
        group.exec("rank", namespace={})
        samples.append(time.perf_counter() - t)
    persistent = statistics.median(samples)
    rows.append(("persistent %%ddp trivial cell, median", ms(persistent)))
    rows.append(("persistent %%ddp trivial cell, p95", ms(sorted(samples)[int(0.95 * len(samples)) - 1])))
    gpumagic.launch_ddp(trivial, 2, gpus="none", output="none")
    fresh = []
    for _ in range(options.launches):
        t = time.perf_counter()
        gpumagic.launch_ddp(trivial, 2, gpus="none", output="none")
        fresh.append(time.perf_counter() - t)
    rows.append(("fresh %%launch_ddp trivial cell (warm), median", ms(statistics.median(fresh))))
    rows.append(("ratio fresh / persistent", f"{statistics.median(fresh) / persistent:.0f}x"))
    rows.extend(ipyparallel_rows(options.cells))

    # cell start -> first step
    group.exec(BUILD, namespace={})
    group.exec(STEP, namespace={})  # the first step of a DDP model pays its own set-up: not this cell's
    persistent_first = []
    for _ in range(10):
        t = time.time()
        ended = group.exec(STEP, namespace={})[0]
        persistent_first.append(ended - t)
    fresh_first = []
    for _ in range(5):
        t = time.time()
        ended = gpumagic.launch_ddp(first_step_fresh, 2, gpus="none", output="none")[0]
        fresh_first.append(ended - t)
    rows.append(
        ("cell start -> first step, persistent (model built before), median", ms(statistics.median(persistent_first)))
    )
    rows.append(
        ("cell start -> first step, fresh launch (build + DDP + step), median", ms(statistics.median(fresh_first)))
    )

    # interrupt of a stuck all_reduce
    group.exec("kept = rank + 100", namespace={})
    interrupted = {}

    def interrupt() -> None:
        interrupted["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Timer(1.0, interrupt).start()
    try:
        group.exec("if rank == 0:\n    dist.all_reduce(torch.ones(1))", namespace={})
        rows.append(("interrupt of a stuck all_reduce", "NOT INTERRUPTED"))
    except gpumagic.CellInterrupted:
        took = time.monotonic() - interrupted["at"]
        rows.append((f"interrupt of a stuck all_reduce -> cell returned (grace {options.grace:g} s)", f"{took:.2f} s"))
    after = group.exec("t = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), kept)", namespace={})
    rows.append(("next cell's all_reduce and namespaces", str(after)))

    rows.extend(interrupt_together_rows(group))
    rows.extend(sync_point_cost_rows(group, options.cells))
    rows.extend(notebook_classes_rows(group, options.cells))

    # 100 cells: growth
    me = psutil.Process()
    group.exec("n = 0", namespace={})
    before = (me.memory_info().rss, me.num_fds(), me.num_threads())
    for _ in range(100):
        group.exec("n += 1\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(n)", namespace={})
    grown = (me.memory_info().rss - before[0]) / 2**20
    rows.append(("100 cells: kernel-side RSS growth", f"{grown:.1f} MB"))
    rows.append(
        ("100 cells: descriptors, threads before -> after", f"{before[1:]} -> {(me.num_fds(), me.num_threads())}")
    )
    group.close()

    width = max(len(name) for name, _ in rows)
    print(f"persistent ranks, 2 gloo ranks on {os.cpu_count()} CPUs, torch {version('torch')}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    main()

"""A big notebook value reaching the ranks (issue #40), 2 CPU ranks (gloo), side by side in one run.

    python benchmarks/big_values.py [--mb 381] [--times 10] [--repeat 5] [--skip-by-value] [--skip-accelerate]

Each size runs through shared memory (``gpumagic.launch.shared_values``); ``--mb`` also by value as before
(``GPUMAGIC_SHM=off``) and through accelerate's ``notebook_launcher`` (fork) when it is installed; the size
``--times`` larger through shared memory only, where this machine's free memory allows.

- launch: ``gpumagic.launch_ddp(f, 2, (X,))`` with a big tensor ``X`` against the same call with a small one, each
  after a warm-up, ``f`` reading one element (what it costs to send, not to read 3.8 GB on one thread); target:
  within 0.3 s of the small one. The first launch with ``X`` (which writes it) is shown apart.
- group: ``gpumagic.ranks(2)``, the first ``exec`` whose code reads ``X`` against one that reads a small value;
  target: within 0.3 s.
- memory: each rank's unique memory (USS) after it has read every byte of ``X``, against ``X``'s size; target: at
  most 10 %. The kernel's (this process's) RSS growth while a launch runs: at most one copy.

Ranks run on the CPU with gloo, on a GPU machine too. The value is a float32 torch tensor of ``--mb`` MB.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import psutil


def touch_and_measure(x) -> tuple[float, float]:
    """On a rank: read every byte of ``x`` (a sum), then, once every rank has (a barrier where there is a process
    group), this process's unique memory in MB: pages the others have not mapped yet would count as its own."""
    import psutil as ps
    import torch.distributed as dist

    total = float(x.sum())
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return total, ps.Process().memory_full_info().uss / 2**20


def first_element(x) -> float:
    """On a rank: use ``x`` without reading all of it (reading 3.8 GB on one thread takes longer than sending)."""
    return float(x.reshape(-1)[0])


def launch_seconds(value, repeat: int) -> tuple[list[float], list[float]]:
    """Seconds per ``launch_ddp`` that passes ``value`` (its ranks read one element); then each rank's USS (MB)
    in one more launch whose ranks read every byte."""
    import gpumagic

    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        gpumagic.launch_ddp(first_element, 2, (value,), gpus="none", output="none")
        samples.append(time.perf_counter() - started)
    result = gpumagic.launch_ddp(touch_and_measure, 2, (value,), gpus="none", output="none")
    return samples, [result[rank][1] for rank in sorted(result)]


def peak_rss_during(action) -> tuple[float, float]:
    """This process's RSS before ``action()`` and the highest seen (every 10 ms) while it ran, in MB."""
    process = psutil.Process()
    before = process.memory_info().rss / 2**20
    peak = [before]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], process.memory_info().rss / 2**20)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        action()
    finally:
        done.set()
        watcher.join()
    return before, peak[0]


def group_first_cells(big, small) -> tuple[float, float, float, list[float]]:
    """Seconds of a fresh group's first ``exec`` reading ``small``, then of its first reading ``big``, then of the
    first after ``big`` changed in place (sent again: through shared memory, written again); the ranks' USS (MB)
    after reading it."""
    import gpumagic

    with gpumagic.ranks(2, gpus="none", output="none") as group:
        group.exec("import psutil")
        names = {"SMALL": small, "BIG": big}
        started = time.perf_counter()
        group.exec("first = float(SMALL[0])", names)
        small_s = time.perf_counter() - started
        started = time.perf_counter()
        group.exec("first = float(BIG[0])", names)
        big_s = time.perf_counter() - started
        big.add_(0)  # a new version: the next cell sends it again
        started = time.perf_counter()
        group.exec("first = float(BIG[0])", names)
        changed_s = time.perf_counter() - started
        group.exec("total = float(BIG.sum())", names)  # every byte read on every rank
        uss = group.exec("psutil.Process().memory_full_info().uss / 2**20", names)
    return small_s, big_s, changed_s, [uss[rank] for rank in sorted(uss)]


def shared_held_mb() -> float:
    """What the kernel holds in shared memory now (MB)."""
    from gpumagic.launch import shared_values

    store = shared_values.kernel_store()
    return 0.0 if store is None else store.held_bytes() / 2**20


def accelerate_uss(path: str, value) -> None:
    """On a notebook_launcher rank: read every byte of ``value``, then append this process's USS (MB) to ``path``."""
    _, uss = touch_and_measure(value)
    with open(path, "a") as out:
        out.write(f"{uss}\n")


def accelerate_first(value) -> None:
    """On a notebook_launcher rank: use ``value`` as ``first_element`` does."""
    first_element(value)


def accelerate_seconds(value, repeat: int) -> tuple[list[float], list[float]] | None:
    """Seconds per ``notebook_launcher(..., num_processes=2)`` passing ``value`` (its ranks read one element);
    its ranks' USS (MB) in one more launch reading every byte; None without accelerate."""
    try:
        from accelerate import notebook_launcher
    except ImportError:
        return None
    import os
    import tempfile

    from launch_workloads import free_port

    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        notebook_launcher(accelerate_first, (value,), num_processes=2, use_port=str(free_port()))
        samples.append(time.perf_counter() - started)
    with tempfile.TemporaryDirectory(prefix="gpumagic-bench-") as directory:
        path = os.path.join(directory, "uss")
        notebook_launcher(accelerate_uss, (path, value), num_processes=2, use_port=str(free_port()))
        with open(path) as written:
            return samples, [float(line) for line in written]


def measure(big, small, repeat: int) -> dict[str, float]:
    """The launches and a group's first cells with ``big`` against ``small``, the ranks' USS, the kernel's RSS
    and shared memory held, as the kernel's sharing is set now."""
    launch_seconds(small, 1)  # the rank server started and warm
    small_s, small_uss = launch_seconds(small, repeat)
    found: dict[str, list[float]] = {}
    held = [0.0]

    def big_launches() -> None:
        first = time.perf_counter()
        launch_seconds(big, 1)
        found["first"] = [time.perf_counter() - first]
        held[0] = shared_held_mb()
        found["seconds"], found["uss"] = launch_seconds(big, repeat)

    before, peak = peak_rss_during(big_launches)
    group_small_s, group_big_s, group_changed_s, group_uss = group_first_cells(big, small)
    return {
        "first": found["first"][0],
        "big": statistics.median(found["seconds"]),
        "small": statistics.median(small_s),
        "group big": group_big_s,
        "group small": group_small_s,
        "group changed": group_changed_s,
        "uss": max(found["uss"]),
        "uss small": max(small_uss),
        "group uss": max(group_uss),
        "rss growth": peak - before,
        "shared": held[0],
    }


def report(title: str, size_mb: float, got: dict[str, float], repeat: int) -> None:
    rows = [
        (f"launch_ddp(f, 2, (X,)), X of {size_mb:.0f} MB, first launch", got["first"], "s"),
        (f"  again, X unchanged (median of {repeat})", got["big"], "s"),
        (f"  with a 4 KB value instead (median of {repeat})", got["small"], "s"),
        ("a group's first exec using X (one element)", got["group big"], "s"),
        ("  using a 4 KB value", got["group small"], "s"),
        ("  using X after X.add_(0) (sent again)", got["group changed"], "s"),
        ("launch: a rank's USS after reading X (largest)", got["uss"], "MB"),
        ("  after reading the 4 KB value", got["uss small"], "MB"),
        ("group: a rank's USS after reading X (largest)", got["group uss"], "MB"),
        ("kernel: RSS growth at its highest during the launches with X", got["rss growth"], "MB"),
        ("kernel: shared memory held for X", got["shared"], "MB"),
    ]
    print(f"\n{title}")
    width = max(len(name) for name, _, _ in rows)
    for name, value, unit in rows:
        print(f"  {name:<{width}}  {value:10.3f} {unit}")
    launch_gap, group_gap = got["big"] - got["small"], got["group big"] - got["group small"]
    first_gap, changed_gap = got["first"] - got["small"], got["group changed"] - got["group small"]
    for_x = got["uss"] - got["uss small"]
    extra = (got["rss growth"] + got["shared"]) / size_mb
    print(f"  launch: X adds {launch_gap:.3f} s / 0.3 s target: {launch_gap / 0.3:.2f}")
    print(f"  launch, the first with X (written then): X adds {first_gap:.3f} s / 0.3 s: {first_gap / 0.3:.2f}")
    print(f"  group: X adds {group_gap:.3f} s / 0.3 s target: {group_gap / 0.3:.2f}")
    print(f"  group, X changed (written again): X adds {changed_gap:.3f} s / 0.3 s: {changed_gap / 0.3:.2f}")
    print(f"  launch: a rank's USS for X / 10 % of X target: {for_x / (0.1 * size_mb):.2f}")
    print(f"  kernel's extra memory (RSS growth + shared) / one copy of X: {extra:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=381.0, help="size of the big tensor, MB")
    parser.add_argument("--times", type=float, default=10.0, help="the larger size, as a multiple of --mb")
    parser.add_argument("--repeat", type=int, default=5, help="launches timed each way")
    parser.add_argument("--skip-by-value", action="store_true", help="leave out the old path (GPUMAGIC_SHM=off)")
    parser.add_argument("--skip-accelerate", action="store_true")
    args = parser.parse_args()

    import os

    import torch

    from gpumagic.launch import shared_values

    small = torch.rand(1000)
    big = torch.rand(int(args.mb * 2**20 / 4))
    size_mb = big.numel() * 4 / 2**20
    if not args.skip_accelerate:  # first: a fork after the kernel ran a parallel op (X.add_ below) hangs in OpenMP
        theirs = accelerate_seconds(big, args.repeat)
        mine = accelerate_seconds(small, args.repeat)
        if theirs is None or mine is None:
            print("\naccelerate is not installed: pip install accelerate (or .[bench])")
        else:
            print(f"\naccelerate notebook_launcher (fork), X of {size_mb:.0f} MB")
            print(
                f"  per launch (median of {args.repeat}): {statistics.median(theirs[0]):.3f} s with X, "
                f"{statistics.median(mine[0]):.3f} s with the 4 KB value"
            )
            print(
                f"  a rank's USS after reading X (largest): {max(theirs[1]):.1f} MB; with the 4 KB value "
                f"{max(mine[1]):.1f} MB"
            )
    report("through shared memory", size_mb, measure(big, small, args.repeat), args.repeat)
    if not args.skip_by_value:
        os.environ[shared_values.SHM_VARIABLE] = "off"
        shared_values.close_kernel_store()
        report("by value, as before (GPUMAGIC_SHM=off)", size_mb, measure(big, small, args.repeat), args.repeat)
        del os.environ[shared_values.SHM_VARIABLE]
    shared_values.close_kernel_store()
    larger_mb = size_mb * args.times
    available = psutil.virtual_memory().available / 2**20
    del big
    if args.times > 1 and available > 3.5 * larger_mb:  # X, its shared copy, headroom for the ranks
        larger = torch.rand(int(larger_mb * 2**20 / 4))
        got = measure(larger, small, max(2, args.repeat // 2))
        report(f"through shared memory, {args.times:g}x larger", larger_mb, got, max(2, args.repeat // 2))
    elif args.times > 1:
        print(f"\n{args.times:g}x larger ({larger_mb:.0f} MB): left out, {available:.0f} MB of memory available")


if __name__ == "__main__":
    main()

"""A ``%ddp`` group across two nodes of a real Slurm allocation against one on this machine, side by side in one
run (issue #41), 1 gloo rank per node against 2 local ranks: the same world of 2.

    python benchmarks/multinode_group.py [--starts 3] [--cells 200] [--replacements 3]

Needs root (it starts the project's two-node test cluster, ``tests/slurm_cluster.py``: network namespaces on
this machine, so the "network" is a bridge; on a real cluster add the network's round trip). This process plays
the kernel, on the cluster's login side (no rank runs here for the two-node group; its hosts run on the nodes).

- start: ``gpumagic.ranks(...)`` until its process group is formed (the hosts' srun, their rank servers, the
  ranks); target <= 10 s across nodes. On one machine the kernel's rank server stays up between groups (only
  the first start imports torch); each start across nodes starts its hosts' rank servers afresh.
- a trivial cell's round trip: ``group.exec("rank")`` (what ``%%ddp`` does, less IPython); target <= 10 ms
  across nodes (median).
- a dead rank replaced: from the SIGKILL of rank 1 to the end of the first trivial cell that runs on every
  rank again (a cell sent before the group heard of the death fails naming it, and the group replaces the rank on
  its node, re-forms and runs the next); target <= 3 s across nodes.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def measure(make, starts: int, cells: int, replacements: int, CellFailed: type) -> dict[str, list[float]]:
    """Start a group ``starts`` times; on the last, ``cells`` trivial cells and ``replacements`` replacements."""
    found: dict[str, list[float]] = {"start": [], "cell": [], "replace": []}
    for attempt in range(starts):
        began = time.perf_counter()
        group = make()
        found["start"].append(time.perf_counter() - began)
        try:
            if attempt < starts - 1:
                continue
            group.exec("rank")
            for _ in range(cells):
                began = time.perf_counter()
                group.exec("rank")
                found["cell"].append(time.perf_counter() - began)
            for _ in range(replacements):
                victim = group.pids[1]
                began = time.perf_counter()
                os.kill(victim, signal.SIGKILL)
                for tries in range(3):  # a cell that met the death fails naming it; the group has replaced it then
                    try:
                        group.exec("rank")
                        break
                    except CellFailed:
                        assert tries < 2
                found["replace"].append(time.perf_counter() - began)
                assert group.pids[1] != victim
        finally:
            group.close()
    return found


def row(label: str, values: list[float], unit: str = "ms", target: str = "") -> str:
    scale = 1000 if unit == "ms" else 1
    median = statistics.median(values) * scale
    spread = f"{min(values) * scale:.2f}-{max(values) * scale:.2f}"
    return f"  {label:<34} {median:>9.2f} {unit:<3} (range {spread}, n={len(values)})  {target}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--replacements", type=int, default=3)
    options = parser.parse_args()
    from tests import slurm_cluster

    reason = slurm_cluster.cannot_start()
    if reason:
        sys.exit(f"benchmarks/multinode_group.py needs the project's test cluster: {reason}")
    os.environ["GPUMAGIC_RUNS_DIR"] = tempfile.mkdtemp(prefix="gpumagic-bench-runs-")
    os.environ["GPUMAGIC_LEASE_DIR"] = tempfile.mkdtemp(prefix="gpumagic-bench-leases-")
    import gpumagic
    from gpumagic.launch.kernel_side.group import CellFailed

    cluster = slurm_cluster.start(2)
    try:
        os.environ.update(cluster.environment())
        job_id, allocation = cluster.allocation(2)
        local = measure(
            lambda: gpumagic.ranks(2, gpus="none"), options.starts, options.cells, options.replacements, CellFailed
        )
        os.environ.update(allocation)
        across = measure(
            lambda: gpumagic.ranks(1, nnodes=2, gpus="none"),
            options.starts,
            options.cells,
            options.replacements,
            CellFailed,
        )
        cluster.run("scancel", job_id, check=False)
    finally:
        cluster.stop()
    print(f"a world of 2 gloo ranks on the CPU; {options.starts} starts, {options.cells} cells, "
          f"{options.replacements} replacements each\n")  # fmt: skip
    for key, label, unit, target in (
        ("start", "start until formed", "s", "target across nodes <= 10 s"),
        ("cell", "trivial cell round trip", "ms", "target across nodes <= 10 ms"),
        ("replace", "rank 1 killed, next cell", "s", "target across nodes <= 3 s"),
    ):
        print(f"{label}")
        print(row("one machine, 2 ranks", local[key], unit))
        print(row("2 nodes, 1 rank each (hosts)", across[key], unit, target))
        ratio = statistics.median(across[key]) / statistics.median(local[key])
        print(f"  ratio 2 nodes / one machine: {ratio:.2f}\n")


if __name__ == "__main__":
    main()

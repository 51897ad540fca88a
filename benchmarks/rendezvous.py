"""What the owner-only rendezvous store (issue #24) costs, side by side in one run.

    python benchmarks/rendezvous.py [--repeats 20] [--baseline REV]

For this checkout and, with ``--baseline REV``, gpumagic as it was at that git revision (TCPStore on loopback):

1. a fresh ``launch_ddp`` of 2 gloo ranks doing one ``all_reduce`` (warm rank server), median and p90 in ms;
2. a ``%ddp`` group re-formed on a fresh rendezvous (``GroupRecovery.reform``, as after a stuck collective), ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jobs import _packages, _run_script  # a sibling script's helpers

CHILD = r"""
import json, os, sys, tempfile, time
os.environ.setdefault("GPUMAGIC_LEASE_DIR", tempfile.mkdtemp())
import gpumagic

def one_reduce():
    import torch, torch.distributed as dist
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()

def main():
    repeats = int(sys.argv[1])
    out = {"launch": [], "reform": []}
    gpumagic.launch_ddp(one_reduce, 2, gpus="none", write=lambda text: None)  # the rank server starts
    for _ in range(repeats):
        started = time.perf_counter()
        assert gpumagic.launch_ddp(one_reduce, 2, gpus="none", write=lambda text: None) == {0: 2.0, 1: 2.0}
        out["launch"].append((time.perf_counter() - started) * 1000)
    group = gpumagic.ranks(2, gpus="none", write=lambda text: None)
    try:
        group.run(one_reduce)
        for _ in range(repeats):
            started = time.perf_counter()
            (group.recovery.reform if hasattr(group, "recovery") else group._reform)([], {})  # a baseline: _reform
            out["reform"].append((time.perf_counter() - started) * 1000)
            assert group.run(one_reduce) == {0: 2.0, 1: 2.0}
    finally:
        group.close()
    print(json.dumps(out))

if __name__ == "__main__":  # the rank server imports this file as __mp_main__
    main()
"""


def _summary(values: list[float]) -> str:
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(len(values) * 0.9))]
    return f"median {statistics.median(values):7.1f} ms   p90 {p90:7.1f} ms   (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--baseline", metavar="REV", help="also measure gpumagic as it was at this git revision")
    options = parser.parse_args()
    rows = [(label, _run_script(CHILD, env, str(options.repeats))) for label, env in _packages(options.baseline)]
    print(f"2 gloo ranks on the CPU, {options.repeats} repeats each, side by side\n")
    for what, key in (("fresh launch_ddp, one all_reduce", "launch"), ("%ddp group re-formed", "reform")):
        print(what)
        medians = []
        for label, measured in rows:
            medians.append(statistics.median(measured[key]))
            print(f"  {label:<28} {_summary(measured[key])}")
        if len(medians) == 2:
            print(f"  ratio this checkout / baseline: {medians[1] / medians[0]:.2f}")


if __name__ == "__main__":
    main()

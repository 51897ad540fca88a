"""What the owner-only rendezvous store (issue #24) costs, side by side in one run.

    python benchmarks/rendezvous.py [--repeats 20] [--baseline REV]

For this checkout and, with ``--baseline REV``, gpumagic as it was at that git revision (TCPStore on loopback):

1. a fresh ``launch_ddp`` of 2 gloo ranks doing one ``all_reduce`` (warm rank server), median and p90 in ms;
2. a ``%ddp`` group re-formed on a fresh rendezvous (``RankGroup._reform``, as after a stuck collective), ms;
3. the store alone: 2 processes forming a gloo group on it (``init_process_group`` to the first barrier), ms.
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
repeats = int(sys.argv[1])

def one_reduce():
    import torch, torch.distributed as dist
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()

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
        group._reform([], {})
        out["reform"].append((time.perf_counter() - started) * 1000)
        assert group.run(one_reduce) == {0: 2.0, 1: 2.0}
finally:
    group.close()
print(json.dumps(out))
"""

STORE_ONLY = r"""
import datetime, json, os, socket, sys, tempfile, time
import torch.multiprocessing as mp
repeats, kind = int(sys.argv[1]), sys.argv[2]

def rank(r, address, port, queue):
    import torch.distributed as dist
    started = time.perf_counter()
    if kind == "secure":
        from gpumagic.launch import secure_store
        if r == 0:
            server = secure_store.StoreServer(secure_store.listen(address), address)
        store = secure_store.connect(address, 30)
    else:
        store = dist.TCPStore("127.0.0.1", port, 2, r == 0, datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=r, world_size=2)
    dist.barrier()
    queue.put((r, (time.perf_counter() - started) * 1000))
    dist.barrier()
    os._exit(0)

context = mp.get_context("fork")
times = []
for i in range(repeats):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"unix:{tempfile.mkdtemp()}/store.sock"
    queue = context.Queue()
    ranks = [context.Process(target=rank, args=(r, address, port, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    times.append(max(queue.get(timeout=60)[1] for _ in ranks))
    for p in ranks:
        p.join()
print(json.dumps({"join": times}))
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
    rows = []
    for label, env in _packages(options.baseline):
        measured = _run_script(CHILD, env, str(options.repeats))
        rows.append((label, measured))
    here = dict(_packages(None)[0][1])
    stores = {kind: _run_script(STORE_ONLY, here, str(options.repeats), kind)["join"] for kind in ("tcp", "secure")}
    print(f"2 gloo ranks on the CPU, {options.repeats} repeats each, side by side\n")
    for what, key in (("fresh launch_ddp, one all_reduce", "launch"), ("%ddp group re-formed", "reform")):
        print(what)
        medians = {}
        for label, measured in rows:
            medians[label] = statistics.median(measured[key])
            print(f"  {label:<28} {_summary(measured[key])}")
        if len(medians) == 2:
            before, after = medians.values()
            print(f"  ratio this checkout / baseline: {after / before:.2f}")
    print("forming a gloo group on the store alone (init_process_group to the first barrier)")
    print(f"  {'torch TCPStore (open)':<28} {_summary(stores['tcp'])}")
    print(f"  {'gpumagic store (owner only)':<28} {_summary(stores['secure'])}")
    print(f"  ratio gpumagic / TCPStore: {statistics.median(stores['secure']) / statistics.median(stores['tcp']):.2f}")


if __name__ == "__main__":
    main()

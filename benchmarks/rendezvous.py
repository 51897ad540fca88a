"""What the owner-only rendezvous store (issues #24, #37) costs, side by side in one run.

    python benchmarks/rendezvous.py [--repeats 20] [--baseline REV]

For this checkout and, with ``--baseline REV``, gpumagic as it was at that git revision:

1. a fresh ``launch_ddp`` of 2 gloo ranks doing one ``all_reduce`` (warm rank server), median and p90 in ms;
2. a ``%ddp`` group re-formed on a fresh rendezvous (``GroupRecovery.reform``, as after a stuck collective), ms;
3. an elastic launch on this machine (``rdzv_endpoint="127.0.0.1:0"``: agent, TCP stores), ms;
4. the store itself: a client's connect and handshake, in us, on a Unix socket and on loopback TCP; a set and
   get on a connection (each frame's tag), in us;
5. joins under a flood: 20 connects of the owner while a flooder (``tests/store_attacks.FLOOD``) opens
   connections as fast as it can and keeps each one alive with a byte every half second; median, slowest,
   and how many did not get in within 10 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jobs import _packages, _run_script  # a sibling script's helpers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.store_attacks import FLOOD  # the flooder of the two-user test

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
    out = {"launch": [], "reform": [], "elastic": []}
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
    for _ in range(max(3, repeats // 4)):
        started = time.perf_counter()
        values = gpumagic.launch_ddp(one_reduce, 2, gpus="none", write=lambda text: None, rdzv_endpoint="127.0.0.1:0")
        assert values == {0: 2.0, 1: 2.0}
        out["elastic"].append((time.perf_counter() - started) * 1000)
    print(json.dumps(out))

if __name__ == "__main__":  # the rank server imports this file as __mp_main__
    main()
"""


STORE = r"""
import json, os, subprocess, sys, tempfile, time
from gpumagic.launch import secure_store
try:  # after issue #37: a run's key and a role; the server in its own module
    from gpumagic.launch.store_server import StoreServer
    OPTIONS = {"role": "group"}
except ImportError:
    StoreServer, OPTIONS = secure_store.StoreServer, {}
KEY = b"k" * 32
FLOOD, STOP = sys.argv[2], tempfile.mktemp(prefix="gpumagic-bench-flood-")


def serve(address):
    return StoreServer(secure_store.listen(address), None if address.startswith("tcp") else address, key=KEY,
                       **OPTIONS)


def connect(address, timeout=10):
    return secure_store.connect(address, timeout, key=KEY, **OPTIONS)


def timed(call, times):
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e6 / times


def main():
    count, out = int(sys.argv[1]), {}
    directory = tempfile.mkdtemp(prefix="gpumagic-bench-")
    for kind, address in (("unix", f"unix:{directory}/store.sock"), ("tcp", "tcp:127.0.0.1:0")):
        server = serve(address)
        connect(server.address).close()
        out[f"connect {kind}"] = [timed(lambda: [connect(server.address).close() for _ in range(50)], 50)
                                  for _ in range(count)]
        client = connect(server.address)
        out[f"set+get {kind}"] = [timed(lambda: [(client.set("k", b"v" * 64), client.get("k")) for _ in range(200)],
                                        200) for _ in range(count)]
        server.close()
    server = serve("tcp:127.0.0.1:0")
    port = server.listener.getsockname()[1]
    for flooded in (False, True):
        flooder = None
        if flooded:
            flooder = subprocess.Popen([sys.executable, "-c", FLOOD, str(port), STOP], stdout=subprocess.PIPE)
            flooder.stdout.readline()
            time.sleep(2)
        joins, failed = [], 0
        for _ in range(20):
            started = time.monotonic()
            try:
                client = connect(server.address, 10)
                client.set("joined", b"1")
                client.close()
                joins.append(time.monotonic() - started)
            except Exception:
                failed += 1
        out["flooded" if flooded else "quiet"] = {"joins": joins, "failed": failed}
        if flooder is not None:
            open(STOP, "w").close()
            flooder.communicate(timeout=60)
            os.unlink(STOP)
    server.close()
    print(json.dumps(out))


main()
"""


def _summary(values: list[float], unit: str = "ms") -> str:
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(len(values) * 0.9))]
    return f"median {statistics.median(values):7.1f} {unit}   p90 {p90:7.1f} {unit}   (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--baseline", metavar="REV", help="also measure gpumagic as it was at this git revision")
    options = parser.parse_args()
    packages = _packages(options.baseline)
    rows = [(label, _run_script(CHILD, env, str(options.repeats))) for label, env in packages]
    print(f"2 gloo ranks on the CPU, {options.repeats} repeats each, side by side\n")
    for what, key in (
        ("fresh launch_ddp, one all_reduce", "launch"),
        ("%ddp group re-formed", "reform"),
        ("elastic launch on this machine (agent, TCP stores)", "elastic"),
    ):
        _compare(what, [(label, measured[key]) for label, measured in rows], "ms")
    stores = [(label, _run_script(STORE, env, str(options.repeats), FLOOD)) for label, env in packages]
    print(f"\nthe store: {options.repeats} rounds of 50 connects (200 set+get), us per connect (per set+get)")
    for key in ("connect unix", "connect tcp", "set+get unix", "set+get tcp"):
        _compare(key, [(label, measured[key]) for label, measured in stores], "us")
    print("\n20 joins (connect, handshake, one set) on loopback TCP, quiet and under a flood of slow senders")
    for label, measured in stores:
        for state in ("quiet", "flooded"):
            joins, failed = measured[state]["joins"], measured[state]["failed"]
            spread = ""
            if joins:
                spread = f"median {statistics.median(joins) * 1000:7.1f} ms   slowest {max(joins) * 1000:7.1f} ms"
            print(f"  {label:<28} {state:<8} {spread}   not in within 10 s: {failed}/20")


def _compare(what: str, rows: list[tuple[str, list[float]]], unit: str) -> None:
    print(what)
    medians = []
    for label, values in rows:
        medians.append(statistics.median(values))
        print(f"  {label:<28} {_summary(values, unit)}")
    if len(medians) == 2:
        difference, ratio = medians[1] - medians[0], medians[1] / medians[0]
        print(f"  this checkout - baseline: {difference:+.1f} {unit} (ratio {ratio:.2f})")


if __name__ == "__main__":
    main()

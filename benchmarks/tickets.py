"""Forged queue tickets (issue #24, part 2): how long another user's tickets keep a waiting pick from free GPUs,
this checkout beside a baseline revision, in one run. Needs root (it makes two real users, as the tests do).

    python benchmarks/tickets.py [--repeats 3] [--wait 60s] [--baseline REV] [--tickets 1000] [--only attacks]
                                 [--attacks held,rotate]

1. For each attack of ``tests/ticket_attacks.py`` (``rotate``, ``held``, ``old-ticket``, ``fake-runner``; or
   ``--attacks``), on a simulated server of 4 free A100s: the seconds from the start of Alice's
   ``pick(1, wait=WAIT)`` to her GPU, or ``failed`` when she got none within WAIT. Median and worst of the
   repeats.
2. Reading the queue when Bob holds ``--tickets`` forged tickets (each locked by his process, of the largest
   size a ticket may have: 64 UUIDs, 64 excluded GPUs): Alice's ``%gpu status`` and one look of a waiting pick
   (``place`` with her ticket), median of 20, ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))
from jobs import _packages  # noqa: E402 - a sibling script's helper

from tests import ticket_attacks  # noqa: E402
from tests.two_users import FAKES, created_users, shared_directory  # noqa: E402

MANY = """
import fcntl, json, os, secrets, sys, time
d, uid, pid, n = os.environ["GPUMAGIC_LEASE_DIR"], os.getuid(), os.getpid(), int(sys.argv[1])
held = []
uuids = [f"GPU-{k:08x}-0000-0000-0000-{k:012x}" for k in range(64)]  # the largest a ticket may be
request = {"count": 4, "uuids": uuids, "exclude": list(range(64))}
for k in range(n):
    path = f"{d}/queue.{uid}.pick-{pid}.{secrets.token_hex(6)}.json"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"kind": "pick", "name": "b" * 120, "request": request, "round": 0,
                             "submitted_ns": time.time_ns()}).encode())
    os.fchmod(fd, 0o644)
    held.append(fd)
print("ready", flush=True)
time.sleep(600)
"""

READ_COST = """
import json, os, statistics, time
import gpumagic
from gpumagic.devices import leases, placement
from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.pick_lock import pick_lock

def timed(call, repeats=20):
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)

inventory = read_inventory()
request = placement.Request(1, shares=False)
mine = placement.Ticket.create("alice", request, time.time(), f"pick-{os.getpid()}", kind="pick")

def look():
    with pick_lock(exclusive=False):
        placement.place(request, inventory, leases.read_view(leases.book()), mine)

print(json.dumps({"status": timed(gpumagic.status), "look": timed(look)}))
"""


def attacks(repeats: int, wait: str, baseline: str | None, which: tuple[str, ...]) -> None:
    print(f"a waiting pick(1, wait={wait!r}) on 4 free simulated A100s, under each attack; seconds to a GPU,")
    print(f"median and worst of {repeats} (failed: none within {wait}):")
    for label, env in _packages(baseline):
        with _two_users(env) as (alice, bob), tempfile.TemporaryDirectory(prefix="gpumagic-bench-") as tmp:
            shared = Path(tmp)
            os.chmod(shared, 0o755)
            leases = shared_directory(shared / "leases")
            server = ticket_attacks.server_file(shared, bob.name)
            for user in (alice, bob):
                user.base_env.update(GPUMAGIC_SIMULATE=str(server), GPUMAGIC_LEASE_DIR=str(leases))
            for attack in which:
                seconds = []
                for _ in range(repeats):
                    answer = ticket_attacks.run(attack, alice, bob, wait=wait)
                    seconds.append(answer["seconds"] if answer["got"] is not None else float("inf"))
                    for name in os.listdir(leases):  # what the attack left
                        (leases / name).unlink(missing_ok=True)
                middle, worst = _show(statistics.median(seconds)), _show(max(seconds))
                print(f"  {label:28} {attack:12} median {middle}  worst {worst}")


def read_cost(tickets: int, baseline: str | None) -> None:
    print(f"\nreading the queue with {tickets} forged tickets of another user (each locked, 64 UUIDs),")
    print("median of 20, ms:")
    for label, env in _packages(baseline):
        with _two_users(env) as (alice, bob), tempfile.TemporaryDirectory(prefix="gpumagic-bench-") as tmp:
            shared = Path(tmp)
            os.chmod(shared, 0o755)
            leases = shared_directory(shared / "leases")
            for user in (alice, bob):
                user.base_env.update(GPUMAGIC_SIMULATE="4xA100-80GB", GPUMAGIC_LEASE_DIR=str(leases))
            forger = bob.popen([bob.python, "-c", MANY, str(tickets)])
            try:
                assert forger.stdout.readline().strip() == b"ready"
                answer = alice.json(READ_COST, timeout=600)
                print(f"  {label:28} %gpu status {answer['status']:8.1f}   a waiting pick's look {answer['look']:8.1f}")
            finally:
                forger.kill()
                forger.wait()


def _two_users(env: dict[str, str]):
    """Alice and Bob running the gpumagic of ``env`` (a baseline's copy is made readable to them)."""
    import sysconfig

    os.chmod(env["PYTHONPATH"], 0o755)
    site = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    return created_users([env["PYTHONPATH"], str(FAKES), *site])


def _show(seconds: float) -> str:
    return "  failed" if seconds == float("inf") else f"{seconds:6.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--wait", default="60s", help="how long the waiting pick waits (the issue's 60s)")
    parser.add_argument("--baseline", metavar="REV", help="also with gpumagic as it was at this git revision")
    parser.add_argument("--tickets", type=int, default=1000, help="forged tickets for the reading cost")
    parser.add_argument("--only", choices=["attacks", "reading"], help="run only this scenario")
    parser.add_argument("--attacks", default=",".join(ticket_attacks.ATTACKS), help="which attacks, comma-separated")
    options = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: it makes two real users (useradd, runuser, userdel), as the shared-server tests do")
    if options.only != "reading":
        attacks(options.repeats, options.wait, options.baseline, tuple(options.attacks.split(",")))
    if options.only != "attacks":
        read_cost(options.tickets, options.baseline)


if __name__ == "__main__":
    main()

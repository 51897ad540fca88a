"""Forged queue tickets (issue #24, part 2): what another user (Bob) does to keep a waiting pick (Alice's) from
free GPUs, as scripts Bob runs, and Alice's waiting pick, timed. Used by ``tests/unit/test_shared_leases.py`` (which
asks that Alice gets a GPU) and ``benchmarks/tickets.py`` (which times it, this checkout beside a baseline).

Each attack starts in Bob's process, prints ``ready`` once its tickets are in place, and runs until killed:

- ``rotate``: a ticket of round 2^20 (the highest a ticket may carry), so that Alice's ticket takes that round;
  once hers is there, two tickets of rounds 0 and 1 asking for every GPU, made anew under new names every 2 s.
- ``held``: two tickets asking for every GPU, made before Alice waits and held by Bob's process as a waiting
  kernel holds its own, never taken up: what the hold-up budget bounds.
- ``old-ticket``: the same, while a new process of Bob's takes a lease every second.
- ``fake-runner``: a job's ticket held by a process that passes for that job's gpumagic runner (``python -m
  gpumagic.jobs.runner RUN_DIR``, his own module), asking for every GPU with all but 512 MiB of their memory
  free (Bob's own processes use more): it cannot start, and waits past the backfill bound (1 s for Alice here).
  The runner check is a filter, not a proof: a module of that name on Bob's own path passes it (issue #37).
- ``pick-lock``: Bob's process holds its own pick lock (exclusive) for as long as it likes (issue #37).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

ATTACKS = ("rotate", "held", "old-ticket", "fake-runner", "pick-lock")
BOUND = "1s"  # Alice's backfill bound: the fake runner's ticket is past it at once

_TICKET = """
import fcntl, json, os, secrets, sys, time
d, uid, pid = os.environ["GPUMAGIC_LEASE_DIR"], os.getuid(), os.getpid()

def ticket(turn, count=4, kind="pick", key=f"pick-{pid}", request=None):
    path = f"{d}/queue.{uid}.{key}.{secrets.token_hex(6)}.json"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    record = {"kind": kind, "name": "bob", "request": request or {"count": count}, "round": turn}
    os.write(fd, json.dumps({**record, "submitted_ns": time.time_ns()}).encode())
    os.fchmod(fd, 0o644)
    return fd, path

def drop(held):
    os.unlink(held[1])
    os.close(held[0])

def alice_waits():
    return any(n.startswith("queue.") and not n.startswith(f"queue.{uid}.") for n in os.listdir(d))
"""

ROTATE = (
    _TICKET
    + """
poison = ticket(1 << 20)
print("ready", flush=True)
while not alice_waits():
    time.sleep(0.005)
current = [ticket(0), ticket(1)]
drop(poison)
while True:
    time.sleep(2)
    new = [ticket(0), ticket(1)]
    for held in current:
        drop(held)
    current = new
"""
)

HELD = (
    _TICKET
    + """
held = [ticket(0), ticket(1)]
print("ready", flush=True)
time.sleep(600)
"""
)

OLD_TICKET = (
    _TICKET
    + """
import subprocess
held = [ticket(0), ticket(1)]
print("ready", flush=True)
TAKE = "import gpumagic, sys, time; sys.stdin.read(1); gpumagic.use('3'); time.sleep(0.02)"
while True:
    time.sleep(1)
    subprocess.run([sys.executable, "-c", TAKE], input=b"x", capture_output=True)  # the lease, once imported
"""
)

FAKE_RUNNER = (
    _TICKET
    + """
total = int(os.environ["TOTAL"])
held = ticket(0, kind="job", key="run-b", request={"count": 4, "min_free": total - (512 << 20)})
time.sleep(1.5)  # past Alice's backfill bound
print("ready", flush=True)
time.sleep(600)
"""
)

PICK_LOCK = """
import fcntl, os, time
d = os.environ["GPUMAGIC_LEASE_DIR"]
own = os.open(f"{d}/pick.{os.getuid()}.{os.getpid()}.abc.lock", os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(own, fcntl.LOCK_EX)
print("ready", flush=True)
time.sleep(600)
"""

WAITING_PICK = """
import gpumagic, json, os, time
messages = []
started = time.monotonic()
try:
    got = list(gpumagic.pick(1, wait=os.environ["WAIT"], on_wait=messages.append).indices)
except Exception as err:  # NotEnoughGpusError, or (before issue #37, under a held pick lock) LeaseBusy
    got = None
    messages.append(f"{type(err).__name__}: {err}")
seconds = time.monotonic() - started
try:
    status = gpumagic.status().status
    ignored, passed_over = status.ignored, list(getattr(status, "passed_over", ()))
    why = repr(gpumagic.why(1)) if hasattr(gpumagic, "why") else ""  # (a baseline's gpumagic, in the benchmark)
except Exception as err:  # before issue #37, a held pick lock: LeaseBusy
    ignored, passed_over, why = {}, [], f"{type(err).__name__}: {err}"
print(json.dumps({"seconds": seconds, "got": got, "messages": sorted(set(messages)), "ignored": ignored,
                  "passed_over": passed_over, "why": why}))
"""


def server_file(directory: Path, bob: str) -> Path:
    """A simulated server of 4 idle A100s on each of which a process of Bob's uses 1 GiB (both users read it)."""
    path = directory / "server.json"
    process = {"pid": 4242, "user": bob, "command": "python bob.py", "memory": "1GB"}
    gpus = [{"model": "A100-80GB", "utilization": 0, "processes": [{**process, "pid": 4242 + k}]} for k in range(4)]
    path.write_text(json.dumps({"gpus": gpus}))
    path.chmod(0o644)
    return path


def run(attack: str, alice, bob, wait: str = "30s") -> dict:
    """Start ``attack`` as Bob, then time Alice's ``pick(1, wait=wait)``; what her script printed."""
    if attack == "fake-runner":
        fake = bob.home / "fake" / "gpumagic" / "jobs"
        assert bob.sh(f"mkdir -p {fake} && touch {fake.parent}/__init__.py {fake}/__init__.py").returncode == 0
        (bob.home / "runner.py").write_text(FAKE_RUNNER)
        assert bob.sh(f"cp {bob.home}/runner.py {fake}/runner.py").returncode == 0
        argv = [bob.python, "-m", "gpumagic.jobs.runner", str(bob.home / "runs" / "run-b")]  # as a runner's
        env = {"PYTHONPATH": f"{bob.home / 'fake'}:{bob.base_env['PYTHONPATH']}", "TOTAL": str(80 << 30)}
    else:
        scripts = {"rotate": ROTATE, "held": HELD, "old-ticket": OLD_TICKET, "pick-lock": PICK_LOCK}
        argv = [bob.python, "-c", scripts[attack]]
        env = {}
    attacker = bob.popen(argv, **env)
    try:
        line = attacker.stdout.readline().strip()
        assert line == b"ready", line + attacker.stdout.read(2000)
        began = time.monotonic()
        answer = alice.json(WAITING_PICK, timeout=120, WAIT=wait, GPUMAGIC_BACKFILL_BOUND=BOUND)
        answer["wall"] = time.monotonic() - began
        return answer
    finally:
        attacker.kill()
        attacker.wait()

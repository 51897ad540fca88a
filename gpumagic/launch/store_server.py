"""The server of a ``secure_store``: one store's keys, served from threads of the process that holds its
listening socket (rank 0, or the agent hosting a multi-node rendezvous) until ``close``.

A stranger can neither learn anything from it nor keep its owner out (issue #37):

- Every unproven connection lives at most ``HANDSHAKE_TIMEOUT_S`` from its accept, whatever it sends: one
  thread waits on all of them at once (``selectors``), so a flood costs file descriptors, not threads.
- How many may wait is bounded by the process's file descriptors (its soft limit is raised to the hard one,
  up to ``MAX_PENDING``), and each source address may hold at most a quarter of them. When either bound is met,
  the oldest unproven connection (of that source) is dropped: the owner's rank or agent, which answers the
  challenge in a millisecond, is always among the newest.
- Only a connection that proved this store's key (``secure_store.StoreIdentity``) gets a thread: its session,
  every frame of which carries the session's tag.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hmac
import logging
import os
import resource
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gpumagic.launch.secure_store import (
    ADD,
    APPEND,
    CHALLENGE,
    CHECK,
    COMPARE_SET,
    DELETE,
    FAILED,
    GET,
    HANDSHAKE_TIMEOUT_S,
    HELLO,
    LIST_KEYS,
    MAGIC,
    MULTI_GET,
    MULTI_SET,
    NONCE,
    NUM_KEYS,
    OK,
    SET,
    TIMED_OUT,
    WAIT,
    Session,
    StoreIdentity,
    StoreTampered,
    connect,
    listener_address,
    parse_address,
)

MAX_PENDING = 1 << 16  # unproven connections at most, whatever the descriptor limit allows
SPARE_DESCRIPTORS = 256  # left to the process itself (its ranks' pipes, gloo's sockets, files)
ACCEPTS_PER_ROUND = 512  # then the waiting handshakes get their turn
_log = logging.getLogger(__name__)


def pending_capacity() -> int:
    """How many unproven connections a server may hold: raised once to what the descriptor limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_PENDING + SPARE_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    limit = MAX_PENDING + SPARE_DESCRIPTORS if soft == resource.RLIM_INFINITY else soft
    return max(64, min(MAX_PENDING, limit - SPARE_DESCRIPTORS))


@dataclass(eq=False, slots=True)
class _Pending:
    """An accepted connection that has not proved the key yet."""

    connection: socket.socket
    source: str
    deadline: float
    nonce: bytes
    received: bytearray = field(default_factory=bytearray)
    done: bool = False


@dataclass
class ServerCounts:
    """What happened to the connections a server accepted (for tests, benchmarks and the log)."""

    proven: int = 0
    refused: int = 0  # answered the challenge without the key
    expired: int = 0  # still unproven at the deadline
    evicted: int = 0  # dropped to make room for newer ones
    tampered: int = 0  # proven sessions that then sent a frame without the session's tag


class StoreServer:
    """Serves one store on a listening socket until ``close``. Only connections that prove ``identity``'s key
    for this store reach the keys.

    Args:
        listener: a listening socket (``secure_store.listen``), bound already.
        address: the address clients were told (as published); the listener's own by default.
        key, role: the run's store key and this store's role (``secure_store.RENDEZVOUS`` or ``GROUP``).
    """

    def __init__(self, listener: socket.socket, address: str | None = None, *, key: bytes, role: str) -> None:
        self.listener = listener
        self.address = address or listener_address(listener)  # a Unix socket's: its path as bound
        self.identity = StoreIdentity(key, role, self.address)
        self.counts = ServerCounts()
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._sessions: set[socket.socket] = set()
        self._closed = False
        self._handshakes = _Handshakes(self)
        self._thread = threading.Thread(target=self._handshakes.run, name="gpumagic-store", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections that did not prove the key: refused, expired or evicted."""
        counts = self.counts
        return counts.refused + counts.expired + counts.evicted

    def close(self) -> None:
        """Stop serving: the listener and every connection are closed, a Unix socket's file removed."""
        self._closed = True
        self._handshakes.wake()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        family, where = parse_address(self.address)
        if family == socket.AF_UNIX:
            with contextlib.suppress(OSError):
                os.unlink(where)
        for connection in list(self._sessions):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        with self._changed:
            self._changed.notify_all()

    def _start_session(self, connection: socket.socket, session: Session) -> None:
        self.counts.proven += 1
        threading.Thread(
            target=self._serve, args=(connection, session), name="gpumagic-store-session", daemon=True
        ).start()

    def _serve(self, connection: socket.socket, session: Session) -> None:
        self._sessions.add(connection)
        try:
            while not self._closed:
                code, fields = session.receive(connection)
                status, reply = self._answer(code, fields)
                session.send(connection, status, reply)
        except StoreTampered as err:
            self.counts.tampered += 1
            _log.debug("gpumagic store %s: dropped a session (%s)", self.address, err)
        except (OSError, ConnectionError, struct.error):
            _log.debug("a session of %s ended: the client left", self.address, exc_info=True)
        finally:
            self._sessions.discard(connection)
            connection.close()

    def _answer(self, code: int, fields: list[bytes]) -> tuple[int, list[bytes]]:
        data, changed = self._data, self._changed
        try:
            if code == SET:
                with changed:
                    data[fields[0].decode()] = fields[1]
                    changed.notify_all()
                return OK, []
            if code in (GET, WAIT, MULTI_GET):
                return self._get(code, fields)
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

    def _get(self, code: int, fields: list[bytes]) -> tuple[int, list[bytes]]:
        """GET, WAIT and MULTI_GET: wait until every key is there, or the request's timeout."""
        data, changed = self._data, self._changed
        timeout = float(fields[0]) if fields[0] else None
        keys = [f.decode() for f in fields[1:]]
        deadline = None if timeout is None else time.monotonic() + timeout
        with changed:
            while not all(k in data for k in keys):
                left = None if deadline is None else deadline - time.monotonic()
                if self._closed or (left is not None and left <= 0):
                    return TIMED_OUT, [", ".join(k for k in keys if k not in data).encode()]
                changed.wait(1.0 if left is None else min(left, 1.0))
            return OK, [] if code == WAIT else [data[k] for k in keys]


class _Handshakes:
    """Every unproven connection of one server, waited on by one thread (``epoll``): accepts, challenges, checks
    proofs, drops what is past its deadline or crowds out newer connections."""

    def __init__(self, server: StoreServer) -> None:
        self.server = server
        self.capacity = pending_capacity()
        self.per_source = max(16, self.capacity // 4)
        self.poll = select.epoll()
        self.waker, self._wake_end = socket.socketpair()
        self.waker.setblocking(False)
        self.pending: dict[int, _Pending] = {}  # by file descriptor
        self.oldest: collections.deque[_Pending] = collections.deque()  # accept order is deadline order
        self.by_source: dict[str, collections.deque[_Pending]] = {}
        self.count_by_source: dict[str, int] = {}
        self._nonces: list[bytes] = []
        server.listener.setblocking(False)
        self.listening = server.listener.fileno()
        self.poll.register(self.listening, select.EPOLLIN)
        self.poll.register(self.waker.fileno(), select.EPOLLIN)

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_end.send(b"x")

    def run(self) -> None:
        waker = self.waker.fileno()
        try:
            while not self.server._closed:
                waiting = self._expire()
                for fd, _ in self.poll.poll(-1 if waiting is None else waiting):
                    if fd == self.listening:
                        self._accept()
                    elif fd == waker:
                        with contextlib.suppress(OSError):
                            self.waker.recv(64)
                    elif fd in self.pending:
                        self._read(self.pending[fd])
        except (OSError, ValueError):  # the listener was closed under poll
            if not self.server._closed:
                _log.debug("gpumagic store %s: stopped accepting", self.server.address, exc_info=True)
        finally:
            for pending in list(self.pending.values()):
                self._drop(pending)
            self.poll.close()
            self.waker.close()
            self._wake_end.close()

    def _expire(self) -> float | None:
        """Drop what is past its deadline; the seconds until the next deadline (None: nothing waits)."""
        now = time.monotonic()
        while self.oldest:
            first = self.oldest[0]
            if first.done:
                self.oldest.popleft()
            elif first.deadline <= now:
                self.oldest.popleft()
                self.server.counts.expired += 1
                self._drop(first)
            else:
                return first.deadline - now
        return None

    def _accept(self) -> None:
        accept = self.server.listener.accept
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                connection, peer = accept()
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and self._evict_oldest():
                    continue  # out of descriptors: the oldest stranger makes room
                if err.errno in (errno.EMFILE, errno.ENFILE):
                    time.sleep(0.01)  # nothing of ours to drop: let the process close something
                return
            self._challenge(connection, peer)

    def _challenge(self, connection: socket.socket, peer: Any) -> None:
        source = peer[0] if isinstance(peer, tuple) else "unix"
        if self.count_by_source.get(source, 0) >= self.per_source:
            self._evict_oldest(source)
        if len(self.pending) >= self.capacity:
            self._evict_oldest()
        nonce = self._nonce()
        try:
            connection.setblocking(False)
            if source != "unix":  # woken only once the whole answer is there: a slow sender costs no wake-ups
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, HELLO)
            if connection.send(MAGIC + nonce) != CHALLENGE:  # a fresh socket's buffer takes 48 bytes
                raise OSError("short send")
        except OSError:
            connection.close()
            return
        pending = _Pending(connection, source, time.monotonic() + HANDSHAKE_TIMEOUT_S, nonce)
        fd = connection.fileno()
        self.pending[fd] = pending
        self.oldest.append(pending)
        queue = self.by_source.get(source)
        if queue is None:
            queue = self.by_source[source] = collections.deque()
        queue.append(pending)
        count = self.count_by_source[source] = self.count_by_source.get(source, 0) + 1
        if len(queue) > 2 * count + 64:  # settled handshakes leave marks behind
            self.by_source[source] = collections.deque(p for p in queue if not p.done)
        self.poll.register(fd, select.EPOLLIN)

    def _nonce(self) -> bytes:
        """A fresh nonce, from random bytes read 256 nonces at a time (one system call, not one per stranger)."""
        if not self._nonces:
            block = os.urandom(NONCE * 256)
            self._nonces = [block[at : at + NONCE] for at in range(0, len(block), NONCE)]
        return self._nonces.pop()

    def _evict_oldest(self, source: str | None = None) -> bool:
        queue = self.oldest if source is None else self.by_source.get(source, collections.deque())
        while queue:
            pending = queue.popleft()
            if not pending.done:
                self.server.counts.evicted += 1
                self._drop(pending)
                return True
        return False

    def _read(self, pending: _Pending) -> None:
        try:
            chunk = pending.connection.recv(HELLO - len(pending.received))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.server.counts.refused += 1
            self._drop(pending)
            return
        pending.received += chunk
        if len(pending.received) < HELLO:
            return
        self._settle(pending)
        hello = bytes(pending.received)
        theirs, proof = hello[len(MAGIC) : len(MAGIC) + NONCE], hello[len(MAGIC) + NONCE :]
        identity = self.server.identity
        if not hello.startswith(MAGIC) or not hmac.compare_digest(
            proof, identity.proof(b"client", pending.nonce, theirs)
        ):
            self.server.counts.refused += 1
            if self.server.counts.refused in (1, 1000, 100_000):
                _log.debug("gpumagic store %s: refused %d connection(s) without the key (the latest from %s)",
                           self.server.address, self.server.counts.refused, pending.source)  # fmt: skip
            pending.connection.close()
            return
        connection = pending.connection
        try:
            if pending.source != "unix":  # a session's frames are small: wake its reader at the first byte again
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            connection.setblocking(True)
            connection.sendall(identity.proof(b"server", pending.nonce, theirs))
        except OSError:
            connection.close()
            return
        self.server._start_session(connection, identity.session(pending.nonce, theirs, server=True))

    def _settle(self, pending: _Pending) -> None:
        """Take ``pending`` out of the waiting set (its socket stays open)."""
        pending.done = True
        fd = pending.connection.fileno()
        self.pending.pop(fd, None)
        left = self.count_by_source[pending.source] - 1
        if left:
            self.count_by_source[pending.source] = left
        else:
            del self.count_by_source[pending.source]
            self.by_source.pop(pending.source, None)
        with contextlib.suppress(OSError, ValueError):
            self.poll.unregister(fd)

    def _drop(self, pending: _Pending) -> None:
        if pending.done:
            return
        self._settle(pending)
        pending.connection.close()


def serve_and_connect(
    listener: socket.socket, address: str | None, timeout_s: float, *, key: bytes, role: str
) -> tuple[StoreServer, Any]:
    """Serve a store on ``listener`` from this process and connect to it (rank 0, a hosting agent)."""
    server = StoreServer(listener, address, key=key, role=role)
    try:
        return server, connect(server.address, timeout_s, key=key, role=role)
    except BaseException:
        server.close()
        raise

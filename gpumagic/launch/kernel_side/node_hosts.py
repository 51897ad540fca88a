"""The kernel's side of a persistent group across a Slurm allocation's nodes (``%ddp start --nnodes N``): one host
per node (``rank_side.node_host``, started by one ``srun --overlap``) linked to the kernel over a ``secure_store``
session, and a bridge thread that makes each remote rank look local to ``group_members``.

Each remote rank still has the three kernel-side pipes a local rank has; the bridge holds their far ends and
copies, unit by unit, between them and the rank's host: what the kernel writes goes to the host as ``MSG`` or
``STATUS`` frames, what the rank writes comes back into the pipes. A rank's end (``EXIT``, sent after its pipes
drained) wakes ``RemoteRanks.poll`` as a pidfd wakes ``ProcessSet.poll``; a node whose host says nothing for
``node_silence()`` seconds has its ranks ended there and named. No new unauthenticated port: the link listens on
the address the nodes reach the kernel at, on a port it bound itself, and only proofs of this run's key for the
``HOST`` role at that address open it (``store_server``'s handshake rules, flood limits included).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing
import os
import queue
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumagic.launch import secure_store
from gpumagic.launch.allocation import Allocation, srun_command, srun_environment
from gpumagic.launch.host_link import PING_S, Frame, HostStart, number, whole
from gpumagic.launch.kernel_side.group_members import GroupError
from gpumagic.launch.kernel_side.node_agents import last_line, node_timeout
from gpumagic.launch.options import LaunchOptions
from gpumagic.launch.plan import LaunchPlan, Placement, command_environment
from gpumagic.launch.process_set import Exit, ProcessSet
from gpumagic.launch.store_server import StoreServer
from gpumagic.run_dirs.launch_files import store_key
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.private import open_private

_log = logging.getLogger(__name__)

SILENCE_VARIABLE = "GPUMAGIC_NODE_SILENCE"
NODE_SILENCE_S = 5.0  # a host that said nothing for this long (it pings every second) stopped answering
STARTED_TIMEOUT_S = 30.0  # for a host to fork a rank
HOSTS_END_S = 5.0  # for srun to end once its hosts were told to stop
SRUN_GRACE_S = 3.0  # then for srun to end at its SIGTERM


def node_silence() -> float:
    try:
        return max(2.0, float(os.environ.get(SILENCE_VARIABLE, NODE_SILENCE_S)))
    except ValueError:
        return NODE_SILENCE_S


class HostLinkServer(StoreServer):
    """The kernel's listener for its hosts: ``StoreServer``'s handshakes (only the run's key for the ``HOST``
    role at this address proves), but a proven connection is handed to ``arrived`` instead of serving keys."""

    def __init__(self, listener: socket.socket, address: str, *, key: bytes,
                 arrived: Callable[[socket.socket, secure_store.Session], None]) -> None:  # fmt: skip
        self.arrived = arrived
        super().__init__(listener, address, key=key, role=secure_store.HOST)

    def _start_session(self, connection: socket.socket, session: secure_store.Session) -> None:
        self.counts.proven += 1
        connection.setblocking(True)
        self.arrived(connection, session)


class HostLink:
    """One node's host as the kernel sees it: its proven connection, and whether it still answers."""

    def __init__(self, connection: socket.socket, session: secure_store.Session, node: str) -> None:
        self.connection = connection
        self.session = session
        self.node = node
        self.node_rank = -1
        self.heard = time.monotonic()
        self.sent = time.monotonic()
        self.gone: str | None = None  # why it no longer answers (silent, its link closed, it failed)
        self.bye = threading.Event()
        self._lock = threading.Lock()  # frames are numbered: one writer at a time

    def send(self, code: Frame, *fields: bytes) -> bool:
        """Send one frame; False once the host is gone."""
        if self.gone is not None:
            return False
        try:
            with self._lock:
                self.session.send(self.connection, int(code), fields)
                self.sent = time.monotonic()
            return True
        except OSError:
            _log.debug("the link to %s's host failed; its ranks are ended as lost", self.node, exc_info=True)
            return False

    def receive(self) -> tuple[Frame, list[bytes]]:
        code, fields = self.session.receive(self.connection)
        self.heard = time.monotonic()
        return Frame(code), fields


class RemoteRank:
    """A rank on another node, as ``group_members`` holds a process: its pid there, its host, how it ended.
    ``sentinel`` becomes readable when it ended (as a pidfd would)."""

    remote = True

    def __init__(self, rank: int, host: HostLink) -> None:
        self.rank = rank
        self.host = host
        self.pid = 0
        self.started = threading.Event()
        self.exitcode: int | None = None
        self.ended_at: float | None = None
        self.stopped = False
        self.lost: str | None = None  # why gpumagic ended it without its host's word (the node went silent)
        self.done = threading.Event()
        self.sentinel, self._wake = os.pipe()
        self._lock = threading.Lock()

    @property
    def node(self) -> str:
        return self.host.node

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)

    def settle(self, within: float) -> None:
        """Wait ``within`` seconds for its host's word that it ended (it was told to end); without one, it ended
        here, as stopped and lost."""
        self.join(within)
        self.end(None, time.time(), True, lost=f"node {self.node} did not say it ended")

    def end(self, exitcode: int | None, when: float, stopped: bool, lost: str | None = None) -> None:
        """Record how it ended (the first word wins) and wake whoever polls its sentinel."""
        with self._lock:
            if self.done.is_set():
                return
            self.exitcode, self.ended_at, self.stopped, self.lost = exitcode, when, stopped, lost
            self.done.set()
            with contextlib.suppress(OSError):
                os.write(self._wake, b"x")

    def close(self) -> None:
        for fd in (self.sentinel, self._wake):
            with contextlib.suppress(OSError):
                os.close(fd)


def send_unit(data: bytes) -> bytes:
    """``data`` framed as ``multiprocessing.Connection.send_bytes`` frames it."""
    if len(data) > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", len(data)) + data
    return struct.pack("!i", len(data)) + data


class UnitReader:
    """The whole ``send_bytes`` units in the bytes read, piece by piece, off a pipe."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buffer, units = self.buffer, []
        buffer += data
        while len(buffer) >= 4:
            (size,) = struct.unpack_from("!i", buffer)
            head = 4
            if size == -1:
                if len(buffer) < 12:
                    break
                (size,) = struct.unpack_from("!Q", buffer, 4)
                head = 12
            if len(buffer) < head + size:
                break
            units.append(bytes(buffer[head : head + size]))
            del buffer[: head + size]
        return units


@dataclass(eq=False)
class _Far:
    """The bridge's ends of one remote rank's kernel-side pipes, and what waits to be written into them."""

    rank: RemoteRank
    fds: dict[str, int]  # "message", "status", "output" -> descriptor
    readers: dict[str, UnitReader] = field(default_factory=lambda: {"message": UnitReader(), "status": UnitReader()})
    pending: dict[str, bytearray] = field(default_factory=lambda: {"message": bytearray(), "status": bytearray(),
                                                                   "output": bytearray()})  # fmt: skip
    ending: tuple[int | None, float, bool] | None = None  # its EXIT, applied once ``pending`` is written
    registered: set[str] = field(default_factory=set)

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = {}


class NodeHosts:
    """The hosts of one group, one per node, and the bridge thread. ``start`` links them; ``spawn`` starts a rank
    on its node; ``stop`` ends every rank; ``close`` ends the hosts and srun."""

    def __init__(self, run_dir: Path, plan: LaunchPlan, gpus_per_rank: int, nodes: list[str], address: str,
                 launch: Callable[[list[str], list[str]], list[subprocess.Popen]]) -> None:  # fmt: skip
        """``plan``: the group's, as the kernel made it (each host fills in its node's part); ``gpus_per_rank``:
        of the GPUs Slurm gives each host's step (0: CPU ranks); ``nodes``: where the hosts run, in node order;
        ``address``: the kernel's, as the nodes reach it; ``launch(nodes, command)``: starts the hosts."""
        self.run_dir = Path(run_dir)
        self.plan = plan
        self.gpus_per_rank = gpus_per_rank
        self.nodes = list(nodes)
        self.address = address
        self.launch = launch
        self.links: list[HostLink] = []  # by node rank
        self.launched: list[subprocess.Popen] = []  # srun (or, for a test on one machine, the hosts themselves)
        self.silence_s = node_silence()
        self._far: dict[int, _Far] = {}
        self._abandoned: list[_Far] = []  # replaced before their end was heard: the bridge closes them
        self._arrivals: queue.Queue[tuple[socket.socket, secure_store.Session]] = queue.Queue()
        self._wake_read, self._wake_write = os.pipe()
        self._closing = False
        self._server: HostLinkServer | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def for_group(cls, run_dir: Path, launch: LaunchOptions, placed: Placement) -> NodeHosts:
        """The hosts of a group ``launch`` asks for across its allocation's nodes (``placed``: one node's ranks),
        started by srun; not started yet."""
        allocation = launch.allocation
        assert allocation is not None  # LaunchOptions checked: inside one, with enough nodes, srun on PATH
        nodes = group_nodes(allocation, launch.nnodes)
        plan = LaunchPlan(
            run_dir=str(run_dir),
            nprocs=len(placed.rank_gpus),
            master_port=0,
            backend=placed.backend or "gloo",
            rank_gpus=placed.rank_gpus,
            use_cuda=placed.use_cuda,
            threads_per_rank=1,
            timeout_s=launch.timeout_s,
            launcher_pid=0,
            nnodes=len(nodes),
            hang_after_s=launch.hang_after_s,
        )
        per_rank = launch.gpus_per_rank if placed.use_cuda else 0
        return cls(run_dir, plan, per_rank, nodes, allocation.address, start_with_srun(allocation, run_dir))

    # --- start ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Listen on the kernel's address, start one host on each node, and link them in node order (``nodes``
        then names the nodes as their hosts did).

        Raises:
            GroupError: a node's host did not answer in time (named), or failed.
        """
        files, nodes = RunFiles(self.run_dir), self.nodes
        listener = secure_store.listen(secure_store.tcp_address(self.address, 0))
        published = secure_store.listener_address(listener, self.address)
        self._server = HostLinkServer(listener, published, key=store_key(files),
                                      arrived=lambda c, s: self._arrivals.put((c, s)))  # fmt: skip
        command = [sys.executable, "-m", "gpumagic.host", "--connect", published, "--run-dir", str(self.run_dir)]
        self.launched = self.launch(nodes, command)
        links: dict[int, HostLink] = {}
        deadline = time.monotonic() + node_timeout()
        while len(links) < len(nodes):
            try:
                connection, session = self._arrivals.get(timeout=0.25)
            except queue.Empty:
                self._check_launched(nodes, links, deadline)
                continue
            link = _hello(connection, session)
            if link is None:
                continue
            free = [n for n in range(len(nodes)) if n not in links]
            link.node_rank = next((n for n in free if nodes[n].split(".")[0] == link.node), free[0])
            links[link.node_rank] = link
        self.links = [links[n] for n in range(len(nodes))]
        self.nodes = [link.node for link in self.links]
        for link in self.links:
            link.send(Frame.START, HostStart(self.plan, link.node_rank, self.gpus_per_rank).encode())
        self._thread = threading.Thread(target=self._bridge, name="gpumagic-node-hosts", daemon=True)
        self._thread.start()

    def _check_launched(self, nodes: list[str], links: dict[int, HostLink], deadline: float) -> None:
        missing = [node for n, node in enumerate(nodes) if n not in links]
        ended = [p for p in self.launched if p.poll() is not None]
        if ended:
            log = RunFiles(self.run_dir).launch / "hosts.log"
            raise GroupError(
                f"srun ended (exit code {ended[0].returncode}) before node(s) {', '.join(missing)} linked their "
                f"host: {last_line(log)}"
            )
        if time.monotonic() > deadline:
            raise GroupError(
                f"node(s) {', '.join(missing)} did not answer within {node_timeout():.0f}s (srun started no host "
                f"there); see sinfo -n {','.join(missing)}, or set GPUMAGIC_NODE_TIMEOUT to wait longer"
            )

    # --- ranks ---------------------------------------------------------------------------------------------

    def host_of(self, rank: int) -> HostLink:
        return self.links[rank // self.plan.nprocs]

    def spawn(self, rank: int, writer: Any, theirs: Any, status_theirs: Any) -> RemoteRank:
        """Start global rank ``rank`` on its node, its kernel-side pipes' far ends bridged to it.

        Raises:
            GroupError: its node does not answer (named), or did not start it.
        """
        host = self.host_of(rank)
        cannot = "rank {rank} cannot start there; %ddp restart starts a fresh group"
        if host.gone is not None:
            raise GroupError(f"{host.gone}: {cannot.format(rank=rank)}")
        remote = RemoteRank(rank, host)
        fds = {"message": os.dup(theirs.fileno()), "status": os.dup(status_theirs.fileno()),
               "output": os.dup(writer.fileno())}  # fmt: skip
        for fd in fds.values():
            os.set_blocking(fd, False)
        old = self._far.get(rank)
        if old is not None and old.fds:  # one whose end was not heard (killed, silent): the bridge lets it go
            self._abandoned.append(old)
        self._far[rank] = _Far(remote, fds)  # before SPAWN: the bridge finds it for the rank's first words
        self._wake()
        if not host.send(Frame.SPAWN, number(rank)):
            host.gone = host.gone or f"node {host.node}'s host ended (its link failed)"
            raise GroupError(f"{host.gone}: {cannot.format(rank=rank)}")
        deadline = time.monotonic() + STARTED_TIMEOUT_S
        while not remote.started.wait(0.1):
            if host.gone is not None or time.monotonic() > deadline:
                why = host.gone or f"no answer within {STARTED_TIMEOUT_S:.0f}s"
                raise GroupError(
                    f"node {host.node} did not start rank {rank} ({why}); %ddp restart starts a fresh group"
                )
        return remote

    def signal(self, rank: int, signum: int) -> None:
        self.host_of(rank).send(Frame.SIGNAL, number(rank), number(int(signum)))

    def kill(self, rank: int) -> None:
        self.host_of(rank).send(Frame.KILL, number(rank))

    def stop(self, first: int, grace_s: float) -> None:
        """Every host ends its ranks (``first``, SIGKILL after ``grace_s``) and says BYE; waits for that."""
        for link in self.links:
            link.send(Frame.STOP, number(int(first)), number(grace_s))
        deadline = time.monotonic() + grace_s + HOSTS_END_S
        for link in self.links:
            while link.gone is None and not link.bye.wait(0.05) and time.monotonic() < deadline:
                pass

    def close(self) -> None:
        """End the hosts (they end their ranks when their link closes) and srun; stop listening."""
        if self._closing:
            return
        self._closing = True
        self._wake()
        if self._thread is not None:
            self._thread.join(5.0)
        for link in self.links:
            with contextlib.suppress(OSError):
                link.connection.close()
        if self._server is not None:
            self._server.close()
        deadline = time.monotonic() + HOSTS_END_S
        for process in self.launched:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
        srun = ProcessSet([p for p in self.launched if p.poll() is None])
        srun.stop(signal.SIGTERM, grace_s=SRUN_GRACE_S)  # srun: SIGTERM ends its step's tasks; SIGKILL after
        srun.close()
        for far in [*self._far.values(), *self._abandoned]:
            far.close()
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")

    # --- the bridge ----------------------------------------------------------------------------------------

    def _bridge(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_read, selectors.EVENT_READ, ("wake", None, ""))
        for link in self.links:
            selector.register(link.connection, selectors.EVENT_READ, ("host", link, ""))
        try:
            while not self._closing:
                while self._abandoned:
                    self._forget(selector, self._abandoned.pop())
                for far in list(self._far.values()):
                    self._interest(selector, far)
                for key, mask in selector.select(0.25):
                    kind, owner, role = key.data
                    if kind == "wake":
                        with contextlib.suppress(OSError):
                            os.read(self._wake_read, 4096)
                    elif kind == "host":
                        self._from_host(selector, owner)
                    else:
                        self._far_ready(selector, owner, role, mask)
                self._keep_links(selector)
        except Exception:  # noqa: BLE001 - the bridge must say why it stopped; the ranks are then lost
            _log.warning("gpumagic: the bridge to the group's nodes failed; its ranks are ended", exc_info=True)
            for link in self.links:
                self._lose(selector, link, f"the kernel's link to node {link.node} failed")
        finally:
            selector.close()

    def _interest(self, selector: selectors.BaseSelector, far: _Far) -> None:
        """Watch what the kernel writes to a rank, and a pipe with bytes waiting for room."""
        for role, fd in far.fds.items():
            events = selectors.EVENT_READ if role != "output" else 0
            if far.pending[role]:
                events |= selectors.EVENT_WRITE
            data = ("far", far, role)
            if role in far.registered:
                if events:
                    selector.modify(fd, events, data)
                else:
                    selector.unregister(fd)
                    far.registered.discard(role)
            elif events:
                selector.register(fd, events, data)
                far.registered.add(role)

    def _forget(self, selector: selectors.BaseSelector, far: _Far) -> None:
        for role in list(far.registered):
            with contextlib.suppress(KeyError, ValueError, OSError):
                selector.unregister(far.fds[role])
        far.registered.clear()
        far.close()

    def _from_host(self, selector: selectors.BaseSelector, link: HostLink) -> None:
        try:
            code, fields = link.receive()
        except (OSError, ConnectionError, struct.error, ValueError) as err:
            self._lose(selector, link, f"node {link.node}'s host ended ({err})")
            return
        if code in (Frame.PING, Frame.HELLO):
            return
        if code is Frame.BYE:
            link.bye.set()
            return
        if code is Frame.FAILED:
            self._lose(selector, link, f"node {link.node}'s host failed: {fields[0].decode(errors='replace')}")
            return
        rank = whole(fields[0])
        far = self._far.get(rank)
        if far is None or far.rank.host is not link:
            return
        if code is Frame.STARTED:
            far.rank.pid = whole(fields[1])
            far.rank.started.set()
            return
        if not far.rank.started.is_set():
            return  # the last words of the rank this one replaces (killed, its end not heard in time): its host
            # sends them before the new one's STARTED
        if code is Frame.MSG:
            far.pending["message"] += send_unit(fields[1])
        elif code is Frame.STATUS:
            far.pending["status"] += send_unit(fields[1])
        elif code is Frame.OUT:
            far.pending["output"] += fields[1]
        elif code is Frame.EXIT:
            exitcode = int(fields[2].decode()) if fields[2] else None
            far.ending = (exitcode, float(fields[3].decode()), fields[4] == b"1")
        self._flush(selector, far)

    def _far_ready(self, selector: selectors.BaseSelector, far: _Far, role: str, mask: int) -> None:
        if mask & selectors.EVENT_READ and role in far.fds:
            try:
                data = os.read(far.fds[role], 1 << 20)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":  # the kernel closed its end (the member was released)
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(far.fds[role])
                far.registered.discard(role)
                with contextlib.suppress(OSError):
                    os.close(far.fds.pop(role))
            elif data:
                code = Frame.MSG if role == "message" else Frame.STATUS
                for unit in far.readers[role].feed(data):
                    far.rank.host.send(code, number(far.rank.rank), unit)
        if mask & selectors.EVENT_WRITE:
            self._flush(selector, far)

    def _flush(self, selector: selectors.BaseSelector, far: _Far) -> None:
        """Write what waits for the kernel's pipes (as much as they take now); a rank whose EXIT came and whose
        words are all in ends now."""
        for role, pending in far.pending.items():
            fd = far.fds.get(role)
            while pending and fd is not None:
                try:
                    written = os.write(fd, pending[: 1 << 20])
                except BlockingIOError:
                    break
                except OSError as err:  # the kernel closed its end: nobody reads it any more
                    if err.errno not in (errno.EPIPE, errno.EBADF, errno.ECONNRESET):
                        _log.debug("a rank's pipe failed; what waited is dropped", exc_info=True)
                    pending.clear()
                    break
                del pending[:written]
        if far.ending is not None and not any(far.pending.values()):
            exitcode, when, stopped = far.ending
            self._forget(selector, far)
            far.rank.end(exitcode, when, stopped)

    def _keep_links(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        for link in self.links:
            if link.gone is not None:
                continue
            if now - link.heard > self.silence_s and not select.select([link.connection], [], [], 0)[0]:
                self._lose(selector, link, f"node {link.node} stopped answering (nothing for {self.silence_s:.0f}s)")
            elif now - link.sent > PING_S and not link.send(Frame.PING):
                self._lose(selector, link, f"node {link.node}'s host ended (its link failed)")

    def _lose(self, selector: selectors.BaseSelector, link: HostLink, why: str) -> None:
        """A host is gone: its ranks end here, named (its link is closed: a host still alive ends them there)."""
        if link.gone is not None:
            return
        link.gone = why
        with contextlib.suppress(KeyError, ValueError, OSError):
            selector.unregister(link.connection)
        with contextlib.suppress(OSError):
            link.connection.shutdown(socket.SHUT_RDWR)
        now = time.time()
        for far in list(self._far.values()):
            if far.rank.host is link and not far.rank.done.is_set():
                with contextlib.suppress(OSError):  # what it said before: given what room there is
                    self._flush(selector, far)
                self._forget(selector, far)
                far.rank.end(None, now, False, lost=f"{why}")


def _hello(connection: socket.socket, session: secure_store.Session) -> HostLink | None:
    """The host's first frame: which node it is on. None (and the connection closed) if it is not a HELLO."""
    try:
        connection.settimeout(10.0)
        code, fields = session.receive(connection)
        connection.settimeout(None)
        if code != Frame.HELLO:
            raise ValueError(f"a host's first frame was {code}, not HELLO")
        _log.debug("node %s's host (pid %s, address %s) linked", *(f.decode() for f in fields[:3]))
        return HostLink(connection, session, fields[0].decode())
    except (OSError, ConnectionError, ValueError, IndexError):
        _log.debug("a proven host did not say HELLO; dropped", exc_info=True)
        with contextlib.suppress(OSError):
            connection.close()
        return None


class RemoteRanks:
    """``group_members``'s process set for ranks on other nodes (the interface of ``ProcessSet``): their ends come
    from their hosts, their signals go there; nothing here is ever signalled on this machine."""

    def __init__(self, hosts: NodeHosts) -> None:
        self.hosts = hosts
        self.processes: list[RemoteRank] = []
        self.exits: dict[int, Exit] = {}
        self.stopped: set[int] = set()

    def __len__(self) -> int:
        return len(self.processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def running(self) -> list[int]:
        return [i for i in range(len(self.processes)) if i not in self.exits]

    def add(self, process: RemoteRank) -> int:
        self.processes.append(process)
        return len(self.processes) - 1

    def replace(self, index: int, process: RemoteRank) -> None:
        self.processes[index].close()
        self.processes[index] = process
        self.exits.pop(index, None)
        self.stopped.discard(index)

    def poll(self, timeout: float = 0.0, also: Iterable[int] = ()) -> tuple[list[Exit], list[int]]:
        also = list(also)
        sentinels = {self.processes[i].sentinel: i for i in self.running}
        ready, _, _ = select.select([*sentinels, *also], [], [], timeout)
        ended = [self._record(sentinels[fd]) for fd in ready if fd in sentinels]
        return [e for e in ended if e is not None], [fd for fd in ready if fd in also]

    def _record(self, index: int) -> Exit | None:
        if index in self.exits:
            return None
        process = self.processes[index]
        when = process.ended_at or time.time()
        exit = Exit(index, process.pid, process.exitcode, when, index in self.stopped or process.stopped)
        self.exits[index] = exit
        return exit

    def gone(self) -> list[Exit]:
        return []  # a host says when a rank ended; /proc here knows nothing of it

    def send_signal(self, index: int, signum: int) -> None:
        self.hosts.signal(self.processes[index].rank, signum)

    def kill(self, index: int) -> Exit:
        """SIGKILL a rank that stays stuck (its host ends its process group); how it ended."""
        self.stopped.add(index)
        process = self.processes[index]
        self.hosts.kill(process.rank)
        process.settle(5.0)
        return self._record(index) or self.exits[index]

    def end_leftovers(self, indices: Iterable[int] | None = None) -> None:
        """Nothing to do here: each host ends what a rank started as the rank ends."""

    def stop(self, first: int = signal.SIGTERM, grace_s: float = 3.0) -> str:
        running = self.running
        self.stopped.update(running)
        self.hosts.stop(first, grace_s)
        for index in running:
            self.processes[index].settle(1.0)
            self._record(index)
        return signal.Signals(first).name

    def close(self) -> None:
        for process in self.processes:
            process.close()


class RemoteStarter:
    """What ``group_members`` starts ranks with, for ranks on the allocation's nodes (``RankStarter``'s part)."""

    def __init__(self, hosts: NodeHosts) -> None:
        self.hosts = hosts
        self.context = multiprocessing.get_context()  # the kernel-side pipes only

    def start(self, rank: int, writer: Any, theirs: Any, status_theirs: Any) -> RemoteRank:
        return self.hosts.spawn(rank, writer, theirs, status_theirs)


def start_with_srun(allocation: Allocation, run_dir: Path) -> Callable[[list[str], list[str]], list[subprocess.Popen]]:
    """How the hosts start inside an allocation: one ``srun --overlap`` step (``gpumagic-host``) over the nodes,
    each node's GPUs Slurm's to give; its output in the run's private launch directory."""

    def launch(nodes: list[str], command: list[str]) -> list[subprocess.Popen]:
        env = srun_environment(command_environment())
        with open_private(RunFiles(run_dir).launch / "hosts.log") as log:
            try:
                return [
                    subprocess.Popen(
                        srun_command(allocation, nodes, command, name="gpumagic-host"),
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # the kernel's interrupt reaches srun only through close
                    )
                ]
            except OSError as err:
                raise GroupError(f"cannot start srun for the group's nodes ({err.strerror})") from None

    return launch


def group_nodes(allocation: Allocation, nnodes: int) -> list[str]:
    """The nodes a group of ``nnodes`` runs on: the kernel's own first when it is on one (its rank 0 there)."""
    return ([allocation.here] if allocation.here else []) + allocation.nodes_to_start(nnodes)

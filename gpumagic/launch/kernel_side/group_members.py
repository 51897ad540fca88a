"""The kernel's side of a persistent group's rank processes (``group.RankGroup``): starting each from the rank
server, watching them (one ``ProcessSet``: every death timed through its pidfd), and talking to them over their
pipes: requests and their replies (a mailbox keyed by rank and request), each rank's output, and a status
channel that answers while the rank runs a cell.

Only the group's own processes are ever signalled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpumagic.errors import GpumagicError
from gpumagic.launch import messages
from gpumagic.launch.messages import READY, STORE, Failed, Reply, ToKernel
from gpumagic.launch.plan import LaunchPlan
from gpumagic.launch.process_set import Exit, ProcessSet
from gpumagic.launch.rank_side.group_rank import serve_group_rank
from gpumagic.launch.rank_side.starter import RankStarter, start_with_pipes
from gpumagic.launch.records import RankState
from gpumagic.run_dirs.outcomes import signal_of

_log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
REPLIES: tuple[type[ToKernel], ...] = (Reply,)  # what ends a request: done, failed or interrupted


class GroupError(GpumagicError):
    """The group could not do what was asked (it is closed, it could not start, a rank could not rejoin)."""


class RankDied(GroupError):
    """Ranks died before they replied."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        super().__init__(
            f"rank {', '.join(map(str, ranks))} died; the group replaces it at the next call (%ddp status shows it)"
        )


class ReplyTimeout(GroupError):
    def __init__(self) -> None:
        super().__init__("the ranks did not answer in time; %ddp restart starts a fresh group")


class RankFailed(Exception):
    """A rank's cell failed while others still run it."""


@dataclass
class Member:
    """The kernel's side of one rank: its process, pipes, and what it holds."""

    rank: int
    process: Any
    pid: int
    connection: Any
    output: Any
    status_connection: Any = None  # answered by the rank's status thread, even while it runs a cell
    status_lock: Any = field(default_factory=threading.Lock)  # one status request at a time on its channel
    own: set[str] = field(default_factory=set)  # names the rank made itself (or were pushed)
    present: set[str] = field(default_factory=set)
    shipped: dict[str, str] = field(default_factory=dict)  # name -> digest of the value the kernel sent
    busy: str | None = None
    end: Exit | None = None  # how its process ended (the group's ProcessSet timed it)
    sending: frozenset[str] = frozenset()  # the kernel names the current cell sends it
    lost: set[str] = field(default_factory=set)  # what the rank it replaced held
    sent_before: frozenset[str] = frozenset()  # the notebook names the rank it replaced had been sent

    @property
    def alive(self) -> bool:
        return self.end is None

    @property
    def exitcode(self) -> int | None:
        return None if self.end is None else self.end.exitcode

    @property
    def died_at(self) -> float | None:
        return None if self.end is None else self.end.time

    @property
    def killed(self) -> bool:
        """By gpumagic, because it stayed stuck."""
        return self.end is not None and self.end.stopped

    @property
    def node(self) -> str | None:
        """The node it runs on, for a rank on another node of an allocation (its host's); None for a local one."""
        return getattr(self.process, "node", None)

    @property
    def lost_with_node(self) -> str | None:
        """Why gpumagic ended it without word of its end (a rank on another node whose node stopped answering)."""
        return getattr(self.process, "lost", None)

    def death(self) -> str:
        """How it ended, for a note."""
        code = self.exitcode
        where = f"pid {self.pid}" + (f" on {self.node}" if self.node else "")
        if self.lost_with_node:
            return f"was lost: {self.lost_with_node} ({where})"
        if how := signal_of(code):
            return f"was killed by {how} ({where})"
        if code is None:  # it ended before its exit code was collected
            return f"ended; its exit code could not be read ({where})"
        return f"exited with code {code} ({where})"

    def release(self) -> None:
        """Close the kernel's ends of its pipes (it has ended)."""
        for handle in (self.connection, self.output, self.status_connection):
            with contextlib.suppress(OSError, AttributeError):
                handle.close()

    def send(self, message: messages.ToRank) -> None:
        with whole_messages():
            try:
                self.connection.send(messages.encode(message))
            except (OSError, ValueError):
                _log.debug("rank %d died (its pidfd says so); a message to it is dropped", self.rank, exc_info=True)


class GroupMembers:
    """The group's ranks, in rank order (iterate, index, ``len``), and the requests the kernel makes of them.

    ``feed(rank, data)`` receives each rank's output; ``check_open()`` raises once the group is closed (no rank
    may start then).
    """

    def __init__(self, feed: Callable[[int, bytes], None], check_open: Callable[[], None]) -> None:
        self.feed = feed
        self.check_open = check_open
        self.starter: Any = None  # how its ranks start: a RankStarter (the plan, the rank server), or a node's host
        self.processes = ProcessSet([], groups=True)  # each rank leads its process group
        self.all: list[Member] = []
        self.partial: dict[int, ToKernel] = {}  # the replies the last wait gathered, when it was cut short
        self._ident = 0
        self._mailbox: dict[tuple[int, int], ToKernel] = {}  # (rank, request) -> its reply
        self.on_round: Callable[[], Any] | None = None  # called every round of a wait (the hang follower's look)
        self.on_debug: Callable[[Member, str, str | None], None] | None = None  # a rank's pdb: text, state
        self._debug_messages: list[tuple[Member, messages.DebugIO]] = []

    def __iter__(self) -> Iterator[Member]:
        return iter(self.all)

    def __getitem__(self, rank: int) -> Member:
        return self.all[rank]

    def __len__(self) -> int:
        return len(self.all)

    # --- life --------------------------------------------------------------------------------------------

    def start(self, context: Any, plan: LaunchPlan) -> None:
        """Start the plan's ranks from ``context`` (the rank server's) and wait until each is ready."""
        self.start_with(RankStarter(plan, context, target=serve_group_rank, name="ddp-rank-{}"), plan.nprocs)

    def start_with(self, starter: Any, nprocs: int, processes: Any = None) -> None:
        """Start ``nprocs`` ranks with ``starter`` (``RankStarter``, or ``node_hosts.RemoteStarter`` for ranks on
        an allocation's nodes, whose ``processes`` are ``node_hosts.RemoteRanks``) and wait until each is ready."""
        self.starter = starter
        if processes is not None:
            self.processes = processes
        for rank in range(nprocs):
            member = self._spawn(rank)
            self.all.append(member)
            self.processes.add(member.process)
        self.await_ready(self.all)

    def _spawn(self, rank: int) -> Member:
        self.check_open()  # closed meanwhile (the kernel is ending): no rank may start now
        starter = self.starter
        assert starter is not None
        started = start_with_pipes(starter.context, lambda *pipes: starter.start(rank, *pipes))
        return Member(rank, started.process, started.process.pid, started.connection, started.output, started.status)

    def replace(self, dead: Member) -> Member:
        """A fresh rank in the place of ``dead`` (not ready yet: ``await_ready``), told what the dead one held."""
        dead.release()
        fresh = self._spawn(dead.rank)
        self.processes.replace(dead.rank, fresh.process)
        fresh.lost = set(dead.own)
        fresh.sent_before = frozenset(dead.shipped)
        self.all[dead.rank] = fresh
        return fresh

    def await_ready(self, members: list[Member]) -> None:
        replies = self.wait(READY, members, time.monotonic() + START_TIMEOUT_S, kinds=(messages.Ready, Failed))
        failed = {r: m.report for r, m in replies.items() if isinstance(m, Failed)}
        if failed:
            rank, report = min(failed.items())
            raise GroupError(f"rank {rank} could not start: {report['type']}: {report['message']}")

    def form(self) -> None:
        """Form a fresh process group: rank 0 serves a new store (``secure_store``), the others join it."""
        first, rest = self.all[0], self.all[1:]
        self._mailbox.pop((0, STORE), None)  # an address from a rendezvous that was cut short
        ident = self.next_ident()
        first.send(messages.Join(ident, None))
        deadline = time.monotonic() + START_TIMEOUT_S
        store = self.wait(STORE, [first], deadline, kinds=(messages.Store, Failed), also=ident)[0]
        if isinstance(store, Failed):
            raise GroupError(f"rank 0 could not serve the rendezvous: {store.report['message']}")
        assert isinstance(store, messages.Store)
        for member in rest:
            member.send(messages.Join(ident, store.address))
        replies = self.wait(ident, self.all, time.monotonic() + START_TIMEOUT_S)
        failed = sorted(r for r, m in replies.items() if not isinstance(m, messages.Done))
        if failed:
            why = replies[failed[0]].failure().get("message")
            raise GroupError(f"rank {failed[0]} could not join the process group: {why}")

    def close(self, within: float) -> None:
        """Ask the ranks to close (``within`` seconds), then end them and what they started (SIGTERM, SIGKILL
        after a second), and close the kernel's ends."""
        with contextlib.suppress(RankDied, ReplyTimeout, KeyboardInterrupt, OSError):
            self.ask([m for m in self.all if m.alive], messages.Close, within=within)
        self.processes.stop(signal.SIGTERM, grace_s=1.0)
        for member in self.all:
            member.release()
        self.processes.close()

    # --- signals -----------------------------------------------------------------------------------------

    def interrupt(self, members: list[Member]) -> None:
        for member in members:
            with contextlib.suppress(OSError):
                self.processes.send_signal(member.rank, signal.SIGINT)

    def break_group(self, ident: int) -> None:
        """Shut the process group's connections on every living rank: whatever waits on a peer fails now."""
        for member in self.all:
            if member.alive:
                member.send(messages.Break(ident))

    def kill(self, member: Member) -> None:
        """SIGKILL a rank that stays stuck, with what it started (it leads its process group)."""
        self._bury(member, self.processes.kill(member.rank))

    def find_dead(self) -> None:
        """Take note of the ranks that died since the last look (between cells)."""
        self.pump(0.0, {m.rank: m for m in self.all if m.alive}, {}, (), ())
        for exit in self.processes.gone():  # gone, though its pidfd may not say so yet (its threads still ending)
            self._bury(self.all[exit.index], exit)

    # --- requests ----------------------------------------------------------------------------------------

    def next_ident(self) -> int:
        self._ident += 1
        for key in [k for k in self._mailbox if 0 < k[1] < self._ident - 100]:  # replies nobody waits for now
            del self._mailbox[key]
        return self._ident

    def ask(
        self, members: list[Member], kind: type[messages.Request], within: float | None = None, **fields: Any
    ) -> dict[int, Reply]:
        """Send request ``kind(ident, **fields)`` to ``members`` and wait for their replies (``within`` seconds;
        ``None``: no limit).

        Raises:
            RankDied: a member died first. ReplyTimeout: ``within`` passed.
        """
        ident = self.next_ident()
        request = kind(ident=ident, **fields)
        for member in members:
            member.send(request)
        return self.wait(ident, members, None if within is None else time.monotonic() + within)

    def request(self, member: Member, kind: type[messages.Request], **fields: Any) -> Any:
        """One request to one rank, outside a cell (no interrupt handling beyond the kernel's own); its answer.

        Raises:
            GroupError: the rank refused it (the message says why), or died first.
        """
        reply = self.ask([member], kind, **fields)[member.rank]
        if not isinstance(reply, messages.Done):
            report = reply.failure()
            raise GroupError(f"rank {member.rank}: {report.get('type')}: {report.get('message')}")
        return reply.value

    def wait(
        self,
        ident: int,
        members: list[Member],
        deadline: float | None,
        kinds: tuple[type[ToKernel], ...] = REPLIES,
        also: int | None = None,
        stop_on_failure: bool = False,
    ) -> dict[int, ToKernel]:
        """The replies of ``members`` to request ``ident`` (or ``also``), streaming their output meanwhile.

        Raises:
            RankDied: a member died first (the replies so far are in ``partial``). ReplyTimeout: ``deadline``.
            RankFailed: ``stop_on_failure`` and a member failed while others are still busy.
        """
        waiting = {m.rank: m for m in members if m.alive}
        replies: dict[int, ToKernel] = {}
        self.partial = replies
        if len(waiting) < len(members):
            raise RankDied([m.rank for m in members if not m.alive])
        while waiting:
            timeout = 0.25 if deadline is None else max(0.0, min(0.25, deadline - time.monotonic()))
            died = self.pump(timeout, waiting, replies, (ident, also), kinds)
            if died:
                raise RankDied(died)
            if self.on_round is not None:
                self.on_round()
            if stop_on_failure and waiting and any(isinstance(reply, Failed) for reply in replies.values()):
                raise RankFailed()
            if deadline is not None and time.monotonic() >= deadline and waiting:
                raise ReplyTimeout()
        return replies

    def gather(
        self,
        ident: int,
        busy: list[Member],
        replies: dict[int, ToKernel],
        within: float,
        kinds: tuple[type[ToKernel], ...] = REPLIES,
    ) -> list[Member]:
        """Wait up to ``within`` seconds for ``busy`` ranks' replies; those still busy (alive)."""
        deadline = time.monotonic() + within
        waiting = {m.rank: m for m in busy if m.alive}
        while waiting and time.monotonic() < deadline:
            try:
                self.pump(min(0.25, max(0.0, deadline - time.monotonic())), waiting, replies, (ident,), kinds)
            except KeyboardInterrupt:
                break  # interrupted again: stop waiting
        return [m for m in waiting.values() if m.alive]

    def pump(
        self,
        timeout: float,
        waiting: dict[int, Member],
        replies: dict[int, ToKernel],
        idents: tuple[int | None, ...],
        kinds: tuple[type[ToKernel], ...],
    ) -> list[int]:
        """One round: read output, messages (into the mailbox) and deaths; move the replies ``waiting`` ranks
        gave to ``idents`` into ``replies``. Returns the ranks among ``waiting`` that died."""
        watched: dict[int, tuple[str, Member]] = {}
        for member in self.all:
            if not member.alive:
                continue
            watched[member.connection.fileno()] = ("message", member)
            if not member.output.closed:
                watched[member.output.fileno()] = ("output", member)
        ended, ready = self.processes.poll(timeout, also=list(watched))
        for fd in ready:
            what, member = watched[fd]
            if what == "output":
                self._read_output(member)
            else:
                self._receive(member)
        for exit in ended:
            member = self.all[exit.index]
            self._receive(member)  # what it said before it died
            self._bury(member, exit)
        while self._debug_messages:
            member, said = self._debug_messages.pop(0)
            if self.on_debug is not None and member.alive:
                self.on_debug(member, said.text, said.state)
        died = []
        for rank, member in list(waiting.items()):
            for ident in idents:
                message = self._mailbox.get((rank, ident)) if ident is not None else None
                if message is not None and isinstance(message, kinds):
                    replies[rank] = self._mailbox.pop((rank, ident))
                    waiting.pop(rank)
                    break
            else:
                if not member.alive:
                    died.append(rank)
                    waiting.pop(rank)
        return died

    def _receive(self, member: Member) -> None:
        with whole_messages():  # an interrupt waits until the message is read whole and in the mailbox
            try:
                while member.connection.poll():
                    try:
                        message = messages.decode(member.connection.recv(), ToKernel)
                    except messages.MessageError:
                        continue  # nothing the kernel asked for: never a reply
                    if isinstance(message, messages.DebugIO):  # handled outside: answering waits for the user
                        self._debug_messages.append((member, message))
                        continue
                    self._mailbox[(member.rank, message.ident)] = message
                    if isinstance(message, REPLIES):
                        member.busy = None
            except (EOFError, OSError):
                _log.debug("rank %d's connection failed: it is dying (its pidfd tells)", member.rank, exc_info=True)

    def _bury(self, member: Member, exit: Exit) -> None:
        """A rank ended: what it started ends with it (it led its process group); read the output it left."""
        member.end = exit
        self.processes.end_leftovers([member.rank])
        while self._read_output(member):
            pass

    def _read_output(self, member: Member) -> bool:
        try:
            data = os.read(member.output.fileno(), 65536) if not member.output.closed else b""
        except BlockingIOError:
            return False  # nothing now (something the rank started may still hold the pipe)
        except OSError:
            data = b""
        if not data:
            if not member.output.closed and not member.alive:
                member.output.close()
            return False
        self.feed(member.rank, data)
        return True

    # --- status --------------------------------------------------------------------------------------------

    def collectives_of(self, members: list[Member]) -> dict[int, tuple[str, float] | None]:
        """The collective each of ``members`` waits in (its name and since when), or ``None``."""
        return {rank: state.collective for rank, state in ask_status(members, 1.0).items()}


def ask_status(members: list[Member], within: float) -> dict[int, RankState]:
    """Each member's status through its status channel (safe from any thread: one request at a time each)."""
    ident = uuid.uuid4().hex
    found: dict[int, RankState] = {}
    with contextlib.ExitStack() as held:
        for member in sorted(members, key=lambda m: m.rank):  # in rank order: no two callers deadlock
            held.enter_context(member.status_lock)
        asked = []
        for member in members:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                member.status_connection.send(messages.encode(messages.StatusAsk(ident)))
                asked.append(member)
        deadline = time.monotonic() + within
        for member in asked:
            try:
                while member.status_connection.poll(max(0.0, deadline - time.monotonic())):
                    answer = messages.decode(member.status_connection.recv(), messages.StatusAnswer)
                    if answer.ident == ident:
                        found[member.rank] = answer.state
                        break
            except (EOFError, OSError, messages.MessageError):
                _log.debug("rank %d's status channel failed; no status from it", member.rank, exc_info=True)
                continue
    return found


@contextlib.contextmanager
def whole_messages() -> Iterator[None]:
    """Hold back the kernel's interrupt while a message to or from a rank is written or read, then raise it: a
    KeyboardInterrupt part-way would leave half a message in the pipe (or a reply read and dropped)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: pending.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            raise KeyboardInterrupt

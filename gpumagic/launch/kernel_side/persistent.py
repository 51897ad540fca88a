"""Persistent ranks: a DDP group that lives across cells (``gpumagic.ranks``, ``%ddp``/``%%ddp``).

The kernel starts N ranks from the rank server (``launch.rank_side.rank_server``, as a launch does) running
``launch.rank_side.group_rank``'s loop, forms their process group, and then sends them work over one pipe each: cells,
functions, pull/push of names. Each rank keeps its namespace between cells. Names a cell uses from the kernel
travel by value once and again only when they change; names the ranks made themselves never travel.

Failures keep what can be kept:

- an interrupt (or a cell's ``timeout``) raises KeyboardInterrupt in every busy rank; a rank still busy after
  ``grace_s`` (stuck in a collective) gets the process group's connections shut on every rank, the group is
  re-formed on a fresh rendezvous, namespaces kept; a rank still busy after that is killed and replaced;
- a rank that dies is replaced by a fresh one: the group re-forms, the state registered with
  ``gpumagic.keep`` is copied to it from a healthy rank, and what it lost is listed by name.

Only the group's own processes are ever signalled.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import hashlib
import os
import select
import shutil
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumagic.errors import GpumagicError, InvalidArgument, ReportedError
from gpumagic.launch.failures import LaunchError, RankOutcome, root_cause
from gpumagic.launch.kernel_side.output import OUTPUT_MODES, ProgressLines, RankOutput, progress_lines
from gpumagic.launch.plan import LaunchPlan, assign_gpus, check_backend, check_timeout
from gpumagic.launch.replay import Definition, ReplayLog, definitions
from gpumagic.launch.replicas import Divergence, compare, sync_plan
from gpumagic.launch.shipping import (
    CellPayload,
    FunctionPayload,
    ShippingError,
    dumps,
    pack,
    parse_cell,
    ship_cell,
    ship_function,
)
from gpumagic.launch.value_keys import change_key, has_cheap_key
from gpumagic.run_dirs.launch_files import make_launch_directories, remove_launch_directories
from gpumagic.run_dirs.layout import RunFiles

DEFAULT_GRACE_S = 5.0
START_TIMEOUT_S = 120.0
CLOSE_GRACE_S = 5.0
MAX_BUFFERED_LINES = 2000


class GroupError(GpumagicError):
    """The group could not do what was asked (it is closed, it could not start, a rank could not rejoin)."""


class CellInterrupted(ReportedError):
    """A cell on the group was interrupted or timed out; the message says what was kept and what was lost."""


class CellFailed(LaunchError):
    """A cell raised on some rank (or a rank died): the first failure's traceback, every rank's fate, and what
    gpumagic did about it (a replaced rank, lost names)."""


@dataclass
class _Member:
    """The kernel's side of one rank: its process, pipes, and what it holds."""

    rank: int
    process: Any
    pid: int
    connection: Any
    output: Any
    pidfd: int | None
    status_connection: Any = None  # answered by the rank's status thread, even while it runs a cell
    status_lock: Any = field(default_factory=threading.Lock)  # one status request at a time on its channel
    own: set[str] = field(default_factory=set)  # names the rank made itself (or were pushed)
    present: set[str] = field(default_factory=set)
    shipped: dict[str, str] = field(default_factory=dict)  # name -> digest of the value the kernel sent
    busy: str | None = None
    exitcode: int | None = None
    died_at: float | None = None
    killed: bool = False  # by gpumagic, because it stayed stuck
    sending: frozenset[str] = frozenset()  # the kernel names the current cell sends it
    lost: set[str] = field(default_factory=set)  # what the rank it replaced held
    sent_before: frozenset[str] = frozenset()  # the notebook names the rank it replaced had been sent

    @property
    def alive(self) -> bool:
        return self.died_at is None

    def release(self) -> None:
        """Close the kernel's ends of its pipes and its process handle (it has ended)."""
        for handle in (self.connection, self.output, self.status_connection):
            with contextlib.suppress(OSError, AttributeError):
                handle.close()
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None
        with contextlib.suppress(ValueError, AssertionError):
            self.process.close()

    def send(self, message: tuple) -> None:
        with _whole_messages():
            try:
                self.connection.send(message)
            except (OSError, ValueError):
                pass  # it died: the pidfd says so


class _Died(GroupError):
    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        super().__init__(
            f"rank {', '.join(map(str, ranks))} died; the group replaces it at the next call (%ddp status shows it)"
        )


class _Expired(GroupError):
    def __init__(self) -> None:
        super().__init__("the ranks did not answer in time; %ddp restart starts a fresh group")


class _Failed(Exception):
    """A rank's cell failed while others still run it."""


_open_groups: set[RankGroup] = set()  # every group of this process not closed yet, for close_open_groups


def close_open_groups(status: str = "finished") -> int:
    """Close every group of ranks this process has open (the kernel is ending); how many were open."""
    groups = list(_open_groups)
    for group in groups:
        with contextlib.suppress(Exception):
            group.close(status)
    return len(groups)


class RankGroup:
    """N ranks with a process group, kept across calls. Use as a context manager, or ``close()`` it.

    ``run(fn, *args)`` and ``exec(code)`` return ``{rank: value}``; ``pull``/``push`` move names;
    ``status()``/``free()`` look after the ranks. See ``gpumagic.ranks``.
    """

    def __init__(
        self,
        nprocs: int | None = None,
        *,
        gpus: str | None = None,
        gpus_per_rank: int = 1,
        backend: str | None = None,
        timeout: str | float = "30m",
        grace: str | float = DEFAULT_GRACE_S,
        output: str = "rank0",
        write: Callable[[str], None] | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        from gpumagic.launch.kernel_side.ddp import _check_nprocs
        from gpumagic.units import parse_duration

        if output not in OUTPUT_MODES:
            raise InvalidArgument(f"output must be one of {', '.join(OUTPUT_MODES)}, got {output!r}")
        if isinstance(gpus_per_rank, bool) or not isinstance(gpus_per_rank, int) or gpus_per_rank < 1:
            raise InvalidArgument(f"gpus_per_rank must be a whole number of at least 1, got {gpus_per_rank!r}")
        if nprocs is not None:
            _check_nprocs(nprocs)
        check_backend(backend)
        self.timeout_s = check_timeout(timeout)
        self.grace_s = parse_duration(grace, at_most=3600.0, what="a grace period")
        self.options = dict(gpus=gpus, gpus_per_rank=gpus_per_rank, backend=backend, timeout=timeout, grace=grace)
        self.requested = nprocs
        self.output = output
        from gpumagic.launch.kernel_side.ddp import _stdout_writer

        self.write = write or _stdout_writer()
        self._bars = write is None  # progress bars as one line per rank, updated in place (in a notebook)
        self.on_note = on_note or (lambda text: self.write(text + "\n"))
        self.members: list[_Member] = []
        self.closed = True
        self.cells = 0
        self.replaced = 0
        self.reformed = 0
        self._ident = 0
        self._sink: _CellOutput | None = None
        self._between_cells: list[tuple[int, bytes]] = []
        self._mailbox: dict[tuple[int, int], tuple] = {}  # (rank, request) -> its reply
        self._partial: dict[int, tuple] = {}
        self._fingerprints: dict[str, tuple[Any, list[Any], str]] = {}  # name -> (change key, its objects, digest)
        self._needs_reform = False  # a re-form was cut short: the next call makes it
        self._namespace: Mapping[str, Any] = {}  # the notebook's names, as the last cell saw them
        self._hidden: set[str] = set()
        self._replay = ReplayLog()  # the cells' imports and definitions, for a rank that replaces a dead one
        self.divergence = Divergence()  # what differed between the replicas when last compared
        self._stack = contextlib.ExitStack()
        self._start()

    # --- life --------------------------------------------------------------------------------------------

    def _start(self) -> None:
        from gpumagic.launch.kernel_side.ddp import _rank_gpus, default_nprocs
        from gpumagic.launch.rank_side.rank_server import forkserver_context
        from gpumagic.run_dirs import store

        gpus, per_rank = self.options["gpus"], self.options["gpus_per_rank"]
        run_dir = store.new_run("ddp-group", ranks=0)
        try:
            make_launch_directories(RunFiles(run_dir))  # the stores' sockets: private to the user
            available, simulated = _rank_gpus(gpus, self.requested, per_rank)
            nprocs = self.requested
            if nprocs is None:
                nprocs = default_nprocs(available, per_rank)
            self.rank_gpus = assign_gpus(available, nprocs, per_rank)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)  # a refused start leaves nothing behind
            raise
        self.run_dir = run_dir
        from gpumagic.devices.spec import parse_spec

        self.leased = gpus is not None and (gpus == "auto" or not parse_spec(gpus).none) and bool(available)
        self.nprocs = nprocs
        self.use_cuda = bool(available) and not simulated
        self.backend = self.options["backend"] or ("nccl" if self.use_cuda else "gloo")
        store.update_run(self.run_dir, ranks=nprocs, backend=self.backend, gpus=[list(g) for g in self.rank_gpus])
        self.plan = LaunchPlan.on_this_machine(
            self.run_dir,
            self.rank_gpus,
            backend=self.backend,
            use_cuda=self.use_cuda,
            master_port=0,
            timeout_s=self.timeout_s,
        )
        self.closed = False
        _open_groups.add(self)
        atexit.register(self.close)
        try:
            self.context = self._stack.enter_context(forkserver_context())  # held: the server is not restarted
            self.members = [self._spawn(rank) for rank in range(nprocs)]
            self._await_ready(self.members)
            self._form()
        except _Died as died:
            self._forget()
            member = self.members[died.ranks[0]]
            raise GroupError(f"rank {member.rank} {_death(member)} while the group was starting") from None
        except BaseException:
            self._forget()
            raise

    def _forget(self) -> None:
        """A start that failed: its ranks end and it leaves no run behind (the error says what went wrong)."""
        self.close(status="failed")
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _spawn(self, rank: int) -> _Member:
        from gpumagic.launch.rank_side.group_rank import serve_group_rank

        self._check_open()  # closed meanwhile (the kernel is ending): no rank may start now

        reader, writer = self.context.Pipe(duplex=False)
        ours, theirs = self.context.Pipe()
        status_ours, status_theirs = self.context.Pipe()
        process = self.context.Process(
            target=serve_group_rank, args=(rank, self.plan, writer, theirs, status_theirs), name=f"ddp-rank-{rank}"
        )
        try:
            process.start()
        finally:
            writer.close()
            theirs.close()
            status_theirs.close()
        os.set_blocking(reader.fileno(), False)
        try:
            pidfd = os.pidfd_open(process.pid)
        except (AttributeError, OSError):
            pidfd = None
        return _Member(rank, process, process.pid, ours, reader, pidfd, status_ours)

    def _await_ready(self, members: list[_Member]) -> None:
        replies = self._wait(READY, members, time.monotonic() + START_TIMEOUT_S, kinds=("ready", "failed"))
        failed = {r: m for r, m in replies.items() if m[0] == "failed"}
        if failed:
            rank, message = min(failed.items())
            raise GroupError(f"rank {rank} could not start: {message[2]['type']}: {message[2]['message']}")

    def _form(self) -> None:
        """Form a fresh process group: rank 0 serves a new store (``secure_store``), the others join it."""
        first, rest = self.members[0], self.members[1:]
        self._mailbox.pop((0, STORE), None)  # an address from a rendezvous that was cut short
        ident = self._next()
        first.send(("join", ident, ident, None))
        reply = self._wait(STORE, [first], time.monotonic() + START_TIMEOUT_S, kinds=("store", "failed"), also=ident)
        if reply[0][0] == "failed":
            raise GroupError(f"rank 0 could not serve the rendezvous: {reply[0][2]['message']}")
        address = reply[0][2]
        for member in rest:
            member.send(("join", ident, ident, address))
        replies = self._wait(ident, self.members, time.monotonic() + START_TIMEOUT_S)
        failed = sorted(r for r, m in replies.items() if m[0] != "done")
        if failed:
            raise GroupError(
                f"rank {failed[0]} could not join the process group: {replies[failed[0]][2].get('message')}"
            )

    def close(self, status: str = "finished") -> None:
        """End the ranks (their process trees), release the group's leases and its rank server hold."""
        if self.closed:
            return
        self.closed = True
        _open_groups.discard(self)
        atexit.unregister(self.close)
        from gpumagic.devices.processes import end_processes
        from gpumagic.run_dirs import store

        with contextlib.suppress(_Died, _Expired, KeyboardInterrupt, OSError):
            self._ask([m for m in self.members if m.alive], "close", within=CLOSE_GRACE_S)
        pids = [m.pid for m in self.members]
        end_processes(pids, groups=pids, grace_s=1.0)
        for member in self.members:
            with contextlib.suppress(OSError, ValueError):
                member.process.join(1.0)
            member.release()
        self._stack.close()
        if getattr(self, "leased", False):
            from gpumagic.devices import selection

            with contextlib.suppress(GpumagicError, OSError):
                selection.release()
        if getattr(self, "run_dir", None) is not None:
            remove_launch_directories(RunFiles(self.run_dir))
            store.finish_run(self.run_dir, status)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{sum(m.alive for m in self.members)} alive"
        return f"<RankGroup {self.nprocs} ranks ({self.backend}), {state}>"

    @property
    def pids(self) -> list[int]:
        return [m.pid for m in self.members]

    # --- work --------------------------------------------------------------------------------------------

    def exec(
        self,
        code: str,
        namespace: Mapping[str, Any] | None = None,
        *,
        ranks: Iterable[int] | None = None,
        timeout: str | float | None = None,
        filename: str | None = None,
        hidden: Collection[str] = (),
    ) -> dict[int, Any]:
        """Run ``code`` on the ranks (all, or ``ranks``) in their namespaces; ``{rank: last expression}``.

        Names the code reads from ``namespace`` (default: the caller's globals) travel by value, once while
        unchanged; names the ranks hold themselves are not sent.

        Raises:
            CellFailed: a rank raised or died (the traceback, what was replaced and lost).
            CellInterrupted: interrupted or timed out (what was kept and lost). ShippingError, InvalidArgument.
        """
        if namespace is None:
            namespace = sys._getframe(1).f_globals
        self.cells += 1
        filename = filename or f"<ddp cell {self.cells}>"
        tree = parse_cell(code, filename)  # once, for what the cell needs and what a replaced rank redoes
        payload = ship_cell(code, namespace, filename, hidden, tree)
        self._deadline(timeout)  # a bad timeout is refused before anything else
        self._recover_dead()
        targets = self._targets(ranks)
        self._namespace, self._hidden = namespace, set(hidden)  # what a replaced rank is sent again
        for name in [n for n in self._fingerprints if n not in namespace]:  # deleted: hold none of it
            del self._fingerprints[name]
        packed, digests = self._pack_for(payload, targets, namespace, hidden)
        found = definitions(code, filename, tree)
        return self._run("exec", filename, packed, targets, self._deadline(timeout), digests, found)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, Any]:
        """Call ``fn(*args, **kwargs)`` on every rank (in its namespace: globals it defines persist);
        ``{rank: value}``."""
        self.cells += 1
        packed = pack(ship_function(fn, args, kwargs, rank_first=False))
        self._recover_dead()
        targets = self._targets(None)
        return self._run("call", getattr(fn, "__name__", "fn"), {m.rank: packed for m in targets}, targets, None, {})

    def pull(self, name: str, rank: int = 0) -> Any:
        """A copy of ``name`` from ``rank`` (tensors, modules and state_dicts on the CPU; a DDP model: its module)."""
        import cloudpickle

        self._check_open()
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidArgument(f"pull needs a variable name, got {name!r}")
        (member,) = self._targets([rank])
        reply = self._request(member, "pull", name)
        return cloudpickle.loads(reply)

    def push(self, **values: Any) -> None:
        """Set names on every rank (``push(lr=1e-3, batch=b)``); pushed names are the ranks' own from then on."""
        self._check_open()
        try:
            packed = dumps(values)
        except Exception:
            pack(FunctionPayload(dict, kwargs=values))
            raise
        self._recover_dead()
        replies = self._ask(self.members, "push", packed)
        for member in self.members:
            if replies[member.rank][0] == "done":
                member.own.update(values)
                member.present.update(values)
                for name in values:
                    member.shipped.pop(name, None)

    def status(self) -> list[dict[str, Any]]:
        """Each rank: alive, pid, the cell it is running and since when, the collective it is in and since
        when, GPU memory allocated and reserved (bytes; ``None`` on a CPU rank), resident memory."""
        self._check_open()
        members = list(self.members)
        replies = _ask_status([m for m in members if m.alive and _running(m.pid)], 2.0)
        rows = []
        for member in members:
            row = {"rank": member.rank, "pid": member.pid, "alive": member.alive and _running(member.pid)}
            row.update(replies.get(member.rank, {}))
            rows.append(row)
        return rows

    def free(self) -> list[dict[str, Any]]:
        """Collect garbage and empty the CUDA cache on every rank; per rank what was released."""
        self._check_open()
        self._recover_dead()
        replies = self._ask(self.members, "free")
        return [{"rank": r, **replies[r][2]} for r in sorted(replies) if replies[r][0] == "done"]

    def kept(self) -> list[str]:
        """The names registered with ``gpumagic.keep`` (rank 0's list)."""
        self._check_open()
        return list(self._request(self.members[0], "kept"))

    def check(self) -> Divergence:
        """Compare the replicas: their DistributedDataParallel models, the optimizers and schedulers of those,
        the kept names, and the plain numbers that were equal on every rank when the last cell started (a step
        counter). What differs (empty: nothing); ``sync`` makes them alike.

        Raises:
            GroupError: the group is closed, or a rank could not describe its state.
        """
        self._check_open()
        self._recover_dead()
        replies = self._ask(self.members, "describe", within=START_TIMEOUT_S)
        refused = {r: reply[2] for r, reply in replies.items() if reply[0] != "done"}
        if refused:
            rank, report = min(refused.items())
            raise GroupError(f"rank {rank} could not describe its state: {report.get('type')}: {report.get('message')}")
        self.divergence = compare({r: reply[2] for r, reply in replies.items()})
        return self.divergence

    def sync(self, source: int = 0, names: Iterable[str] | None = None) -> list[str]:
        """Make every rank's ``names`` equal to rank ``source``'s, over the process group: models and tensors in
        place, optimizers and schedulers by their state, other values replaced. Default names: every rank's
        replicated state (DDP models, their optimizers and schedulers, the kept names) and whatever the last
        ``check`` (or the last interrupt's) found different. The names synced.

        Raises:
            InvalidArgument: ``source`` is not a rank, or it lacks a name. CellFailed, CellInterrupted.
        """
        (member,) = self._targets([source])
        if names is None:
            wanted = set(self._request(member, "replicated")) | set(self.divergence.names)
        else:
            wanted = {names} if isinstance(names, str) else set(names)
            bad = sorted(repr(n) for n in wanted if not isinstance(n, str) or not n.isidentifier())
            if bad:
                raise InvalidArgument(f"sync needs variable names, got {', '.join(bad)}")
        if not wanted:
            return []
        kinds = {r: reply[2] for r, reply in self._ask(self.members, "kinds", sorted(wanted)).items()}
        try:
            plan = sync_plan(sorted(wanted), kinds, source)
        except KeyError as err:
            raise InvalidArgument(f"{err.args[0]!r} is not defined on rank {source}: nothing to copy") from None
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        from gpumagic.launch.rank_side.group_rank import (
            sync_here,  # the ranks' module: not imported by a kernel until here
        )

        self.run(sync_here, source, plan)
        self.divergence = Divergence()
        return [name for name, _ in plan]

    # --- the request machinery -----------------------------------------------------------------------

    def _next(self) -> int:
        self._ident += 1
        for key in [k for k in self._mailbox if 0 < k[1] < self._ident - 100]:  # replies nobody waits for now
            del self._mailbox[key]
        return self._ident

    def _check_open(self) -> None:
        if self.closed:
            raise GroupError("this group of ranks is closed; start another (gpumagic.ranks, %ddp start)")

    def _targets(self, ranks: Iterable[int] | None) -> list[_Member]:
        self._check_open()
        if ranks is None:
            return list(self.members)
        asked = list(ranks)
        chosen = sorted(set(asked))
        bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.nprocs]
        if bad or not chosen:
            raise InvalidArgument(f"ranks must be among 0..{self.nprocs - 1}, got {asked!r}")
        if len(chosen) < len(asked):
            raise InvalidArgument(f"each rank once: {asked!r} names a rank twice")
        return [self.members[r] for r in chosen]

    def _deadline(self, timeout: str | float | None) -> float | None:
        if timeout is None:
            return None
        return time.monotonic() + check_timeout(timeout, what="a cell timeout")

    def _ask(self, members: list[_Member], kind: str, *args: Any, within: float | None = None) -> dict[int, tuple]:
        """Send request ``kind`` to ``members`` and wait for their replies (``within`` seconds; ``None``: no limit).

        Raises:
            _Died: a member died first. _Expired: ``within`` passed.
        """
        ident = self._next()
        for member in members:
            member.send((kind, ident, *args))
        return self._wait(ident, members, None if within is None else time.monotonic() + within)

    def _request(self, member: _Member, kind: str, *args: Any, recover: bool = True) -> Any:
        """One request to one rank, outside a cell (no interrupt handling beyond the kernel's own); ``recover``:
        replace dead ranks first (not while a re-form is under way)."""
        if recover:
            self._recover_dead()
        reply = self._ask([member], kind, *args)[member.rank]
        if reply[0] != "done":
            report = reply[2] or {}
            raise GroupError(f"rank {member.rank}: {report.get('type')}: {report.get('message')}")
        return reply[2]

    def _wait(
        self,
        ident: int,
        members: list[_Member],
        deadline: float | None,
        kinds: tuple[str, ...] = ("done", "failed", "interrupted"),
        also: int | None = None,
        stop_on_failure: bool = False,
    ) -> dict[int, tuple]:
        """The replies of ``members`` to request ``ident`` (or ``also``), streaming their output meanwhile.

        Raises:
            _Died: a member died first (the replies so far are in ``self._partial``). _Expired: ``deadline``.
            _Failed: ``stop_on_failure`` and a member failed while others are still busy.
        """
        waiting = {m.rank: m for m in members if m.alive}
        replies: dict[int, tuple] = {}
        self._partial = replies
        if len(waiting) < len(members):
            raise _Died([m.rank for m in members if not m.alive])
        while waiting:
            timeout = 0.25 if deadline is None else max(0.0, min(0.25, deadline - time.monotonic()))
            died = self._pump(timeout, waiting, replies, (ident, also), kinds)
            if died:
                raise _Died(died)
            if stop_on_failure and waiting and any(reply[0] == "failed" for reply in replies.values()):
                raise _Failed()
            if deadline is not None and time.monotonic() >= deadline and waiting:
                raise _Expired()
        return replies

    def _pump(
        self,
        timeout: float,
        waiting: dict[int, _Member],
        replies: dict[int, tuple],
        idents: tuple[int | None, ...],
        kinds: tuple[str, ...],
    ) -> list[int]:
        """One round: read output, messages (into the mailbox) and deaths; move the replies ``waiting`` ranks
        gave to ``idents`` into ``replies``. Returns the ranks among ``waiting`` that died."""
        watched: dict[int, tuple[str, _Member]] = {}
        for member in self.members:
            if not member.alive:
                continue
            watched[member.connection.fileno()] = ("message", member)
            if not member.output.closed:
                watched[member.output.fileno()] = ("output", member)
            if member.pidfd is not None:
                watched[member.pidfd] = ("death", member)
        ready, _, _ = select.select(list(watched), [], [], timeout) if watched else ([], [], [])
        seen = time.time()
        for fd in ready:
            what, member = watched[fd]
            if what == "output":
                self._read_output(member)
            elif what == "message":
                self._receive(member)
        died = []
        for fd in ready:
            what, member = watched[fd]
            if what == "death" and member.alive:
                self._receive(member)  # what it said before it died
                self._mark_dead(member, seen)
        if not any(what == "death" for what, _ in watched.values()):  # no pidfds: ask the processes
            for member in list(waiting.values()):
                if not _running(member.pid):
                    self._mark_dead(member)
        for rank, member in list(waiting.items()):
            for ident in idents:
                message = self._mailbox.get((rank, ident)) if ident is not None else None
                if message is not None and message[0] in kinds:
                    replies[rank] = self._mailbox.pop((rank, ident))
                    waiting.pop(rank)
                    break
            else:
                if not member.alive:
                    died.append(rank)
                    waiting.pop(rank)
        return died

    def _receive(self, member: _Member) -> None:
        with _whole_messages():  # an interrupt waits until the message is read whole and in the mailbox
            try:
                while member.connection.poll():
                    message = member.connection.recv()
                    self._mailbox[(member.rank, message[1])] = message
                    if message[0] in _REPLIES:
                        member.busy = None
            except (EOFError, OSError):
                pass  # it is dying: the pidfd tells

    def _mark_dead(self, member: _Member, when: float | None = None) -> None:
        with contextlib.suppress(OSError):
            os.killpg(member.pid, signal.SIGKILL)  # what the rank started (it led its process group) ends with it
        with contextlib.suppress(OSError, ValueError):
            member.process.join(5.0)
        member.exitcode = member.process.exitcode
        member.died_at = when or time.time()
        while self._read_output(member):
            pass

    def _read_output(self, member: _Member) -> bool:
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
        if self._sink is not None:
            self._sink.feed(member.rank, data)
        else:
            self._between_cells.append((member.rank, data))
        return True

    # --- cells -------------------------------------------------------------------------------------------

    def _pack_for(
        self, payload: CellPayload, targets: list[_Member], namespace: Mapping[str, Any], hidden: Collection[str]
    ) -> tuple[dict[int, bytes], dict[str, str]]:
        """Each rank's packed cell: only the kernel's names it lacks or that changed since sent. Names sent
        before are checked too, used by the cell or not: a function the ranks defined may read them (``lr``)."""
        for member in targets:
            for name in member.shipped:
                if name in namespace and name not in member.own and name not in hidden and name not in payload.names:
                    value = namespace[name]
                    if not isinstance(value, types.ModuleType):
                        payload.names[name] = value
        wanted = [name for name in payload.names if any(name not in m.own for m in targets)]  # not held by all
        digests = {name: self._digest(name, payload.names[name]) for name in wanted}
        packed: dict[int, bytes] = {}
        by_names: dict[frozenset[str], bytes] = {}
        for member in targets:
            send = frozenset(
                name
                for name in wanted
                if name not in member.own and not (member.shipped.get(name) == digests[name] and name in member.present)
            )
            if send not in by_names:
                part = CellPayload(
                    payload.source,
                    payload.filename,
                    {n: payload.names[n] for n in sorted(send)},
                    payload.modules,
                    payload.sources,
                )
                by_names[send] = pack(part)
            packed[member.rank] = by_names[send]
            member.sending = send
        return packed, digests

    def _run(
        self,
        kind: str,
        label: str,
        packed: dict[int, bytes],
        targets: list[_Member],
        deadline: float | None,
        digests: dict[str, str],
        found: list[Definition] | None = None,
    ) -> dict[int, Any]:
        import cloudpickle

        bars = progress_lines() if self._bars else None
        self._sink = _CellOutput(self.write, self.output if len(targets) > 1 else "all", self.nprocs, bars)
        self._show_between_cells()
        ident = self._next()
        self._partial = {}
        reformed = self.reformed
        notes: list[str] = []
        why = None
        point = None
        try:
            try:
                for member in targets:
                    member.busy = label
                    member.send((kind, ident, label, packed[member.rank]))
                replies = self._wait(ident, targets, deadline, stop_on_failure=True)
            except (KeyboardInterrupt, _Expired) as stopped:
                why = "interrupted" if isinstance(stopped, KeyboardInterrupt) else "timed out"
                replies = dict(self._partial)
                point = self._stop_together(ident, targets, replies)
                replies = self._recover(ident, targets, why, notes, replies)
            except (_Died, _Failed):
                replies = self._recover(ident, targets, None, notes)
            else:
                if any(reply[0] == "interrupted" and reply[2] for reply in replies.values()):
                    replies = self._recover(ident, targets, None, notes, replies)
        except KeyboardInterrupt:  # interrupted again while recovering: the next call re-forms the group
            self._needs_reform = True
            raise CellInterrupted(
                "interrupted twice: the cell was stopped, and the group is re-formed before the next cell"
            ) from None
        finally:
            self._sink.finish()
            self._sink = None
        steady = why is None and reformed == self.reformed and len(targets) == len(self.members)
        if steady and all(m.alive for m in self.members):
            counts = {r: _collectives(reply) for r, reply in replies.items()}
            if len(set(counts.values()) - {None}) > 1:  # one rank skipped a collective its peers made
                try:
                    self._reform(notes, {})
                except KeyboardInterrupt:
                    self._needs_reform = True
                told = ", ".join(f"rank {r}: {c}" for r, c in sorted(counts.items()))
                notes.insert(0, f"the ranks made different numbers of collectives ({told})")
                if not any(reply[0] != "done" for reply in replies.values()):
                    for note in notes:
                        self.on_note(note)
        for member in targets:
            reply = replies.get(member.rank)
            if reply is not None and reply[0] == "done":
                own, present = reply[2][1], reply[2][2]
                member.own, member.present = set(own), set(present)
                for name in member.sending:
                    if name in digests:  # a function's call sends no names
                        member.shipped[name] = digests[name]
            member.sending = frozenset()
        self._replay.record(found or [], [r for r, reply in replies.items() if reply[0] == "done"])
        failed = {r: m for r, m in replies.items() if m[0] in ("failed", "interrupted")}
        dead = [m for m in targets if m.rank not in replies]
        if why is not None or failed or dead:
            notes.extend(self._replicas_after(replies, targets, point, quiet=why is None))
        if why is not None:
            raise CellInterrupted("; ".join([f"{why}: the cell was stopped on every rank", *notes]))
        if failed or dead:
            raise self._failure(targets, replies, notes)
        return {rank: cloudpickle.loads(reply[2][0]) for rank, reply in sorted(replies.items())}

    def _stop_together(self, ident: int, targets: list[_Member], replies: dict[int, tuple]) -> int | None:
        """Stop every busy rank at one sync point (``sync_points``): before the same collective or DDP training
        forward, so that the replicas stay in step. The point asked for, or ``None`` where the ranks cannot
        agree on one (a rank made no sync point in this cell, one finished it, one waits in a collective for a
        peer that is not coming, one did not answer): the caller then interrupts them the usual way, which also
        ends their waiting."""
        busy = [m for m in targets if m.rank not in replies and m.alive]
        if len(busy) < 2 or len(busy) < len(targets):
            return None
        try:
            ask = self._next()
            for member in busy:
                member.send(("pause", ask, ident))
            answers: dict[int, tuple] = {}
            self._gather(ask, busy, answers, 1.0, kinds=("paused",))
            where = {rank: answer[2] for rank, answer in answers.items()}
            if len(where) < len(busy) or any(not _may_stop_together(w) for w in where.values()):
                return None
            point = max(w["made"] for w in where.values()) + 1
            for member in busy:
                member.send(("stop_at", ask, ident, point))
        except KeyboardInterrupt:  # interrupted again: paused ranks wait for nobody, the signal frees them
            self._interrupt(busy)
            raise
        slowest = max((point - w["made"]) * (w["gap"] or w["since"]) for w in where.values())
        self._gather(ident, busy, replies, min(self.grace_s, max(1.0, 3 * slowest)))
        return point

    def _replicas_after(
        self, replies: dict[int, tuple], targets: list[_Member], point: int | None, quiet: bool = False
    ) -> list[str]:
        """After an interrupt or a failure: are the replicas still alike? What to tell the user (``quiet``, after
        a failure: only that they differ)."""
        together = point is not None and all(
            len(r := replies.get(m.rank, ())) > 4 and r[0] == "interrupted" and r[4] is not None for m in targets
        )
        stopped_at = {replies[m.rank][4] for m in targets} if together else set()
        if len(stopped_at) > 1:
            together = False
        if self.nprocs < 2 or self.closed or not all(m.alive for m in self.members):
            return []
        try:
            divergence = self.check()
        except (GroupError, _Died, _Expired, KeyboardInterrupt):
            return ["the replicas could not be compared (%ddp check compares them)"]
        compared = ", ".join(divergence.checked)
        if divergence:
            return [
                f"the replicas differ now: {divergence.describe()}; %ddp sync makes every rank like rank 0 "
                "(group.sync() from Python)"
            ]
        if quiet:
            return []
        if together:
            nth = _nth(stopped_at.pop() + 1)
            where = f"every rank stopped before the same collective or DDP forward (the cell's {nth})"
            return [where + (f"; the replicas are alike: {compared}" if compared else "")]
        return [f"the replicas are alike: {compared}"] if compared else []

    def _failure(self, targets: list[_Member], replies: dict[int, tuple], notes: list[str]) -> CellFailed:
        outcomes = []
        for member in targets:
            reply = replies.get(member.rank)
            if reply is not None and reply[0] == "interrupted" and member.alive:  # gpumagic freed it: a peer failed
                outcomes.append(RankOutcome(member.rank, member.pid, -int(signal.SIGINT), stopped_by_launcher=True))
                continue
            if reply is None:
                if not member.alive:
                    outcomes.append(
                        RankOutcome(
                            member.rank,
                            member.pid,
                            member.exitcode,
                            "process",
                            timestamp=member.died_at,
                            stopped_by_launcher=member.killed,
                        )
                    )
                else:
                    outcomes.append(RankOutcome(member.rank, member.pid, -int(signal.SIGINT), stopped_by_launcher=True))
                continue
            if reply[0] == "done":
                outcomes.append(RankOutcome(member.rank, member.pid, 0))
                continue
            report = reply[2]
            outcomes.append(
                RankOutcome(
                    member.rank,
                    member.pid,
                    1,
                    report.get("phase"),
                    report.get("type"),
                    report.get("message"),
                    report.get("traceback"),
                    report.get("timestamp"),
                )
            )
        deaths = [o for o in outcomes if o.phase == "process" and not o.stopped_by_launcher]
        cause = root_cause(deaths) if deaths else (root_cause(outcomes) or outcomes[0])  # its peers fail after it
        return CellFailed(outcomes, cause, "\n".join(notes))

    def _digest(self, name: str, value: Any) -> str:
        """``_digest``, pickled again only when the value's change key (``value_keys``) is not the one it had: a
        notebook class or function a cell uses costs microseconds a cell, not a pickle."""
        if not has_cheap_key(value):
            return _digest(name, value)
        try:
            key, held = change_key(value, lambda part: _digest(name, part))
        except ShippingError:  # a part cannot travel alone (the value's own pickle may manage): no cheap key
            return _digest(name, value)
        known = self._fingerprints.get(name)
        if known is not None and known[0] == key:
            return known[2]
        digest = _digest(name, value)
        self._fingerprints[name] = (key, held, digest)
        return digest

    def _show_between_cells(self) -> None:
        pending, self._between_cells = self._between_cells, []
        if not pending:
            return
        sink = RankOutput(self.write, "all", self.nprocs)
        for rank, data in pending:
            sink.feed(rank, data)
        sink.flush()

    # --- recovery --------------------------------------------------------------------------------------

    def _recover(
        self,
        ident: int,
        targets: list[_Member],
        why: str | None,
        notes: list[str],
        replies: dict[int, tuple] | None = None,
    ) -> dict[int, tuple]:
        """Bring the group back after an interrupt, a timeout, a failure or a death; the replies gathered.

        Interrupted or timed out: busy ranks get SIGINT; those still busy after the grace period, the group's
        connections shut on every rank (and the group re-formed); those still busy after that, SIGKILL. A rank
        failed or died: its peers wait for it (in a collective, or in a DDP backward, which is out of sight),
        so they are freed at once: the group's connections shut, SIGINT to those not in a collective. Dead
        ranks are replaced.
        """
        replies = dict(self._partial if replies is None else replies)
        busy = [m for m in targets if m.rank not in replies and m.alive]
        broken = False
        stuck_in: dict[int, Any] = {}
        if busy and why is None:
            stuck_in = self._collectives_of(busy)
            self._interrupt([m for m in busy if not stuck_in.get(m.rank)])
            self._break(ident)
            broken = True
            busy = self._gather(ident, busy, replies, self.grace_s)
        elif busy:
            self._interrupt(busy)
            busy = self._gather(ident, busy, replies, self.grace_s)
        if not broken and (busy or any(not m.alive for m in self.members)):
            stuck_in = {**self._collectives_of(busy), **{r: c for r, c in stuck_in.items() if c}}
            self._break(ident)
            broken = True
            busy = self._gather(ident, busy, replies, self.grace_s)
        if any(r[0] == "interrupted" and r[2] for r in replies.values()):
            broken = True  # a rank was interrupted inside a collective: its peers' sequence no longer matches
        for member in busy:
            self._kill(member)
            notes.append(f"rank {member.rank} did not stop{_in(stuck_in.get(member.rank))} and was killed")
        if broken:
            stuck = [f"rank {r}{_in(c)}" for r, c in sorted(stuck_in.items()) if c and self.members[r].alive]
            if stuck and why is not None:  # after a death or a failure its peers' waiting is no news
                notes.append("stuck in a collective: " + ", ".join(stuck))
            self._reform(notes, stuck_in)
        return replies

    def _interrupt(self, members: list[_Member]) -> None:
        for member in members:
            with contextlib.suppress(OSError):
                os.kill(member.pid, signal.SIGINT)

    def _break(self, ident: int) -> None:
        """Shut the process group's connections on every living rank: whatever waits on a peer fails now."""
        for member in self.members:
            if member.alive:
                member.send(("break", ident))

    def _kill(self, member: _Member) -> None:
        """SIGKILL a rank that stays stuck, with what it started (it leads its process group)."""
        member.killed = True
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(member.pid, signal.SIGKILL)
        self._mark_dead(member)

    def _gather(
        self,
        ident: int,
        busy: list[_Member],
        replies: dict[int, tuple],
        within: float,
        kinds: tuple[str, ...] = ("done", "failed", "interrupted"),
    ) -> list[_Member]:
        """Wait up to ``within`` seconds for ``busy`` ranks' replies; those still busy (alive)."""
        deadline = time.monotonic() + within
        waiting = {m.rank: m for m in busy if m.alive}
        while waiting and time.monotonic() < deadline:
            try:
                self._pump(min(0.25, max(0.0, deadline - time.monotonic())), waiting, replies, (ident,), kinds)
            except KeyboardInterrupt:
                break  # interrupted again: stop waiting
        return [m for m in waiting.values() if m.alive]

    def _collectives_of(self, members: list[_Member]) -> dict[int, tuple[str, float] | None]:
        return {rank: row.get("collective") for rank, row in _ask_status(members, 1.0).items()}

    def _recover_dead(self) -> None:
        """Ranks that died between cells: replace them now, telling what they lost."""
        self._check_open()
        waiting = {m.rank: m for m in self.members if m.alive}
        self._pump(0.0, waiting, {}, (), ())
        for member in self.members:  # gone, though its pidfd may not say so yet (its threads still ending)
            if member.alive and not _running(member.pid):
                self._mark_dead(member)
        if self._needs_reform or any(not m.alive for m in self.members):
            notes: list[str] = []
            self._break(-2)
            self._reform(notes, {})
            for note in notes:
                self.on_note(note)

    def _reform(self, notes: list[str], stuck_in: dict[int, Any]) -> None:
        """Re-form the process group: the living ranks leave the old one, dead ranks are replaced by fresh
        ones, the group forms on a new rendezvous, the kept state reaches the new ranks, and every
        DistributedDataParallel model is wrapped anew."""
        self._needs_reform = True  # until it is done: cut short, the next call re-forms
        ident = self._next()
        living = [m for m in self.members if m.alive]
        for member in living:
            member.send(("leave", ident))
        left: dict[int, tuple] = {}
        stuck = self._gather(ident, living, left, self.grace_s)
        for member in stuck:  # cannot even leave: killed, replaced below
            self._kill(member)
            notes.append(f"rank {member.rank} could not leave the broken group and was killed")
        dead = [m for m in self.members if not m.alive]
        healthy = [m for m in self.members if m.alive]
        for member in dead:
            notes.append(f"rank {member.rank} {_death(member)}; replaced by a fresh rank")
            self._replace(member)
        if dead:
            self._await_ready([self.members[m.rank] for m in dead])
        self._form()
        self.reformed += 1
        if not dead:
            notes.append("the process group was re-formed on a fresh rendezvous; every rank kept its namespace")
        if dead:
            self._restore(dead, healthy, notes)
        held = self._ask(self.members, "wrapped", within=START_TIMEOUT_S)
        lists = [set(reply[2]) for reply in held.values() if reply[0] == "done"]
        everywhere = set.intersection(*lists) if len(lists) == len(self.members) else set()
        names = sorted(everywhere)
        if names:
            self._ask(self.members, "rewrap", names, within=START_TIMEOUT_S)
            notes.append(f"re-wrapped {', '.join(names)} in DistributedDataParallel on the new group")
        self._needs_reform = False
        stale = sorted({n for reply in held.values() if reply[0] == "done" for n in reply[2]} - everywhere)
        if stale:
            notes.append(
                f"{', '.join(stale)}: DistributedDataParallel on the ended group, not on every rank; wrap it again "
                "(or register it with gpumagic.keep)"
            )

    def _replace(self, dead: _Member) -> None:
        dead.release()
        fresh = self._spawn(dead.rank)
        fresh.lost = set(dead.own)
        fresh.sent_before = frozenset(dead.shipped)
        self.members[dead.rank] = fresh
        self.replaced += 1

    def _restore(self, dead: list[_Member], healthy: list[_Member], notes: list[str]) -> None:
        """Give fresh ranks back what can be had: the notebook's names the dead ranks were sent, their cells'
        imports and definitions (run again), and the kept state of a healthy rank; list what is lost."""
        fresh = [self.members[m.rank] for m in dead]
        source = healthy[0] if healthy else None
        state, missing = self._request(source, "export", recover=False) if source is not None else (None, [])
        ident = self._next()
        sent: dict[int, dict[str, str]] = {}
        for member in fresh:
            names, sent[member.rank] = self._notebook_names(member.sent_before)
            member.send(("restore", ident, names, self._replay.for_rank(member.rank), state))
        try:
            restored = self._wait(ident, fresh, time.monotonic() + START_TIMEOUT_S)
        except _Died as died:  # the fresh rank died too: the next call replaces it again
            self._needs_reform = True
            raise GroupError(f"rank {died.ranks[0]} died while taking back its state; the next call retries") from None
        for member in fresh:
            reply = restored[member.rank]
            if reply[0] != "done":
                notes.append(f"rank {member.rank} could not take back its state: {reply[2].get('message')}")
                continue
            got = reply[2]
            member.shipped = {n: d for n, d in sent[member.rank].items() if n in got["notebook"]}
            member.own = set(got["replayed"]) | set(got["kept"]) | set(got["modules"])
            member.present = member.own | set(got["notebook"])
            parts = []
            if got["kept"]:
                parts.append(f"{_names(got['kept'])} (gpumagic.keep) from rank {source.rank if source else '?'}")
            if got["replayed"]:
                parts.append(f"{_names(got['replayed'])} (its cells' imports and definitions, run again)")
            if got["notebook"]:
                parts.append(f"{_names(got['notebook'])} (sent from the notebook)")
            if parts:
                notes.append(f"restored on rank {member.rank}: " + "; ".join(parts))
            lost = sorted(member.lost - member.present - {"_"})  # a loop's throwaway is no loss
            if lost:
                notes.append(f"lost on rank {member.rank}: {_names(lost)}")
            unsent = sorted(member.sent_before - member.present)
            if unsent:
                notes.append(
                    f"not sent to rank {member.rank} again (gone from the notebook, or no longer picklable): "
                    f"{_names(unsent)}"
                )
            for name, why in sorted(got["failed"].items()):
                notes.append(f"rank {member.rank} could not define {name} again: {why}")
        if source is None and any(m.lost for m in fresh):
            notes.append("every rank was replaced: the kept state is lost with them")
        if missing:
            notes.append(f"kept names no longer defined on rank {source.rank}: {', '.join(missing)}")

    def _notebook_names(self, names: Collection[str]) -> tuple[bytes, dict[str, str]]:
        """The notebook's current values of ``names`` (those it still has and that can travel), pickled
        together, and their digests."""
        values = {}
        for name in sorted(names):
            value = self._namespace.get(name)
            if name in self._namespace and not isinstance(value, types.ModuleType) and name not in self._hidden:
                values[name] = value
        digests = {}
        for name, value in list(values.items()):
            try:
                digests[name] = self._digest(name, value)
            except ShippingError:
                del values[name]  # it cannot travel any more: lost, and said so
        return dumps(values), digests


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n:,}{suffix}"


def _may_stop_together(where: dict[str, Any] | None) -> bool:
    """A rank's answer to ``pause``: it made sync points in this cell and is not waiting in a collective for
    longer than its sync points usually take (a peer it waits for would not come)."""
    if where is None or where["made"] == 0:
        return False
    usual = 3 * where["gap"] if where["gap"] else 1.0
    return where.get("inside", 0.0) <= max(1.0, usual)


def _names(names: Collection[str], shown: int = 12) -> str:
    """Names for a note: the first ``shown``, then how many more."""
    ordered = sorted(names)
    more = len(ordered) - shown
    return ", ".join(ordered[:shown]) + (f" and {more} more" if more > 0 else "")


_REPLIES = ("done", "failed", "interrupted")
READY = 0  # the request number of a rank's "ready"
STORE = -1  # and of the address of rank 0's store


def _collectives(reply: tuple) -> int | None:
    """How many collectives the rank had made when it replied to a cell."""
    if reply[0] == "done" and isinstance(reply[2], tuple) and len(reply[2]) > 3:
        return reply[2][3]
    if reply[0] == "failed" and isinstance(reply[2], dict):
        return reply[2].get("collectives")
    if reply[0] == "interrupted" and len(reply) > 3:
        return reply[3]
    return None


def _ask_status(members: list[_Member], within: float) -> dict[int, dict[str, Any]]:
    """Each member's status through its status channel (safe from any thread: one request at a time each)."""
    import uuid

    ident = uuid.uuid4().hex
    found: dict[int, dict[str, Any]] = {}
    with contextlib.ExitStack() as held:
        for member in sorted(members, key=lambda m: m.rank):  # in rank order: no two callers deadlock
            held.enter_context(member.status_lock)
        asked = []
        for member in members:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                member.status_connection.send(ident)
                asked.append(member)
        deadline = time.monotonic() + within
        for member in asked:
            try:
                while member.status_connection.poll(max(0.0, deadline - time.monotonic())):
                    answer, row = member.status_connection.recv()
                    if answer == ident:
                        found[member.rank] = row
                        break
            except (EOFError, OSError):
                continue
    return found


@contextlib.contextmanager
def _whole_messages() -> Any:
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


def _digest(name: str, value: Any) -> str:
    """A digest of the value as it would travel: equal digests, the ranks have it already."""
    try:
        data = dumps(value)
    except Exception:  # noqa: BLE001 - pack() names the culprit
        pack(CellPayload("", "", {name: value}))
        raise ShippingError(f"cannot send {name!r} to the ranks") from None
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _death(member: _Member) -> str:
    code = member.exitcode
    if code is not None and code < 0:
        try:
            how = signal.Signals(-code).name
        except ValueError:
            how = f"signal {-code}"
        return f"was killed by {how} (pid {member.pid})"
    return f"exited with code {code} (pid {member.pid})"


def _in(collective: tuple[str, float] | None) -> str:
    if not collective:
        return ""
    return f" (stuck in {collective[0]} for {time.time() - collective[1]:.1f}s)"


def _running(pid: int) -> bool:
    from gpumagic.devices.processes import is_running

    return is_running(pid)


class _CellOutput:
    """A cell's output on the group. ``all``: every rank's lines, live and prefixed. ``rank0``: rank 0's lines
    live; the other ranks' lines at the end, where they differ from rank 0's, else "(same on ranks 1–3)".
    ``none``: nothing (failures still show their traceback)."""

    def __init__(self, write: Callable[[str], None], mode: str, nprocs: int, bars: ProgressLines | None = None) -> None:
        self.write = write
        self.mode = mode
        self.nprocs = nprocs
        self.live = RankOutput(write, "none" if mode == "none" else "all", nprocs, bars)
        self.lines: dict[int, list[str]] = {}
        self.partial: dict[int, str] = {}
        self.decoders: dict[int, Any] = {}

    def feed(self, rank: int, data: bytes) -> None:
        if self.mode == "all" or (self.mode == "rank0" and rank == 0):
            self.live.feed(rank, data)
        if self.mode != "rank0":
            return
        decoder = self.decoders.setdefault(rank, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        text = self.partial.pop(rank, "") + decoder.decode(data)
        *done, rest = text.split("\n")
        lines = self.lines.setdefault(rank, [])
        lines.extend(line.rstrip("\r").rsplit("\r", 1)[-1] for line in done)
        del lines[:-MAX_BUFFERED_LINES]
        if rest:
            self.partial[rank] = rest

    def finish(self) -> None:
        self.live.flush()
        if self.mode != "rank0":
            return
        for rank, rest in self.partial.items():
            self.lines.setdefault(rank, []).append(rest.rsplit("\r", 1)[-1])
        first = self.lines.get(0, [])
        same = []
        for rank in range(1, self.nprocs):
            lines = self.lines.get(rank, [])
            if not lines:
                continue
            if lines == first:
                same.append(rank)
                continue
            seen = list(first)
            width = len(str(self.nprocs - 1))
            for line in lines:
                if line in seen:
                    seen.remove(line)
                else:
                    self.write(f"[rank {rank:>{width}}] {line}\n")
        if same:
            self.write(f"(same on {_ranks_text(same)})\n")


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}–{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))

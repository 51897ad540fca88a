"""Persistent ranks: a DDP group that lives across cells (``gpumagic.ranks``, ``%ddp``/``%%ddp``), and its life.

The kernel starts N ranks from the rank server (``launch.rank_side.rank_server``, as a launch does) running
``launch.rank_side.group_rank``'s loop, forms their process group, and then sends them work over one pipe each:
cells, functions, pull/push of names. Each rank keeps its namespace between cells. Names a cell uses from the
kernel travel by value once and again only when they change (``group_shipping``); names the ranks made
themselves never travel. The ranks' processes and pipes are ``group_members``'s, their output
``group_output``'s; an interrupt, a timeout, a failure or a death is recovered from by ``group_recovery``,
keeping what can be kept.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import shutil
import signal
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import cloudpickle

from gpumagic.devices import selection
from gpumagic.devices.processes import is_running
from gpumagic.devices.spec import parse_spec
from gpumagic.errors import GpumagicError, InvalidArgument, ReportedError
from gpumagic.launch import messages
from gpumagic.launch.failures import LaunchError
from gpumagic.launch.hang_reports import HangFollower, HangReport, mismatch_after_failure
from gpumagic.launch.kernel_side import tracked
from gpumagic.launch.kernel_side.ddp import place_on_allocation, place_ranks, stdout_writer
from gpumagic.launch.kernel_side.group_members import (
    START_TIMEOUT_S,
    GroupError,
    GroupMembers,
    Member,
    RankDied,
    RankFailed,
    ReplyTimeout,
    ask_status,
)
from gpumagic.launch.kernel_side.group_output import GroupOutput
from gpumagic.launch.kernel_side.group_recovery import GroupRecovery
from gpumagic.launch.kernel_side.group_shipping import NameShipper
from gpumagic.launch.kernel_side.node_hosts import NodeHosts, RemoteRanks, RemoteStarter
from gpumagic.launch.kernel_side.post_mortem import read_user_line
from gpumagic.launch.kernel_side.rank_start import rank_context
from gpumagic.launch.options import GROUP_OPTIONS, LaunchOptions, check_hang_after
from gpumagic.launch.plan import LaunchPlan, check_timeout
from gpumagic.launch.rank_side.debugging import LEFT, PROMPT
from gpumagic.launch.rank_side.group_rank import sync_here
from gpumagic.launch.records import MemoryFreed, RankStatus
from gpumagic.launch.replay import Definition, definitions
from gpumagic.launch.replicas import Divergence, compare, sync_plan
from gpumagic.launch.shared_values import sharing
from gpumagic.launch.shipping import FunctionPayload, dumps, pack, parse_cell, ship_cell, ship_function
from gpumagic.run_dirs import store
from gpumagic.run_dirs.launch_files import make_launch_directories, remove_launch_directories
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.outcomes import ProcessEnd, RankOutcome, read_outcome, root_cause
from gpumagic.units import parse_duration

_log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 5.0
CLOSE_GRACE_S = 5.0


class CellInterrupted(ReportedError):
    """A cell on the group was interrupted or timed out; the message says what was kept and what was lost."""


class CellFailed(LaunchError):
    """A cell raised on some rank (or a rank died): the first failure's traceback, every rank's fate, and what
    gpumagic did about it (a replaced rank, lost names)."""


_open_groups: set[RankGroup] = set()  # every group of this process not closed yet, for close_open_groups


def close_open_groups(status: str = "finished") -> int:
    """Close every group of ranks this process has open (the kernel is ending); how many were open."""
    groups = list(_open_groups)
    for group in groups:
        try:
            group.close(status)
        except Exception:  # noqa: BLE001
            _log.debug("a group could not be closed as the kernel ends; the others still are", exc_info=True)
    return len(groups)


class RankGroup:
    """N ranks with a process group, kept across calls. Use as a context manager, or ``close()`` it.

    ``run(fn, *args)`` and ``exec(code)`` return ``{rank: value}``; ``pull``/``push`` move names;
    ``status()``/``free()`` look after the ranks. See ``gpumagic.ranks``.
    """

    def __init__(
        self,
        launch: LaunchOptions | None = None,
        *,
        grace: str | float = DEFAULT_GRACE_S,
        write: Callable[[str], None] | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        """Start the group: ``launch`` (``LaunchOptions.for_group``: ranks, GPUs, backend, timeout, output; checked
        when it was made), ``grace`` (how long an interrupted cell may take to stop), ``write`` (where rank output
        goes, default stdout) and ``on_note`` (where gpumagic's notes go, default ``write``)."""
        self.launch = launch or LaunchOptions.for_group()
        if self.launch != LaunchOptions.for_group(**{name: getattr(self.launch, name) for name in GROUP_OPTIONS}):
            raise InvalidArgument(
                "a group of ranks runs on this machine, from the rank server, on ports of its own: make its options "
                "with LaunchOptions.for_group (nprocs, gpus, gpus_per_rank, backend, timeout, output)"
            )
        self.timeout_s = self.launch.timeout_s
        self.grace_s = parse_duration(grace, at_most=3600.0, what="a grace period")
        self.requested = self.launch.nprocs
        self.output = self.launch.output
        self.write = write or stdout_writer()
        self.on_note = on_note or (lambda text: self.write(text + "\n"))
        self.closed = True
        self.cells = 0
        self._output = GroupOutput(bars=write is None)  # progress bars updated in place (in a notebook)
        self.members = GroupMembers(self._output.feed, self._check_open)
        self._shipper = NameShipper()
        self.recovery = GroupRecovery(self.members, self._shipper, self.grace_s)
        self.divergence = Divergence()  # what differed between the replicas when last compared
        self.failed_last: dict[int, str] = {}  # rank -> "failed" (its frames kept) or "died", in the last cell
        self._stopping = False  # an interrupted or timed-out cell is being stopped
        self.read_line: Callable[[str], str] = read_user_line  # the user's answer to a rank's pdb prompt
        self.members.on_debug = self._debug_io
        self._stack = contextlib.ExitStack()
        self._start()

    # --- life --------------------------------------------------------------------------------------------

    def _start(self) -> None:
        launch, across = self.launch, self.launch.nnodes > 1
        run_dir = store.new_run("ddp-group", ranks=0)
        try:
            make_launch_directories(RunFiles(run_dir))  # the stores' sockets and the run's secret: the user's only
            # the same GPUs, ranks and backend as a launch's; across nodes, the GPUs Slurm gave each node
            placed = place_on_allocation(launch) if across else place_ranks(launch)
            hosts = NodeHosts.for_group(Path(run_dir), launch, placed) if across else None
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)  # a refused start leaves nothing behind
            raise
        self.run_dir = run_dir
        self.use_cuda = placed.use_cuda
        self.backend = placed.backend or "gloo"
        self.nodes: list[str] = []  # the allocation's nodes it runs on, in node order (none: this machine)
        if hosts is not None:
            self.nodes, self.plan, self.leased = hosts.nodes, hosts.plan, False
            self.rank_gpus = tuple(() for _ in range(hosts.plan.world_size))  # each host's to give
        else:
            gpus = launch.gpus
            self.rank_gpus = placed.rank_gpus
            self.leased = gpus is not None and (gpus == "auto" or not parse_spec(gpus).none) and any(placed.rank_gpus)
            self.plan = LaunchPlan.on_this_machine(
                run_dir,
                self.rank_gpus,
                backend=self.backend,
                use_cuda=self.use_cuda,
                master_port=0,
                timeout_s=self.timeout_s,
                hang_after_s=launch.hang_after_s,
            )
        self.nprocs = nprocs = len(self.rank_gpus)
        where = {"nodes": self.nodes} if self.nodes else {}
        store.update_run(run_dir, ranks=nprocs, backend=self.backend, gpus=[list(g) for g in self.rank_gpus], **where)
        self.hangs = HangFollower.of_run(self.run_dir, nprocs, launch.hang_after_s, self.on_note)
        self.members.on_round = self.hangs.poll
        self.closed = False
        _open_groups.add(self)
        atexit.register(self.close)
        try:
            if hosts is not None:  # a host per node forks its ranks; the kernel talks to them through it
                self._stack.callback(hosts.close)
                hosts.start()
                self.nodes = hosts.nodes
                self._output.hosts = {rank: hosts.host_of(rank).node for rank in range(nprocs)}
                self.members.start_with(RemoteStarter(hosts), nprocs, RemoteRanks(hosts))
            else:
                context = self._stack.enter_context(rank_context("forkserver"))  # held while the group lives
                self.members.start(context, self.plan)
            self.members.form()
        except RankDied as died:
            self._forget()
            member = self.members[died.ranks[0]]
            raise GroupError(f"rank {member.rank} {member.death()} while the group was starting") from None
        except BaseException:
            self._forget()
            raise
        self.export = tracked.follow(run_dir, "ddp-group", launch, nprocs=nprocs, backend=self.backend)

    def _forget(self) -> None:
        """A start that failed: its ranks end and it leaves no run behind (the error says what went wrong)."""
        self.close(status="failed")
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def close(self, status: str = "finished") -> None:
        """End the ranks (their process trees), release the group's leases and its rank server hold."""
        if self.closed:
            return
        self.closed = True
        _open_groups.discard(self)
        atexit.unregister(self.close)
        self.members.close(within=CLOSE_GRACE_S)
        self._stack.close()
        if getattr(self, "leased", False):
            with contextlib.suppress(GpumagicError, OSError):
                selection.release()
        if getattr(self, "run_dir", None) is not None:
            remove_launch_directories(RunFiles(self.run_dir))
            store.finish_run(self.run_dir, status)
            tracked.end(getattr(self, "export", None), status, self.on_note)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{sum(m.alive for m in self.members)} alive"
        return f"<RankGroup {self.nprocs} ranks ({self.backend}), {state}>"

    @property
    def pids(self) -> list[int]:
        """Each rank's pid (on its node, for a group across nodes)."""
        return [m.pid for m in self.members]

    @property
    def local_pids(self) -> list[int | None]:
        """Each rank's pid where it runs on this machine, ``None`` where on another node (the dashboard reads those
        ranks' resources from the samples their node's host writes)."""
        return [None if m.node else m.pid for m in self.members]

    @property
    def reformed(self) -> int:
        """How many times the process group was re-formed (after a stuck collective, a death)."""
        return self.recovery.reformed

    @property
    def replaced(self) -> int:
        """How many dead ranks were replaced by fresh ones."""
        return self.recovery.replaced

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
        hang_after: str | float | None = None,
    ) -> dict[int, Any]:
        """Run ``code`` on the ranks (all, or ``ranks``) in their namespaces; ``{rank: last expression}``.
        ``hang_after``: this call's hang report threshold (default: the group's ``--hang-after``; 0: off).

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
        after_s = None if hang_after is None else check_hang_after(hang_after)
        self._recover_dead()
        targets = self._targets(ranks)
        with self._sharing() as shared:  # the ranks have mapped what they were sent once they replied
            packed, digests = self._shipper.pack_for(payload, targets, namespace, hidden, shared)
            found = definitions(code, filename, tree)
            with self._hang_threshold(after_s):
                return self._run(messages.Exec, filename, packed, targets, self._deadline(timeout), digests, found)

    @property
    def hang_reports(self) -> list[HangReport]:
        """The hang reports of this group's cells, oldest first (each: ``text``, ``time``, ``ranks``, ...)."""
        return self.hangs.reports

    @contextlib.contextmanager
    def _hang_threshold(self, after_s: float | None) -> Iterator[None]:
        """Run with the hang threshold ``after_s`` (``None``: the group's), the group's again afterwards."""
        default = self.launch.hang_after_s
        if after_s is None or after_s == default:
            yield
            return
        self._tell_hang_after(after_s)
        try:
            yield
        finally:
            self._tell_hang_after(default)

    def _tell_hang_after(self, after_s: float) -> None:
        self.hangs.after_s = after_s
        for member in self.members:
            if member.alive:
                member.send(messages.HangAfter(0, after_s))

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, Any]:
        """Call ``fn(*args, **kwargs)`` on every rank (in its namespace: globals it defines persist);
        ``{rank: value}``."""
        self.cells += 1
        with self._sharing() as shared:
            packed = pack(ship_function(fn, args, kwargs, rank_first=False), shared)
            self._recover_dead()
            targets = self._targets(None)
            return self._run(
                messages.Call, getattr(fn, "__name__", "fn"), {m.rank: packed for m in targets}, targets, None, {}
            )

    def pull(self, name: str, rank: int = 0) -> Any:
        """A copy of ``name`` from ``rank`` (tensors, modules and state_dicts on the CPU; a DDP model: its module)."""
        self._check_open()
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidArgument(f"pull needs a variable name, got {name!r}")
        (member,) = self._targets([rank])
        return cloudpickle.loads(self._request(member, messages.Pull, name=name))

    def push(self, **values: Any) -> None:
        """Set names on every rank (``push(lr=1e-3, batch=b)``); pushed names are the ranks' own from then on."""
        self._check_open()
        with self._sharing() as shared:
            try:
                packed = dumps(values, shared)
            except Exception:
                pack(FunctionPayload(dict, kwargs=values), shared)
                raise
            self._recover_dead()
            replies = self.members.ask(list(self.members), messages.Push, packed=packed)
        for member in self.members:
            if isinstance(replies[member.rank], messages.Done):
                member.own.update(values)
                member.present.update(values)
                for name in values:
                    member.shipped.pop(name, None)

    def status(self) -> list[RankStatus]:
        """Each rank (a ``RankStatus``, read as a dict): alive, pid, the cell it is running and since when, the
        collective it is in and since when, GPU memory allocated and reserved (bytes; ``None`` on a CPU rank),
        resident memory."""
        self._check_open()
        members = list(self.members)
        alive = {m.rank: m.alive and (m.node is not None or is_running(m.pid)) for m in members}
        states = ask_status([m for m in members if alive[m.rank]], 2.0)
        return [RankStatus(m.rank, m.pid, alive[m.rank], states.get(m.rank), m.node) for m in members]

    def debug(self, rank: int) -> None:
        """A post-mortem debugger (pdb) on the frame where ``rank``'s last cell failed: its prompt and output
        here, the user's lines read with ``input()`` (in a notebook, an input box), until ``q``. The other ranks
        wait between cells meanwhile.

        Raises:
            InvalidArgument: no such rank, or it did not fail in the last cell (or died: its frames are gone).
        """
        self._check_open()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.nprocs:
            raise InvalidArgument(f"rank {rank!r} is not in this group: its ranks are 0..{self.nprocs - 1}")
        fate = self.failed_last.get(rank)
        if fate is None and not self.failed_last and self.cells:
            raise InvalidArgument(
                f"rank {rank} has no failed cell to debug (none failed since the last cell or %ddp free); "
                "breakpoint() in a %%ddp cell stops a rank where you choose"
            )
        if fate is None:
            failed = [r for r, f in sorted(self.failed_last.items()) if f == "failed"]
            listed = ", ".join(f"rank {r}" for r in failed)
            raise InvalidArgument(
                f"rank {rank} did not fail in the last cell, so there is nothing to debug"
                + (f" ({listed} did: %ddp debug {failed[0]})" if failed else "")
                + "; breakpoint() in a %%ddp cell stops a rank where you choose"
            )
        if fate == "died":
            raise InvalidArgument(
                f"rank {rank} died in the last cell, so its frames are gone (a fresh rank took its place); the "
                "cell's error shows its last Python stack"
            )
        self.members.request(self.members[rank], messages.Debug)

    def _debug_io(self, member: Member, text: str, state: str | None) -> None:
        """A rank's debugger said something: show it; at its prompt, read the user's line and send it."""
        if state == PROMPT:
            self.hangs.quiet = True  # the peers wait for the rank in the debugger: no hang to report
            if self._stopping:  # an interrupted cell is being stopped: no prompt may hold it
                member.send(messages.Stdin(0, None))
                return
            try:
                line: str | None = self.read_line(text)
            except KeyboardInterrupt:  # the stop button: the debugger lets go, and the cell is interrupted
                member.send(messages.Stdin(0, None))
                raise
            except (EOFError, Exception):  # noqa: BLE001 - no input box here
                _log.debug("rank %d's debugger cannot read a line here; it goes on", member.rank, exc_info=True)
                line = None
                self.on_note(f"rank {member.rank}'s debugger cannot read a line here (no input); it goes on")
            member.send(messages.Stdin(0, line))
            return
        if text:
            self.write(text)
        if state == LEFT:
            self.hangs.quiet = False

    def free(self) -> list[MemoryFreed]:
        """Collect garbage and empty the CUDA cache on every rank; per rank what was released (a ``MemoryFreed``,
        read as a dict)."""
        self._check_open()
        self._recover_dead()
        self.failed_last = {}  # the ranks drop a failed cell's frames too
        replies = self.members.ask(list(self.members), messages.Free)
        return [reply.value for _, reply in sorted(replies.items()) if isinstance(reply, messages.Done)]

    def kept(self) -> list[str]:
        """The names registered with ``gpumagic.keep`` (rank 0's list)."""
        self._check_open()
        return list(self._request(self.members[0], messages.Kept))

    def check(self) -> Divergence:
        """Compare the replicas: their DistributedDataParallel models, the optimizers and schedulers of those,
        the kept names, and the plain numbers that were equal on every rank when the last cell started (a step
        counter). What differs (empty: nothing); ``sync`` makes them alike.

        Raises:
            GroupError: the group is closed, or a rank could not describe its state.
        """
        self._check_open()
        self._recover_dead()
        replies = self.members.ask(list(self.members), messages.Describe, within=START_TIMEOUT_S)
        refused = {r: reply.failure() for r, reply in replies.items() if not isinstance(reply, messages.Done)}
        if refused:
            rank, report = min(refused.items())
            raise GroupError(f"rank {rank} could not describe its state: {report.get('type')}: {report.get('message')}")
        self.divergence = compare({r: reply.value for r, reply in replies.items() if isinstance(reply, messages.Done)})
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
            wanted = set(self._request(member, messages.Replicated)) | set(self.divergence.names)
        else:
            wanted = {names} if isinstance(names, str) else set(names)
            bad = sorted(repr(n) for n in wanted if not isinstance(n, str) or not n.isidentifier())
            if bad:
                raise InvalidArgument(f"sync needs variable names, got {', '.join(bad)}")
        if not wanted:
            return []
        replies = self.members.ask(list(self.members), messages.Kinds, names=sorted(wanted))
        kinds = {
            r: reply.value if isinstance(reply, messages.Done) else reply.failure() for r, reply in replies.items()
        }
        try:
            plan = sync_plan(sorted(wanted), kinds, source)
        except KeyError as err:
            raise InvalidArgument(f"{err.args[0]!r} is not defined on rank {source}: nothing to copy") from None
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        self.run(sync_here, source, plan)
        self.divergence = Divergence()
        return [name for name, _ in plan]

    # --- helpers of the work -------------------------------------------------------------------------------

    def _sharing(self) -> contextlib.AbstractContextManager[Any]:
        """Big tensors travel through /dev/shm on this machine (``shared_values``); to other nodes by value."""
        return sharing() if not self.nodes else contextlib.nullcontext(None)

    def _check_open(self) -> None:
        if self.closed:
            raise GroupError("this group of ranks is closed; start another (gpumagic.ranks, %ddp start)")

    def _targets(self, ranks: Iterable[int] | None) -> list[Member]:
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

    def _request(
        self, member: Member, kind: type[messages.Pull | messages.Kept | messages.Replicated], **fields: Any
    ) -> Any:
        """One request to one rank outside a cell, dead ranks replaced first (``GroupMembers.request``)."""
        self._recover_dead()
        return self.members.request(member, kind, **fields)

    def _recover_dead(self) -> None:
        """Ranks that died between cells: replace them now, telling what they lost."""
        self._check_open()
        for note in self.recovery.recover_dead():
            self.on_note(note)

    # --- cells -------------------------------------------------------------------------------------------

    def _run(
        self,
        kind: type[messages.Exec | messages.Call],
        label: str,
        packed: dict[int, bytes],
        targets: list[Member],
        deadline: float | None,
        digests: dict[str, str],
        found: list[Definition] | None = None,
    ) -> dict[int, Any]:
        members, recovery = self.members, self.recovery
        reformed = recovery.reformed
        notes: list[str] = []
        why = None
        point = None
        mismatches: list[str] = []
        with self._output.cell(self.write, self.output, self.nprocs, len(targets)):
            ident = members.next_ident()
            members.partial = {}
            try:
                try:
                    for member in targets:
                        member.busy = label
                        member.send(kind(ident, label, packed[member.rank]))
                    replies = members.wait(ident, targets, deadline, stop_on_failure=True)
                except (KeyboardInterrupt, ReplyTimeout) as stopped:
                    why = "interrupted" if isinstance(stopped, KeyboardInterrupt) else "timed out"
                    replies = dict(members.partial)
                    self._stopping = True
                    try:
                        point = recovery.stop_together(ident, targets, replies)
                        replies = recovery.recover(ident, targets, why, notes, replies)
                    finally:
                        self._stopping = False
                except (RankDied, RankFailed):
                    # read before a dead rank's replacement starts its recorder afresh
                    mismatches = mismatch_after_failure(RunFiles(self.run_dir), [m.rank for m in targets])
                    replies = recovery.recover(ident, targets, None, notes, members.partial)
                else:
                    if any(isinstance(reply, messages.Interrupted) and reply.collective for reply in replies.values()):
                        replies = recovery.recover(ident, targets, None, notes, replies)
            except KeyboardInterrupt:  # interrupted again while recovering: the next call re-forms the group
                recovery.needs_reform = True
                raise CellInterrupted(
                    "interrupted twice: the cell was stopped, and the group is re-formed before the next cell"
                ) from None
        steady = why is None and reformed == recovery.reformed and len(targets) == len(members)
        if steady and all(m.alive for m in members):
            self._check_collectives(replies, notes)
        self._shipper.received(targets, replies, digests)
        recovery.replay.record(found or [], [r for r, reply in replies.items() if isinstance(reply, messages.Done)])
        failed = {r: m for r, m in replies.items() if isinstance(m, (messages.Failed, messages.Interrupted))}
        dead = [m for m in targets if m.rank not in replies]
        self.failed_last = {r: "failed" for r, m in replies.items() if isinstance(m, messages.Failed)}
        self.failed_last.update({m.rank: "died" for m in dead})
        if why is not None or failed or dead:
            notes.extend(self._replicas_after(replies, targets, point, quiet=why is None))
        if why is not None:
            raise CellInterrupted("; ".join([f"{why}: the cell was stopped on every rank", *notes]))
        if failed or dead:
            raise _failure(targets, replies, [*mismatches, *notes], RunFiles(self.run_dir))
        return {rank: cloudpickle.loads(_result(reply).value) for rank, reply in sorted(replies.items())}

    def _check_collectives(self, replies: dict[int, messages.Reply], notes: list[str]) -> None:
        """After a cell every rank finished: one rank that skipped a collective its peers made leaves the group
        out of step; it is re-formed, and the user told."""
        counts = {r: _collectives(reply) for r, reply in replies.items()}
        if len(set(counts.values()) - {None}) <= 1:
            return
        try:
            self.recovery.reform(notes, {})
        except KeyboardInterrupt:
            self.recovery.needs_reform = True
        told = ", ".join(f"rank {r}: {c}" for r, c in sorted(counts.items()))
        notes.insert(0, f"the ranks made different numbers of collectives ({told})")
        if all(isinstance(reply, messages.Done) for reply in replies.values()):
            for note in notes:
                self.on_note(note)

    def _replicas_after(
        self, replies: dict[int, messages.Reply], targets: list[Member], point: int | None, quiet: bool = False
    ) -> list[str]:
        """After an interrupt or a failure: are the replicas still alike? What to tell the user (``quiet``, after
        a failure: only that they differ)."""
        stopped = {m.rank: r.stopped_at for m in targets if isinstance(r := replies.get(m.rank), messages.Interrupted)}
        together = point is not None and len(stopped) == len(targets) and None not in stopped.values()
        stopped_at = set(stopped.values()) if together else set()
        if len(stopped_at) > 1:
            together = False
        if self.nprocs < 2 or self.closed or not all(m.alive for m in self.members):
            return []
        try:
            divergence = self.check()
        except (GroupError, KeyboardInterrupt):
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


def _failure(
    targets: list[Member], replies: dict[int, messages.Reply], notes: list[str], files: RunFiles
) -> CellFailed:
    """The error of a cell that failed on some rank: every target's fate, the root cause first in time."""
    outcomes = [_outcome(member, replies.get(member.rank), files) for member in targets]
    deaths = [o for o in outcomes if o.phase == "process" and not o.stopped_by_launcher]
    cause = root_cause(deaths) if deaths else (root_cause(outcomes) or outcomes[0])  # its peers fail after it
    return CellFailed(outcomes, cause, "\n".join(notes))


def _outcome(member: Member, reply: messages.Reply | None, files: RunFiles) -> RankOutcome:
    """How a cell ended on one rank: done, failed (its report), died (with the Python stack a fatal signal left,
    read as a launch's rank's is), lost with its node, or freed by gpumagic (a peer failed)."""
    outcome = _how_it_ended(member, reply, files)
    return dataclasses.replace(outcome, host=member.node, lost=member.lost_with_node or outcome.lost)


def _how_it_ended(member: Member, reply: messages.Reply | None, files: RunFiles) -> RankOutcome:
    if reply is None and not member.alive:  # its report, its fatal-signal stack, its exit code, or lost
        end = ProcessEnd(member.pid, member.exitcode, member.died_at, member.killed)
        return read_outcome(files, member.rank, 0, end)
    if reply is None or (isinstance(reply, messages.Interrupted) and member.alive):  # gpumagic freed it: a peer failed
        return RankOutcome(member.rank, member.pid, -int(signal.SIGINT), stopped_by_launcher=True)
    if isinstance(reply, messages.Done):
        return RankOutcome(member.rank, member.pid, 0)
    report = reply.failure()
    return RankOutcome(
        member.rank,
        member.pid,
        1,
        report.get("phase"),
        report.get("type"),
        report.get("message"),
        report.get("traceback"),
        report.get("timestamp"),
    )


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n:,}{suffix}"


def _collectives(reply: messages.Reply) -> int | None:
    """How many collectives the rank had made when it replied to a cell."""
    if isinstance(reply, messages.Done):
        return _result(reply).collectives
    if isinstance(reply, (messages.Failed, messages.Interrupted)):
        return reply.collectives
    return None


def _result(reply: messages.Reply) -> messages.CellResult:
    """What a cell's ``Done`` carries."""
    assert isinstance(reply, messages.Done) and isinstance(reply.value, messages.CellResult), reply
    return reply.value

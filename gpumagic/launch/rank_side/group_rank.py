"""A rank that lives across cells (``%%ddp``, ``gpumagic.ranks``): the rank runtime's set-up, then a loop that
runs what the kernel sends (cells, functions, pull/push, re-forming the process group) in one namespace that
persists, until the kernel closes the group or dies.

Two threads. The main thread runs the user's code, so the kernel's interrupt (SIGINT) raises
KeyboardInterrupt there. The control thread reads every message from the kernel (``launch.messages``): the
control messages (``Break``: shut the process group's connections so a collective stuck waiting for a peer
fails at once; ``Pause``, ``StopAt``, ``Stdin``, ``HangAfter``) it acts on itself, even while the main thread
is busy (``CONTROLS``); the requests it queues for the main thread, which does each with its handler in
``HANDLERS``. A third thread answers the status channel.

Started from the rank server like a launch's ranks (``rank.run_local_rank``), with the same runtime and set-up
(``runtime.RankRuntime``); imported there, so torch is imported only where it is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any, ClassVar

import cloudpickle

from gpumagic.launch import messages, replay, replicas, secure_store
from gpumagic.launch.host_link import HOST_VARIABLE
from gpumagic.launch.plan import LaunchPlan
from gpumagic.launch.rank_side.debugging import RemoteConsole, post_mortem, set_trace
from gpumagic.launch.rank_side.failure_reports import failure_report
from gpumagic.launch.rank_side.hang_watch import CollectiveRecorder, HangWatch
from gpumagic.launch.rank_side.lifeline import end_own_group
from gpumagic.launch.rank_side.output_routing import flush
from gpumagic.launch.rank_side.process_group import (
    StorePlace,
    break_connections,
    join_tracking_sockets,
    leave_broken_group,
)
from gpumagic.launch.rank_side.runtime import RankRuntime, RankSetup, become_rank, exit_rank, plan_setup
from gpumagic.launch.rank_side.sync_points import SyncPoints, track_ddp_forwards
from gpumagic.launch.records import MemoryFreed, RankState
from gpumagic.launch.shipping import dumps, dumps_to_cpu

_log = logging.getLogger(__name__)
_kept: dict[str, None] = {}  # names registered with gpumagic.keep, in registration order
_this_rank: GroupRank | None = None


def serve_group_rank(local_rank: int, plan: LaunchPlan, output: Any, connection: Any, status: Any) -> None:
    """The target of a group rank's process: set up, then serve the kernel until it closes the group."""
    become_rank(plan, local_rank, [output], 0)
    exit_rank(GroupRank(plan_setup(plan, local_rank), connection, status).serve())


def keep(*objects: Any, **named: Any) -> None:
    """In a rank of a persistent group (``gpumagic.keep``): state to restore when a dead rank is replaced
    (``keep(model, optimizer)`` or ``keep(model=m)``). A healthy rank's copy is sent to the fresh rank; DDP models
    are wrapped again. Outside such a rank it does nothing."""
    if _this_rank is None:
        return
    namespace = _this_rank.namespace
    for name, value in named.items():
        namespace[name] = value
        _kept[name] = None
    for value in objects:
        names = [n for n, v in namespace.items() if v is value and not n.startswith("_")]
        if not names:
            raise ValueError(
                f"gpumagic.keep: this {type(value).__name__} has no name in the cell's namespace; "
                "assign it to a variable first, or name it: gpumagic.keep(model=model)"
            )
        _kept[sorted(names)[0]] = None


class GroupRank(RankRuntime):
    """One rank of a persistent group: its namespace, its process group, and the loop serving the kernel."""

    made_by = "%ddp start"
    joins_at_set_up = False  # the kernel has every rank join (do_join) once all are up, and again on a re-form

    def __init__(self, setup: RankSetup, connection: Any, status_connection: Any) -> None:
        super().__init__(dataclasses.replace(setup, backend=setup.backend or "gloo"))
        self.connection = connection
        self.status_connection = status_connection
        self.jobs: queue.Queue[messages.Request] = queue.Queue()
        self.sending = threading.Lock()
        self.namespace: dict[str, Any] = {}
        self.provided: set[str] = set()  # the names the runtime put in the namespace (rank, device, ...)
        self.shipped: dict[str, int] = {}  # names the kernel sent: the id of the object each was sent as
        self.executing: str | None = None  # the cell being run
        self.executing_since = 0.0
        self.group_sockets: dict[int, int] = {}  # fd -> inode of the process group's connections
        self.broken = False
        self.to_wrap: dict[str, dict[str, Any]] = {}  # kept DDP models a fresh rank got as modules
        self.sync = SyncPoints()  # where the rank is, for an interrupt that stops every rank at one point
        self.before: dict[str, Any] = {}  # the plain numbers of the namespace when the last cell started
        self.failure: Any = None  # the traceback of the last cell, if it failed here: %ddp debug's frames
        self.lines: queue.Queue[str | None] = queue.Queue()  # the notebook's answers to this rank's debugger

    # --- the loop --------------------------------------------------------------------------------------

    def serve(self) -> int:
        global _this_rank
        try:
            self.set_up()
            self._open_namespace()
        except BaseException as err:  # noqa: BLE001 - the kernel must hear why the rank cannot serve
            _log.debug("the rank cannot serve; the kernel is told why", exc_info=True)
            self.send(messages.Failed(messages.READY, failure_report(self.phase, err), None))
            return 1
        _this_rank = self
        threading.Thread(target=self._control, name="gpumagic-control", daemon=True).start()
        threading.Thread(target=self._answer_status, name="gpumagic-status", daemon=True).start()
        self.send(messages.Ready(os.getpid()))
        while True:
            try:
                request = self.jobs.get()
            except KeyboardInterrupt:  # an interrupt that came after the cell it was meant for ended
                continue
            if isinstance(request, messages.Close):
                self.send(messages.Done(request.ident, None))
                return 0
            reply = self._handle(request)
            self.send(reply)
            if not isinstance(reply, messages.Done):  # what failed code held (DataLoader workers...) ends now
                gc.collect()

    def _handle(self, request: messages.Request) -> messages.Reply:
        """Do one request (its handler in ``HANDLERS``); the reply. An interrupt meant for the user's code that
        arrives late (while the reply is made) is absorbed here: it must never end the loop."""
        ident = request.ident
        cell = isinstance(request, (messages.Exec, messages.Call))
        if cell:
            self.sync.start_cell(ident)
            self._forget_failure()  # its frames go: a new cell runs
        while True:
            try:
                try:
                    return messages.Done(ident, self.HANDLERS[type(request)](self, request))
                except KeyboardInterrupt:
                    collective = self.collective
                    name = collective[0] if collective else None
                    return messages.Interrupted(ident, name, self.collectives, self.sync.stopped_at)
                except BaseException as err:  # noqa: BLE001 - every failure goes back to the kernel
                    _log.debug("a %s failed; its failure goes to the kernel", type(request).__name__, exc_info=True)
                    self.executing = None
                    if cell:
                        self.failure = err.__traceback__
                    return messages.Failed(ident, failure_report("user code", err), self.collectives)
                finally:
                    self.executing = None  # before the reply: a late interrupt must not hit the loop
                    if self.recorder is not None:
                        self.recorder.current = None
                    if cell:
                        self.sync.end_cell()
                        if signal.getsignal(signal.SIGINT) != self._on_interrupt:  # a cell took it over
                            signal.signal(signal.SIGINT, self._on_interrupt)
                    flush()
            except KeyboardInterrupt:
                if cell:
                    return messages.Interrupted(ident, None, self.collectives, None)

    def send(self, message: messages.ToKernel) -> None:
        with self.sending:
            try:
                self.connection.send(messages.encode(message))
            except (OSError, ValueError):  # the kernel is gone: so is this rank
                end_own_group()

    def _answer_status(self) -> None:
        """The status channel: answered at once, whatever the main thread does (the kernel may ask from another
        thread than the one running cells)."""
        while True:
            try:
                asked = messages.decode(self.status_connection.recv(), messages.StatusAsk)
                self.status_connection.send(messages.encode(messages.StatusAnswer(asked.ident, self.status())))
            except messages.MessageError:
                continue
            except (EOFError, OSError):
                _log.debug("the status channel closed; status answers stop", exc_info=True)
                return

    def _control(self) -> None:
        """Read the kernel's messages: control messages (``CONTROLS``) now, requests queued for the main thread."""
        while True:
            try:
                raw = self.connection.recv()
            except (EOFError, OSError):
                end_own_group()
                return
            try:
                message = messages.decode(raw, messages.ToRank)
            except messages.MessageError as err:  # a request this rank cannot read fails, as one it cannot do would
                ident = raw[1] if isinstance(raw, tuple) and len(raw) > 1 else None
                if isinstance(ident, int) and ident > 0:
                    self.send(messages.Failed(ident, failure_report("gpumagic", err), self.collectives))
                continue
            control = self.CONTROLS.get(type(message))
            if control is not None:
                control(self, message)
            else:
                self.jobs.put(message)

    def _on_pause(self, message: messages.Pause) -> None:
        """Where the rank is in the cell, held at its next sync point."""
        where = self.sync.pause(message.cell)
        inside = self.collective  # (name, since): waiting there may be for a peer that never comes
        if where is not None and inside is not None:
            where["inside"] = time.time() - inside[1]
        self.send(messages.Paused(message.ident, where))

    # --- set-up ----------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Watches over the user's code, before the device is chosen (``RankRuntime.set_up``)."""
        self._track_collectives()
        track_ddp_forwards(self.sync)
        _end_stuck_data_loader_workers_soon()

    def _open_namespace(self) -> None:
        """The namespace every cell runs in (the fresh ``__main__``), with the names the runtime provides; the
        kernel's interrupt from now on reaches the user's code only."""
        self.namespace = self.main_module.__dict__
        self.namespace.update(self.context())
        self.provided = set(self.namespace)
        signal.signal(signal.SIGINT, self._on_interrupt)
        sys.breakpointhook = self._breakpoint

    # --- debugging -------------------------------------------------------------------------------------

    def console(self, unanswered: str) -> RemoteConsole:
        """pdb's stream to the notebook: over this rank's pipe; ``unanswered``: the line taken when the
        notebook cannot answer (no input box: a script, a non-interactive run)."""
        while not self.lines.empty():  # answers left from an earlier session
            self.lines.get_nowait()

        def receive() -> str | None:
            line = self.lines.get()
            return unanswered if line is None else line

        return RemoteConsole(lambda text, state: self.send(messages.DebugIO(text, state)), receive)

    def _forget_failure(self) -> None:
        """Let the failed cell's frames go (and the memory their tensors hold)."""
        if self.failure is not None:
            self.failure = None
            gc.collect()

    def _at_prompt(self, at: bool) -> None:
        if self.hang_watch is not None:
            self.hang_watch.debugging = "at the pdb prompt" if at else None

    def do_debug(self, request: messages.Debug) -> None:
        """``%ddp debug R``: pdb on the frame where this rank's last cell failed, until the user quits."""
        if self.failure is None:
            raise LookupError(f"rank {self.setup.rank} has no failed cell to debug")
        post_mortem(self.console("q"), self.failure, self._at_prompt)

    def _breakpoint(self, *args: Any, **kwargs: Any) -> None:
        """``breakpoint()`` in a cell: pdb on this rank, its prompt in the notebook (c continues the cell)."""
        if os.environ.get("PYTHONBREAKPOINT") == "0" or self.executing is None:
            return
        set_trace(self.console("c"), sys._getframe(1), self._at_prompt)

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        if self.executing is not None:
            raise KeyboardInterrupt

    def _track_collectives(self) -> None:
        """Record which collective the rank is in, and since when (``status``, interrupts, hang reports); a call
        of the default group is a point where an interrupt meant for every rank stops them together."""
        if self.recorder is None:
            self.recorder = CollectiveRecorder()

        def entered(name: str, default_group: bool) -> None:
            if default_group:
                self.sync.enter()

        self.recorder.on_enter = entered
        self.recorder.install()

    @property
    def collective(self) -> tuple[str, float] | None:
        """The collective the rank is in (its name, since when), or ``None``."""
        call = self.recorder.current if self.recorder is not None else None
        return (call.op, call.since) if call is not None else None

    @property
    def collectives(self) -> int:
        """The default group's collectives made since it was formed: peers that differ are out of step."""
        return self.recorder.count if self.recorder is not None else 0

    def busy(self) -> bool:
        return self.executing is not None

    def watch_hangs(self, after_s: float) -> None:
        """Set the hang watch's threshold (0: quiet); a group started without one gets one now, seeing its own
        recorder's calls (torch's recorder is on only if the group started with a threshold)."""
        if self.hang_watch is None and after_s > 0:
            self.hang_watch = HangWatch(self.setup.files, self.setup.rank, after_s, self.recorder, self.busy)
            self.hang_watch.start()
        elif self.hang_watch is not None:
            self.hang_watch.after_s = after_s

    # --- the process group -----------------------------------------------------------------------------

    def do_join(self, request: messages.Join) -> str:
        """Join a fresh process group. Rank 0 serves its store (``secure_store``) on a new Unix socket in the
        run's private launch directory (across nodes: on a port of its node's address it bound itself) and reports
        the address first; the others are given it."""
        # lazy: torch, in rank processes only
        import torch.distributed as dist

        if dist.is_initialized():  # the old group could not be left: joining would reuse it
            raise RuntimeError("this rank is still in its old process group; %ddp restart starts a fresh group")
        listener = None
        address = request.address
        if address is None:
            node_address = os.environ.get(HOST_VARIABLE)  # a group across nodes: its other nodes must reach it
            if node_address:
                listener = secure_store.listen(secure_store.tcp_address(node_address, 0))
                address = secure_store.listener_address(listener, node_address)
            else:
                address = f"unix:{self.setup.files.group_store_socket(request.ident)}"
                listener = secure_store.listen(address)
            self.send(messages.Store(address))
        os.environ[secure_store.VARIABLE] = address
        setup = self.setup
        self.group_sockets = join_tracking_sockets(
            setup.files,
            StorePlace(address=address, listener=listener),
            setup.backend,
            setup.rank,
            setup.world_size,
            setup.timeout_s,
        )
        self.broken = False
        if self.recorder is not None:
            self.recorder.restart_count()  # counted from this group's start, the same on every rank
        if self.hang_watch is not None:
            self.hang_watch.new_group()
        return address

    def do_leave(self, request: messages.Leave) -> None:
        """Leave the process group (broken first, so that no peer waits on this rank)."""
        # lazy: torch, in rank processes only
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if not self.broken:
            self.break_group()
        leave_broken_group()

    def break_group(self) -> None:
        """End every connection of the process group now, from any thread: a collective waiting on a peer fails
        at once ("Connection closed by peer") instead of after the group's timeout. NCCL groups are aborted."""
        self.broken = True
        break_connections(self.setup.backend, self.group_sockets)

    def do_wrapped(self, request: messages.Wrapped) -> list[str]:
        """The names of DistributedDataParallel models here (and kept ones a fresh rank is to wrap)."""
        # lazy: torch, in rank processes only
        from torch.nn.parallel import DistributedDataParallel

        found = {n for n, v in self.namespace.items() if isinstance(v, DistributedDataParallel)}
        return sorted(found | set(self.to_wrap))

    def do_rewrap(self, request: messages.Rewrap) -> list[str]:
        """After the group was re-formed: the DistributedDataParallel models ``names`` wrapped anew on it (the old
        ones hold the ended group). A collective: every rank wraps the same names in the same order."""
        names = request.names
        for name in names:
            old = self.namespace[name]
            if name in self.to_wrap:
                self.namespace[name] = _wrap_like(old, None, self.to_wrap.pop(name))
            else:
                self.namespace[name] = _wrap_like(old.module, old)
        self.to_wrap.clear()
        return names

    # --- the user's code -------------------------------------------------------------------------------

    def do_exec(self, request: messages.Exec) -> messages.CellResult:
        """Run a shipped cell (``shipping.CellPayload``) in the namespace; its value (pickled), and the names the
        ranks now hold as their own and all the names they hold."""
        payload = cloudpickle.loads(request.packed)
        payload.prepare()
        self.receive(payload.names)
        self._start(request.label)
        value = payload.run(self._context(), self.namespace)
        return messages.CellResult(dumps_to_cpu(value), *self.names(), self.collectives)

    def do_call(self, request: messages.Call) -> messages.CellResult:
        """Call a shipped function (``shipping.FunctionPayload``)."""
        payload = cloudpickle.loads(request.packed)
        payload.prepare()
        fn = self._in_namespace(payload.fn)
        self._start(request.label)
        value = fn(*payload.args, **payload.kwargs)
        return messages.CellResult(dumps_to_cpu(value), *self.names(), self.collectives)

    def receive(self, names: dict[str, Any]) -> None:
        """Take the notebook's names (their values as the kernel sent them) into the namespace."""
        for name, value in list(names.items()):
            names[name] = self._in_namespace(value)
            self.shipped[name] = id(names[name])
        self.namespace.update(names)

    def _in_namespace(self, value: Any, seen: dict[int, Any] | None = None) -> Any:
        """A notebook function (or class) as if defined here: its globals are the rank's namespace, so it sees
        what the cells made on the rank (``model``), as the notebook's own functions see the notebook's names.
        The notebook names it refers to (sent along with it) join the namespace, made at home there the same
        way, unless the rank made its own. ``seen``: what this call made already (functions refer to each
        other, and to themselves)."""
        seen = {} if seen is None else seen
        if id(value) in seen:
            return seen[id(value)]
        if isinstance(value, type) and value.__module__ == "__main__":
            seen[id(value)] = value
            for cls in value.__mro__:  # its notebook base classes' methods too
                if cls.__module__ != "__main__" or cls is object:
                    continue
                for attribute, member in list(vars(cls).items()):
                    rebound = _rebind(member, lambda function: self._in_namespace(function, seen))
                    if rebound is not member:
                        setattr(cls, attribute, rebound)
            return value
        if not isinstance(value, types.FunctionType) or value.__module__ != "__main__":
            return value  # an importable function keeps its module's globals
        if value.__globals__ is self.namespace:
            return value
        function = types.FunctionType(
            value.__code__, self.namespace, value.__name__, value.__defaults__, value.__closure__
        )
        for attribute in ("__kwdefaults__", "__qualname__", "__doc__", "__module__", "__annotations__"):
            setattr(function, attribute, getattr(value, attribute))
        function.__dict__.update(value.__dict__)
        seen[id(value)] = function
        for name, known in value.__globals__.items():
            held = name in self.namespace and self.shipped.get(name) != id(self.namespace[name])
            if not name.startswith("__") and not held:
                self.namespace[name] = self._in_namespace(known, seen)
                self.shipped[name] = id(self.namespace[name])
        return function

    def _start(self, label: str) -> None:
        self.executing = label
        self.executing_since = time.time()
        self.before = self.numbers()

    def numbers(self) -> dict[str, Any]:
        """The rank's own plain numbers (``steps``): compared between ranks after an interrupt."""
        sent = {n for n, i in self.shipped.items() if id(self.namespace.get(n)) == i}  # the notebook's: alike
        return replicas.scalars_of(self.namespace, self.provided | sent)

    def _context(self) -> dict[str, Any]:
        return {k: self.namespace.get(k) for k in ("rank", "local_rank", "world_size", "device", "dist", "gpumagic")}

    def names(self) -> tuple[list[str], list[str]]:
        """The names this rank holds as its own (made by its code or pushed), and every name it holds."""
        present = [n for n in self.namespace if not _hidden(n) and n not in self.provided]
        own = [n for n in present if self.shipped.get(n) != id(self.namespace[n])]
        return own, present

    def do_pull(self, request: messages.Pull) -> bytes:
        """A name's value, pickled with every tensor copied to the CPU (a DDP model: its module)."""
        # lazy: torch, in rank processes only
        from torch.nn.parallel import DistributedDataParallel

        name = request.name
        if name not in self.namespace or _hidden(name):
            raise NameError(f"name {name!r} is not defined on rank {self.setup.rank}")
        value = self.namespace[name]
        if isinstance(value, DistributedDataParallel):
            value = value.module
        return dumps_to_cpu(value)

    def do_push(self, request: messages.Push) -> None:
        values = cloudpickle.loads(request.packed)
        self.namespace.update(values)
        for name in values:
            self.shipped.pop(name, None)  # pushed: the rank's own from now on

    def do_export(self, request: messages.Export) -> tuple[bytes, list[str]]:
        """The state registered with ``gpumagic.keep``, pickled together (DDP models as their modules), and
        the names it could not include."""
        # lazy: torch, in rank processes only
        from torch.nn.parallel import DistributedDataParallel

        state: dict[str, Any] = {}
        wrapped: dict[str, dict[str, Any]] = {}
        missing = []
        for name in _kept:
            if name not in self.namespace:
                missing.append(name)
                continue
            value = self.namespace[name]
            if isinstance(value, DistributedDataParallel):
                wrapped[name] = _wrapping_of(value)
                value = value.module
            state[name] = value
        modules = {
            n: v.__name__
            for n, v in self.namespace.items()
            if isinstance(v, types.ModuleType) and not _hidden(n) and n not in self.provided
        }
        return dumps((state, wrapped, list(_kept), modules)), missing

    def do_restore(self, request: messages.Restore) -> messages.Restored:
        """A fresh rank that replaces a dead one takes back what it can: the notebook's names the dead rank was
        sent (``names``, pickled), its cells' imports and definitions (``definitions``, run again), and the state
        another rank exported (``state``: the kept names, tensors landing on this rank's device, and that
        rank's imported modules). What it got, and why anything could not be redone."""
        received = cloudpickle.loads(request.names)
        self.receive(received)
        replayed, failed, why = replay.replay(self.namespace, request.definitions)
        kept: list[str] = []
        modules: list[str] = []
        if request.state is not None:
            values, wrapped, registered, imported = cloudpickle.loads(request.state)
            for name, module in imported.items():  # the healthy rank's imports: cheap to redo, never "lost"
                with contextlib.suppress(ImportError):
                    self.namespace.setdefault(name, importlib.import_module(module))
                    modules.append(name)
            self.namespace.update(values)
            self.to_wrap.update(wrapped)  # wrapped with the others' (a collective), in do_rewrap
            _kept.update(dict.fromkeys(registered))
            kept = sorted(values)
        if failed:  # a definition may need what the kept state brought (a default argument, a base class)
            again, failed, why = replay.replay(self.namespace, failed)
            replayed += again
        return messages.Restored(sorted(received), sorted(set(replayed)), kept, sorted(set(modules)), why)

    def do_describe(self, request: messages.Describe) -> dict[str, Any]:
        """This rank's fingerprints of the state replicas keep alike (``replicas.describe``)."""
        return replicas.describe(self.namespace, _kept, self.before)

    def do_replicated(self, request: messages.Replicated) -> list[str]:
        """The names of the state replicas keep alike here (models, optimizers, schedulers, kept names)."""
        return sorted(replicas.replicated(self.namespace, _kept))

    def do_kinds(self, request: messages.Kinds) -> dict[str, Any]:
        """How this rank holds ``names`` (``replicas.plan_kinds``), for the kernel's sync plan."""
        return replicas.plan_kinds(self.namespace, request.names)

    def do_kept(self, request: messages.Kept) -> list[str]:
        return list(_kept)

    def do_free(self, request: messages.Free) -> MemoryFreed:
        """Collect garbage and return cached GPU memory; what was released."""
        # lazy: torch, in rank processes only
        import torch

        cuda = self.setup.use_cuda and torch.cuda.is_initialized()
        before = torch.cuda.memory_reserved() if cuda else 0
        self._forget_failure()  # what a failed cell's frames held, kept for %ddp debug, is released too
        collected = gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        after = torch.cuda.memory_reserved() if cuda else 0
        return MemoryFreed(self.setup.rank, collected, before, after, cuda)

    def status(self) -> RankState:
        # lazy: torch, in rank processes only
        import torch

        cuda = self.setup.use_cuda and torch.cuda.is_initialized()
        return RankState(
            rank=self.setup.rank,
            pid=os.getpid(),
            cell=self.executing,
            since=self.executing_since if self.executing else None,
            collective=self.collective,
            allocated=torch.cuda.memory_allocated() if cuda else None,
            reserved=torch.cuda.memory_reserved() if cuda else None,
            rss=_rss(),
        )

    # what the main thread does for each request (``messages.Close`` ends the loop), and the control thread at once
    HANDLERS: ClassVar[dict[type[messages.Request], Callable[[Any, Any], Any]]] = {
        messages.Join: do_join,
        messages.Leave: do_leave,
        messages.Wrapped: do_wrapped,
        messages.Rewrap: do_rewrap,
        messages.Exec: do_exec,
        messages.Call: do_call,
        messages.Pull: do_pull,
        messages.Push: do_push,
        messages.Export: do_export,
        messages.Restore: do_restore,
        messages.Describe: do_describe,
        messages.Replicated: do_replicated,
        messages.Kinds: do_kinds,
        messages.Kept: do_kept,
        messages.Free: do_free,
        messages.Debug: do_debug,
    }
    CONTROLS: ClassVar[dict[type[messages.Control], Callable[[Any, Any], None]]] = {
        messages.Break: lambda rank, message: rank.break_group(),
        messages.Pause: _on_pause,
        messages.StopAt: lambda rank, message: rank.sync.stop_at(message.cell, message.point),
        messages.Stdin: lambda rank, message: rank.lines.put(message.line),  # the notebook's answer to the rank's pdb
        messages.HangAfter: lambda rank, message: rank.watch_hangs(message.seconds),  # a cell's own --hang-after
    }


def sync_here(source: int, plan: list[tuple[str, str]]) -> list[str]:
    """``replicas.sync_from`` on this rank's namespace (what ``RankGroup.sync`` runs on every rank); the numbers
    compared after it are those it left."""
    rank = _this_rank
    if rank is None:
        raise RuntimeError("sync_here runs on a rank of a persistent group")
    synced = replicas.sync_from(rank.namespace, source, plan)
    rank.before = rank.numbers()
    return synced


def _hidden(name: str) -> bool:
    """Python's own names in a namespace (``__builtins__``, ``__warningregistry__``): never the user's state."""
    return name.startswith("__") and name.endswith("__")


def _rebind(member: Any, rebind: Any) -> Any:
    """A class attribute with its functions rebound by ``rebind`` (methods, static and class methods, properties,
    cached properties); the attribute itself where it holds none."""
    if isinstance(member, types.FunctionType):
        return rebind(member)
    if isinstance(member, (staticmethod, classmethod)):
        return type(member)(rebind(member.__func__))
    if isinstance(member, property):
        parts = [rebind(f) if isinstance(f, types.FunctionType) else f for f in (member.fget, member.fset, member.fdel)]
        return type(member)(*parts, member.__doc__)
    if isinstance(member, functools.cached_property):
        cached = functools.cached_property(rebind(member.func))
        cached.attrname, cached.__doc__ = member.attrname, member.__doc__
        return cached
    return member


def _end_stuck_data_loader_workers_soon() -> None:
    """A DataLoader whose worker raised leaves its other workers waiting for work that never comes (torch 2.13):
    ending the iterator joins each for ``MP_STATUS_CHECK_INTERVAL`` (5 s) before terminating it, which held a
    failed rank 10 s and got it killed. Joined for 0.25 s each, they are terminated at once. Only the rank's
    joins change: the workers poll with the value they imported."""
    # lazy: torch, in rank processes only
    from torch.utils.data import _utils

    _utils.MP_STATUS_CHECK_INTERVAL = min(_utils.MP_STATUS_CHECK_INTERVAL, 0.25)


def _wrapping_of(model: Any) -> dict[str, Any]:
    how = {
        "device_ids": model.device_ids,
        "output_device": model.output_device,
        "find_unused_parameters": model.find_unused_parameters,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
    }
    if not model.broadcast_buffers:  # deprecated as an argument: given only when it differs from the default
        how["broadcast_buffers"] = False
    return how


def _wrap_like(module: Any, old: Any, how: dict[str, Any] | None = None) -> Any:
    # lazy: torch, in rank processes only
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, **(how if how is not None else _wrapping_of(old)))


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        _log.debug("/proc/self/statm is unreadable; the rank's memory is unknown", exc_info=True)
        return None

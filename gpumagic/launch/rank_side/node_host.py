"""The host of one node of a persistent group across a Slurm allocation (``%ddp start --nnodes N``): started on
its node by ``srun --overlap`` (``python -m gpumagic.host``), it links to the kernel (``launch.host_link``),
forks its node's ranks from its own rank server, watches them (pidfds), signals them, and relays their three
pipes to the kernel whole, so the kernel talks to a rank on another node as to one of its own.

It lives exactly as long as its link: when the kernel ends (a shutdown, a restart, a SIGKILL: the kernel's end
of the connection closes) or says nothing for ``KERNEL_SILENCE_S``, the host ends every rank's process group and
exits; the ranks also die with the host itself (``lifeline.die_with``: its pid is their launcher's).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumagic.launch import secure_store
from gpumagic.launch.host_link import HOST_VARIABLE, KERNEL_SILENCE_S, PING_S, Frame, HostStart, number, whole
from gpumagic.launch.plan import assign_gpus, launch_environment, threads_per_rank
from gpumagic.launch.process_set import Exit, ProcessSet
from gpumagic.launch.rank_side.group_rank import serve_group_rank
from gpumagic.launch.rank_side.lifeline import die_with_parent
from gpumagic.launch.rank_side.starter import RankStarter, start_with_pipes, starting_context
from gpumagic.launch.rank_side.usage import start_sampling
from gpumagic.run_dirs.launch_files import store_key
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.private import write_private

_log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0
START_TIMEOUT_S = 60.0  # for the kernel's START once the host said HELLO


class HostEnded(Exception):
    """The kernel is gone (its link closed, failed a tag, or went quiet): the host ends its ranks."""


@dataclass
class _Rank:
    """The host's side of one of its ranks: its process and the host's ends of its pipes."""

    rank: int
    process: Any
    message: Any
    status: Any
    output: Any
    ended_pipes: set[str] = field(default_factory=set)  # the pipes it closed (it is ending): not watched


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpumagic.host", description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="the kernel's link address, tcp:HOST:PORT")
    parser.add_argument("--run-dir", required=True, help="the group's run directory (on a shared filesystem)")
    parser.add_argument("--die-with-parent", action="store_true", help="end with the process that started this one")
    args = parser.parse_args(argv)
    if args.die_with_parent:
        die_with_parent(signal.SIGTERM)
    logging.basicConfig(level=logging.DEBUG if os.environ.get("GPUMAGIC_DEBUG") else logging.WARNING)
    files = RunFiles(Path(args.run_dir))
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    try:
        key = store_key(files)  # refuses a run whose secret the user's key did not seal
        identity = secure_store.StoreIdentity(key, secure_store.HOST, args.connect)
        link, session = secure_store.open_session(args.connect, CONNECT_TIMEOUT_S, identity)
    except (OSError, ValueError, secure_store.StoreRefused, TimeoutError) as err:
        print(f"gpumagic host on {name}: cannot reach the kernel at {args.connect}: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a refused seal is the user's to read in srun's log
        _log.debug("the host cannot start", exc_info=True)
        print(f"gpumagic host on {name}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return NodeHost(link, session, files, name).run()


class NodeHost:
    """One node's host: ``run`` serves the link until the kernel stops the group or is gone."""

    def __init__(self, link: socket.socket, session: secure_store.Session, files: RunFiles, name: str) -> None:
        self.link = link
        self.session = session
        self.files = files
        self.name = name
        self.ranks: dict[int, _Rank] = {}  # global rank -> its process and pipes
        self.processes = ProcessSet([], groups=True)  # each rank leads its process group
        self.index: dict[int, int] = {}  # global rank -> its index in ``processes``
        self.heard = time.monotonic()
        self.sent = time.monotonic()
        self.plan: Any = None
        self.starter: Any = None  # its node's ranks' (``starter.RankStarter``), once the kernel sent START
        self._sending = threading.Lock()
        self._finished = threading.Event()

    def send(self, code: Frame, *fields: bytes) -> None:
        with self._sending:  # frames are numbered: one writer at a time (the loop, the heartbeat)
            self.session.send(self.link, int(code), fields)
            self.sent = time.monotonic()

    def _heartbeat(self) -> None:
        """A PING whenever nothing else went out for ``PING_S``, from its own thread: the loop may be busy for
        seconds (the rank server imports torch before the first rank starts), and the kernel must not take that
        for a node that stopped answering."""
        while not self._finished.wait(PING_S / 2):
            if time.monotonic() - self.sent >= PING_S:
                try:
                    self.send(Frame.PING)
                except OSError:
                    _log.debug("the kernel's link failed; the loop ends the ranks", exc_info=True)
                    return

    def receive(self) -> tuple[Frame, list[bytes]]:
        try:
            code, fields = self.session.receive(self.link)
        except (OSError, ConnectionError) as err:
            raise HostEnded(f"the kernel's link ended ({err})") from None
        self.heard = time.monotonic()
        return Frame(code), fields

    def run(self) -> int:
        node_address = self.link.getsockname()[0]  # the address the kernel reaches this node at: the others' too
        self.send(Frame.HELLO, self.name.encode(), number(os.getpid()), node_address.encode())
        threading.Thread(target=self._heartbeat, name="gpumagic-heartbeat", daemon=True).start()
        with contextlib.ExitStack() as held:
            held.callback(self._finished.set)
            try:
                self.link.settimeout(START_TIMEOUT_S)
                code, fields = self.receive()
                self.link.settimeout(None)
                if code is not Frame.START:
                    raise HostEnded(f"the kernel sent {code.name} before START")
                start = HostStart.decode(fields[0])
                self.plan = self._plan(start, node_address)
                context = held.enter_context(starting_context("forkserver"))
                self.starter = RankStarter(self.plan, context, target=serve_group_rank, name="ddp-rank-{}")
                held.callback(start_sampling(self.files.root, self.plan.world_size, self.plan.use_cuda).set)
            except HostEnded as err:
                _log.debug("the host ends before its ranks start: %s", err)
                return 1
            except Exception as err:  # noqa: BLE001 - the kernel names the node and says why
                _log.debug("the host cannot start its ranks; the kernel is told", exc_info=True)
                self._fail(f"{type(err).__name__}: {err}")
                return 1
            try:
                return self._serve()
            except (HostEnded, OSError, ConnectionError) as err:  # the kernel is gone, or its link failed under us
                _log.debug("the host ends its ranks: %s", err)
                self._end_all()
                return 1
            finally:
                self.processes.close()
                with contextlib.suppress(OSError):
                    self.link.close()

    def _fail(self, why: str) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            self.send(Frame.FAILED, why.encode())

    def _plan(self, start: HostStart, node_address: str) -> Any:
        """The group's plan for this node: its ranks, their GPUs (of those Slurm gave this step), this host as their
        launcher, the environment srun gave the host."""
        template = start.plan
        nprocs = template.nprocs
        visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        per_rank = start.gpus_per_rank
        rank_gpus = assign_gpus(visible, nprocs, per_rank) if per_rank else tuple(() for _ in range(nprocs))
        env = {**launch_environment(), **template.base_env, HOST_VARIABLE: node_address}
        return dataclasses.replace(
            template,
            node_rank=start.node_rank,
            launcher_pid=os.getpid(),
            rank_gpus=rank_gpus,
            use_cuda=bool(per_rank and visible),
            threads_per_rank=threads_per_rank(nprocs),
            base_env=env,
        )

    # --- the loop ------------------------------------------------------------------------------------------

    def _serve(self) -> int:
        while True:
            watched: dict[int, tuple[str, _Rank | None]] = {self.link.fileno(): ("link", None)}
            for rank in self.ranks.values():
                for what, pipe in (("message", rank.message), ("status", rank.status), ("output", rank.output)):
                    if what not in rank.ended_pipes:
                        watched[pipe.fileno()] = (what, rank)
            ended, ready = self.processes.poll(PING_S / 2, also=list(watched))
            for fd in ready:
                what, rank = watched[fd]
                if what == "link":
                    if self._from_kernel():
                        return 0
                elif rank is not None and rank.rank in self.ranks:
                    self._relay(what, rank)
            for exit in ended:
                self._ended(exit)
            # silent: nothing came, and nothing waits unread (a rank's start can hold the loop for seconds)
            if time.monotonic() - self.heard > KERNEL_SILENCE_S and not select.select([self.link], [], [], 0)[0]:
                raise HostEnded(f"the kernel said nothing for {KERNEL_SILENCE_S:.0f}s")

    def _from_kernel(self) -> bool:
        """Handle one frame from the kernel; whether the host is done (the group was stopped)."""
        code, fields = self.receive()
        if code is Frame.PING:
            return False
        if code is Frame.STOP:
            self._stop(int(whole(fields[0])), float(fields[1].decode()))
            self.send(Frame.BYE)
            return True
        rank = whole(fields[0])
        if code is Frame.SPAWN:
            self._spawn(rank)
            return False
        held = self.ranks.get(rank)
        if held is None:
            return False  # ended meanwhile: its EXIT is on its way
        with contextlib.suppress(OSError, ValueError):
            if code is Frame.MSG:
                held.message.send_bytes(fields[1])
            elif code is Frame.STATUS:
                held.status.send_bytes(fields[1])
            elif code is Frame.SIGNAL:
                os.kill(held.process.pid, whole(fields[1]))
            elif code is Frame.KILL:
                self._ended(self.processes.kill(self.index[rank]))
        return False

    def _spawn(self, rank: int) -> None:
        plan = self.plan
        local_rank = rank - plan.node_rank * plan.nprocs
        started = start_with_pipes(self.starter.context, lambda *pipes: self.starter.start(local_rank, *pipes))
        process = started.process
        if rank in self.index:
            self.processes.replace(self.index[rank], process)
        else:
            self.index[rank] = self.processes.add(process)
        self.ranks[rank] = _Rank(rank, process, started.connection, started.status, started.output)
        self.send(Frame.STARTED, number(rank), number(process.pid))
        # where it runs, as a launch's rank records it: this node's sampler (the dashboard's resources) reads it
        record = {"rank": rank, "attempt": 0, "pid": process.pid, "host": socket.gethostname(), "started": time.time()}
        try:
            write_private(self.files.rank_start(rank), json.dumps(record).encode())
        except OSError:
            _log.debug("rank %d's start record could not be written; the dashboard misses its resources", rank,
                       exc_info=True)  # fmt: skip

    def _relay(self, what: str, rank: _Rank) -> bool:
        """What a rank wrote on one of its pipes, to the kernel whole (a message pipe's: all it holds now); whether
        more may wait (output relayed, one read at a time)."""
        try:
            if what == "output":
                data = os.read(rank.output.fileno(), 65536)
                if data:
                    self.send(Frame.OUT, number(rank.rank), data)
                    return True
                rank.ended_pipes.add(what)
                return False
            connection, code = (rank.message, Frame.MSG) if what == "message" else (rank.status, Frame.STATUS)
            while connection.poll():
                self.send(code, number(rank.rank), connection.recv_bytes())
        except BlockingIOError:
            return False
        except (EOFError, OSError):
            rank.ended_pipes.add(what)
            _log.debug("rank %d's %s pipe ended: it is ending (its pidfd tells)", rank.rank, what)
        return False

    def _ended(self, exit: Exit | None) -> None:
        """A rank ended: what it said and wrote goes first, then its end; what it started ends with it."""
        if exit is None:
            return
        rank = next((r for r, i in self.index.items() if i == exit.index), None)
        held = self.ranks.pop(rank, None) if rank is not None else None
        if held is None:
            return
        self.processes.end_leftovers([exit.index])
        for what in ("message", "status", "output"):
            while what not in held.ended_pipes and self._relay(what, held):
                pass
        for handle in (held.message, held.status, held.output):
            with contextlib.suppress(OSError):
                handle.close()
        code = "" if exit.exitcode is None else str(exit.exitcode)
        self.send(Frame.EXIT, number(held.rank), number(exit.pid), code.encode(), number(exit.time),
                  b"1" if exit.stopped else b"0")  # fmt: skip

    def _stop(self, first: int, grace_s: float) -> None:
        running = set(self.processes.running)
        self.processes.stop(first, grace_s=grace_s)
        for index in running:
            self._ended(self.processes.exits.get(index))

    def _end_all(self) -> None:
        """The kernel is gone: every rank and what it started ends now."""
        self.processes.stop(signal.SIGKILL, grace_s=0.0)
        self.processes.end_leftovers()

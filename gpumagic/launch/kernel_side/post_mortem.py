"""``%%launch_ddp --pdb``, the kernel's side: a rank that failed in the user's code serves pdb on a Unix socket in
the run's private launch directory (``rank_side.debugging.serve_post_mortem``); the launch's watch loop finds
it, connects, and runs the session in the cell: the rank's output written, its prompts read with ``input()``
(an input box in a notebook). The other ranks wait meanwhile; the group ends as usual once the rank exits.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from gpumagic.launch.messages import DebugIO, MessageError, Stdin, from_json_line, to_json_line
from gpumagic.launch.rank_side.debugging import PROMPT, peer_uid
from gpumagic.run_dirs.layout import RunFiles

_log = logging.getLogger(__name__)


def read_user_line(prompt: str) -> str:
    """A line from the user: ``input()`` as it is now (a kernel replaces it with its own while a cell runs)."""
    return builtins.input(prompt)


class PostMortems:
    """Finds the debugger socket of a launch's first failed rank (``poll``) and runs its session, once."""

    def __init__(
        self,
        files: RunFiles,
        nprocs: int,
        write: Callable[[str], None],
        hangs: Any = None,
        read_line: Callable[[str], str] | None = None,
    ) -> None:
        self.files = files
        self.nprocs = nprocs
        self.write = write
        self.hangs = hangs  # the launch's hang follower: quiet once a rank is debugged (its peers wait for it)
        self.read_line = read_line or read_user_line
        self.done: set[int] = set()

    def poll(self) -> None:
        for rank in range(self.nprocs):
            if rank in self.done:
                continue
            path = self.files.rank_debug_socket(rank)
            try:
                info = os.lstat(path)
            except FileNotFoundError:  # no debugger (yet): the usual answer
                continue
            except OSError:
                _log.debug("rank %d's debug socket cannot be stat'ed; looked for again later", rank, exc_info=True)
                continue
            self.done.add(rank)
            if info.st_uid != os.getuid():  # not the rank's: nothing of another user's is talked to
                continue
            if self.hangs is not None:
                self.hangs.quiet = True
            self.session(rank, str(path))
            # q ends the launch: a peer that failed meanwhile (its collective broke as this rank left) is no
            # second debugger; the launch's report names the first failure
            self.done.update(range(self.nprocs))
            return

    def session(self, rank: int, path: str) -> None:
        """One debugging session with ``rank``, until its debugger ends (``q``) or the rank goes."""
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(path)
            if peer_uid(connection) != os.getuid():
                return
            stream = connection.makefile("rw", encoding="utf-8", newline="\n")
            self.write(f"[gpumagic] rank {rank} failed; --pdb: its debugger is here (q ends it and the launch)\n")
            for raw in stream:
                try:
                    said = from_json_line(raw, DebugIO)
                except MessageError:
                    return
                if said.state != PROMPT:
                    if said.text:
                        self.write(said.text)
                    continue
                try:
                    line: str | None = self.read_line(said.text)
                except (EOFError, KeyboardInterrupt, Exception):  # noqa: BLE001 - no input box: end the session
                    _log.debug("no line can be read for rank %d's debugger; its session ends", rank, exc_info=True)
                    line = None
                stream.write(to_json_line(Stdin(0, "q" if line is None else line)))
                stream.flush()

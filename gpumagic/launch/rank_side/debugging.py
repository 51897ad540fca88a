"""Debug one rank from the notebook: pdb on a rank, its prompt and its output in the cell, the user's answers
read with the kernel's ``input()`` (so the notebook shows an input box).

``RemoteConsole`` is pdb's stdin and stdout: output is sent as it is flushed, and a prompt (pdb asking for a
line) is sent with ``state`` "prompt"; the answer comes back as one line. How the text travels is the caller's:
a persistent group's rank sends it over its pipe to the kernel (``GroupRank``), a launch's rank kept alive by
``--pdb`` serves it on a private Unix socket (``serve_post_mortem``, JSON lines).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pdb
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumagic.launch.messages import DebugIO, Stdin, from_json_line, to_json_line

_log = logging.getLogger(__name__)

ACCEPT_TIMEOUT_S = 600.0  # how long a failed rank kept for --pdb waits for the notebook to connect
PROMPT = "prompt"  # a console message's state: pdb waits for a line
LEFT = "left"  # pdb left its prompt (continue, quit): the rank runs on


class RemoteConsole:
    """A text stream for pdb: ``send(text, state)`` delivers output (``state`` ``None``), a prompt (``PROMPT``)
    or the end of a prompt loop (``LEFT``); ``receive()`` returns the user's next line (``None``: gone)."""

    def __init__(self, send: Callable[[str, str | None], None], receive: Callable[[], str | None]) -> None:
        self._send = send
        self._receive = receive
        self._buffer: list[str] = []
        self.encoding = "utf-8"

    def write(self, text: str) -> int:
        self._buffer.append(text)
        return len(text)

    def flush(self) -> None:
        """Send the whole lines written; a partial one (pdb's prompt) waits to be the next prompt's text."""
        done, newline, rest = "".join(self._buffer).rpartition("\n")
        if newline:
            self._send(done + newline, None)
            self._buffer = [rest] if rest else []

    def readline(self) -> str:
        text, self._buffer = "".join(self._buffer), []
        self._send(text, PROMPT)
        line = self._receive()
        return "q\n" if line is None else line.rstrip("\n") + "\n"  # a vanished notebook quits the debugger

    def left(self) -> None:
        text, self._buffer = "".join(self._buffer), []
        self._send(text, LEFT)


class RemotePdb(pdb.Pdb):
    """pdb over a ``RemoteConsole``; ``on_prompt(bool)`` says when it holds the rank at its prompt."""

    def __init__(self, console: RemoteConsole, on_prompt: Callable[[bool], None] = lambda at: None) -> None:
        super().__init__(stdin=console, stdout=console, nosigint=True, readrc=False)
        self.console = console
        self.on_prompt = on_prompt
        self.prompt = "(Pdb) "

    def _cmdloop(self) -> None:
        """pdb's prompt loop, but the kernel's interrupt ends it (pdb's own catches it and asks again: the stop
        button would bring back the prompt it meant to leave, on a rank gpumagic is stopping)."""
        self.allow_kbdint = True
        try:
            self.cmdloop()
        finally:
            self.allow_kbdint = False

    def preloop(self) -> None:
        self.on_prompt(True)

    def postloop(self) -> None:
        self.on_prompt(False)
        self.console.left()


def post_mortem(console: RemoteConsole, traceback: Any, on_prompt: Callable[[bool], None] = lambda at: None) -> None:
    """pdb on the frame where ``traceback`` ends (the failing line), until the user quits or continues."""
    debugger = RemotePdb(console, on_prompt)
    debugger.reset()
    console.write(f"post-mortem debugger on rank {os.environ.get('RANK', '?')}; q ends it\n")
    debugger.interaction(None, traceback)


def set_trace(console: RemoteConsole, frame: Any, on_prompt: Callable[[bool], None] = lambda at: None) -> None:
    """pdb at ``frame`` (``breakpoint()``): c continues the cell, q too (the rank does not stop)."""
    RemotePdb(console, on_prompt).set_trace(frame)


def serve_post_mortem(path: Path, traceback: Any, timeout_s: float = ACCEPT_TIMEOUT_S) -> bool:
    """Keep this failed rank alive for a post-mortem: serve pdb on a Unix socket at ``path`` (in the run's
    private launch directory) to one connection of this user's, within ``timeout_s``; whether one came."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(1)
        listener.settimeout(timeout_s)
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            return False
        with connection:
            if peer_uid(connection) != os.getuid():
                return False
            connection.settimeout(None)
            stream = connection.makefile("rw", encoding="utf-8", newline="\n")

            def send(text: str, state: str | None) -> None:
                stream.write(to_json_line(DebugIO(text, state)))
                stream.flush()

            def receive() -> str | None:
                line = stream.readline()
                return from_json_line(line, Stdin).line if line else None

            with contextlib.suppress(OSError, ValueError):  # ValueError: MessageError too
                post_mortem(RemoteConsole(send, receive), traceback)
        return True
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


def peer_uid(connection: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    try:
        credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        _log.debug("the debug socket's peer credentials are unreadable; the peer is refused", exc_info=True)
        return None
    return struct.unpack("3i", credentials)[1]

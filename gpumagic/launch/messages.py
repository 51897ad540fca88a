"""The messages between the kernel and a persistent group's ranks (``kernel_side.group_members`` and
``rank_side.group_rank``): one frozen dataclass per kind, and one ``encode``/``decode`` pair at the pipe.

On the pipe a message is what it always was: a tuple of plain values, ``(kind, ident, *fields)``, pickled by
``multiprocessing`` over a pipe only the kernel and that rank hold (the rank is forked from the kernel's own rank
server). ``decode`` takes a tuple back into its class only if its kind is one that may travel that way (a rank
takes only ``ToRank`` messages, the kernel only ``ToKernel`` ones) and it has exactly that class's fields:
anything else raises ``MessageError``.

``ident`` is the request a message belongs to: the kernel numbers its requests, and a reply carries the
number of the request it answers. A rank's own notices have fixed numbers (``READY``, ``STORE``, ``DEBUG``).
The status channel (answered even while a cell runs) carries ``StatusAsk``/``StatusAnswer``, numbered by a
random string.

A launch's rank kept for ``--pdb`` talks to the kernel over a Unix socket instead (``debugging.serve_post_mortem``):
there ``DebugIO`` and ``Stdin`` travel as JSON lines, ``{"text", "state"}`` and ``{"line"}``
(``to_json_line``/``from_json_line``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, TypeVar

from gpumagic.launch.records import RankState

READY = 0  # the request number of a rank's ``Ready`` (or of its ``Failed`` at start)
STORE = -1  # of the address of rank 0's store
DEBUG = -3  # of a rank's debugger's output and prompts


class MessageError(ValueError):
    """A tuple on a pipe that is no message that may travel that way."""


class Message:
    """A message of the group's pipes. ``KIND``: its name on the pipe."""

    KIND: ClassVar[str] = ""
    ident: Any


class ToRank(Message):
    """From the kernel to a rank, on its pipe: a request (``Request``) or a control message (``Control``)."""


class Request(ToRank):
    """A request the rank's main thread does, one at a time; answered with a ``Reply``."""


class Control(ToRank):
    """A message the rank's control thread acts on at once, even while a cell runs."""


class ToKernel(Message):
    """From a rank to the kernel, on its pipe."""


class Reply(ToKernel):
    """How a ``Request`` ended: ``Done``, ``Failed`` or ``Interrupted``."""

    def failure(self) -> dict[str, Any]:
        """What went wrong, as the rank reported it (``Failed.report``; ``{}``: it reported nothing)."""
        return {}


# --- requests -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Join(Request):
    """Join a fresh process group: at ``address`` (``None``: rank 0, which serves its store and sends ``Store``)."""

    KIND = "join"
    ident: int
    address: str | None


@dataclasses.dataclass(frozen=True)
class Leave(Request):
    KIND = "leave"
    ident: int


@dataclasses.dataclass(frozen=True)
class Exec(Request):
    """Run a shipped cell (``shipping.CellPayload``, packed); done with a ``CellResult``."""

    KIND = "exec"
    ident: int
    label: str
    packed: bytes


@dataclasses.dataclass(frozen=True)
class Call(Request):
    """Call a shipped function (``shipping.FunctionPayload``, packed); done with a ``CellResult``."""

    KIND = "call"
    ident: int
    label: str
    packed: bytes


@dataclasses.dataclass(frozen=True)
class Pull(Request):
    KIND = "pull"
    ident: int
    name: str


@dataclasses.dataclass(frozen=True)
class Push(Request):
    KIND = "push"
    ident: int
    packed: bytes


@dataclasses.dataclass(frozen=True)
class Export(Request):
    KIND = "export"
    ident: int


@dataclasses.dataclass(frozen=True)
class Restore(Request):
    """A fresh rank takes back the notebook's ``names`` (pickled), ``definitions`` and ``state``; done with a
    ``Restored``."""

    KIND = "restore"
    ident: int
    names: bytes
    definitions: list[Any]
    state: bytes | None


@dataclasses.dataclass(frozen=True)
class Describe(Request):
    KIND = "describe"
    ident: int


@dataclasses.dataclass(frozen=True)
class Replicated(Request):
    KIND = "replicated"
    ident: int


@dataclasses.dataclass(frozen=True)
class Kinds(Request):
    KIND = "kinds"
    ident: int
    names: list[str]


@dataclasses.dataclass(frozen=True)
class Kept(Request):
    KIND = "kept"
    ident: int


@dataclasses.dataclass(frozen=True)
class Free(Request):
    """Collect garbage and empty the CUDA cache; done with a ``records.MemoryFreed``."""

    KIND = "free"
    ident: int


@dataclasses.dataclass(frozen=True)
class Wrapped(Request):
    KIND = "wrapped"
    ident: int


@dataclasses.dataclass(frozen=True)
class Rewrap(Request):
    KIND = "rewrap"
    ident: int
    names: list[str]


@dataclasses.dataclass(frozen=True)
class Debug(Request):
    KIND = "debug"
    ident: int


@dataclasses.dataclass(frozen=True)
class Close(Request):
    """End the rank's loop (answered ``Done`` first)."""

    KIND = "close"
    ident: int


# --- control --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Break(Control):
    """Shut the process group's connections now: a collective waiting on a peer fails at once."""

    KIND = "break"
    ident: int


@dataclasses.dataclass(frozen=True)
class Pause(Control):
    """Say where the rank is in request ``cell`` and hold it at its next sync point; answered with ``Paused``."""

    KIND = "pause"
    ident: int
    cell: int


@dataclasses.dataclass(frozen=True)
class StopAt(Control):
    """Stop request ``cell`` at its sync point ``point``."""

    KIND = "stop_at"
    ident: int
    cell: int
    point: int


@dataclasses.dataclass(frozen=True)
class Stdin(Control):
    """The notebook's answer to the rank's debugger (``None``: no answer can come)."""

    KIND = "stdin"
    ident: int
    line: str | None


@dataclasses.dataclass(frozen=True)
class HangAfter(Control):
    """The hang watch's threshold from now on (seconds; 0: quiet)."""

    KIND = "hang_after"
    ident: int
    seconds: float


# --- from a rank ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Done(Reply):
    KIND = "done"
    ident: int
    value: Any


@dataclasses.dataclass(frozen=True)
class Failed(Reply):
    """The request raised: ``report`` (``failure_reports.failure_report``: phase, type, message, traceback,
    timestamp), and how many collectives the rank had made (``None``: it could not start)."""

    KIND = "failed"
    ident: int
    report: dict[str, Any]
    collectives: int | None

    def failure(self) -> dict[str, Any]:
        return self.report


@dataclasses.dataclass(frozen=True)
class Interrupted(Reply):
    """The request was interrupted: in which collective (its name, or ``None``), the collectives made, and the
    sync point it stopped at (``None``: not at one)."""

    KIND = "interrupted"
    ident: int
    collective: str | None
    collectives: int
    stopped_at: int | None


@dataclasses.dataclass(frozen=True)
class Ready(ToKernel):
    """The rank is set up and serves; its pid."""

    KIND = "ready"
    ident: ClassVar[int] = READY
    pid: int


@dataclasses.dataclass(frozen=True)
class Store(ToKernel):
    """Rank 0's store for the group being formed listens at ``address``."""

    KIND = "store"
    ident: ClassVar[int] = STORE
    address: str


@dataclasses.dataclass(frozen=True)
class Paused(ToKernel):
    """A rank's answer to ``Pause``: ``where`` (``SyncPoints.pause``: made, gap, since, inside) or ``None``."""

    KIND = "paused"
    ident: int
    where: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class DebugIO(ToKernel):
    """The rank's debugger said ``text``; ``state`` is ``debugging.PROMPT``, ``debugging.LEFT`` or ``None``."""

    KIND = "debug_io"
    ident: ClassVar[int] = DEBUG
    text: str
    state: str | None


# --- values replies carry -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CellResult:
    """What an ``Exec`` or ``Call`` is done with: the value (pickled, tensors on the CPU), the names the rank
    holds as its own and every name it holds, and the collectives it has made."""

    value: bytes
    own: list[str]
    present: list[str]
    collectives: int


@dataclasses.dataclass(frozen=True)
class Restored:
    """What a fresh rank got back (``Restore``): the notebook's names, the definitions run again, the kept names,
    the modules imported again, and why a definition could not be run again (name -> why)."""

    notebook: list[str]
    replayed: list[str]
    kept: list[str]
    modules: list[str]
    failed: dict[str, str]


# --- the status channel ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StatusAsk(Message):
    KIND = "status"
    ident: str


@dataclasses.dataclass(frozen=True)
class StatusAnswer(Message):
    KIND = "status_answer"
    ident: str
    state: RankState


# --- the pipe -------------------------------------------------------------------------------------------


def _kinds(base: type) -> dict[str, type[Message]]:
    found: dict[str, type[Message]] = {}
    for cls in base.__subclasses__():
        if dataclasses.is_dataclass(cls):
            found[cls.KIND] = cls
        found.update(_kinds(cls))
    return found


KINDS: dict[str, type[Message]] = _kinds(Message)  # every message, by its name on the pipe


def _fields(cls: type[Message]) -> tuple[str, ...]:
    """The fields a message carries after its ident, in order."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "ident")


def encode(message: Message) -> tuple:
    """``(kind, ident, *fields)``: what goes on the pipe."""
    return (message.KIND, message.ident, *(getattr(message, name) for name in _fields(type(message))))


def decode(raw: Any, expected: type[Message]) -> Message:
    """The message ``raw`` encodes, if it is one of the ``expected`` kind (``ToRank``, ``ToKernel``,
    ``StatusAsk``, ``StatusAnswer``).

    Raises:
        MessageError: not a tuple, an unknown kind or one that may not travel this way, the wrong number of
            fields, or a number where its kind has a fixed one.
    """
    if not isinstance(raw, tuple) or len(raw) < 2 or not isinstance(raw[0], str):
        raise MessageError(f"not a message: {type(raw).__name__}")
    cls = KINDS.get(raw[0])
    if cls is None or not issubclass(cls, expected):
        raise MessageError(f"no {expected.__name__} message is called {raw[0]!r}")
    names = _fields(cls)
    if len(raw) != 2 + len(names):
        raise MessageError(f"a {raw[0]!r} message has {len(names)} fields, not {len(raw) - 2}")
    values = dict(zip(names, raw[2:], strict=True))
    if "ident" in {f.name for f in dataclasses.fields(cls)}:
        return cls(ident=raw[1], **values)
    if raw[1] != cls.ident:
        raise MessageError(f"a {raw[0]!r} message is numbered {cls.ident}, not {raw[1]!r}")
    return cls(**values)


def to_json_line(message: DebugIO | Stdin) -> str:
    """A debugger's message as a line of its socket: ``{"text", "state"}`` or ``{"line"}``."""
    if isinstance(message, DebugIO):
        return json.dumps({"text": message.text, "state": message.state}) + "\n"
    return json.dumps({"line": message.line}) + "\n"


Console = TypeVar("Console", DebugIO, Stdin)


def from_json_line(line: str, expected: type[Console]) -> Console:
    """The ``expected`` message a line of a debugger's socket holds (a field it lacks: empty).

    Raises:
        MessageError: not JSON, not an object, or a field of the wrong type.
    """
    try:
        data = json.loads(line)
    except ValueError:
        raise MessageError("a debugger's line that is not JSON") from None
    if not isinstance(data, dict):
        raise MessageError(f"a debugger's line holds {type(data).__name__}, not an object")
    if expected is DebugIO:
        text, state = data.get("text") or "", data.get("state")
        if isinstance(text, str) and (state is None or isinstance(state, str)):
            return expected(text, state)
    elif data.get("line") is None or isinstance(data.get("line"), str):
        return expected(0, data.get("line"))
    raise MessageError(f"a debugger's {expected.__name__} line with a field of the wrong type")

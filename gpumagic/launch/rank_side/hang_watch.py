"""Hang triage, the rank's side: what collective this rank is in, and a thread that says so when it waits too
long, and answers where the rank is when the launcher asks.

Two recorders:

- torch's flight recorder (on by default in torch 2.13, 2,000 entries; ``TORCH_FR_BUFFER_SIZE``): every
  collective, gloo's and NCCL's, DDP's own bucket all-reduces and asynchronous ones included, with its process
  group, sequence number, sizes and whether it finished. Reading it costs 20-50 ms once it is full, so the
  watch reads it only when the default group's sequence number (~0.2 us to read) has stood still past the
  threshold, and to answer the launcher.
- ``CollectiveRecorder``: the Python call this rank is in (op, its number among the default group's
  collectives, the first tensor, since when), and, in a small file mapped into memory, on disk: a rank that
  gloo aborts for a size mismatch leaves it behind. ~2 us a call (0.5 us without the file).

``HangWatch`` compares the oldest collective in flight with ``--hang-after``: past it, the rank writes
``ranks/rank-R.waiting.json``; the launcher (``launch.hang_reports.HangFollower``) then writes
``ranks/hang-request.json`` and every rank answers with ``ranks/rank-R.where.json``: its collectives in flight and
its main thread's Python stack, cut to the user's lines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import pickle
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from gpumagic.launch.hang_reports import describe_tensor, frame_of
from gpumagic.launch.rank_side.process_group import replace_in_torch_distributed
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.outcomes import read_json
from gpumagic.run_dirs.private import write_private

_log = logging.getLogger(__name__)

RECORDER_ENTRIES = "2000"  # torch's flight recorder: the last collectives kept (a few hundred bytes each)
RECORD_BYTES = 4096
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
)
POINT_TO_POINT = ("send", "recv")  # recorded, but not numbered: only some ranks make them
_OWN_DIRECTORY = str(Path(__file__).resolve().parents[2])  # gpumagic's package: never the user's lines
_LIBRARIES = tuple(
    {p for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(key))}
)


def enable_flight_recorder() -> None:
    """Have torch record every collective (before the process group is made); the user's own size is kept."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", RECORDER_ENTRIES)


class RecordedCall(NamedTuple):
    """A collective call the recorder saw: its op, its number among the default group's collectives (``None``:
    a point-to-point or a subgroup's call), whether it is the default group's, its first argument (``None``
    once it returned) and since when (``time.time()``). A named tuple: made on every collective (~0.2 us)."""

    op: str
    seq: int | None
    default_group: bool
    first: Any
    since: float


class CollectiveRecorder:
    """Wraps ``torch.distributed``'s collectives: ``current`` is the call this rank is in (``None`` between
    calls), ``last`` the last one it finished, ``count`` the default group's collectives made; ``describe``
    turns one into its fields. ``on_enter(name, default_group)`` runs as a call starts (a persistent group's
    sync points). With ``path``, each call is also written to that file, mapped into memory."""

    def __init__(self, path: Path | None = None, on_enter: Callable[[str, bool], None] | None = None) -> None:
        self.current: RecordedCall | None = None
        self.last: RecordedCall | None = None  # the same, without the argument
        self.count = 0
        self.on_enter = on_enter
        self._map: mmap.mmap | None = None
        if path is not None:
            with contextlib.suppress(OSError, ValueError):
                self._map = _mapped(path)

    def install(self) -> None:
        for name in COLLECTIVES:
            replace_in_torch_distributed(name, self._wrap)

    def restart_count(self) -> None:
        """A fresh process group: its collectives are numbered from 1 again, on every rank alike."""
        self.count = 0
        self.current = self.last = None

    @staticmethod
    def describe(call: RecordedCall | None) -> dict[str, Any] | None:
        """A recorded call as the hang report reads it: op, seq, group, tensor, since."""
        if call is None:
            return None
        return {
            "op": call.op,
            "seq": call.seq,
            "group": "default" if call.default_group else "subgroup",
            "tensor": describe_tensor((call.first,), {}),
            "since": call.since,
        }

    def _wrap(self, original: Any) -> Any:
        # lazy: torch, in rank processes only
        import torch.distributed as dist

        name = original.__name__
        numbered = name not in POINT_TO_POINT
        members = dist.GroupMember

        def collective(*args: Any, **kwargs: Any) -> Any:
            if self.current is not None:  # a collective made by another (all_gather_object's own)
                return original(*args, **kwargs)
            group = kwargs.get("group")
            default_group = group is None or group is members.WORLD
            if self.on_enter is not None:
                self.on_enter(name, numbered and default_group)
            seq = None
            if numbered and default_group:
                self.count = seq = self.count + 1
            first = args[0] if args else kwargs.get("tensor", kwargs.get("tensor_list", kwargs.get("object_list")))
            self.current = call = RecordedCall(name, seq, default_group, first, time.time())
            if self._map is not None:
                self._save(call)
            try:
                return original(*args, **kwargs)
            finally:
                self.current = None
                self.last = RecordedCall(name, seq, default_group, None, call.since)
                if self._map is not None:
                    self._map[0:1] = b"D"

        return collective

    def _save(self, call: RecordedCall) -> None:
        """The call in the mapped file, its fields tab-separated after a state byte (``I``: in it; ``D``, set
        alone when it returns: done). Read by ``hang_reports.read_record``, also after the rank died."""
        tensor = describe_tensor((call.first,), {})
        group = "default" if call.default_group else "subgroup"
        data = f"I{call.op}\t{call.seq}\t{group}\t{tensor}".encode()
        data = data[: RECORD_BYTES - 1]
        self._map[: len(data) + 1] = data + b"\0"  # type: ignore[index]


def _mapped(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, RECORD_BYTES)
        return mmap.mmap(fd, RECORD_BYTES)
    finally:
        os.close(fd)


def in_flight(since_ns: int = 0, entries: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The collectives torch's flight recorder holds as not finished, made after ``since_ns`` (an ended group's
    are not waited for), oldest first, summarised (``_summary``: op, backend, seq, group, tensor, since).
    ``entries``: the recorder's entries read already (else it is read now)."""
    if entries is None:
        entries = _flight_recorder(only_active=True)
    found = [_summary(e) for e in entries if not e.get("retired") and (e.get("time_created_ns") or 0) >= since_ns]
    return sorted(found, key=lambda e: e["created_ns"])


def last_finished(since_ns: int = 0, entries: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The last collective the flight recorder saw finish (of any group), or ``None``; ``entries`` as above."""
    done = [
        e
        for e in (_flight_recorder(only_active=False) if entries is None else entries)
        if e.get("retired") and (e.get("time_created_ns") or 0) >= since_ns
    ]
    return _summary(max(done, key=lambda e: e.get("record_id", 0))) if done else None


def _sequence_number() -> int | None:
    """How many collectives the default process group has made (every kind, DDP's too; ~0.2 us), or ``None``."""
    # lazy: torch, in rank processes only
    import torch.distributed as dist

    try:
        if not dist.is_initialized():
            return None
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - a backend without one: only the Python calls are watched
        _log.debug("the process group has no sequence number; only the Python calls are watched", exc_info=True)
        return None


def _flight_recorder(only_active: bool) -> list[dict[str, Any]]:
    # lazy: torch, in rank processes only
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return []
    try:
        raw = dump(includeCollectives=True, includeStackTraces=False, onlyActive=only_active)
        return list(pickle.loads(raw).get("entries", []))  # torch's own dump, of this process
    except Exception:  # noqa: BLE001 - no recorder (no group yet, an older torch): nothing known
        _log.debug("torch's flight recorder cannot be read; nothing known from it", exc_info=True)
        return []


def _summary(entry: dict[str, Any]) -> dict[str, Any]:
    name = str(entry.get("profiling_name") or "")
    backend, _, op = name.partition(":")
    group = entry.get("process_group") or ("", "")
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    tensor = " ".join(f"{d}{list(s)}" for d, s in zip(dtypes, sizes, strict=False)) or None
    p2p = bool(entry.get("is_p2p"))
    return {
        "op": op or name,
        "backend": backend if op else "",
        "seq": entry.get("p2p_seq_id") if p2p else entry.get("collective_seq_id"),
        "p2p": p2p,
        "group": group[1] if len(group) > 1 and group[1] else str(group[0]),
        "tensor": tensor,
        "created_ns": int(entry.get("time_created_ns") or 0),
        "state": entry.get("state"),
    }


def user_stack(frame: Any, limit: int = 4) -> list[dict[str, Any]]:
    """The user's frames of a stack (outermost first, at most ``limit``, the innermost kept): not gpumagic's,
    torch's or the standard library's."""
    if frame is None:
        return []
    found = []
    for summary in traceback.extract_stack(frame):
        filename = summary.filename
        if filename.startswith((_OWN_DIRECTORY, *_LIBRARIES, "<frozen", "<string>")):
            continue
        found.append(frame_of(filename, summary.lineno or 0, summary.name, summary.line or ""))
    return found[-limit:]


class HangWatch:
    """The thread that watches this rank's collectives (started by the rank's runtime when ``after_s`` > 0).

    ``busy()`` says whether the user's code runs (a persistent group's rank between cells waits for nothing);
    ``since_ns`` is when the current process group was made; ``debugging`` a note while a debugger holds the
    rank (its peers then wait for it, and that is no hang)."""

    def __init__(
        self,
        files: RunFiles,
        rank: int,
        after_s: float,
        recorder: CollectiveRecorder | None = None,
        busy: Callable[[], bool] = lambda: True,
    ) -> None:
        self.files = files
        self.rank = rank
        self.after_s = after_s
        self.recorder = recorder
        self.busy = busy
        self.since_ns = time.time_ns()
        self.debugging: str | None = None
        self._main = threading.main_thread().ident
        self._told: set[tuple] = set()
        self._sequence: int | None = None  # the default group's sequence number at the last look
        self._still_since = 0.0  # since when it has not moved
        self._flight_read = False  # torch's recorder was read in this still stretch
        self._request_seen: int | None = None
        self._answered: str | None = None

    @property
    def period_s(self) -> float:
        """How often it looks: a quarter of the threshold, between 0.05 and 0.25 s (a report ~1 s after it)."""
        return min(0.25, max(0.05, self.after_s / 4)) if self.after_s > 0 else 0.25

    def start(self) -> None:
        threading.Thread(target=self._run, name="gpumagic-hang-watch", daemon=True).start()

    def new_group(self) -> None:
        """A fresh process group: what the old one left in flight is not waited for."""
        self.since_ns = time.time_ns()
        self._told.clear()

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            try:  # a watch must never harm the rank it watches
                self.look()
            except Exception:  # noqa: BLE001
                _log.debug("a look of the hang watch failed; the next one tries again", exc_info=True)

    def look(self) -> None:
        """One look: tell the launcher of a collective waiting too long; answer its request."""
        if not self.busy():
            self._sequence = None  # a stretch without collectives between cells is no wait
        elif self.after_s > 0 and self.debugging is None:
            waiting = self.waiting()
            new = [w for w in waiting if _key(w) not in self._told]
            if new:
                self._told.update(_key(w) for w in new)
                notice = {"rank": self.rank, "time": time.time(), "waiting": waiting}
                write_private(self.files.rank_waiting(self.rank), json.dumps(notice).encode())
        self._answer()

    def waiting(self) -> list[dict[str, Any]]:
        """The collectives this rank has waited in longer than ``after_s`` (oldest first).

        A Python call of a collective: the recorder says since when (free). One made in C++ (DDP's bucket
        all-reduces) or left in flight (asynchronous, NCCL): only torch's recorder knows, and reading it grows
        with its entries (20-50 ms when its 2,000 are full). It is read only once the default group's sequence
        number has stood still longer than the threshold (a rank that makes collectives is not stuck in one),
        once per such stretch."""
        now = time.time()
        call = self.recorder.current if self.recorder is not None else None
        if call is not None:
            return [{"call": self.recorder.describe(call)}] if now - call.since > self.after_s else []
        sequence = _sequence_number()
        if sequence is None or sequence != self._sequence:
            self._sequence, self._still_since, self._flight_read = sequence, now, False
            return []
        if self._flight_read or now - self._still_since <= self.after_s:
            return []
        self._flight_read = True
        return [e for e in in_flight(self.since_ns) if now - e["created_ns"] / 1e9 > self.after_s]

    def _answer(self) -> None:
        try:
            stamp = os.stat(self.files.hang_request).st_mtime_ns
        except FileNotFoundError:  # none asked: the usual answer
            return
        except OSError:
            _log.debug("the hang request cannot be stat'ed; none is answered now", exc_info=True)
            return
        if stamp == self._request_seen:
            return
        self._request_seen = stamp
        request = read_json(self.files.hang_request)
        if request is None or request.get("id") == self._answered:
            return
        self._answered = request.get("id")
        write_private(self.files.rank_where(self.rank), json.dumps(self.where(request.get("id"))).encode())

    def where(self, request: str | None = None) -> dict[str, Any]:
        """Where this rank is: its collectives in flight (torch's recorder and its own), the last it finished,
        its main thread's stack cut to the user's lines."""
        recorder = self.recorder
        frame = sys._current_frames().get(self._main)
        entries = _flight_recorder(only_active=False)  # read once (20-50 ms when full) for both fields below
        return {
            "id": request,
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "busy": self.busy(),
            "debugging": self.debugging,
            "in_flight": in_flight(self.since_ns, entries),
            "last": last_finished(self.since_ns, entries),
            "call": recorder.describe(recorder.current) if recorder is not None else None,
            "last_call": recorder.describe(recorder.last) if recorder is not None else None,
            "count": recorder.count if recorder is not None else None,
            "stack": user_stack(frame),
        }


def _key(waiting: dict[str, Any]) -> tuple:
    call = waiting.get("call")
    if call is not None:
        return ("call", call["op"], call["seq"], call["since"])
    return ("flight", waiting["group"], waiting["seq"], waiting["created_ns"])

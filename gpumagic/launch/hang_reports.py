"""Hang triage, the launcher's side: when a rank says a collective of its has waited past ``--hang-after``
(``rank_side.hang_watch``), ask every rank where it is and make one short report of the answers: who waits in
which collective (op, number, tensor, the line that called it), where each other rank is (its Python stack cut
to the user's lines), and what does not match (ops, sizes, ranks at different collectives).

``HangFollower.poll`` is called by whatever follows the ranks (a launch's watch loop, a persistent group's,
an elastic launch's, a background job's runner), about ten times a second: a ``stat`` of the run's ``ranks``
directory while nothing happens. ``mismatch_after_failure`` names a mismatch after a rank died of one (gloo
aborts a rank whose all_reduce sizes differ from its peers').
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumagic.launch.records import Record
from gpumagic.run_dirs import store
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.outcomes import read_json
from gpumagic.run_dirs.private import write_private
from gpumagic.units import format_duration as _long_duration

_log = logging.getLogger(__name__)
ANSWER_WAIT_S = 1.5  # how long the report waits for every rank's answer
LOOK_EVERY_S = 0.1  # the follower looks at most this often, however often its loop calls it
_CELL = re.compile(r"^<.*?cell (.+)>$")
_DURATION = re.compile(r"\b\d+(\.\d+)?s\b")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class HangReport(Record):
    """One hang report, read as the dict it is kept as in ``run.json`` (``hang``): when it was made, the
    threshold (seconds), the ranks that waited past it, those that did not answer, each rank's line (by its
    number as a string), the mismatches found, and ``text``: what the cell shows."""

    time: float
    after_s: float
    waiting: list[int]
    silent: list[int]
    ranks: dict[str, str]
    mismatches: list[str]
    text: str


def format_duration(seconds: float) -> str:
    """``10.4s`` under a minute (tenths matter when the threshold is seconds), ``2m05s`` past it."""
    return f"{seconds:.1f}s".replace(".0s", "s") if seconds < 60 else _long_duration(seconds)


_DTYPE_NAMES: dict[Any, str] = {}


def describe_tensor(args: tuple, kwargs: dict[str, Any]) -> str | None:
    """The first tensor a collective was given (a list's first, with its length), as ``float32[1000]``."""
    if args and getattr(args[0], "shape", None) is not None:  # the common case, first (~0.4 us)
        return _tensor_text(args[0])
    for value in (*args[:2], kwargs.get("tensor"), kwargs.get("tensor_list"), kwargs.get("object_list")):
        if isinstance(value, (list, tuple)):
            if not value:
                continue
            inner = _tensor_text(value[0])
            return f"{len(value)} x {inner}" if inner else f"{len(value)} objects"
        text = _tensor_text(value)
        if text:
            return text
    return None


def _tensor_text(value: Any) -> str | None:
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return None
    name = _DTYPE_NAMES.get(dtype) or _DTYPE_NAMES.setdefault(dtype, str(dtype).removeprefix("torch."))
    return f"{name}{list(shape)}"


def frame_of(filename: str, line: int, function: str, code: str) -> dict[str, Any]:
    """One of the user's frames, named as a notebook user knows it (``cell In[5] line 4``)."""
    found = _CELL.match(filename)
    if found:
        where = f"cell {found.group(1)} line {line}"
    else:
        where = f"{os.path.basename(filename)}:{line}" + (f" in {function}" if function != "<module>" else "")
    return {"where": where, "code": code.strip()}


def _call_text(call: dict[str, Any]) -> str:
    number = f" #{call['seq']}" if call.get("seq") is not None else ""
    tensor = f" of {call['tensor']}" if call.get("tensor") else ""
    group = " (a subgroup)" if call.get("group") == "subgroup" else ""
    return f"{call['op']}{number}{tensor}{group}"


def _flight_text(entry: dict[str, Any]) -> str:
    kind = "p2p " if entry.get("p2p") else ""
    backend = f"{entry['backend']} " if entry.get("backend") else ""
    tensor = f" of {entry['tensor']}" if entry.get("tensor") else ""
    group = entry.get("group")
    where = f" in group {group}" if group not in (None, "", "0", "default_pg") else ""
    return f"{backend}{entry['op']} {kind}#{entry['seq']}{tensor}{where}"


def _stack_lines(stack: list[dict[str, Any]]) -> list[str]:
    return [f"{f['where']}: {f['code']}" if f.get("code") else f["where"] for f in stack]


def compose(
    waiting: dict[int, dict[str, Any]], answers: dict[int, dict[str, Any]], world_size: int, after_s: float
) -> HangReport:
    """The report: ``text`` (what the cell shows), ``ranks`` (each rank's line), ``mismatches``, ``waiting``,
    ``silent`` (ranks that did not answer), ``time``."""
    now = time.time()
    ranks: dict[int, str] = {}
    for rank in range(world_size):
        answer = answers.get(rank)
        if answer is None:
            told = waiting.get(rank)
            ranks[rank] = "did not answer (busy in native code holding Python's lock, stopped, or on a node that "
            ranks[rank] += "cannot see the run directory)"
            if told:
                ranks[rank] = f"waited {_waiting_text(told['waiting'][0], now)}; did not answer since"
            continue
        ranks[rank] = _rank_text(answer, now)
    mismatches = find_mismatches(answers)
    late = sorted(waiting)
    first = waiting[late[0]]["waiting"][0] if late else None
    who = f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))}"
    head = f"gpumagic: {who} waited over {format_duration(after_s)} in a collective; where every rank is:"
    if first is not None:
        head = f"gpumagic: {who} waited {_waiting_text(first, now)} (--hang-after {format_duration(after_s)}); "
        head += "where every rank is:"
    lines = [head]
    hosts = {r: str(a.get("host") or "?") for r, a in answers.items()}
    if len(set(hosts.values())) > 1:  # ranks on several machines: say which
        ranks = {r: (f"(on {hosts[r]}) " if r in hosts else "") + text for r, text in ranks.items()}
    alike: dict[str, list[int]] = {}  # many ranks in one state (63 of 64 waiting) make one entry
    for rank, text in ranks.items():
        alike.setdefault(_DURATION.sub("", text), []).append(rank)
    labels = {members[0]: _ranks_label(members) for members in alike.values()}
    width = max(len(label) for label in labels.values())
    for first_rank, label in labels.items():
        first_line, *rest = ranks[first_rank].split("\n")
        lines.append(f"  {label:>{width}}: {first_line}")
        lines.extend(f"  {'':>{width}}  {line}" for line in rest)
    lines.extend(f"  mismatch: {m}" for m in mismatches)
    lines.append("  (interrupt the cell to stop it; --hang-after D sets when this shows, 0 turns it off)")
    return HangReport(
        time=now,
        after_s=after_s,
        waiting=late,
        silent=sorted(set(range(world_size)) - set(answers)),
        ranks={str(r): t for r, t in ranks.items()},
        mismatches=mismatches,
        text="\n".join(lines),
    )


def _ranks_label(ranks: list[int]) -> str:
    """``rank 3``; ``ranks 0-2, 5`` (runs of consecutive ranks joined)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return "ranks " + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _waiting_text(waiting: dict[str, Any], now: float) -> str:
    call = waiting.get("call")
    if call is not None:
        return f"{format_duration(now - call['since'])} in {_call_text(call)}"
    return f"{format_duration(now - waiting['created_ns'] / 1e9)} in {_flight_text(waiting)}"


def _rank_text(answer: dict[str, Any], now: float) -> str:
    stack = _stack_lines(answer.get("stack") or [])
    call = answer.get("call")
    flight = answer.get("in_flight") or []
    if answer.get("debugging"):
        head = f"in the debugger ({answer['debugging']})"
    elif call is not None:
        head = f"waits in {_call_text(call)} for {format_duration(now - call['since'])}"
        same = [e for e in flight if e.get("op") == call["op"]]
        if same and same[0].get("backend"):
            head += f" ({same[0]['backend']})"
    elif flight:
        oldest = flight[0]
        head = f"has {_flight_text(oldest)} in flight for {format_duration(now - oldest['created_ns'] / 1e9)}"
        if len(flight) > 1:
            head += f" (+{len(flight) - 1} more)"
    elif not answer.get("busy", True):
        head = "idle (no cell running)"
    else:
        last = answer.get("last_call") or answer.get("last")
        head = "not in a collective"
        if answer.get("count") is not None:
            head += f" (it made {answer['count']} so far"
            head += f", the last {_call_text(last)})" if last and answer.get("last_call") else ")"
        elif last:
            head += f" (the last: {_flight_text(last)})"
    if not stack:
        return head
    return head + "\n" + "\n".join(stack)


def find_mismatches(answers: dict[int, dict[str, Any]]) -> list[str]:
    """What the ranks' collectives in flight say does not match: numbers, ops, tensor sizes."""
    calls = {r: a["call"] for r, a in answers.items() if a.get("call") and a["call"].get("seq") is not None}
    found = _compare(calls, _call_text)
    if found:
        return found
    firsts: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, answer in answers.items():
        for entry in answer.get("in_flight") or []:
            if not entry.get("p2p"):
                firsts.setdefault(str(entry.get("group")), {}).setdefault(rank, entry)
    for entries in firsts.values():
        found.extend(_compare(entries, _flight_text))
    return found


def _compare(calls: dict[int, dict[str, Any]], text: Callable[[dict[str, Any]], str]) -> list[str]:
    if len(calls) < 2:
        return []
    listed = ", ".join(f"rank {r} {text(c)}" for r, c in sorted(calls.items()))
    if len({c.get("seq") for c in calls.values()}) > 1:
        return [f"the ranks are at different collectives: {listed}"]
    if len({c.get("op") for c in calls.values()}) > 1:
        return [f"different ops at the same collective: {listed}"]
    if len({c.get("tensor") for c in calls.values()}) > 1:
        return [f"different sizes in the same collective: {listed}"]
    return []


def mismatch_after_failure(files: RunFiles, ranks: list[int]) -> list[str]:
    """After a cell failed: a mismatch the ranks' own recorders (``collective-R`` files) show, for the error."""
    records = {r: read_record(files.rank_collective(r)) for r in ranks}
    calls = {r: rec for r, rec in records.items() if rec is not None and rec.get("seq") is not None}
    if len(calls) < 2:
        return []
    if len({c["seq"] for c in calls.values()}) == 1 and any(c.get("state") == "in" for c in calls.values()):
        return [f"collective mismatch: {m}" for m in find_mismatches({r: {"call": c} for r, c in calls.items()})]
    return []


def read_record(path: Path) -> dict[str, Any] | None:
    """A rank's ``CollectiveRecorder`` file: the call it was in (``state`` "in") or had finished last."""
    try:
        data = path.read_bytes().split(b"\0", 1)[0].decode()
        op, seq, group, tensor = data[1:].split("\t")
        return {
            "state": {"I": "in", "D": "done"}[data[0]],
            "op": op,
            "seq": None if seq == "None" else int(seq),
            "group": group,
            "tensor": None if tensor == "None" else tensor,
        }
    except (OSError, ValueError, KeyError, IndexError):
        _log.debug("the hang record %s cannot be read; it is taken as absent", path, exc_info=True)
        return None


class HangFollower:
    """Follows one run's ranks for hang notices; ``show(text)`` the report, ``record(report)`` keeps it (given it
    as a plain dict, for JSON)."""

    def __init__(
        self,
        run_dir: str | Path,
        world_size: int,
        after_s: float,
        show: Callable[[str], None],
        record: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.files = RunFiles(run_dir)
        self.world_size = world_size
        self.after_s = after_s
        self.show = show
        self.record = record
        self.reports: list[HangReport] = []
        self.quiet = False  # a debugger holds a rank: its peers wait for it, which is no hang
        self._stamp: int | None = None
        self._ranks = str(self.files.ranks)
        self._next_look = 0.0
        self._notices: dict[int, float] = {}  # rank -> the time of its last notice seen
        self._pending: tuple[str, float, dict[int, dict[str, Any]]] | None = None

    @classmethod
    def of_run(cls, run_dir: str | Path, world_size: int, after_s: float, show: Callable[[str], None]) -> HangFollower:
        """The follower of a launch's or a group's run: each report shown (``show(text)``, a line) and kept in
        the run's ``run.json`` (``hang``)."""
        return cls(
            run_dir, world_size, after_s, show, record=lambda report: store.update_run(Path(run_dir), hang=report)
        )

    def poll(self) -> HangReport | None:
        """One look (cheap while nothing waits); the report made now, if any. Never raises: a report that
        cannot be made (a full disk) must not end the cell it is about."""
        try:
            return self._look()
        except Exception:  # noqa: BLE001 - see above
            _log.debug("a hang report could not be made; the cell goes on without it", exc_info=True)
            self._pending = None
            return None

    def _look(self) -> HangReport | None:
        if self.after_s <= 0:
            return None
        now = time.monotonic()
        if now < self._next_look:  # a busy loop (a cell's replies, a launch's output) calls it far more often
            return None
        self._next_look = now + LOOK_EVERY_S
        if self._pending is None:
            waiting = self._new_notices()
            if not waiting or self.quiet:
                return None
            request = uuid.uuid4().hex
            write_private(self.files.hang_request, json.dumps({"id": request, "time": time.time()}).encode())
            self._pending = (request, time.monotonic(), waiting)
            return None
        request, asked, waiting = self._pending
        answers = self._answers(request)
        if len(answers) < self.world_size and time.monotonic() - asked < ANSWER_WAIT_S:
            return None
        self._pending = None
        report = compose(waiting, answers, self.world_size, self.after_s)
        self.reports.append(report)
        self.show(report.text)
        if self.record is not None:
            self.record(report.as_json())
        return report

    def _new_notices(self) -> dict[int, dict[str, Any]]:
        try:
            stamp = os.stat(self._ranks).st_mtime_ns
        except OSError:
            _log.debug("the ranks' directory %s cannot be stat'ed; no new notice is read", self._ranks, exc_info=True)
            return {}
        if stamp == self._stamp:
            return {}
        self._stamp = stamp
        found = {}
        for rank in range(self.world_size):
            notice = read_json(self.files.rank_waiting(rank))
            if notice is not None and notice.get("time", 0) > self._notices.get(rank, 0):
                self._notices[rank] = notice["time"]
                found[rank] = notice
        return found

    def _answers(self, request: str) -> dict[int, dict[str, Any]]:
        answers = {rank: read_json(self.files.rank_where(rank)) for rank in range(self.world_size)}
        return {rank: answer for rank, answer in answers.items() if answer is not None and answer.get("id") == request}

"""The typed messages between the kernel and a persistent group's ranks (``launch/messages.py``), the tables that
dispatch them, and the records users index as dicts (``launch/records.py``, hang reports, held leases)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpumagic
from gpumagic.devices import leases
from gpumagic.launch import messages
from gpumagic.launch.hang_reports import HangReport, compose
from gpumagic.launch.messages import from_json_line, to_json_line
from gpumagic.launch.rank_side.group_rank import GroupRank
from gpumagic.launch.rank_side.hang_watch import CollectiveRecorder, RecordedCall
from gpumagic.launch.records import MemoryFreed, RankState, RankStatus
from gpumagic.magics.ddp import _PARSERS, DdpMagics
from gpumagic.run_dirs import records

PACKAGE = Path(gpumagic.__file__).parent


def _kinds(base: type) -> set[type]:
    return {cls for cls in messages.KINDS.values() if issubclass(cls, base)}


def _string_built_dispatch(tree: ast.AST) -> list[int]:
    """Lines calling ``getattr(obj, <a name built from strings>)``: an f-string, a concatenation, a format."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            name = node.args[1] if len(node.args) > 1 else None
            built = isinstance(name, (ast.JoinedStr, ast.BinOp)) or (
                isinstance(name, ast.Call) and isinstance(name.func, ast.Attribute) and name.func.attr == "format"
            )
            if built:
                found.append(node.lineno)
    return found


def test_no_module_dispatches_on_a_name_built_from_strings():
    assert _string_built_dispatch(ast.parse('getattr(self, f"do_{kind}")(*args)')) == [1]  # the check sees it
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = _string_built_dispatch(ast.parse(path.read_text(), str(path)))
        if lines:
            found[str(path.relative_to(PACKAGE))] = lines
    assert found == {}, f"dispatch through an explicit table instead: {found}"


def test_a_rank_dispatches_every_message_the_kernel_sends_from_its_tables():
    requests, controls = _kinds(messages.Request), _kinds(messages.Control)
    assert set(GroupRank.HANDLERS) == requests - {messages.Close}  # Close ends the loop itself
    assert set(GroupRank.CONTROLS) == controls
    assert requests | controls == _kinds(messages.ToRank)
    assert all(callable(handler) for handler in [*GroupRank.HANDLERS.values(), *GroupRank.CONTROLS.values()])


def test_every_ddp_subcommand_has_its_entry_in_the_dispatch_table():
    assert set(DdpMagics.SUBCOMMANDS) == set(_PARSERS)


def _example(cls: type[messages.Message]) -> messages.Message:
    values = {f.name: f"{f.name}-value" for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if "ident" in values:
        values["ident"] = 7
    return cls(**values)


@pytest.mark.parametrize("kind", sorted(messages.KINDS))
def test_each_message_travels_as_a_plain_tuple_and_comes_back_whole(kind):
    cls = messages.KINDS[kind]
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    message = _example(cls)
    raw = messages.encode(message)
    assert type(raw) is tuple and raw[0] == kind
    direction = next(base for base in (messages.ToRank, messages.ToKernel, cls) if issubclass(cls, base))
    assert messages.decode(raw, direction) == message


def test_a_message_that_may_not_travel_that_way_is_refused():
    join = messages.encode(messages.Join(3, None))
    refused = [
        (join, messages.ToKernel),  # a rank never sends a request
        (messages.encode(messages.Done(3, 1)), messages.ToRank),  # nor does the kernel reply
        (("ready", 4, 123), messages.ToKernel),  # a notice's number is fixed
        (("exec", 3, "label"), messages.ToRank),  # a field short
        (("join", 3, None, "extra"), messages.ToRank),
        (("run_this", 3, b"code"), messages.ToRank),  # no such kind: never a handler
        (["join", 3, None], messages.ToRank),  # not a tuple
        ("join", messages.ToRank),
        ((), messages.ToRank),
        ((b"join", 3, None), messages.ToRank),
    ]
    for raw, expected in refused:
        with pytest.raises(messages.MessageError):
            messages.decode(raw, expected)
    assert messages.decode(join, messages.ToRank) == messages.Join(3, None)


def test_status_and_free_rows_read_and_show_as_the_dicts_they_were():
    state = RankState(1, 4242, "<ddp cell 2>", 10.5, ("all_reduce", 11.0), None, None, 1 << 20)
    row = RankStatus(1, 4242, True, state)
    old = {"rank": 1, "pid": 4242, "alive": True}
    old.update(dataclasses.asdict(state))
    assert row == old and repr(row) == repr(old) and list(row) == list(old)
    assert row["collective"][0] == "all_reduce" and row.get("allocated") is None and row.cell == "<ddp cell 2>"
    dead = RankStatus(0, 4241, False)  # did not answer: its row has only what the kernel knows
    assert repr(dead) == repr({"rank": 0, "pid": 4241, "alive": False}) and dead.get("cell") is None
    with pytest.raises(KeyError):
        dead["cell"]
    freed = MemoryFreed(0, 12, 0, 0, False)
    assert repr(freed) == repr({"rank": 0, "collected": 12, "reserved_before": 0, "reserved_after": 0, "cuda": False})
    assert json.loads(json.dumps(row.as_json()))["collective"] == ["all_reduce", 11.0]


def test_a_hang_report_is_a_record_kept_as_plain_json():
    answers = {0: {"call": {"op": "all_reduce", "seq": 3, "since": 0.0}, "stack": []}}
    report = compose({0: {"waiting": [{"call": answers[0]["call"]}]}}, answers, 2, 10.0)
    assert isinstance(report, HangReport)
    assert report["text"] == report.text and report["silent"] == [1] and "did not answer" in report.ranks["1"]
    assert json.loads(json.dumps(report.as_json())) == dict(report)


def test_a_held_lease_is_a_record_of_its_lock_and_file(isolated_leases):
    book = leases.LeaseBook()
    uuid = "GPU-00000000-0000-0000-0000-000000000001"
    assert book.try_share(uuid, 1 << 30)
    try:
        (held,) = book._held.values()
        assert isinstance(held, leases.HeldLease) and held.shared and held.path.exists()
        assert book.since(uuid) == held.since and book.shares(uuid)
    finally:
        assert book.release_all() == [uuid]
    assert not held.path.exists()


GROUP = """
import json, time, gpumagic
from gpumagic.launch.kernel_side.group import CellFailed
out = {}
group = gpumagic.ranks(2, gpus="none", output="none", grace=1)
try:
    out["exec"] = group.exec("x = rank * 10\\nx + 1", {})
    group.push(y=5)
    out["pushed"] = group.exec("x + y", {})
    out["pull"] = group.pull("x", rank=1)
    group.exec("gpumagic.keep(x=x)", {})
    out["kept"] = group.kept()
    rows = group.status()
    out["status"] = [[type(r).__name__, list(r), r["cell"], r["alive"]] for r in rows]
    out["free"] = [[type(f).__name__, list(f), f["rank"]] for f in group.free()]
    try:
        group.exec("1 / (rank - 1)", {})
    except CellFailed as err:
        out["failed"] = str(err)
    group.members[1].process.kill()
    deadline = time.monotonic() + 30
    while group.status()[1]["alive"] and time.monotonic() < deadline:  # until the kernel sees it gone
        time.sleep(0.01)
    out["dead"] = repr(group.status()[1])
    out["replaced"] = group.exec("rank", {})
    out["check"] = type(group.check()).__name__
finally:
    group.close()
print(json.dumps(out))
"""


def test_a_group_answers_every_request_over_its_typed_messages(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", GROUP], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["exec"] == {"0": 1, "1": 11} and out["pushed"] == {"0": 5, "1": 15} and out["pull"] == 10
    assert out["kept"] == ["x"]
    keys = ["rank", "pid", "alive", "cell", "since", "collective", "allocated", "reserved", "rss"]
    assert out["status"] == [["RankStatus", keys, None, True], ["RankStatus", keys, None, True]]
    freed = ["rank", "collected", "reserved_before", "reserved_after", "cuda"]
    assert out["free"] == [["MemoryFreed", freed, 0], ["MemoryFreed", freed, 1]]
    assert out["failed"].startswith("rank 1 failed") and "ZeroDivisionError" in out["failed"]
    assert out["dead"].startswith("{'rank': 1, 'pid': ") and out["dead"].endswith("'alive': False}")
    assert out["replaced"] == {"0": 0, "1": 1} and out["check"] == "Divergence"


def test_the_runner_reads_its_sealed_job_as_a_spec():
    with records.names_locked():
        path = records.create("spec", b"code", reserve=False, request={"count": 0}, ddp=2, backend="gloo", after=[])
    spec = records.read_spec(path)
    assert spec == records.JobSpec(path.name, "spec", spec.submitted, {"count": 0}, ddp=2, backend="gloo", after=[])
    sealed = ("name", "submitted", "request", "ddp", "backend", "timeout_s", "after", "sys_path", "cwd")
    later = ("memory_limit", "hang_after_s", "attempt", "notify", "notify_wait_s", "requeue_on_timeout", "track")
    assert records.RUNNER_FIELDS == (*sealed, *later)  # job.json keeps its fields


def test_a_recorded_collective_is_read_by_its_fields():
    call = RecordedCall("all_reduce", 3, True, None, 5.0)
    assert (call.op, call.since) == ("all_reduce", 5.0)
    expected = {"op": "all_reduce", "seq": 3, "group": "default", "tensor": None, "since": 5.0}
    assert CollectiveRecorder.describe(call) == expected


def test_a_debugger_socket_carries_the_same_messages_as_json_lines():
    said = messages.DebugIO("(Pdb) ", "prompt")
    assert to_json_line(said) == '{"text": "(Pdb) ", "state": "prompt"}\n'  # the lines --pdb always wrote
    assert from_json_line(to_json_line(said), messages.DebugIO) == said
    assert to_json_line(messages.Stdin(0, "p x")) == '{"line": "p x"}\n'
    assert from_json_line('{"line": null}', messages.Stdin).line is None
    assert from_json_line("{}", messages.DebugIO) == messages.DebugIO("", None)
    for bad in ("not json", "[1, 2]", '{"text": 3}', '{"state": ["prompt"]}'):
        with pytest.raises(messages.MessageError):
            from_json_line(bad, messages.DebugIO)
    with pytest.raises(messages.MessageError):
        from_json_line('{"line": {"__reduce__": 1}}', messages.Stdin)

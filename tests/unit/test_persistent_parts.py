"""The parts under persistent ranks that need no process: sync points, the replicas' comparison and sync plan,
change keys of notebook values, and the replay of a cell's imports and definitions."""

import abc
import threading
import time

import pytest

from gpumagic.launch.kernel_side.group_shipping import _digest
from gpumagic.launch.rank_side.sync_points import SyncPoints
from gpumagic.launch.replay import ReplayLog, definitions, replay
from gpumagic.launch.replicas import compare, sync_plan
from gpumagic.launch.value_keys import change_key


def key(value):
    return change_key(value, lambda part: _digest("x", part))[0]


def notebook(code: str) -> dict:
    namespace = {"__name__": "__main__"}
    exec(code, namespace)
    return namespace


# --- sync points ----------------------------------------------------------------------------------------------


def test_every_rank_stops_before_the_point_one_past_the_furthest():
    ranks = [SyncPoints(), SyncPoints()]
    for points in ranks:
        points.start_cell(7)
    for _ in range(3):
        ranks[0].enter()
    ranks[1].enter()
    answers = [points.pause(7) for points in ranks]
    assert [a["made"] for a in answers] == [3, 1]
    point = max(a["made"] for a in answers) + 1
    for points in ranks:
        points.stop_at(7, point)
    ranks[1].enter()
    ranks[1].enter()  # rank 1 catches up: its 2nd and 3rd sync points pass
    for points in ranks:
        with pytest.raises(KeyboardInterrupt):
            points.enter()
    assert [points.stopped_at for points in ranks] == [3, 3]


def test_a_paused_rank_waits_at_its_next_point_until_told_where_to_stop():
    points = SyncPoints()
    points.start_cell(1)
    points.enter()
    assert points.pause(1)["made"] == 1
    assert points.pause(2) is None  # a cell that is no longer running
    reached = []

    def rank() -> None:
        try:
            points.enter()
            reached.append("passed")
            points.enter()
        except KeyboardInterrupt:
            reached.append(points.stopped_at)

    worker = threading.Thread(target=rank)
    worker.start()
    time.sleep(0.2)
    assert reached == [] and worker.is_alive()  # held at the point
    points.stop_at(1, 3)
    worker.join(5)
    assert reached == ["passed", 2]


def test_after_the_stop_a_handler_makes_collectives_without_waiting():
    points = SyncPoints()
    points.start_cell(1)
    points.pause(1)
    points.stop_at(1, 1)
    with pytest.raises(KeyboardInterrupt):
        points.enter()
    handler = threading.Thread(target=points.enter, daemon=True)  # `except KeyboardInterrupt: dist.barrier()`
    handler.start()
    handler.join(2)
    assert not handler.is_alive(), "the rank stayed paused after its stop"
    points.end_cell()


# --- comparing the replicas and syncing them --------------------------------------------------------------


def description(state: dict, scalars: dict | None = None) -> dict:
    return {"state": state, "scalars": scalars or {}}


def test_the_comparison_names_what_differs_what_is_missing_and_what_cannot_be_compared():
    found = compare(
        {
            0: description({"model": "a", "opt": "o", "data": "cannot be compared: TypeError"}, {"steps": (5, 9)}),
            1: description({"model": "b", "opt": "o", "data": "cannot be compared: TypeError"}, {"steps": (5, 8)}),
            2: description({"model": "a"}, {"steps": (5, 9), "seen": (1, 3)}),
        }
    )
    assert found.state == {"model": [1]} and found.missing == {"opt": [2], "data": [2]}
    assert found.scalars == {"steps": {0: 9, 1: 8, 2: 9}} and found.checked == []
    assert found.describe() == (
        "data (missing on rank 2); model (rank 1 differs); opt (missing on rank 2); "
        "steps (rank 0: 9, rank 1: 8, rank 2: 9)"
    )
    alike = compare(
        {r: description({"model": "a", "data": "cannot be compared: TypeError"}, {"epoch": (1, 2)}) for r in (0, 1)}
    )
    assert (
        not alike
        and alike.checked == ["model", "epoch"]
        and alike.uncomparable == {"data": "cannot be compared: TypeError"}
    )


def test_a_number_that_differed_when_the_cell_started_is_a_ranks_own():
    found = compare({0: description({}, {"seen": (10, 20)}), 1: description({}, {"seen": (11, 21)})})
    assert not found and found.checked == []


def test_the_sync_plan_copies_in_place_where_every_rank_holds_the_same_kind():
    kinds = {
        0: {"model": ("ddp",), "opt": ("optimizer",), "w": ("tensor", (3,), "torch.float32"), "steps": ("value",)},
        1: {"model": ("ddp",), "opt": ("optimizer",), "w": ("tensor", (4,), "torch.float32"), "steps": None},
    }
    plan = sync_plan(["model", "opt", "steps", "w"], kinds, 0)
    assert plan == [("model", "ddp"), ("opt", "optimizer"), ("steps", "value"), ("w", "value")]
    with pytest.raises(KeyError):
        sync_plan(["steps"], kinds, 1)
    kinds[1]["opt"] = None
    with pytest.raises(ValueError, match="rank 1 lacks opt, rank 0 a optimizer: make it there"):
        sync_plan(["opt"], kinds, 0)


# --- change keys ---------------------------------------------------------------------------------------------


def test_a_notebook_class_keeps_its_key_until_it_changes():
    space = notebook(
        "offset = 1\nclass Base:\n    def shift(self):\n        return offset\nclass Layer(Base):\n    pass\n"
    )
    first = key(space["Layer"])
    assert key(space["Layer"]) == first
    space["offset"] = 2  # a global a base class's method reads
    assert key(space["Layer"]) != first
    second = key(space["Layer"])
    space["Layer"].extra = lambda self: 3  # an attribute added
    assert key(space["Layer"]) != second


def test_a_function_keys_the_globals_it_reads_not_the_attributes_it_names():
    space = notebook(
        "import threading\nwriter = threading.Lock()\nconfig = {'lr': 0.1}\n"
        "def log_to(o):\n    return o.writer\ndef train():\n    return config['lr']\n"
    )
    assert key(space["log_to"]) == key(space["log_to"])  # the lock is no global of it: nothing to pickle
    before = key(space["train"])
    space["config"]["lr"] = 0.2  # mutated in place: its digest changes
    assert key(space["train"]) != before


def test_an_abstract_base_class_in_the_notebook_has_a_key():
    space = notebook(
        "import abc\nclass Stream(abc.ABC):\n    @abc.abstractmethod\n    def read(self): ...\n"
        "class Lines(Stream):\n    def read(self):\n        return 1\n"
    )
    assert key(space["Lines"]) == key(space["Lines"])
    assert isinstance(space["Lines"](), abc.ABC)


# --- replaying a cell's imports and definitions ----------------------------------------------------------


def test_replay_runs_each_statement_alone_at_its_cell_lines():
    cell = (
        "import os; print('side effect')\nvalue = 1\n\n@staticmethod\ndef where():\n    return os.sep\n"
        "from math import sqrt as root, pi\n"
    )
    found = definitions(cell, "<cell 1>")
    assert [(d.names, d.index) for d in found] == [(("os",), 0), (("where",), 3), (("root", "pi"), 4)]
    namespace: dict = {}
    bound, failed, why = replay(namespace, found)
    assert bound == ["os", "pi", "root", "where"] and failed == [] and why == {}
    assert "value" not in namespace and namespace["root"](9.0) == 3.0
    assert namespace["where"].__func__.__code__.co_firstlineno == 4  # its own line (its decorator's) in the cell


def test_the_log_keeps_a_repeated_import_in_place_and_moves_a_redefinition_last():
    log = ReplayLog()
    log.record(definitions("import torch\nclass Net(torch.nn.Module):\n    pass\n", "<cell 1>"), [0, 1])
    log.record(definitions("import torch\n", "<cell 2>"), [0, 1])
    log.record(definitions("def net():\n    return 1\n", "<cell 3>"), [1])
    log.record(definitions("class Net:\n    pass\n", "<cell 4>"), [0, 1])
    assert [(d.names, d.filename) for d in log.for_rank(0)] == [(("torch",), "<cell 1>"), (("Net",), "<cell 4>")]
    assert [d.names for d in log.for_rank(1)] == [("torch",), ("net",), ("Net",)]


def test_replay_goes_on_while_a_pass_makes_progress():
    found = definitions("class Child(Parent):\n    pass\n", "<cell 2>") + definitions(
        "class Parent:\n    pass\n", "<cell 1>"
    )
    namespace: dict = {}
    bound, failed, _ = replay(namespace, found)
    assert bound == ["Child", "Parent"] and failed == []
    bound, failed, why = replay({}, definitions("def f(x=missing):\n    pass\n", "<cell 3>"))
    assert (
        bound == []
        and [d.names for d in failed] == [("f",)]
        and why == {"f": "NameError: name 'missing' is not defined"}
    )

"""The job queue's placement, in this process: submission order with backfill, whole-GPU and shared leases,
memory needs and settling, and the reasons a waiting job shows. (Real runners: test_jobs.py.)"""

import os
import subprocess
import sys
import time

import pytest

import gpumagic
from gpumagic.devices import leases
from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.processes import current_user
from gpumagic.jobs.queue import Request, Ticket, place, take, waiting_tickets

ME = current_user()


SHARER = """
import sys
from gpumagic.devices import leases
uuid = sys.argv[1]
leases.book().label = "job S"
with leases.pick_lock():
    assert leases.book().try_share(uuid)
print("shared", flush=True)
for line in sys.stdin:
    leases.book().mark_settled(uuid)
    print("settled", flush=True)
"""


@pytest.fixture
def sharer():
    """Starts a process of this user that shares a GPU as a sharing job's runner does (a locked shared record);
    a line on its stdin marks it settled."""
    processes = []

    def start(uuid):
        process = subprocess.Popen(
            [sys.executable, "-c", SHARER, uuid], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        processes.append(process)
        assert process.stdout.readline().strip() == "shared"
        return process

    yield start
    for process in processes:
        process.kill()
        process.wait()


def settle(process):
    process.stdin.write("settle\n")
    process.stdin.flush()
    assert process.stdout.readline().strip() == "settled"


def ticket(name, request, offset):
    return Ticket.create(name, request, time.time() - 100 + offset, key=f"run-{name}")


def test_tickets_are_served_in_submission_order(simulated):
    inventory = read_inventory()
    ticket("first", Request(2), 0)
    ticket("second", Request(1), 1)
    mine = ticket("third", Request(1), 2)
    chosen, reason = place(mine, inventory, leases.book())
    assert len(chosen) == 1 and not reason
    gpumagic.use("GPU:3")  # one GPU fewer: the two earlier jobs take the other three
    chosen, reason = place(mine, read_inventory(), leases.book())
    assert chosen == []
    assert "waiting for 1 GPU" in reason and "goes to job first, ahead in the queue" in reason
    assert "goes to job second" in reason and "GPU 3: leased by this kernel" in reason


def test_a_job_that_cannot_start_does_not_hold_up_a_later_one(simulated):
    gpumagic.use("GPU:0")
    ticket("big", Request(4), 0)  # cannot start while GPU 0 is leased
    mine = ticket("small", Request(1), 1)
    chosen, _ = place(mine, read_inventory(), leases.book())
    assert [g.nvml_index for g in chosen] == [1]


def test_named_gpus_wait_for_exactly_those(simulated):
    inventory = read_inventory()
    gpumagic.use("GPU:2")
    mine = ticket("named", Request(1, (inventory[2].uuid,)), 0)
    chosen, reason = place(mine, inventory, leases.book())
    assert chosen == [] and "GPU 2: leased by this kernel" in reason and "GPU 0" not in reason


def test_dead_runners_tickets_are_ignored_and_removed(simulated, monkeypatch):
    from gpumagic.jobs import queue

    mine = ticket("mine", Request(1), 5)
    monkeypatch.setattr(queue, "PROVISIONAL_S", 0.0)
    stale = Ticket.create("gone", Request(4), time.time() - 200, key="run-gone", provisional=True)  # never locked
    time.sleep(0.01)
    assert [t.name for t in waiting_tickets()] == ["mine"]
    assert not stale.path.exists()
    chosen, _ = place(mine, read_inventory(), leases.book())
    assert len(chosen) == 1


def test_provisional_tickets_expire_when_no_runner_takes_them_over(simulated, monkeypatch):
    from gpumagic.jobs import queue

    monkeypatch.setattr(queue, "PROVISIONAL_S", -1.0)
    Ticket.create("never-started", Request(1), time.time(), key="run-x", provisional=True)
    assert waiting_tickets() == []


def test_sharing_jobs_join_a_gpu_only_after_its_jobs_settled(monkeypatch, sharer):
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    uuid = read_inventory()[0].uuid
    other = sharer(uuid)
    mine = ticket("sharer", Request(1, (), 10 << 30), 0)
    chosen, reason = place(mine, read_inventory(), leases.book())
    assert chosen == [] and "GPU 0: a job on it is still allocating its memory" in reason
    settle(other)
    chosen, reason = place(mine, read_inventory(), leases.book())
    assert [g.uuid for g in chosen] == [uuid]
    with leases.pick_lock():
        assert take(chosen, mine.request, leases.book())
    assert {s.pid for s in leases.sharers(uuid)} == {other.pid, os.getpid()}
    assert leases.holders([uuid], leases.book())[uuid].mine


def test_a_shared_gpu_is_closed_to_whole_gpu_jobs_and_kernels(monkeypatch, sharer):
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    uuid = read_inventory()[0].uuid
    other_process = sharer(uuid)
    settle(other_process)
    mine = ticket("whole", Request(1), 0)
    chosen, reason = place(mine, read_inventory(), leases.book())
    assert chosen == [] and f"GPU 0: shared by jobs of {ME} (pid {other_process.pid}, job S)" in reason
    with pytest.raises(gpumagic.NotEnoughGpusError, match=f"shared by jobs of {ME}"):
        gpumagic.pick(1)
    with leases.pick_lock():
        assert not leases.book().try_acquire(uuid)  # nor by naming it
    other_process.kill()
    other_process.wait()
    assert gpumagic.pick(1).indices == (0,)  # the sharer is gone: its record no longer counts


def test_a_memory_need_says_how_much_is_free(tmp_path, monkeypatch):
    scenario = tmp_path / "busy.json"
    scenario.write_text('{"gpus": [{"model": "A100-80GB", "used": "75GB"}, {"model": "A100-80GB", "used": "71GB"}]}')
    monkeypatch.setenv("GPUMAGIC_SIMULATE", str(scenario))
    mine = ticket("big", Request(1, (), 20 << 30), 0)
    chosen, reason = place(mine, read_inventory(), leases.book())
    assert chosen == []
    assert reason == (
        "waiting for 1 GPU with 20.0 GiB free — GPU 0 has 5.0 GiB free, job needs 20.0 GiB; "
        "GPU 1 has 9.0 GiB free, job needs 20.0 GiB"
    )
    small = ticket("small", Request(1, (), 8 << 30), 1)
    assert [g.nvml_index for g in place(small, read_inventory(), leases.book())[0]] == [1]


def test_a_ticket_of_ours_that_someone_else_locked_holds_no_place(monkeypatch):
    """A neighbour who locks a job's provisional ticket before its runner does (it is readable by all) does not
    make the job wait behind its own ghost."""
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    provisional = Ticket.create("J", Request(1), time.time(), key="run-j", provisional=True)
    locker = subprocess.Popen(["flock", "-s", str(provisional.path), "sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while not any(str(locker.pid) in line for line in open("/proc/locks")) and time.monotonic() < deadline:
            time.sleep(0.01)
        mine = Ticket.create("J", Request(1), time.time(), key="run-j")  # the runner: makes its own
        chosen, reason = place(mine, read_inventory(), leases.book())
        assert len(chosen) == 1 and reason == ""
        assert [t.path for t in waiting_tickets()] == [mine.path]
        mine.remove()
    finally:
        locker.kill()
        locker.wait()

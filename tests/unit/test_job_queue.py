"""The job queue's placement: submission order with backfill and its bound, round-robin between users,
whole-GPU and shared leases, reservations, kernels waiting in order, and the reasons a waiting job shows."""

import os
import subprocess
import sys
import time

import pytest

import gpumagic
from gpumagic.devices import lease_directory, leases, pick_lock, placement, tickets
from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.processes import current_user
from gpumagic.jobs.queue import Request, Ticket, place, take, waiting_tickets
from gpumagic.units import GIB

ME = current_user()


SHARER = """
import sys
from gpumagic.devices import leases, pick_lock
uuid, reserve = sys.argv[1], int(sys.argv[2])
leases.book().label = "job S"
with pick_lock.pick_lock():
    assert leases.book().try_share(uuid, reserve)
print("shared", flush=True)
held = []
for line in sys.stdin:
    held.append(bytearray(int(line) << 20))  # touched: resident, so the simulated GPU counts it
    print("allocated", flush=True)
"""


@pytest.fixture
def sharer():
    """Starts a process of this user that shares a GPU as a sharing job's runner does (a locked shared record
    reserving ``reserve`` bytes), seen on that GPU (its ``CUDA_VISIBLE_DEVICES``); ``allocate(p, mib)`` makes it
    allocate."""
    processes = []

    def start(uuid, reserve):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid}
        process = subprocess.Popen(
            [sys.executable, "-c", SHARER, uuid, str(reserve)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        processes.append(process)
        assert process.stdout.readline().strip() == "shared"
        return process

    yield start
    for process in processes:
        process.kill()
        process.wait()


def allocate(process, mib):
    process.stdin.write(f"{mib}\n")
    process.stdin.flush()
    assert process.stdout.readline().strip() == "allocated"


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


def test_jobs_that_declare_memory_share_a_gpu_at_once_within_what_is_not_reserved(monkeypatch, sharer):
    """Placement counts each sharer's reservation less what it has allocated, not a wait for it to settle."""
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xT4-4GB")
    uuid = read_inventory()[0].uuid
    first = sharer(uuid, GIB)
    mine = ticket("sharer", Request(1, (), 5 * GIB // 2), 0)
    chosen, reason = place(mine, read_inventory(), leases.book())
    assert [g.uuid for g in chosen] == [uuid], reason  # 4 GiB free, 1 GiB reserved: no waiting for it to settle
    second = sharer(uuid, GIB)
    chosen, reason = place(mine, read_inventory(), leases.book())
    assert chosen == []
    assert "after 2.0 GiB reserved and not yet allocated < 2.5 GiB needed" in reason
    assert f"{ME} (pid {first.pid}, job S) 1.0 GiB, {ME} (pid {second.pid}, job S) 1.0 GiB" in reason  # every sharer
    allocate(first, 900)  # what it allocated is in use, and no longer counted as reserved too
    later = ticket("later", Request(1, (), 19 * GIB // 10), 1)
    chosen, reason = place(later, read_inventory(), leases.book())
    assert [g.uuid for g in chosen] == [uuid], reason
    with pick_lock.pick_lock():
        assert take(chosen, later.request, leases.book())
        view = leases.read_view(leases.book())
    assert {lease.pid for lease in view.on(uuid)} == {first.pid, second.pid, os.getpid()}
    assert [lease.reserve for lease in view.on(uuid) if lease.mine] == [19 * GIB // 10]


def test_an_earlier_sharing_ticket_takes_its_reservation_first(monkeypatch):
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xT4-4GB")
    ticket("first", Request(1, (), 3 * GIB), 0)
    mine = ticket("second", Request(1, (), 2 * GIB), 1)
    chosen, reason = place(mine, read_inventory(), leases.book())
    assert chosen == [] and "(shared by job first 3.0 GiB (placed ahead in the queue))" in reason


def test_a_shared_gpu_is_closed_to_whole_gpu_jobs_and_kernels(monkeypatch, sharer):
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    uuid = read_inventory()[0].uuid
    other_process = sharer(uuid, 10 * GIB)
    mine = ticket("whole", Request(1), 0)
    chosen, reason = place(mine, read_inventory(), leases.book())
    assert chosen == [] and f"GPU 0: shared by jobs: {ME} (pid {other_process.pid}, job S) 10.0 GiB" in reason
    with pytest.raises(gpumagic.NotEnoughGpusError, match=f"shared by jobs: {ME}"):
        gpumagic.pick(1)
    with pick_lock.pick_lock():
        assert not leases.book().try_acquire(uuid)  # nor by naming it
    other_process.kill()
    other_process.wait()
    mine.remove()  # else the job's ticket, ahead of the kernel, gets the GPU first
    assert gpumagic.pick(1).indices == (0,)  # the sharer is gone: its record no longer counts


def test_a_memory_need_says_how_much_is_free(tmp_path, monkeypatch):
    scenario = tmp_path / "busy.json"
    scenario.write_text('{"gpus": [{"model": "A100-80GB", "used": "75GB"}, {"model": "A100-80GB", "used": "71GB"}]}')
    monkeypatch.setenv("GPUMAGIC_SIMULATE", str(scenario))
    mine = ticket("big", Request(1, (), 20 << 30), 0)
    chosen, reason = place(mine, read_inventory(), leases.book())
    assert chosen == []
    assert reason == (
        "waiting for 1 GPU with 20.0 GiB reserved — GPU 0: 5.0 GiB free < 20.0 GiB needed; "
        "GPU 1: 9.0 GiB free < 20.0 GiB needed"
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


def _with_lease(view, uuid, uid):
    """``view`` with a lease of user ``uid`` (another user: a kernel of theirs) on ``uuid`` added."""
    from gpumagic.devices.leases import Lease, LeaseView

    lease = Lease(uuid, f"user{uid}", 4321, time.time(), uid=uid)
    return LeaseView({**view.leases, uuid: (*view.on(uuid), lease)}, view.tickets)


def test_a_large_job_passed_over_longer_than_the_bound_has_its_gpus_held(simulated, monkeypatch):
    """Backfill lets small jobs pass a large one that cannot start, until it has waited the bound; then the
    GPUs it would take are held for it, so the small ones stop taking them as they come free."""
    inventory = read_inventory()
    ticket("large", Request(4), 0)
    small = Ticket.create("small", Request(1), time.time(), key="run-small")

    def placed():  # another user's kernel holds GPU 0: the large job, wanting all four, cannot start
        view = _with_lease(leases.read_view(leases.book()), inventory[0].uuid, os.getuid() + 1)
        return placement.place(small.request, inventory, view, small, keep_own=False)

    assert len(placed().gpus) == 1, placed().explain()  # backfilled: the large job has not waited the 10 minutes
    monkeypatch.setenv("GPUMAGIC_BACKFILL_BOUND", "0s")  # ... now it has
    reason = placed().explain()
    assert placed().gpus == ()
    assert "GPU 1: held for job large, waiting longer than 0s" in reason and "GPU 3: held for job large" in reason
    assert "GPU 0: leased by user" in reason


def test_a_kernel_keeps_a_gpu_it_holds_that_is_held_for_a_large_job(monkeypatch):
    """Bob's job wanting all four GPUs waits past the bound for this kernel's GPU 0: GPUs 1-3 are held for it,
    and this kernel, picking again, keeps its own GPU 0."""
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "4xA100-80GB")
    monkeypatch.setenv("GPUMAGIC_BACKFILL_BOUND", "0s")
    assert gpumagic.use("GPU:0").indices == (0,)
    inventory = read_inventory()
    bobs = _ticket_file(os.getuid() + 1, 1, "large", 0, "job", Request(4))
    view = leases.read_view(leases.book())
    view = type(view)(view.leases, (bobs,))
    placed = placement.place(Request(1, shares=False), inventory, view)
    assert [g.nvml_index for g in placed.gpus] == [0], placed.explain()
    assert all("held for" in placed.reasons[i] for i in (1, 2, 3)), placed.reasons


def test_nothing_is_held_for_a_job_no_gpu_here_could_ever_take(monkeypatch):
    """Held GPUs are ones the job could use once free: a 40 GiB job holds A100s, never a 16 GiB T4, and a job
    asking more memory than any GPU has free at best holds nothing."""
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "2xT4-16GB,2xA100-80GB")
    monkeypatch.setenv("GPUMAGIC_BACKFILL_BOUND", "0s")
    inventory = read_inventory()
    ticket("big", Request(2, (), 40 * GIB), 0)  # two GPUs of 40 GiB: only the A100s, one leased
    small = Ticket.create("small", Request(1), time.time(), key="run-small")

    def placed():
        view = _with_lease(leases.read_view(leases.book()), inventory[2].uuid, os.getuid() + 1)
        return placement.place(small.request, inventory, view, small, False)

    assert [g.nvml_index for g in placed().gpus] == [0]  # a T4 is free to take
    assert placed().reasons[3] == "held for job big, waiting longer than 0s" and 1 not in placed().reasons
    tickets.remove_tickets("run-big")
    ticket("impossible", Request(1, (), 90 * GIB), 1)
    assert not any("held" in why for why in placed().reasons.values())


def test_a_job_only_its_own_users_leases_keep_waiting_holds_nothing(simulated, monkeypatch):
    """Every reader holds the same GPUs for a job: those it could use once other users than its own let go.
    A job that only its own user's kernel keeps from starting holds nothing, for its user too."""
    monkeypatch.setenv("GPUMAGIC_BACKFILL_BOUND", "0s")
    gpumagic.use("GPU:0")
    ticket("large", Request(4), 0)
    small = Ticket.create("small", Request(1), time.time(), key="run-small")
    chosen, reason = place(small, read_inventory(), leases.book())
    assert len(chosen) == 1 and "held" not in reason


def test_the_bound_is_read_from_the_environment_and_checked(monkeypatch):
    from gpumagic.devices.placement import BACKFILL_BOUND_S, backfill_bound

    monkeypatch.delenv("GPUMAGIC_BACKFILL_BOUND", raising=False)
    assert backfill_bound() == BACKFILL_BOUND_S == 600
    monkeypatch.setenv("GPUMAGIC_BACKFILL_BOUND", "2m")
    assert backfill_bound() == 120
    monkeypatch.setenv("GPUMAGIC_BACKFILL_BOUND", "soon")
    with pytest.raises(gpumagic.InvalidArgument, match="GPUMAGIC_BACKFILL_BOUND"):
        backfill_bound()


def test_queue_order_is_round_robin_between_users_and_arrival_within_a_round(tmp_path):
    from gpumagic.devices.placement import queue_order
    from gpumagic.devices.tickets import TicketFile

    def made(uid, at, name, turn):
        data = {"kind": "job", "name": name, "request": Request(1).to_json(), "submitted_ns": at, "round": turn}
        return Ticket.of(TicketFile(tmp_path / f"queue.{uid}.{name}.ab.json", uid, at, data))

    alice = [made(1001, at, f"a{at}", turn) for turn, at in enumerate((1, 2, 3, 4))]  # a sweep of 4
    bob = made(1002, 5, "b5", 0)
    carol = [made(1003, at, f"c{at}", turn) for turn, at in enumerate((6, 7))]
    assert [t.name for t in queue_order([*carol, bob, *alice])] == ["a1", "b5", "c6", "a2", "c7", "a3", "a4"]
    # a1 has started: a2 keeps its turn, behind Bob's and Carol's first
    assert [t.name for t in queue_order([*carol, bob, *alice[1:]])] == ["b5", "c6", "a2", "c7", "a3", "a4"]
    # a newcomer joins the round being served: Alice's backlog is not passed by every later job
    backlog = [made(1001, at, f"a{at}", turn) for turn, at in ((37, 1), (38, 2), (39, 3))]
    late = [made(1002, at, f"b{at}", turn) for turn, at in ((37, 10), (38, 11), (39, 12))]  # as next_round writes
    assert [t.name for t in queue_order([*late, *backlog])] == ["a1", "b10", "a2", "b11", "a3", "b12"]
    # a forged round 0 on every ticket gets no more than one ticket per turn
    forged = [made(1004, at, f"m{at}", 0) for at in (0, 8, 9)]
    assert [t.name for t in queue_order([*forged, bob])][:3] == ["m0", "b5", "m8"]


WAITER = """
import sys, time, gpumagic
from gpumagic.devices import leases
poll = float(sys.argv[1])
leases.book().label = sys.argv[2]
print("waiting", flush=True)
chosen = gpumagic.pick(1, wait="60s", poll_interval=poll)
print("got", time.time(), flush=True)
sys.stdin.readline()
"""


def test_kernels_waiting_in_pick_are_served_in_arrival_order_and_a_re_pick_queues_behind(monkeypatch):
    """A waiter holds a ticket: the first to wait gets the GPU first, even if a later one looks more often, and
    a kernel that gives its GPU back and picks again at once (no --wait) does not jump the queue."""
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    gpumagic.pick(1)
    started = []
    try:
        for poll, label in ((1.5, "slow"), (0.05, "eager")):
            process = subprocess.Popen(
                [sys.executable, "-c", WAITER, str(poll), label],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            started.append(process)
            assert process.stdout.readline().strip() == "waiting"
            deadline = time.monotonic() + 10
            while len(waiting_tickets()) < len(started) and time.monotonic() < deadline:
                time.sleep(0.02)
        assert [t.name for t in waiting_tickets()] == ["slow", "eager"]
        gpumagic.release()
        with pytest.raises(gpumagic.NotEnoughGpusError, match=r"goes to kernel slow \(in %gpu pick --wait\)|, slow\)"):
            gpumagic.pick(1)  # this kernel picks again at once: behind both waiters (or slow has it already)
        slow, eager = started
        assert slow.stdout.readline().startswith("got")  # the first waiter, though it looks every 1.5 s
        assert [t.name for t in waiting_tickets()] == ["eager"]
        slow.stdin.write("\n")
        slow.stdin.flush()
        assert eager.stdout.readline().startswith("got")
    finally:
        for process in started:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_three_jobs_declaring_memory_run_at_once_and_the_fourth_when_one_ends(monkeypatch, tmp_path):
    """Four jobs declaring 1.3 GB each on a 4 GiB GPU (the issue's 4 x 20 GiB declaring 25 GB on 80 GiB, at
    1/20): three fit their reservations and start together, without waiting for each other to allocate; the
    fourth waits, saying why, until one ends."""
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xT4-4GB")  # a job's memory is its resident memory here

    def hold(stop):
        import os
        import time

        block = bytearray(600 << 20)  # touched: resident
        while not os.path.exists(stop):
            time.sleep(0.05)
        return len(block) >> 20

    jobs = [
        gpumagic.jobs_with(min_free="1.3GB", name=f"r{n}").submit(hold, str(tmp_path / f"stop{n}")) for n in range(4)
    ]
    try:
        deadline = time.monotonic() + 120
        while any(j.status != "running" for j in jobs[:3]) and time.monotonic() < deadline:
            assert all(j.status in ("queued", "running") for j in jobs)
            time.sleep(0.05)
        assert [j.status for j in jobs] == ["running", "running", "running", "queued"]
        time.sleep(1.0)  # the three allocate: the fourth still does not fit
        assert jobs[3].status == "queued"
        assert "waiting for 1 GPU with 1.3 GiB reserved — GPU 0:" in jobs[3].reason
        assert all(f"job r{n}" in jobs[3].reason for n in range(3)), jobs[3].reason  # every sharer named
        (tmp_path / "stop1").touch()
        assert jobs[1].wait("60s") == "finished"
        while jobs[3].status == "queued" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert jobs[3].status == "running" and jobs[3].info["started"] >= jobs[1].info["ended"]
        for n in (0, 2, 3):
            (tmp_path / f"stop{n}").touch()
        assert [j.wait("60s") for j in jobs] == ["finished"] * 4 and jobs[0].result() == 600
        starts = [j.info["started"] for j in jobs[:3]]
        assert max(starts) < min(j.info["ended"] for j in jobs[:3])  # the three ran together
    finally:
        for job in jobs:
            if job.status in ("queued", "running"):
                job.kill(grace_s=1)


def test_an_out_of_memory_error_of_a_capped_job_names_its_limit_and_what_to_do(monkeypatch):
    import torch

    from gpumagic.launch.rank_side.memory_cap import MEMORY_LIMIT_VARIABLE, memory_limit, name_memory_limit

    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has ...")
    monkeypatch.delenv(MEMORY_LIMIT_VARIABLE, raising=False)
    assert memory_limit() is None and str(name_memory_limit(error)).startswith("CUDA out of memory")
    monkeypatch.setenv(MEMORY_LIMIT_VARIABLE, str(25 * GIB))
    assert memory_limit() == 25 * GIB
    assert str(name_memory_limit(error)) == (
        "the job ran out of its --memory-limit of 25.0 GiB, the memory it declared with --min-free 25.0 GiB "
        "(CUDA out of memory. Tried to allocate 2.00 GiB.); declare more with --min-free, or lower its batch size"
    )
    other = ValueError("not memory")
    assert name_memory_limit(other) is other and str(other) == "not memory"


@pytest.mark.slow
def test_memory_limit_reaches_the_jobs_processes_and_needs_a_declared_size(simulated):
    def limit():
        import os

        return os.environ.get("GPUMAGIC_MEMORY_LIMIT")

    with pytest.raises(gpumagic.InvalidArgument, match="give min_free too"):
        gpumagic.jobs_with(memory_limit=True).submit(limit)
    with pytest.raises(gpumagic.InvalidArgument, match="True or False"):
        gpumagic.jobs_with(min_free="1GB", memory_limit="yes").submit(limit)
    capped = gpumagic.jobs_with(min_free="2GB", memory_limit=True, name="capped").submit(limit)
    free = gpumagic.jobs_with(min_free="2GB", name="uncapped").submit(limit)
    assert capped.result("60s") == str(2 * GIB) and free.result("60s") is None


def test_a_waiting_kernel_that_dies_leaves_no_place_in_the_queue(monkeypatch):
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    gpumagic.pick(1)
    waiter = subprocess.Popen(
        [sys.executable, "-c", WAITER, "0.05", "doomed"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert waiter.stdout.readline().strip() == "waiting"
        deadline = time.monotonic() + 10
        while not waiting_tickets() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [t.name for t in waiting_tickets()] == ["doomed"]
    finally:
        waiter.kill()
        waiter.wait()
    assert waiting_tickets() == []  # at once: not after the 30 s a job's runner has to take its ticket over
    gpumagic.release()
    assert gpumagic.pick(1).indices == (0,)


def test_a_newcomers_round_is_the_round_being_served():
    from gpumagic.devices.leases import LeaseView
    from gpumagic.devices.placement import next_round
    from gpumagic.devices.tickets import TicketFile

    def made(uid, at, turn):
        data = {"kind": "job", "name": f"t{at}", "request": Request(1).to_json(), "submitted_ns": at, "round": turn}
        return TicketFile(lease_directory.lease_dir() / f"queue.{uid}.t{at}.ab.json", uid, at, data)

    assert next_round(LeaseView({}, ())) == 0
    backlog = tuple(made(os.getuid() + 1, at, turn) for at, turn in ((1, 37), (2, 38)))
    assert next_round(LeaseView({}, backlog)) == 37
    assert next_round(LeaseView({}, (*backlog, made(os.getuid(), 3, 37)))) == 38


@pytest.mark.parametrize(
    "field, value",
    [
        ("kind", "root"),
        ("round", -1),
        ("round", 1.5),
        ("round", (1 << 20) + 1),
        ("name", "evil\x1b[2J"),
        ("name", "x" * 121),
        ("exclude", [-1]),
        ("pid", -1),
        ("pid", "1"),
        ("process_start", float("inf")),
        ("uuids", [f"GPU-{k}" for k in range(65)]),
        ("process_start", 10**400),  # no float holds it: it crashed every other user's reading (review)
        ("max_util", 10**400),
    ],
)
def test_tickets_with_malformed_fields_are_untrusted(field, value):
    from gpumagic.devices.shared_files import Untrusted
    from gpumagic.devices.ticket_checks import checked_ticket

    good = {"kind": "pick", "name": "nb.ipynb", "request": Request(1).to_json(), "submitted_ns": 1, "round": 3}
    assert checked_ticket({**good, "pid": 12, "process_start": 1.5}) == {**good, "pid": 12, "process_start": 1.5}
    bad = {**good, "request": {**good["request"]}}
    if field in ("exclude", "uuids", "max_util"):
        bad["request"][field] = value
    else:
        bad[field] = value
    with pytest.raises(Untrusted, match="malformed"):
        checked_ticket(bad)


def test_a_ticket_submitted_after_it_was_made_is_untrusted():
    from gpumagic.devices.shared_files import Untrusted
    from gpumagic.devices.ticket_checks import checked_ticket

    made = time.time_ns()
    ticket = {"kind": "job", "name": "j", "request": Request(1).to_json(), "submitted_ns": made - 10**9}
    assert checked_ticket(ticket, made)["submitted_ns"] == made - 10**9
    with pytest.raises(Untrusted, match="submitted after it was made"):
        checked_ticket({**ticket, "submitted_ns": made + 60 * 10**9}, made)


def _ticket_file(uid, at, name, turn, kind="job", request=None):
    from gpumagic.devices.tickets import TicketFile

    data = {"kind": kind, "name": name, "request": (request or Request(1)).to_json(), "submitted_ns": at}
    data["round"] = turn
    return TicketFile(lease_directory.lease_dir() / f"queue.{uid}.{name}.ab.json", uid, at, data)


def test_a_round_no_queue_reaches_is_not_inherited_nor_pushes_anyone_behind_newcomers():
    """Issue #24: a ticket round of 2^20 made everyone's next ticket 2^20 + 1, out of range, so theirs were
    ignored. A round beyond half the limit counts as 0 and is not inherited; no round written passes the limit;
    and a ticket that copied such a round is not passed by every newcomer (review)."""
    from gpumagic.devices.leases import LeaseView
    from gpumagic.devices.placement import next_round, queue_order
    from gpumagic.devices.ticket_checks import ROUND_LIMIT

    me, bob, carol = os.getuid(), os.getuid() + 7, os.getuid() + 8
    poison = _ticket_file(bob, 1, "p", ROUND_LIMIT)
    assert next_round(LeaseView({}, (poison,))) == 0
    high = _ticket_file(bob, 1, "h", ROUND_LIMIT // 2)  # inherited: there is room left for a long queue
    assert next_round(LeaseView({}, (high,))) == ROUND_LIMIT // 2
    mine = [_ticket_file(me, 2 + k, f"m{k}", ROUND_LIMIT // 2 + k) for k in range(3)]
    mine.append(_ticket_file(me, 5, "m3", next_round(LeaseView({}, (high, *mine)))))
    assert mine[-1].data["round"] <= ROUND_LIMIT
    assert [t.name for t in queue_order(map(Ticket.of, (high, *mine)))] == ["h", "m0", "m1", "m2", "m3"]
    copied = _ticket_file(me, 5, "v", ROUND_LIMIT // 2 + 1)  # a victim's ticket that copied a high round
    newcomers = [_ticket_file(carol + k, 10 + k, f"n{k}", next_round(LeaseView({}, (copied,)))) for k in range(3)]
    assert [t.name for t in queue_order(map(Ticket.of, (*newcomers, copied)))] == ["v", "n0", "n1", "n2"]
    forged = _ticket_file(bob, 20, "f", 10**5)  # a forged high round behind everyone, not a new frame
    order = [t.name for t in queue_order(map(Ticket.of, (forged, copied, *newcomers)))]
    assert order == ["v", "n0", "n1", "n2", "f"] and next_round(LeaseView({}, (forged, copied))) == 1


def _place_behind(inventory, tickets, holding=(), name="mine", request=None):
    """A waiter's look: this user's ticket (for ``request``, one GPU by default) behind ``tickets``."""
    from gpumagic.devices.leases import LeaseView

    request = request or Request(1, shares=False)
    mine = Ticket.of(_ticket_file(os.getuid(), time.time_ns(), name, 1 << 19, "pick", request))
    view = LeaseView(dict(holding), (*tickets, mine.file))
    return placement.count_hold_ups(placement.place(request, inventory, view, mine), mine.path.name)


def _looks_until_placed(inventory, tickets_at, holding=(), seconds=10.0):
    """A waiter looking every 20 ms, with ``tickets_at(k)`` ahead at its k-th look, until it is placed."""
    deadline, k, placed = time.monotonic() + seconds, 0, None
    while time.monotonic() < deadline:
        placed = _place_behind(inventory, tickets_at(k), holding)
        if placed.gpus:
            return placed, k
        k += 1
        time.sleep(0.02)
    return placed, k


def test_another_users_tickets_that_could_start_hold_a_waiter_up_for_the_budget_in_all(monkeypatch):
    """Issue #24: another user's tickets that could start and were not taken kept a waiting pick from 4 free
    GPUs: renamed every few seconds, or with a lease taken now and then, they were never passed over. The time
    they hold a waiter up is counted per user, past a grace second, whatever the tickets are called and
    whatever leases that user takes; at the budget that user's tickets are passed over."""
    from gpumagic.devices.hold_ups import GRACE_S, HoldUp, hold_ups
    from gpumagic.devices.leases import Lease

    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    monkeypatch.setitem(hold_ups().budgets, HoldUp.STARTS, 0.3)
    inventory = read_inventory()
    bob = os.getuid() + 4242
    placed = _place_behind(inventory, [_ticket_file(bob, 1, "f1", 0, "pick")])
    assert not placed.gpus and "goes to" in placed.reasons[0]  # it could start: it goes first
    assert "could start and are not taken up: passed over in 1s at most" in placed.note(countdown=True)

    def renamed_with_new_leases(k):  # a new ticket name, and a new lease of Bob's on another GPU, at every look
        lease = Lease(f"GPU-other-{k}", "bob", 10_000 + k, time.time(), uid=bob)
        return [_ticket_file(bob, k + 2, f"f{k + 2}", 0, "pick")], {lease.uuid: (lease,)}

    started = time.monotonic()
    deadline, k = started + 5, 0
    while time.monotonic() < deadline:
        tickets, leases_now = renamed_with_new_leases(k)
        placed = _place_behind(inventory, tickets, leases_now)
        if placed.gpus:
            break
        k += 1
        time.sleep(0.02)
    assert placed.gpus, "never passed over"
    assert GRACE_S + 0.25 < time.monotonic() - started < GRACE_S + 1.5
    assert "passing over" in placed.explain()
    again = _place_behind(inventory, [_ticket_file(bob, 99, "f99", 0, "pick")], name="second-wait")
    assert again.gpus and hold_ups().seconds(bob, HoldUp.STARTS) >= 0.3  # this process's next wait too


@pytest.mark.slow
def test_a_hold_up_broken_off_now_and_then_gets_no_new_grace(monkeypatch):
    """Review of #24: Bob's tickets could start for 0.95 s, then his leases kept every GPU for 0.3 s, and so on:
    each hold-up began with a new uncounted grace second, and the waiter was never placed. The grace is one
    second per user and wait."""
    from gpumagic.devices.hold_ups import HoldUp, hold_ups
    from gpumagic.devices.leases import Lease

    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    monkeypatch.setitem(hold_ups().budgets, HoldUp.STARTS, 1.0)
    inventory = read_inventory()
    bob = os.getuid() + 4242
    lease = Lease(inventory[0].uuid, "bob", 4321, time.time(), uid=bob)
    tickets = [_ticket_file(bob, 1, "b", 0, "pick")]
    started, placed = time.monotonic(), None
    while time.monotonic() - started < 10:
        leased = (time.monotonic() - started) % 1.25 > 0.95  # his lease, 0.3 s of every 1.25 s
        placed = _place_behind(inventory, tickets, {lease.uuid: (lease,)} if leased else ())
        if placed.gpus:
            break
        time.sleep(0.05)
    assert placed.gpus, "never passed over"
    assert time.monotonic() - started < 4


def test_a_pick_without_a_ticket_counts_too(monkeypatch):
    """Review of #24: a pick without --wait (and %%launch_ddp --gpus auto) comes after every ticket and held no
    ticket, so nothing was counted: one ticket of Bob's that could start refused every such pick for ever. Its
    looks count as this process's."""
    from gpumagic.devices.hold_ups import HoldUp, hold_ups
    from gpumagic.devices.leases import LeaseView

    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    monkeypatch.setitem(hold_ups().budgets, HoldUp.STARTS, 0.5)
    inventory = read_inventory()
    view = LeaseView({}, (_ticket_file(os.getuid() + 4242, 1, "b", 0, "pick"),))
    request = Request(1, shares=False)
    started = time.monotonic()
    while time.monotonic() - started < 10:
        looked = placement.place(request, inventory, view, waiting=True)
        if looked.gpus:
            break
        assert "goes to" in looked.reasons[0]
        placement.count_hold_ups(looked, f"process-{os.getpid()}")
        time.sleep(0.05)
    assert looked.gpus and time.monotonic() - started < 4


def test_an_ignored_ticket_is_named_as_its_files_owner(monkeypatch):
    """Review of #24: a file planted under Carol's uid in its name was named as "ignoring carol's tickets"; it is
    named as the user who owns the file."""
    from gpumagic.devices.shared_files import owner_name

    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    planted = lease_directory.lease_dir() / f"queue.{os.getuid() + 5}.x.ab.json"  # owned by this user
    planted.write_text("{}")
    placed = placement.place(Request(1, shares=False), read_inventory(), leases.read_view(leases.book()))
    assert placed.ignored == (owner_name(os.getuid()),)


def test_a_user_with_two_tickets_is_counted_for_both(monkeypatch):
    """Review of #24: taking away only the ticket that started let the same user's next one start in its place,
    so the waiter was never counted as held up. All of a user's tickets are taken away together."""
    from gpumagic.devices.hold_ups import HoldUp, hold_ups

    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    monkeypatch.setitem(hold_ups().budgets, HoldUp.STARTS, 0.3)
    bob = os.getuid() + 4242
    two = [_ticket_file(bob, 1, "b0", 0, "pick"), _ticket_file(bob, 2, "b1", 1, "pick")]
    placed, _ = _looks_until_placed(read_inventory(), lambda k: two)
    assert placed.gpus, placed.explain()


def test_a_user_whose_tickets_start_only_because_another_is_passed_over_is_not_counted(monkeypatch):
    """Review of #24: this waiter passes Alice over; Carol, ahead of it, still waits behind Alice in her own
    view. Carol's ticket starts only in this waiter's view: she is not counted, nor passed over."""
    from gpumagic.devices.hold_ups import HoldUp, hold_ups

    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    inventory = read_inventory()
    alice, carol = os.getuid() + 1, os.getuid() + 2
    base = time.monotonic() - 20  # an earlier wait of this process, held up by Alice 15 s in all
    for at in range(16):
        hold_ups().look("earlier-wait", {alice: HoldUp.STARTS}, 600, now=base + at)
    assert hold_ups().passed_over(alice)
    tickets = [_ticket_file(alice, 1, "a", 0, "pick"), _ticket_file(carol, 2, "c", 0, "pick")]
    for _ in range(3):
        placed = _place_behind(inventory, tickets)
        assert not placed.gpus and placed.holding_up == () and "goes to carol" not in placed.explain()
        time.sleep(0.05)
    assert hold_ups().seconds(carol, HoldUp.STARTS) == 0


@pytest.mark.slow
def test_a_second_account_behind_the_first_holds_a_waiter_up_for_a_bounded_time(monkeypatch):
    """Review of #24: Dana's tickets could start and Alex's waited behind them, so taking either user's away,
    or both only while Dana's started, placed nothing: nobody was counted, and a user with two accounts held a
    waiter for ever. Dana, at the front, is counted; then Alex, once passed Dana would have let Alex's own
    waiter pass her too (their grace and budget): each further account adds that much."""
    from gpumagic.devices.hold_ups import GRACE_S, LOOK_CAP_S, HoldUp, hold_ups

    monkeypatch.setenv("GPUMAGIC_SIMULATE", "4xA100-80GB")
    monkeypatch.setitem(hold_ups().budgets, HoldUp.STARTS, 0.3)
    dana, alex = os.getuid() + 1, os.getuid() + 2
    four = Request(4, shares=False)
    tickets = [_ticket_file(dana, 1, "d", 0, "pick", four), _ticket_file(alex, 2, "a", 0, "pick", four)]
    started = time.monotonic()
    placed, _ = _looks_until_placed(read_inventory(), lambda k: tickets, seconds=15)
    took = time.monotonic() - started
    assert placed.gpus and hold_ups().passed_over(dana) and hold_ups().passed_over(alex)
    one = GRACE_S + 0.3
    assert 2 * one + LOOK_CAP_S < took < 2 * one + LOOK_CAP_S + 2, took


@pytest.mark.slow
def test_a_user_kept_apart_cannot_start_its_window_again_by_stopping_now_and_then(monkeypatch):
    """Review of #24: Alex, behind Dana whom this waiter passes over, had his time kept apart; a lease of his
    on every GPU for a moment now and then dropped it and started his window again, so he was never counted.
    The window runs from when this waiter first saw him so."""
    from gpumagic.devices.hold_ups import GRACE_S, LOOK_CAP_S, HoldUp, hold_ups
    from gpumagic.devices.leases import Lease

    monkeypatch.setenv("GPUMAGIC_SIMULATE", "4xA100-80GB")
    monkeypatch.setitem(hold_ups().budgets, HoldUp.STARTS, 0.3)
    inventory = read_inventory()
    dana, alex = os.getuid() + 1, os.getuid() + 2
    base = time.monotonic() - 20
    for at in range(16):
        hold_ups().look("earlier-wait", {dana: HoldUp.STARTS}, 600, now=base + at)
    four = Request(4, shares=False)
    tickets = [_ticket_file(dana, 1, "d", 0, "pick", four), _ticket_file(alex, 2, "a", 0, "pick", four)]
    leases_of_alex = {g.uuid: (Lease(g.uuid, "alex", 4321, time.time(), uid=alex),) for g in inventory}
    started = time.monotonic()
    placed = None
    while time.monotonic() - started < 15:
        leased = (time.monotonic() - started) % 1.0 > 0.9  # every GPU his for a tenth of every second
        placed = _place_behind(inventory, tickets, leases_of_alex if leased else (), name="w")
        if placed.gpus:
            break
        time.sleep(0.05)
    assert placed.gpus, "never placed"
    assert time.monotonic() - started < GRACE_S + 0.3 + LOOK_CAP_S + 2 + 2


def test_more_than_256_tickets_of_one_user_are_not_all_read():
    """Review of #24: a look read every ticket, however many one user wrote. Of another user's tickets (by the
    files' owners), the oldest 256 are read and the rest named."""
    from gpumagic.devices import shared_files

    if os.geteuid() != 0:
        pytest.skip("needs root to make files of another user (chown), as CI runs")
    directory = lease_directory.lease_dir()
    stranger = os.getuid() + 5
    for k in range(300):
        path = directory / f"queue.{stranger}.t{k:03d}.ab.json"
        path.write_text("{}")
        os.chown(path, stranger, stranger)
    with pick_lock.pick_lock(exclusive=False):
        leases.read_view(leases.book())
    ignored, _ = shared_files.ignored()
    many = [n for n, why in ignored.items() if why == "one of more than 256 tickets of one user"]
    assert len(many) == 44 and all(n >= f"queue.{stranger}.t256" for n in many)
    assert ignored[f"queue.{stranger}.t000.ab.json"] == "a ticket with malformed fields"  # the oldest were read
    assert len(tickets._checked_tickets) == 256  # what a look read, no more (review: it grew to 165 MB)
    for path in directory.glob("queue.*"):
        path.unlink()
    with pick_lock.pick_lock(exclusive=False):
        leases.read_view(leases.book())
    assert not tickets._checked_tickets


def test_proc_locks_are_trusted_for_this_lease_directory_only_when_this_process_is_seen_in_them():
    from gpumagic.devices import shared_files

    assert not pick_lock.pick_lock_seen_in(shared_files.flock_holders())  # not holding the pick lock
    with pick_lock.pick_lock(exclusive=False):
        assert pick_lock.pick_lock_seen_in(shared_files.flock_holders())
        assert not pick_lock.pick_lock_seen_in({})  # where /proc/locks shows other numbers (overlay, NFS)


def test_a_ticket_that_holds_nobody_up_is_not_counted(monkeypatch):
    """Only time a waiter could have taken GPUs but for another user's tickets is counted: with a free GPU left
    for it, or wanting two GPUs where only one is free whatever the tickets do, nothing is."""
    from gpumagic.devices.hold_ups import HoldUp, hold_ups
    from gpumagic.devices.leases import Lease

    monkeypatch.setenv("GPUMAGIC_SIMULATE", "2xA100-80GB")
    inventory = read_inventory()
    bob = os.getuid() + 4242
    carol = Lease(inventory[1].uuid, "carol", 4321, time.time(), uid=bob + 1)
    for _ in range(3):
        placed = _place_behind(inventory, [_ticket_file(bob, 1, "f", 0, "pick")])
        assert placed.gpus  # two free GPUs: one for Bob's ticket, one for this waiter
        two = Request(2, shares=False)
        placed = _place_behind(inventory, [_ticket_file(bob, 1, "f", 0, "pick")], {carol.uuid: (carol,)}, request=two)
        assert not placed.gpus and placed.holding_up == ()  # GPU 1 is Carol's: two GPUs were never to be had
        time.sleep(0.05)
    assert hold_ups().seconds(bob, HoldUp.STARTS) == 0


def test_the_hold_up_count_has_a_grace_second_is_earned_back_and_counts_again_at_half_the_budget():
    from gpumagic.devices.hold_ups import GRACE_S, LOOK_CAP_S, RECOVERY_S, HoldUp, HoldUps

    counts = HoldUps(start_budget_s=10)
    starts = {7: HoldUp.STARTS}
    for at in (0.0, 0.5):
        counts.look("w", starts, 600, now=at)
    assert counts.seconds(7, HoldUp.STARTS, now=0.5) == 0  # within the grace second
    counts.look("w", starts, 600, now=GRACE_S + 1.0)
    assert counts.seconds(7, HoldUp.STARTS, now=GRACE_S + 1.0) == pytest.approx(1.0)
    # a hold-up that stops and starts again gets no second grace (review: the budget was dodged that way)
    counts.look("w", {}, 600, now=GRACE_S + 1.25)
    counts.look("w", starts, 600, now=GRACE_S + 1.5)
    assert counts.seconds(7, HoldUp.STARTS, now=GRACE_S + 1.5) == pytest.approx(1.25)
    counts.look("other wait", starts, 600, now=GRACE_S + 1.5)  # each wait has its own grace
    counts.look("other wait", starts, 600, now=GRACE_S + 2.0)
    assert counts.seconds(7, HoldUp.STARTS, now=GRACE_S + 2.0) == pytest.approx(1.25)
    rate = 10 / RECOVERY_S  # earned back while it holds nobody up: a full budget in RECOVERY_S
    at = GRACE_S + 30
    counts.look("w", starts, 600, now=at)  # a look after a long pause counts at most LOOK_CAP_S
    earned = (at - (GRACE_S + 1.5 + LOOK_CAP_S)) * rate  # from a look after its last count
    assert counts.seconds(7, HoldUp.STARTS, now=at) == pytest.approx(1.25 - earned + LOOK_CAP_S)
    level = counts.seconds(7, HoldUp.STARTS, now=at)
    idle = at + LOOK_CAP_S + 60
    assert counts.seconds(7, HoldUp.STARTS, now=idle) == pytest.approx(level - 60 * rate)
    counts.look("w", {}, 600, now=idle)
    for k in range(1, 12):
        counts.look("w", starts, 600, now=idle + k)
    assert counts.passed_over(7, now=idle + 11) and counts.left(7, HoldUp.STARTS, now=idle + 11) == 0
    assert counts.passed_over_users(now=idle + 11) == [7]
    level = counts.seconds(7, HoldUp.STARTS, now=idle + 11)
    back = idle + 11 + LOOK_CAP_S + (level - 5) / rate  # down to half the budget
    assert counts.passed_over(7, now=back - 1) and not counts.passed_over(7, now=back + 1)
    assert not counts.passed_over(8, now=back + 1)
    # a pick without a ticket, tried now and then: only a try soon after the last counts
    counts.look("process", starts, 600, now=0.0)
    counts.look("process", starts, 600, now=100.0, steady=False)
    counts.look("process", starts, 600, now=100.5, steady=False)  # its grace
    before = counts.seconds(7, HoldUp.STARTS, now=100.5)
    counts.look("process", starts, 600, now=300.0, steady=False)
    assert counts.seconds(7, HoldUp.STARTS, now=300.0) == pytest.approx(before)


def test_a_user_behind_a_released_hold_is_kept_apart_as_long_as_behind_a_passed_over_one():
    """Review of #24: a user whose jobs would start once this waiter stopped holding GPUs for another's large job
    was kept apart for the whole backfill bound, then charged all of it (passed over for hours). Its window is
    that of any such user (13 s), and no count passes its budget."""
    from gpumagic.devices.hold_ups import GRACE_S, LOOK_CAP_S, HoldUp, HoldUps

    counts = HoldUps(start_budget_s=10)
    behind = {5: HoldUp.STARTS}
    for k in range(4 * 20):
        counts.look("w", behind, 600, now=k / 4, seeming={5: HoldUp.HOLDS})
        if counts.passed_over(5, now=k / 4):
            break
    assert GRACE_S + 10 + LOOK_CAP_S < k / 4 < GRACE_S + 10 + LOOK_CAP_S + 0.5
    assert counts.seconds(5, HoldUp.STARTS, now=k / 4) == 10  # not the 13 s kept apart: 5 minutes to half
    assert not counts.passed_over(5, now=k / 4 + LOOK_CAP_S + 301)


def test_holds_of_a_job_past_the_default_bound_are_counted_up_to_it_and_only_holds_stop():
    """Review of #24: holds were earned back as fast as they were counted at the default 10 minute bound, so a
    job that never runs held GPUs for ever. They are earned back only while nobody is held up."""
    from gpumagic.devices.hold_ups import RECOVERY_S, HoldUp, HoldUps

    counts = HoldUps()
    k = 0
    while not counts.passed_over(9, HoldUp.HOLDS, now=k / 4):  # held up 4 looks a second by its holds
        counts.look("w", {9: HoldUp.HOLDS}, 600, now=k / 4)
        k += 1
    assert 600 < k / 4 < 603 and not counts.passed_over(9, now=k / 4)  # its turns stand
    assert counts.passed_over(9, HoldUp.HOLDS, now=k / 4 + 0.4 * RECOVERY_S)
    assert not counts.passed_over(9, HoldUp.HOLDS, now=k / 4 + 0.6 * RECOVERY_S)


def test_another_users_job_past_the_bound_holds_gpus_only_while_other_users_hold_them(monkeypatch, tmp_path):
    """Issue #24: a forged job ticket past the backfill bound that asked for what no free GPU has held 3 of 4
    free GPUs for ever. Another user's job now holds GPUs only while leases or processes of other users than
    its own stand in its way: not on GPUs only its own user's processes use, not behind its own user's
    leases; and against a waiter for the bound at most, then that user's tickets are passed over."""
    import json

    from gpumagic.devices.hold_ups import HoldUp, hold_ups
    from gpumagic.devices.leases import Lease
    from gpumagic.devices.shared_files import owner_name

    bob = os.getuid() + 4242
    server = tmp_path / "server.json"
    used = {"pid": 4242, "user": owner_name(bob), "command": "python bob.py", "memory": "1GB"}
    server.write_text(json.dumps({"gpus": [{"model": "A100-80GB", "utilization": 0, "processes": [used]}] * 4}))
    monkeypatch.setenv("GPUMAGIC_SIMULATE", str(server))
    monkeypatch.setenv("GPUMAGIC_BACKFILL_BOUND", "0s")
    inventory = read_inventory()
    everything = Request(4, (), inventory[0].memory_total - (512 << 20))  # more than Bob's own processes leave
    forged = _ticket_file(bob, 1, "big", 0, "job", everything)
    assert _place_behind(inventory, [forged]).gpus  # before #24: every GPU held for it
    four = _ticket_file(bob, 1, "four", 0, "job", Request(4))
    own = Lease(inventory[0].uuid, "bob", 4321, time.time(), uid=bob)  # only Bob's own lease blocks it
    assert _place_behind(inventory, [four], {own.uuid: (own,)}).gpus
    theirs = dataclasses_replace(own, user="carol", uid=bob + 1)  # a lease of someone else's: it ends one day
    placed = _place_behind(inventory, [four], {own.uuid: (theirs,)})
    assert not placed.gpus and sorted(placed.reasons) == [0, 1, 2, 3]
    assert all("held for" in placed.reasons[i] for i in (1, 2, 3)), placed.reasons
    assert "hold GPUs for a job past the backfill bound: passed over if it lasts" in placed.explain()
    monkeypatch.setenv("GPUMAGIC_BACKFILL_BOUND", "300ms")  # held against this waiter for that long at most
    placed, _ = _looks_until_placed(inventory, lambda k: [four], {own.uuid: (theirs,)})
    assert placed.gpus and hold_ups().seconds(bob, HoldUp.HOLDS) >= 0.3


def test_a_jobs_ticket_asking_what_no_job_asks_is_untrusted():
    """Review of #24: a forged job ticket with ``max_util`` 0 held GPUs that a monitor kept 2% busy, as holds
    ignore business. Jobs never ask a utilization or a percentage: such a job's ticket is refused."""
    from gpumagic.devices.shared_files import Untrusted
    from gpumagic.devices.ticket_checks import checked_ticket

    for field, value in (("max_util", 0), ("min_free_percent", 50)):
        ticket = {"kind": "job", "name": "j", "request": {"count": 4, field: value}, "submitted_ns": 1}
        with pytest.raises(Untrusted, match="what no job asks"):
            checked_ticket(ticket)
        assert checked_ticket({**ticket, "kind": "pick"})["request"][field] == value


def dataclasses_replace(value, **changes):
    import dataclasses

    return dataclasses.replace(value, **changes)


def _exited_pid():
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


HOLDER = """
import fcntl, sys, time
fd = open(sys.argv[1], "rb")
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_a_tickets_holder_is_checked_against_what_the_ticket_says(tmp_path):
    """A waiting kernel's ticket counts only while held by the process it names, started before the ticket was
    made; a job's only while held by that job's runner (``python -m gpumagic.jobs.runner RUN_DIR``, the
    directory named as the ticket), started while its place held. ``/proc/locks`` and ``/proc`` say who holds it
    and since when: nothing the ticket's writer can set."""
    from gpumagic.devices.processes import process_start_time
    from gpumagic.devices.ticket_checks import TicketHolders

    def objection(path, uid, data, made, pids):
        return TicketHolders(30).objection(path, uid, data, made, pids)

    fake = tmp_path / "fake" / "gpumagic" / "jobs"
    fake.mkdir(parents=True)
    for init in (fake.parent / "__init__.py", fake / "__init__.py"):
        init.touch()
    (fake / "runner.py").write_text("import time\ntime.sleep(60)\n")
    path = tmp_path / "queue.0.pick-1.ab.json"
    path.write_text("{}")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    runner = subprocess.Popen([sys.executable, "-m", "gpumagic.jobs.runner", "/runs/run-j"], env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = process_start_time(holder.pid)
        made = int((started + 5) * 1e9)
        uid, pid = os.getuid(), holder.pid
        pick = {"kind": "pick", "pid": pid, "process_start": started}
        named = tmp_path / f"queue.{uid}.pick-{pid}.ab.json"
        assert objection(named, uid, pick, made, [pid]) is None
        assert objection(named, uid + 1, pick, made, [pid]) == "locked by a process of another user"
        early = int((started - 60) * 1e9)
        assert "started after the ticket was made" in objection(named, uid, pick, early, [pid])
        reused = {**pick, "process_start": started - 3600}
        assert "pid was reused" in objection(named, uid, reused, made, [pid])
        other = tmp_path / f"queue.{uid}.pick-{pid + 1}.ab.json"
        unnamed = {"kind": "pick"}
        assert objection(other, uid, unnamed, made, [pid]) == "held by another process than the kernel it names"
        assert "names no process, or two" in objection(other, uid, pick, made, [pid])
        job = {"kind": "job"}
        ticket = tmp_path / f"queue.{uid}.run-j.ab.json"
        assert "not that user's gpumagic runner of that job" in objection(ticket, uid, job, made, [pid])
        deadline = time.monotonic() + 10
        while process_start_time(runner.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        runner_start = process_start_time(runner.pid)
        assert objection(ticket, uid, job, int(runner_start * 1e9), [runner.pid]) is None
        another = tmp_path / f"queue.{uid}.run-k.ab.json"  # one runner holds its own job's ticket, no other
        assert "runner of that job" in objection(another, uid, job, int(runner_start * 1e9), [runner.pid])
        lapsed = int((runner_start - 100) * 1e9)
        assert "started after the ticket's place had lapsed" in objection(ticket, uid, job, lapsed, [runner.pid])
        assert objection(named, uid, pick, made, [pid, os.getpid()]) is None  # this process only probes it
        gone = _exited_pid()
        dead = {**pick, "pid": gone}
        assert objection(tmp_path / f"queue.{uid}.pick-{gone}.ab.json", uid, dead, made, [gone]) == "its kernel is gone"
        assert "runner of that job" in objection(ticket, uid, job, made, [gone])  # its child holds the lock
    finally:
        for process in (holder, runner):
            process.kill()
            process.wait()

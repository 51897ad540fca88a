"""Idle-aware leases in parts: the activity a kernel's records carry, rewritten in place; the administrator's
policy.toml and when it is honoured; the per-user cap in picks, ``use`` and the queue; which of a kernel's
GPUs a waiter would take; GPU use by a kernel's processes (NVML's per-process samples, the fake ``pynvml``).
Devices: simulated GPUs (``GPUMAGIC_SIMULATE``), or the fake NVML."""

import json
import os
import subprocess
import sys
import threading
import time
import zlib

import pytest

import gpumagic
from gpumagic.devices import activity as activity_module
from gpumagic.devices import idle_release, leases, nvml, placement, policy
from gpumagic.devices.activity import Activity
from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.lease_directory import lease_dir, listing
from gpumagic.devices.model import GpuInfo, GpuProcess, Inventory
from gpumagic.devices.status import gather_status
from gpumagic.jobs.queue import Request, Ticket, place, take
from gpumagic.widgets.status_table import render_text


@pytest.fixture
def tracked(monkeypatch):
    """This process as a kernel whose cells are watched (its records carry an activity), idle from now."""
    watched = activity_module.CellActivity()
    watched.track(running=False)
    monkeypatch.setattr(activity_module, "_activity", watched)
    monkeypatch.setattr(idle_release, "follow_leases", lambda: None)  # looks only when a test calls look()
    return watched


def as_root(text: str, mode: int = 0o644):
    """Write the lease directory's policy.toml as root's (the suite runs as root, as CI does)."""
    if os.geteuid() != 0:
        pytest.skip("a policy.toml gpumagic honours must belong to root: run the suite as root, as CI does")
    path = lease_dir() / "policy.toml"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def record_of(uuid: str) -> dict:
    (name,) = listing(lease_dir()).records[uuid]
    return json.loads((lease_dir() / name).read_text())


def test_an_activity_reads_back_and_a_torn_or_forged_one_reads_as_unknown():
    idle = Activity(False, 1_764_441_234.5)
    assert Activity.parse(idle.text()) == idle and idle.text().startswith("idle 1764441234.500000 ")
    busy = Activity(True, 1_764_441_299.25)
    assert Activity.parse(busy.text()) == busy and len(busy.text()) == len(idle.text())
    torn = idle.text()[:12] + busy.text()[12:]  # half of each, as a read racing a rewrite could see
    assert Activity.parse(torn) is None
    head = f"idle {time.time() + 3600:017.6f}"
    assert Activity.parse(f"{head} {zlib.crc32(head.encode()):08x}") is None  # idle from the future: no time
    assert Activity.parse(None) is None and Activity.parse(12) is None and Activity.parse("idle") is None
    assert Activity(False, time.time() - 90).idle_s() >= 90 and busy.idle_s() is None


def test_a_kernels_record_says_how_long_it_has_been_idle_and_a_cell_rewrites_only_that(simulated, tracked):
    gpu = gpumagic.pick(1).gpus[0]
    before = record_of(gpu.uuid)
    assert Activity.parse(before["activity"]).busy is False and list(before)[-1] == "activity"
    (lease,) = leases.read_view(leases.book()).on(gpu.uuid)
    assert lease.idle_s() is not None and ", idle <1m" in lease.describe()
    assert [leases.idle_for(s) for s in (59.9, 60, 3599, 3600, 11_520)] == ["<1m", "1m", "59m", "1h00m", "3h12m"]
    tracked.cell_started(leases.book().write_activity)
    after = record_of(gpu.uuid)
    assert Activity.parse(after["activity"]).busy is True
    assert {k: v for k, v in after.items() if k != "activity"} == {k: v for k, v in before.items() if k != "activity"}
    assert ", idle" not in leases.read_view(leases.book()).on(gpu.uuid)[0].describe()


SCRIPT = """
import json, gpumagic
from gpumagic.devices import leases
uuid = gpumagic.pick(1).gpus[0].uuid
(lease,) = leases.read_view(leases.book()).on(uuid)
print(json.dumps([lease.activity is None, lease.idle_s(), lease.describe()]))
"""


def test_a_process_whose_cells_nobody_watches_is_never_idle(simulated):
    """A script (no IPython kernel) writes no activity: others never see it idle."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    no_activity, idle, described = json.loads(out.stdout.strip().splitlines()[-1])
    assert no_activity and idle is None and "idle" not in described


def test_readers_never_lose_a_lease_while_its_activity_is_rewritten(simulated, tracked):
    """Only the activity's bytes are rewritten, in place: a reader racing thousands of rewrites always finds the
    lease (a torn activity at worst reads as unknown)."""
    uuid = gpumagic.pick(1).gpus[0].uuid
    stop = threading.Event()

    written = [tracked.now()]  # every activity the record held: the pick's, then each rewrite's

    def rewrite() -> None:
        while not stop.is_set():
            written.append(tracked.cell_started(leases.book().write_activity))
            written.append(tracked.cell_ended(leases.book().write_activity))

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        seen = [leases.read_view(leases.book()).on(uuid) for _ in range(500)]
    finally:
        stop.set()
        writer.join()
    assert all(len(found) == 1 and found[0].mine for found in seen)
    activities = [found[0].activity for found in seen]
    whole = {Activity.parse(a.text()) for a in written}  # as the record's text holds them: to the microsecond
    assert all(a is None or a in whole for a in activities)  # one that was written, or unknown
    assert sum(a is not None for a in activities) >= 400
    print(f"{len(written) - 1} rewrites while 500 reads of the leases ran")
    assert len(written) > 1000  # a race, not two turns


def test_a_policy_counts_only_when_root_alone_can_write_it(simulated, tmp_path):
    assert policy.read_policy() == policy.Policy()
    path = as_root('idle_release = "2h"\nmax_gpus_per_user = 2\n')
    honoured = policy.read_policy()
    assert (honoured.idle_release, honoured.max_gpus_per_user, honoured.problem) == (7200.0, 2, None)
    status = render_text(gather_status())
    assert f"Policy ({path}): an idle kernel's lease goes to a waiter after 2h00m; at most 2 GPUs per user" in status
    assert "policy.toml (not a file gpumagic writes)" not in status  # the administrator's file is no stranger's

    os.chmod(path, 0o664)
    assert policy.read_policy().problem == f"{path} is ignored: others than root may write it (chmod go-w)"
    assert policy.read_policy().max_gpus_per_user is None
    assert f"⚠ {path} is ignored: others than root may write it" in render_text(gather_status())
    os.chmod(path, 0o644)
    os.chown(path, 65534, -1)
    assert policy.read_policy().problem.endswith("not root") and policy.read_policy().idle_release is None
    path.unlink()
    (tmp_path / "elsewhere.toml").write_text("max_gpus_per_user = 0\n")
    path.symlink_to(tmp_path / "elsewhere.toml")
    assert policy.read_policy().problem == f"{path} is ignored: a symbolic link"
    assert "is ignored: a symbolic link" in repr(gpumagic.why(1))


@pytest.mark.parametrize(
    ("text", "kept", "problem"),
    [
        ('idle_release = "2 fortnights"', {}, "idle_release"),
        ('idle_release = "0.2s"', {}, "at least 1s"),
        ("max_gpus_per_user = -1", {}, "max_gpus_per_user must be a whole number"),
        ('max_gpus_per_user = "2"\nidle_release = "30m"', {"idle_release": 1800.0}, "max_gpus_per_user"),
        ("max_gpus_per_user = 1\ncolour = 'red'", {"max_gpus_per_user": 1}, "unknown field colour"),
        ("max_gpus_per_user = [", {}, "is ignored: it is not TOML"),
    ],
)
def test_a_bad_field_is_left_out_and_named_in_one_line(simulated, text, kept, problem):
    as_root(text + "\n")
    read = policy.read_policy()
    assert {f: getattr(read, f) for f in policy.FIELDS if getattr(read, f) is not None} == kept
    assert problem in read.problem and "\n" not in read.problem


HOLDER = """
import sys, gpumagic
print(gpumagic.pick(int(sys.argv[1])).indices, flush=True)
sys.stdin.readline()
"""


def test_the_cap_counts_every_process_of_the_user_and_refuses_picks_and_use(simulated):
    path = as_root("max_gpus_per_user = 2\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"(0,)"
        assert gpumagic.pick(1).indices == (1,)
        assert gpumagic.pick(1).indices == (1,)  # picking again replaces this kernel's own: still 2
        with pytest.raises(gpumagic.GpuCapError) as refused:
            gpumagic.pick(2)
        me = leases.current_user()
        assert str(refused.value) == (
            f"Refused: the administrator's policy ({path}) allows 2 GPUs per user: {me} holds 1 (GPU 0), and "
            "this asks 2; give some back first (%gpu release, or let a job end)"
        )
        with pytest.raises(gpumagic.GpuCapError, match="allows 2 GPUs per user"):
            gpumagic.use("2,3")
        assert "is refused: the administrator's policy" in repr(gpumagic.why(2))
        assert gpumagic.use("2").indices == (2,)
    finally:
        holder.kill()
        holder.wait()


def test_a_job_past_the_cap_waits_saying_so_and_does_not_hold_up_the_queue(simulated):
    as_root("max_gpus_per_user = 1\n")
    gpumagic.pick(1)
    capped = Ticket.create("capped", Request(1), time.time() - 10, key="run-capped")
    chosen, why = place(capped, read_inventory(), leases.book())
    assert chosen == [] and "waiting for 1 GPU — the administrator's policy" in why and "holds 1 (GPU 0)" in why
    outlook = repr(gpumagic.why(1))
    assert "job capped: 1 GPU, waiting" in outlook and "waits — the administrator's policy" in outlook
    gpumagic.release()
    chosen, why = place(capped, read_inventory(), leases.book())
    assert [g.nvml_index for g in chosen] == [0] and not why


def test_a_waiter_is_given_only_the_idle_gpus_it_would_start_on(monkeypatch):
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "2xA100-80GB")
    gpumagic.use("0,1")
    inventory = read_inventory()
    mine = set(leases.book().held())

    def wanted() -> dict:
        return idle_release.wanted_by_waiters(inventory, leases.read_view(leases.book()), mine)

    assert wanted() == {}  # nobody waits
    Ticket.create("small", Request(1, exclude=frozenset({0})), time.time() - 5, key="run-small")
    assert wanted() == {inventory[1].uuid: "job small"}
    Ticket.create("huge", Request(1, min_free=90 << 30), time.time() - 4, key="run-huge")
    assert set(wanted()) == {inventory[1].uuid}  # no GPU here has 90 GiB: giving one back starts nothing more
    gpumagic.use("0")
    assert idle_release.wanted_by_waiters(read_inventory(), leases.read_view(leases.book()), {inventory[0].uuid}) == {}


def test_a_waiter_leaves_the_queue_in_the_same_hold_of_the_lock_as_its_take(monkeypatch):
    """A second idle holder that looked after a waiter took one GPU, and before the waiter's ``pick`` or job runner
    removed its ticket, saw it still waiting and gave it a GPU it never took (a fresh-clone run: both holders of
    ``test_idle_leases`` said their lease was given away). This process is the waiter and the other holder."""
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "2xA100-80GB")
    gpumagic.use("1")  # the other holder's GPU
    inventory = read_inventory()
    other_holders = {inventory[1].uuid}
    request = Request(1)
    waiting = Ticket.create("waiter", request, time.time() - 5, key="run-waiter")
    assert idle_release.wanted_by_waiters(inventory, leases.read_view(leases.book()), other_holders) == {}  # GPU 0

    placed = placement.place_and_take(
        request, inventory, lambda gpus: take(list(gpus), request, leases.book()), waiting
    )
    assert [gpu.nvml_index for gpu in placed.gpus] == [0]
    view = leases.read_view(leases.book())  # before the waiter's own ``remove``: the window a look fell into
    assert view.tickets == ()
    assert idle_release.wanted_by_waiters(inventory, view, other_holders) == {}
    waiting.remove()  # as its owner does (``finally``): the descriptor closed, nothing else to remove


def test_gpu_use_by_the_kernels_own_processes_moves_its_idle_start():
    me, child = os.getpid(), os.getppid()
    uuid = "GPU-00000000-0000-0000-0000-000000000001"

    def on_gpu(*processes: GpuProcess) -> Inventory:
        return Inventory((GpuInfo(0, uuid, "A100", processes=processes),), "nvml", time.time())

    assert idle_release._used(on_gpu(GpuProcess(me, 1 << 30, utilization=35.0)), {uuid})
    assert not idle_release._used(on_gpu(GpuProcess(me, 1 << 30, utilization=0.0)), {uuid})
    assert not idle_release._used(on_gpu(GpuProcess(me, 1 << 30)), {uuid})  # NVML did not tell: not counted
    assert not idle_release._used(on_gpu(GpuProcess(child, 1 << 30, utilization=90.0)), {uuid})  # not ours
    assert not idle_release._used(on_gpu(GpuProcess(me, 1 << 30, utilization=90.0)), set())  # not our lease

    watched = activity_module.CellActivity()
    watched.track(running=False)
    later = time.time() + 5
    assert watched.gpu_used(later) == Activity(False, later)
    assert watched.gpu_used(later - 1) is None  # idle since later already
    watched.cell_started()
    assert watched.gpu_used(later + 1) is None  # busy: a cell runs


def test_nvml_per_process_samples_become_each_processes_utilization(fake_nvml):
    scenario = fake_nvml.DEFAULT_SCENARIO | {}
    first = scenario["gpus"][0]
    scenario["gpus"] = [dict(first, processes=[{"pid": 999991, "usedGpuMemory": 1 << 30, "sm_util": 42}])]
    fake_nvml.configure(scenario)
    assert nvml.read_inventory()[0].processes[0].utilization == 42.0
    scenario["gpus"] = [dict(first, processes=[{"pid": 999991, "usedGpuMemory": 1 << 30}])]
    fake_nvml.configure(scenario)
    nvml.reset()  # the fake starts afresh: NVML is started again
    assert nvml.read_inventory()[0].processes[0].utilization == 0.0  # no sample: NVML's NOT_FOUND, nobody busy
    fake_nvml.configure(scenario | {"process_utilization": "unsupported"})
    nvml.reset()
    assert nvml.read_inventory()[0].processes[0].utilization is None


def test_a_look_gives_back_only_past_the_threshold_while_someone_waits_and_the_next_cell_hears_once(
    monkeypatch, tracked, capsys
):
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "2xA100-80GB")
    gpumagic.use("0,1")
    inventory = read_inventory()
    later = time.time() + 10  # looks as if idle for 10 s, without waiting for it
    assert idle_release.look(later) == ()  # no policy
    path = as_root('idle_release = "5s"\n')
    assert idle_release.look(later) == ()  # nobody waits
    Ticket.create("first", Request(1, exclude=frozenset({0})), time.time() - 5, key="run-first")
    assert idle_release.look(time.time() + 1) == ()  # idle 1 s of the 5
    assert idle_release.look(later) == (inventory[1].uuid,)
    assert leases.book().held() == (inventory[0].uuid,)
    Ticket.create("second", Request(1), time.time() - 4, key="run-second")
    assert idle_release.look(later) == (inventory[0].uuid,)  # a second waiter before the next cell
    idle_release._cell_started(None)
    told = capsys.readouterr().err
    assert told == (
        "gpumagic: this kernel's lease on GPUs 0, 1 was given to job first, job second, who waited, after this "
        f"kernel was idle 5s ({path}: idle_release); CUDA_VISIBLE_DEVICES still names them: %gpu pick to pick "
        "again\n"
    )
    idle_release._cell_started(None)
    assert capsys.readouterr().err == ""  # once


def test_a_look_gives_nothing_while_a_cell_runs_or_after_one_started(monkeypatch, tracked):
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "1xA100-80GB")
    as_root('idle_release = "1s"\n')
    gpumagic.pick(1)
    Ticket.create("waiting", Request(1), time.time() - 5, key="run-waiting")
    seen = tracked.now()
    tracked.cell_started()
    assert idle_release.look(time.time() + 10) == ()  # busy
    tracked.cell_ended()
    assert tracked.if_unchanged(seen, lambda: "released") is None  # a look that saw the earlier idle gives nothing
    assert len(leases.book().held()) == 1


def test_a_front_ends_own_executions_do_not_change_the_idle_start(tracked):
    idle_since = tracked.now()

    class Info:
        store_history = False

    class Result:
        info = Info()

    idle_release._cell_started(Info())
    idle_release._cell_ended(Result())
    assert tracked.now() == idle_since
    idle_release._cell_started(None)
    assert tracked.now().busy


def test_the_cap_counts_gpus_used_with_force_and_a_request_past_it_can_never_start(simulated):
    as_root("max_gpus_per_user = 1\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"(0,)"
        with pytest.raises(gpumagic.GpuLeasedError):
            gpumagic.use("0")  # leased by another process: that error first, as before
        with pytest.raises(gpumagic.GpuCapError, match=r"allows 1 GPU per user: .* holds 1 \(GPU 0\)"):
            gpumagic.use("0", force=True)  # a GPU used without a lease counts too
        started = time.monotonic()
        with pytest.raises(gpumagic.GpuCapError, match="allows 1 GPU per user and this asks 2: it cannot start"):
            gpumagic.pick(2, wait="30s")  # more than the cap: no use waiting
        assert time.monotonic() - started < 5
        with pytest.raises(gpumagic.GpuCapError, match="holds 1 \\(GPU 0\\), and this asks 1"):
            gpumagic.pick(1, wait="1s")  # waits while the user is at the cap, then says why
    finally:
        holder.kill()
        holder.wait()
    assert gpumagic.pick(1, wait="30s").indices in ((0,), (1,))


def test_a_hard_link_to_another_root_file_is_no_policy(simulated, tmp_path):
    as_root("max_gpus_per_user = 0\n")
    os.link(lease_dir() / "policy.toml", tmp_path / "another-name")
    assert policy.read_policy().problem.endswith("is ignored: it has 2 names (a hard link)")
    (tmp_path / "another-name").unlink()
    assert policy.read_policy().max_gpus_per_user == 0


def test_the_looking_thread_runs_only_while_the_kernel_holds_leases(simulated, monkeypatch):
    watched = activity_module.CellActivity()
    watched.track(running=False)
    monkeypatch.setattr(activity_module, "_activity", watched)
    monkeypatch.setattr(idle_release, "LOOK_S", 0.05)

    def looking() -> bool:
        return any(t.name == "gpumagic-idle-leases" for t in threading.enumerate())

    gpumagic.pick(1)
    assert looking()
    gpumagic.release()
    deadline = time.monotonic() + 10
    while looking() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not looking()  # an idle kernel without leases runs nothing of gpumagic's


def test_the_notebooks_gpu_table_shows_the_idle_time_where_the_lease_cell_is_not_cut(simulated, tracked):
    """The HTML lease cell is cut at 12em (in full under the mouse): the idle time comes first in it."""
    from gpumagic.widgets.status_table import render_html

    gpumagic.pick(1)
    page = render_html(gather_status())
    assert ">idle &lt;1m · leased by this kernel since " in page  # escaped, as every cell
    assert "title='leased by this kernel since " in page and ", idle &lt;1m'" in page  # the tooltip as %gpu says it

"""Leases across processes: exclusive, visible to others, reclaimed when the holder dies."""

import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap

import psutil
import pytest

import gpumagic
from gpumagic.devices import lease_directory, leases, pick_lock
from gpumagic.devices.processes import current_user
from gpumagic.errors import LeaseDirectoryError, NotEnoughGpusError
from gpumagic.widgets.status_table import render_text

CONTESTANT = textwrap.dedent(
    """
    import sys, gpumagic
    for line in sys.stdin:
        command = line.strip()
        try:
            if command == "pick":
                print("picked", ",".join(gpumagic.pick(2).uuids), flush=True)
            elif command == "release":
                gpumagic.release(); print("released", flush=True)
        except gpumagic.NotEnoughGpusError:
            print("picked", flush=True)
    """
)


def contestant(env):
    return subprocess.Popen(
        [sys.executable, "-c", CONTESTANT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def test_two_processes_picking_at_once_never_share_a_gpu(simulated, no_leftover_children):
    env = dict(os.environ, GPUMAGIC_SIMULATE="3xA100-80GB")  # 3 GPUs for 2x2 wanted: someone must lose
    players = [contestant(env) for _ in range(2)]
    try:
        for _ in range(60):
            for p in players:
                p.stdin.write("pick\n")
                p.stdin.flush()
            answers = [p.stdout.readline().split()[1:] for p in players]
            sets = [set(a[0].split(",")) if a else set() for a in answers]
            assert not sets[0] & sets[1], f"both leased {sets[0] & sets[1]}"
            assert sorted(len(s) for s in sets) == [0, 2]  # one gets two, the other a clear failure
            for p in players:
                p.stdin.write("release\n")
                p.stdin.flush()
                assert p.stdout.readline().strip() == "released"
    finally:
        for p in players:
            p.stdin.close()
            p.wait(10)


def test_a_killed_holders_lease_is_reclaimed(simulated, isolated_leases, no_leftover_children):
    holder = contestant(dict(os.environ))
    holder.stdin.write("pick\n")
    holder.stdin.flush()
    taken = holder.stdout.readline().split()[1].split(",")
    status = gpumagic.status().status
    assert {u for u, held in status.leases.items() for lease in held if lease.pid == holder.pid} == set(taken)
    with pytest.raises(NotEnoughGpusError, match="leased by"):
        gpumagic.pick(3)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert set(gpumagic.pick(4).uuids) >= set(taken)
    # the dead holder's records were cleaned up (same user); ours remain
    records = sorted(p.name for p in isolated_leases.glob("GPU-*.json"))
    assert len(records) == 4 and all(f".{os.getuid()}.{os.getpid()}." in r for r in records)


def test_release_gives_gpus_back_and_removes_records(simulated, isolated_leases):
    gpumagic.pick(2)
    assert len(list(isolated_leases.glob("GPU-*.json"))) == 2
    assert len(gpumagic.release()) == 2
    assert not list(isolated_leases.glob("GPU-*.json"))
    assert leases.book().held() == ()


def test_forged_records_are_ignored(simulated, isolated_leases, no_leftover_children):
    holder = contestant(dict(os.environ))
    holder.stdin.write("pick\n")
    holder.stdin.flush()
    uuid = holder.stdout.readline().split()[1].split(",")[0]
    forged = isolated_leases / f"{uuid}.{os.getuid() + 4242}.{os.getpid()}.abc123.json"  # in another uid's name
    forged.write_text(json.dumps({"uuid": uuid, "user": "mallory", "pid": os.getpid(), "since": 0}))
    with open(forged) as handle:  # locked, as a live holder's record is
        fcntl.flock(handle, fcntl.LOCK_EX)
        with pick_lock.pick_lock(exclusive=False):
            (lease,) = leases.read_view(leases.book()).on(uuid)
    assert lease.pid == holder.pid and lease.user != "mallory"
    assert "named as" in gpumagic.status().status.ignored[forged.name]
    holder.stdin.close()
    holder.wait(10)


def test_files_are_readable_by_other_users_whatever_the_umask(simulated, isolated_leases):
    old = os.umask(0o077)
    try:
        gpumagic.pick(1)
    finally:
        os.umask(old)
    for path in isolated_leases.iterdir():
        if path.suffix in (".lock", ".json"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_an_unsafe_shared_directory_is_refused(tmp_path, monkeypatch, simulated):
    unsafe = tmp_path / "shared"
    unsafe.mkdir()
    os.chmod(unsafe, 0o777)
    monkeypatch.setenv("GPUMAGIC_LEASE_DIR", str(unsafe))
    with pytest.raises(LeaseDirectoryError, match="sticky"):
        gpumagic.pick(1)
    os.chmod(unsafe, 0o1777)
    assert gpumagic.pick(1).indices == (0,)


def test_the_default_directory_is_made_shared_and_sticky(tmp_path, monkeypatch):
    target = tmp_path / "gpumagic-leases"
    monkeypatch.delenv("GPUMAGIC_LEASE_DIR")
    monkeypatch.setattr(lease_directory, "DEFAULT_LEASE_DIR", str(target))
    assert lease_directory.lease_dir() == target
    assert stat.S_IMODE(target.stat().st_mode) == 0o1777


def test_a_lease_directory_of_another_user_or_group_writable_is_refused(tmp_path, monkeypatch, simulated):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory to another uid")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o1777)
    os.chown(theirs, 4242, 4242)  # any user but root and us could remove our leases there
    monkeypatch.setenv("GPUMAGIC_LEASE_DIR", str(theirs))
    with pytest.raises(LeaseDirectoryError, match="belongs to uid 4242, who could remove your leases; ask an admin"):
        gpumagic.pick(1)
    assert list(theirs.iterdir()) == []
    assert gpumagic.status().status.lease_problem.startswith(f"the lease directory {theirs} belongs to uid 4242")
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, 0o770)
    monkeypatch.setenv("GPUMAGIC_LEASE_DIR", str(group))
    with pytest.raises(LeaseDirectoryError, match="writable by others without the sticky bit"):
        gpumagic.pick(1)
    link = tmp_path / "link"
    link.symlink_to(group)
    monkeypatch.setenv("GPUMAGIC_LEASE_DIR", str(link))
    with pytest.raises(LeaseDirectoryError, match="is a symbolic link"):
        gpumagic.pick(1)


def test_status_names_what_it_ignored_in_the_lease_directory_once(simulated, isolated_leases):
    uuid = gpumagic.pick(1).uuids[0]
    os.mkfifo(isolated_leases / f"{uuid}.{os.getuid()}.1.abc.json")
    (isolated_leases / f"{uuid}.{os.getuid()}.2.abc.json").symlink_to("/dev/zero")
    (isolated_leases / "pick.lock").write_text("")
    text = render_text(gpumagic.status().status)
    line = [row for row in text.splitlines() if "ignored" in row]
    assert len(line) == 1, text
    assert line[0] == (
        f"⚠ ignored in the lease directory: {uuid}.{os.getuid()}.1.abc.json (a FIFO); {uuid}.{os.getuid()}.2.abc.json "
        "(a symbolic link); pick.lock (not a file gpumagic writes)"
    )
    (isolated_leases / "pick.lock").unlink()
    assert "pick.lock" not in render_text(gpumagic.status().status)  # named while it is there, not after


def pick_lock_holder(seconds: float) -> subprocess.Popen:
    """Another process of this user that takes the pick lock and keeps it ``seconds``; returns once it holds it."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from gpumagic.devices.pick_lock import pick_lock\n"
            "with pick_lock():\n    print('held', flush=True); time.sleep(float(sys.argv[1]))",
            str(seconds),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_the_pick_lock_held_elsewhere_makes_pick_say_busy_in_one_line(simulated, isolated_leases, monkeypatch):
    holder = pick_lock_holder(30)
    try:
        monkeypatch.setattr(pick_lock, "PICK_LOCK_WAIT_S", 0.3)
        with pytest.raises(pick_lock.LeaseBusy) as caught:
            with pick_lock.pick_lock(wait_s=0.3):
                pass
        assert str(caught.value).startswith(
            f"the GPU lease directory is busy: {current_user()}'s process {holder.pid} has kept its pick lock"
        )
        assert "\n" not in str(caught.value)
        assert gpumagic.status().status.lease_problem.startswith("the GPU lease directory is busy")
    finally:
        holder.kill()
        holder.wait()
    assert gpumagic.pick(1).indices == (0,)


def test_pick_with_wait_waits_out_a_busy_lease_directory(simulated, isolated_leases, monkeypatch):
    holder = pick_lock_holder(1.5)
    monkeypatch.setattr(pick_lock, "PICK_LOCK_WAIT_S", 0.2)
    heard = []
    assert gpumagic.pick(1, wait="30s", on_wait=heard.append).indices == (0,)
    assert (
        heard[0] == f"Waiting for the GPU lease directory: {current_user()}'s process {holder.pid} keeps its pick lock"
    )
    holder.wait(10)


def test_a_record_locked_after_its_holders_death_is_no_lease(simulated, isolated_leases, no_leftover_children):
    """A neighbour waiting in flock() on a holder's record gets the lock when the holder dies: the record
    names a dead process, so the GPU is free (and not 'leased by' the dead kernel for ever)."""
    holder = contestant(dict(os.environ))
    holder.stdin.write("pick\n")
    holder.stdin.flush()
    taken = holder.stdout.readline().split()[1].split(",")
    record = next(p for p in isolated_leases.glob(f"{taken[0]}.*.json"))
    waiter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl, time\nf = open({str(record)!r})\nfcntl.flock(f, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\ntime.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert waiter.stdout.readline().strip() == "locked"  # the neighbour holds the dead kernel's record
        assert set(gpumagic.pick(4).uuids) >= set(taken)
    finally:
        waiter.kill()
        waiter.wait()


def test_records_and_tickets_with_poisoned_fields_are_ignored(simulated, isolated_leases):
    """Fields a neighbour can write within the size cap: nesting deep enough for a RecursionError, Infinity,
    unhashable UUIDs, a time no clock can show. Nothing raises; each file is named as ignored."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make files of another uid")
    uuid = gpumagic.gpus().gpus[1].uuid
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = psutil.Process(sleeper.pid).create_time()
    planted = {
        f"{uuid}.4242.1.abc.json": "[" * 30000 + "]" * 30000,
        f"{uuid}.4242.{sleeper.pid}.def.json": json.dumps({"since": 1e300, "process_start": start}),
        "queue.4242.run-a.abc.json": '{"name": "a", "request": {"count": Infinity}, "submitted_ns": 1}',
        "queue.4242.run-b.abc.json": '{"name": "b", "request": {"uuids": [[1]]}, "submitted_ns": Infinity}',
        "queue.4242.run-c.abc.json": '{"name": "c", "request": {"count": 1, "min_free": "x"}}',
    }
    locks = []
    try:
        for name, text in planted.items():
            (isolated_leases / name).write_text(text)
            os.chown(isolated_leases / name, 4242, 4242)
        handle = open(isolated_leases / f"{uuid}.4242.{sleeper.pid}.def.json")
        locks.append(handle)
        fcntl.flock(handle, fcntl.LOCK_EX)  # held, as a live holder's record is
        from gpumagic.jobs.queue import waiting_tickets

        assert waiting_tickets() == []
        status = gpumagic.status().status
        assert gpumagic.pick(4).indices == (0, 1, 2, 3)
        assert status.ignored[f"{uuid}.4242.1.abc.json"] == "not a JSON record"
        assert status.ignored[f"{uuid}.4242.{sleeper.pid}.def.json"] == "a record with malformed fields"
        for name in ("queue.4242.run-a.abc.json", "queue.4242.run-b.abc.json", "queue.4242.run-c.abc.json"):
            assert status.ignored[name] == "a ticket with malformed fields", name
    finally:
        for handle in locks:
            handle.close()
        sleeper.kill()
        sleeper.wait()


def test_thousands_of_junk_files_are_counted_and_named_escaped_on_one_line(simulated, isolated_leases):
    """Issue #24: 40,000 junk files made %gpu take 0.71 s; their names come from anyone and may hold escapes."""
    for n in range(2000):
        (isolated_leases / f"junk-{n:04}").touch()
    (isolated_leases / "\x1b[31mA\nB").touch()
    gpumagic.pick(1)
    text = render_text(gpumagic.status().status)
    line = [row for row in text.splitlines() if "ignored" in row]
    assert len(line) == 1 and "\x1b" not in text, text
    assert line[0] == (
        "⚠ ignored in the lease directory: \\x1b[31mA\\nB (not a file gpumagic writes); junk-0000 (not a file gpumagic "
        "writes); junk-0001 (not a file gpumagic writes); junk-0002 (not a file gpumagic writes); junk-0003 (not a "
        "file gpumagic writes); and 1996 more"
    )

"""A runs directory shared with a neighbour (issue #12, attack 1): two real Unix users, Alice and Bob.

Bob can write the shared runs directory. He swaps Alice's new job directory for his own (whose run.json names
his ``cloudpickle.py`` in ``sys_path``), plants a job of his own under Alice's job name and a lock Alice
cannot open. None of it may run his code as Alice, hang or break her submission, or let him read her result:
a runs directory he could use so is refused in one line; in a sticky one, her runs are hers (0700, files
0600 whatever her umask), and her runner runs only what her key sealed.
"""

import grp
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumagic.jobs.api import Job
from gpumagic.jobs.queue import Request
from gpumagic.launch.shipping import pack, ship_function
from gpumagic.run_dirs import records
from tests.two_users import shared_directory

pytestmark = [pytest.mark.usefixtures("no_job_left_running"), pytest.mark.slow]  # two real users: seconds each

SIMULATED = "4xA100-80GB"  # the jobs run on the CPU (gpus=0); the machine is stated all the same

PLANTED_CLOUDPICKLE = """
import os
import shutil
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"ran-as-{os.getuid()}"), "w") as marker:
    marker.write("Bob's code ran")
raise ImportError("Bob's cloudpickle")
"""

SWAPPER = r"""
import json, os, sys, time
root, lib, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
me = os.getuid()
seen = set(os.listdir(root))
done = []
print("ready", flush=True)
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name in seen:
            continue
        seen.add(name)
        try:
            if os.lstat(path).st_uid == me:
                continue
            os.rename(path, os.path.join(root, "stolen-" + name))
        except OSError as err:
            done.append(f"{name}: {err.strerror}")
            continue
        seen.add("stolen-" + name)
        os.mkdir(path)
        os.chmod(path, 0o777)
        info = {"id": name, "kind": "job", "name": "train", "status": "queued", "reason": "starting",
                "submitted": time.time(), "ranks": 1, "request": {"count": 0, "uuids": [], "min_free": None},
                "after": [], "sys_path": [lib], "cwd": lib}
        for file in ("run.json", "job.json"):
            with open(os.path.join(path, file), "w") as handle:
                json.dump(info, handle)
            os.chmod(os.path.join(path, file), 0o666)
        done.append(f"{name}: swapped")
    time.sleep(0.001)
print(json.dumps(done), flush=True)
"""

ALICE_SUBMITS = """
import json, os
import gpumagic

os.umask(0)  # the runs must be private whatever the umask
out = {}

def train():
    return {"secret": 42}

try:
    job = gpumagic.jobs_with(gpus=0, name="train").submit(train)
except gpumagic.GpumagicError as err:
    out["refused"] = f"{type(err).__name__}: {err}"
else:
    out["status"] = job.wait("90s")
    out["reason"] = job.reason
    out["path"] = str(job.path)
    out["result"] = job.result() if out["status"] == "finished" else None
    out["found"] = str(gpumagic.job("train").path)
    out["names"] = [j.name for j in gpumagic.list_jobs()]
print(json.dumps(out))
"""


def settings(user, root: Path) -> dict[str, str]:
    return {
        "GPUMAGIC_RUNS_DIR": str(root),
        "GPUMAGIC_LEASE_DIR": str(user.home / "leases"),
        "GPUMAGIC_SIMULATE": SIMULATED,
    }


def plant_library(bob, root: Path) -> Path:
    """Bob's directory in the shared runs directory, with his ``cloudpickle.py``, writable by all."""
    lib = root / "bob-lib"
    out = bob.sh(f"mkdir -m 777 {lib} && chmod 777 {lib}")
    assert out.returncode == 0, out.stderr
    out = bob.run(f"open({str(lib / 'cloudpickle.py')!r}, 'w').write({PLANTED_CLOUDPICKLE!r})")
    assert out.returncode == 0, out.stderr
    return lib


def start_swapper(bob, root: Path, lib: Path, seconds: float):
    swapper = bob.popen([bob.python, "-c", SWAPPER, str(root), str(lib), str(seconds)])
    assert swapper.stdout.readline().decode().strip() == "ready"
    return swapper


def swapper_report(swapper) -> list[str]:
    output, _ = swapper.communicate(timeout=60)
    return json.loads(output.decode().strip().splitlines()[-1])


def test_a_runs_directory_a_neighbour_can_write_is_refused_and_his_swap_runs_nothing(two_users, shared_tmp):
    alice, bob = two_users
    root = shared_directory(shared_tmp / "runs", 0o777)  # writable by all, not sticky: Bob can rename in it
    lib = plant_library(bob, root)
    swapper = start_swapper(bob, root, lib, seconds=8)
    out = alice.json(ALICE_SUBMITS, timeout=120, **settings(alice, root))
    swapper_report(swapper)
    assert not list(lib.glob("ran-as-*")), f"Bob's cloudpickle.py ran as Alice ({out})"
    refusal = out.get("refused", "")
    assert refusal.startswith("RunsDirectoryError: the runs directory"), out
    assert f"{root} can be written by everyone (mode 777, not sticky)" in refusal and "chmod 1777" in refusal
    assert "\n" not in refusal
    assert not [p for p in root.iterdir() if p.stat().st_uid == alice.uid], "nothing of Alice's is written there"

    owned_by_bob = shared_tmp / "bobs"
    shared_directory(owned_by_bob, 0o1777)
    os.chown(owned_by_bob, bob.uid, bob.gid)  # sticky, but its owner may rename anything in it
    refused = alice.json(
        """
        import json, gpumagic
        out = {}
        def f():
            return 1
        for name, call in (("submit", lambda: gpumagic.jobs_with(gpus=0).submit(f)),
                           ("launch_ddp", lambda: gpumagic.launch_ddp(f, 1, gpus="none", runs_dir=ROOT))):
            try:
                call()
            except gpumagic.GpumagicError as err:
                out[name] = f"{type(err).__name__}: {err}"
        print(json.dumps(out))
        """.replace("ROOT", repr(str(owned_by_bob))),
        **settings(alice, owned_by_bob),
    )
    for message in refused.values():
        assert message.startswith("RunsDirectoryError: the runs directory") and "\n" not in message
        assert f"{owned_by_bob} belongs to user {bob.name}" in message
    assert sorted(refused) == ["launch_ddp", "submit"]
    assert os.listdir(owned_by_bob) == []


def test_in_a_sticky_runs_directory_a_neighbour_cannot_swap_plant_or_read_a_job(two_users, shared_tmp):
    alice, bob = two_users
    root = shared_directory(shared_tmp / "runs", 0o1777)  # as an administrator makes /tmp
    lib = plant_library(bob, root)
    bob_job = bob.json(  # a job of Bob's own, named as Alice will name hers, readable by all
        """
        import json, os, gpumagic
        def f():
            return "bob's"
        job = gpumagic.jobs_with(gpus=0, name="train").submit(f)
        job.wait("60s")
        os.chmod(job.path, 0o755)
        for each in job.path.iterdir():
            os.chmod(each, 0o755)
        print(json.dumps({"path": str(job.path)}))
        """,
        timeout=120,
        **settings(bob, root),
    )
    out = bob.sh(f"umask 077 && : > {root}/.jobs.lock")  # a lock file Alice cannot open, where it used to be
    assert out.returncode == 0, out.stderr
    swapper = start_swapper(bob, root, lib, seconds=8)

    out = alice.json(ALICE_SUBMITS, timeout=120, **settings(alice, root))

    report = swapper_report(swapper)
    assert not list(lib.glob("ran-as-*")), f"Bob's cloudpickle.py ran as Alice ({out})"
    assert out["status"] == "finished" and out["result"] == {"secret": 42}, out
    job = Path(out["path"])
    assert out["found"] == out["path"] != bob_job["path"] and out["names"] == ["train"], "Bob's job is not hers"
    assert f"{job.name}: Operation not permitted" in report, report
    found = {p.relative_to(job): p.lstat() for p in [job, *job.rglob("*")]}
    assert {"run.json", "job.json", "payload.pkl", "output.log", "runner.log", "result.pkl"} <= set(map(str, found))
    for path, info in found.items():
        assert info.st_uid == alice.uid
        wanted = 0o700 if stat.S_ISDIR(info.st_mode) else 0o600
        assert stat.S_IMODE(info.st_mode) == wanted, f"{path} is {stat.S_IMODE(info.st_mode):o} under umask 0"
    peek = bob.run(f"open({str(job / 'result.pkl')!r}, 'rb').read()")
    assert "PermissionError" in peek.stderr


def test_a_home_writable_by_a_private_group_is_safe_and_one_shared_with_a_neighbour_is_not(two_users):
    """With umask 002 (Debian and Ubuntu give it to users with a group of their own) a user's directories are
    group-writable: safe while the group is theirs alone, refused once a neighbour is in it."""
    alice, bob = two_users
    code = """
        import json, os, gpumagic
        os.umask(0o002)
        os.makedirs(os.path.expanduser("~/.local/state"), exist_ok=True)
        os.chmod(os.path.expanduser("~"), 0o775)
        def f():
            return 7
        try:
            job = gpumagic.jobs_with(gpus=0).submit(f)
            print(json.dumps({"status": job.wait("90s"), "result": job.result()}))
        except gpumagic.GpumagicError as err:
            print(json.dumps({"refused": str(err)}))
        """
    env = {"GPUMAGIC_LEASE_DIR": str(alice.home / "leases"), "GPUMAGIC_SIMULATE": SIMULATED}
    assert alice.json(code, timeout=120, **env) == {"status": "finished", "result": 7}
    group = grp.getgrgid(alice.gid).gr_name
    subprocess.run(["usermod", "-a", "-G", group, bob.name], check=True)
    refused = alice.json(code, timeout=120, **env)["refused"]
    assert f"{alice.home}/.local/state can be written by group {group} (mode 775, not sticky)" in refused, refused


def test_a_home_writable_by_a_group_of_no_one_else_is_safe(two_users):
    """A container's home in a shared group such as ``users`` (Zero to JupyterHub: /home/jovyan, 2775): the
    group has no member but its user, so the home is still theirs alone; once another user is in it, refused."""
    alice, bob = two_users
    group = f"gmg{alice.name[3:]}"
    subprocess.run(["groupadd", group], check=True)
    try:
        subprocess.run(["chgrp", "-R", group, str(alice.home)], check=True)
        code = """
            import json, os, gpumagic
            os.chmod(os.path.expanduser("~"), 0o2775)
            try:
                print(json.dumps({"run": gpumagic.launch_ddp(lambda: 1, nprocs=1, gpus="none")[0]}))
            except gpumagic.GpumagicError as err:
                print(json.dumps({"refused": str(err)}))
            """
        assert alice.json(code, timeout=120) == {"run": 1}
        subprocess.run(["usermod", "-a", "-G", group, bob.name], check=True)
        refused = alice.json(code, timeout=120)["refused"]
        assert f"{alice.home} can be written by group {group} (mode 775, not sticky)" in refused, refused
    finally:
        subprocess.run(["groupdel", group], capture_output=True)


def answer():
    return 42


def test_the_runner_runs_only_what_the_sealed_description_names(tmp_path):
    """run.json is the job's record, not its instructions: a sys_path written into it is not imported from, and
    a description without the user's seal is refused before anything of it is imported."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "cloudpickle.py").write_text(PLANTED_CLOUDPICKLE)
    jobs = []
    for name in ("edited-record", "unsealed-description"):
        with records.names_locked():
            path = records.create(
                name,
                pack(ship_function(answer, (), {}, rank_first=False)),
                request=Request(0).to_json(),
                sys_path=[p for p in sys.path if p],
                cwd=os.getcwd(),
            )
        records.update(path, sys_path=[str(planted), *sys.path])  # as one who can write run.json would
        jobs.append(Job(path))
    description = jobs[1].path / "job.json"
    description.write_text(json.dumps({"id": jobs[1].path.name, "name": "x", "sys_path": [str(planted)]}))
    root = str(Path(records.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for job in jobs:  # started as submit starts it
        subprocess.run([sys.executable, "-m", "gpumagic.jobs.runner", str(job.path)], env=env, check=True)
    assert [job.wait("60s") for job in jobs] == ["finished", "failed"]
    assert jobs[0].result() == 42
    assert jobs[1].reason.startswith(f"the description of job {jobs[1].path.name} ({description}) is not sealed")
    assert not list(planted.glob("ran-as-*"))
    assert time.time() - jobs[1].info["ended"] < 60


def test_the_runner_refuses_a_directory_that_is_not_the_users_own(tmp_path):
    """Before it reads anything of a job, the runner checks the directory is the user's own, 0700, not a link."""
    jobs = []
    for name in ("opened-up", "linked"):
        with records.names_locked():
            jobs.append(
                records.create(
                    name,
                    pack(ship_function(answer, (), {}, rank_first=False)),
                    request=Request(0).to_json(),
                    sys_path=[p for p in sys.path if p],
                    cwd=os.getcwd(),
                )
            )
    os.chmod(jobs[0], 0o755)
    link = jobs[1].with_name(jobs[1].name + "-link")
    link.symlink_to(jobs[1])
    root = str(Path(records.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for path in (jobs[0], link):
        out = subprocess.run(
            [sys.executable, "-m", "gpumagic.jobs.runner", str(path)], env=env, capture_output=True, text=True
        )
        assert out.stderr == (
            f"gpumagic: the job at {path} will not run: {path} is not a run directory of yours that only you can use "
            "(a directory you own, mode 700): nothing of it is trusted\n"
        )
    for path in jobs:
        info = records.read(path)
        assert info["status"] == "queued" and "runner_pid" not in info, "nothing of it ran"
        shutil.rmtree(path)  # no runner will ever end them


def _launch_files_modes():
    import os
    import stat
    from pathlib import Path

    launch = Path(os.environ["GPUMAGIC_RUN_DIR"]) / "launch"
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [launch, *launch.iterdir()] if not p.name.endswith(".tmp")}


def _fail():
    raise ValueError("on purpose")


def test_a_launchs_files_are_private_whatever_the_umask(tmp_path):
    """The ranks' directory of a %%launch_ddp (payload, results, failure reports) is 0700, its files 0600."""
    import gpumagic

    old = os.umask(0o002)
    try:
        modes = gpumagic.launch_ddp(_launch_files_modes, nprocs=1, gpus="none")[0]
        with pytest.raises(gpumagic.LaunchError, match="on purpose"):
            gpumagic.launch_ddp(_fail, nprocs=1, gpus="none")
    finally:
        os.umask(old)
    assert modes.pop("launch") == 0o700
    assert modes and all(mode & 0o077 == 0 for mode in modes.values()), modes

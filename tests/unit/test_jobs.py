"""Background jobs with real runners on simulated GPUs: the queue, sharing with settling, results, failures,
kills of whole process trees, --after ordering, and the API's checks."""

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

import gpumagic
from gpumagic.launch.plan import threads_per_rank
from gpumagic.run_dirs import records
from gpumagic.run_dirs.layout import RunFiles

pytestmark = pytest.mark.usefixtures("no_job_left_running")


def wait_until(predicate, timeout=60.0, every=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError("timed out")


def variant(k, seconds=3.0):
    import time

    for step in range(4):
        gpumagic.log(loss=k / (step + 1))
        time.sleep(seconds / 4)
    return k * 10


@pytest.mark.slow
def test_four_variants_run_at_once_and_a_fifth_waits_for_a_free_gpu(simulated):
    jobs = [gpumagic.jobs_with(name=f"A{k}").submit(variant, k) for k in range(5)]
    reasons = set()
    while jobs[4].status == "queued":
        reasons.add(jobs[4].reason)
        time.sleep(0.05)
    assert [j.wait("2m") for j in jobs] == ["finished"] * 5
    infos = [j.info for j in jobs]
    first = infos[:4]
    assert max(i["started"] for i in first) < min(i["ended"] for i in first), "the four ran at the same time"
    assert sorted(i["gpus"][0] for i in first) == [0, 1, 2, 3]
    assert infos[4]["started"] >= min(i["ended"] for i in first), "the fifth started when a GPU was free"
    assert any(r.startswith("waiting for 1 GPU — GPU 0: leased by") and "job A" in r for r in reasons), reasons
    assert [j.result() for j in jobs] == [0, 10, 20, 30, 40]
    assert [len(j.metrics()[0]["loss"]) for j in jobs] == [4] * 5
    assert jobs[1].last_metrics() == {"loss": (3.0, 0.25)}


@pytest.mark.slow
def test_why_a_job_waits_shows_from_its_submission_on(simulated):
    """The kernel records why a new job waits; its runner, starting a moment later, must not hide that behind
    "starting" until it has queued itself (a %jobs right after the submission read "starting")."""
    busy = [gpumagic.jobs_with(name=f"B{k}").submit(variant, k, 4.0) for k in range(4)]
    wait_until(lambda: all(j.status == "running" for j in busy))
    waiting = gpumagic.jobs_with(name="B9").submit(variant, 9, 0.1)
    seen = []
    deadline = time.monotonic() + 1.5  # past the runner's start and its own first placement
    while time.monotonic() < deadline:
        seen.append(waiting.reason)
        time.sleep(0.002)
    assert seen and all(reason.startswith("waiting for 1 GPU") for reason in seen), sorted(set(seen))
    assert [j.wait("2m") for j in [*busy, waiting]] == ["finished"] * 5


@pytest.mark.slow
def test_a_job_sees_exactly_its_gpus_and_a_cpu_job_none(simulated):
    def visible():
        import os

        return os.environ["CUDA_VISIBLE_DEVICES"]

    on_gpu, on_cpu = gpumagic.jobs_with(gpus="GPU:2").submit(visible), gpumagic.jobs_with(gpus=0).submit(visible)
    assert on_gpu.result("1m") == gpumagic.gpus()[2].uuid and on_gpu.gpus == (2,)
    assert on_cpu.result("1m") == "" and on_cpu.gpus == ()


def test_a_jobs_rank_starts_with_its_gpus_in_the_environment_proc_shows(simulated):
    """A job's ranks start with ``spawn``: their GPUs are in the environment they started with, which ``/proc``
    shows (the simulated inventory counts each rank on its GPU so); a CPU job's start as its runner is."""

    def started_with():
        with open("/proc/self/environ", "rb") as handle:
            entries = [entry.decode().split("=", 1) for entry in handle.read().split(b"\0") if b"=" in entry]
        return {name: value for name, value in entries if name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}

    on_gpu = gpumagic.jobs_with(gpus="GPU:1").submit(started_with)
    on_cpu = gpumagic.jobs_with(gpus=0).submit(started_with)
    assert on_gpu.result("1m") == {"CUDA_VISIBLE_DEVICES": gpumagic.gpus()[1].uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert on_cpu.result("1m") == {}


def rank_environment():
    import os

    names = (
        *("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"),
        *("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GPUMAGIC_RUN_DIR", "GPUMAGIC_STORE"),
        *("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"),
        "MPLBACKEND",
    )
    return {name: os.environ.get(name) for name in names}


def test_a_launch_a_group_and_a_job_start_their_ranks_with_one_environment(simulated):
    """The three ways ranks start on this machine (``launch_ddp``, ``ranks``, ``submit``) take one path
    (``starter.RankStarter``): each rank's environment is torchrun's, its run's store, no GPU for a CPU rank."""
    launched = gpumagic.launch_ddp(rank_environment, 2, gpus="none", output="none")
    with gpumagic.ranks(2, gpus="none", output="none") as group:
        grouped = group.run(rank_environment)
    queued = gpumagic.jobs_with(gpus=0, ddp=2).submit(rank_environment).result("2m")
    for seen in (launched, grouped, queued):
        assert sorted(seen) == [0, 1]
        run_dir = seen[0]["GPUMAGIC_RUN_DIR"]
        store = RunFiles(run_dir).store_socket
        if seen is grouped:  # each forming of a group's process group serves a store of its own, beside the first
            store = store.with_name(Path(seen[0]["GPUMAGIC_STORE"]).name)
            assert store.name.startswith("store-") and store.suffix == ".sock", store
        for rank, environment in seen.items():
            assert environment == {
                **dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"),
                **dict(GROUP_RANK="0", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=environment["MASTER_PORT"]),
                "TORCHELASTIC_RUN_ID": os.path.basename(run_dir),
                "GPUMAGIC_RUN_DIR": run_dir,
                "GPUMAGIC_STORE": f"unix:{store}",
                **dict(CUDA_VISIBLE_DEVICES="", CUDA_DEVICE_ORDER=None, OMP_NUM_THREADS=str(threads_per_rank(2))),
                **dict(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo", MPLBACKEND="Agg"),
            }
    ports = [seen[0]["MASTER_PORT"] for seen in (launched, grouped, queued)]
    assert ports[1] == "0" and all(port.isdigit() and port != "0" for port in ports[::2]), ports  # a group's: none


def test_failure_records_the_traceback_and_the_exit(simulated):
    def diverge():
        raise FloatingPointError("loss is nan at step 7")

    job = gpumagic.jobs_with(gpus=0).submit(diverge)
    assert job.wait("1m") == "failed"
    assert job.reason == "rank 0 failed: raised FloatingPointError: loss is nan at step 7 (in user code)"
    with pytest.raises(gpumagic.JobFailed) as caught:
        job.result()
    text = caught.value._render_traceback_()[0]
    assert 'raise FloatingPointError("loss is nan at step 7")' in text and "in diverge" in text
    log = job.logs()  # the traceback is in the log too, where a script's would be
    assert 'raise FloatingPointError("loss is nan at step 7")' in log and log.startswith("rank 0 failed")


def test_follow_from_the_last_lines_misses_nothing_after_them(simulated, tmp_path):
    import threading

    flag = tmp_path / "go"

    def count(flag):
        import os
        import time

        for line in range(3):
            print(line, flush=True)
        while not os.path.exists(flag):
            time.sleep(0.05)
        for line in range(3, 6):
            print(line, flush=True)

    job = gpumagic.jobs_with(gpus=0).submit(count, str(flag))
    wait_until(lambda: job.logs() == "0\n1\n2\n")
    threading.Timer(0.5, flag.touch).start()  # the rest is written while follow() runs
    seen = []
    assert job.follow(seen.append, tail=2) == "finished"
    assert "".join(seen) == "1\n2\n3\n4\n5\n"


def test_a_job_killed_by_a_signal_records_which(simulated):
    def crash():
        import os
        import signal

        print("about to crash", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)

    job = gpumagic.jobs_with(gpus=1).submit(crash)
    assert job.wait("1m") == "failed"
    assert job.info["signal"] == "SIGSEGV" and "killed by SIGSEGV" in job.reason
    assert job.logs().startswith("about to crash\n\nrank 0 failed: killed by SIGSEGV")


def test_kill_stops_the_whole_tree_of_a_running_job(simulated):
    def spawner():
        import time

        child = subprocess.Popen(["sleep", "300"])
        print(child.pid, flush=True)
        while True:
            time.sleep(1)

    job = gpumagic.jobs_with(name="tree").submit(spawner)
    wait_until(lambda: job.logs().strip().isdigit())
    grandchild = int(job.logs())
    runner, (rank,) = job.info["runner_pid"], job.info["pids"]
    assert psutil.Process(grandchild).ppid() == rank and psutil.Process(rank).ppid() == runner
    on_its_gpu = {p.pid for p in gpumagic.gpus()[job.gpus[0]].processes}
    assert on_its_gpu == {rank, grandchild}, "the job's processes, and nothing of gpumagic's own"
    started = time.monotonic()
    assert job.kill() == "killed"
    assert time.monotonic() - started < 5
    assert job.reason == "killed with %jobs kill"
    for pid in (grandchild, rank, runner):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(gpumagic.InvalidArgument, match="already ended"):
        job.kill()


def test_only_the_jobs_user_can_kill_it(simulated):
    gpumagic.use("GPU:*")
    job = gpumagic.submit(variant, 1)
    state = job.path / "run.json"
    os.chown(state, 65534, 65534)  # as if another user's job (its directory would also be private to them)
    try:
        with pytest.raises(gpumagic.KillRefused, match="belongs to another user"):
            job.kill()
        assert job.status == "queued"
    finally:
        os.chown(state, os.getuid(), os.getgid())


@pytest.mark.slow
def test_kill_falls_back_to_sigkill_for_a_job_that_ignores_signals(simulated):
    def stubborn():
        import signal
        import time

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ignoring", flush=True)
        while True:
            time.sleep(0.1)

    job = gpumagic.jobs_with(gpus=0).submit(stubborn)
    wait_until(lambda: job.logs() == "ignoring\n")
    tree = [psutil.Process(job.info["runner_pid"]), *psutil.Process(job.info["runner_pid"]).children(True)]
    assert job.kill(grace_s=1) == "killed"
    assert "SIGKILL" in job.reason or job.reason == "killed with %jobs kill"
    _, alive = psutil.wait_procs(tree, timeout=5)
    assert not alive


def test_kill_of_a_queued_job_and_its_place_is_given_back(simulated):
    gpumagic.use("GPU:*")  # this process holds every GPU: the job waits
    job = gpumagic.submit(variant, 1)
    wait_until(lambda: job.reason.startswith("waiting for 1 GPU"))
    assert "GPU 0: leased by root" in job.reason or "GPU 0: leased by" in job.reason
    assert job.kill() == "killed" and job.reason == "killed with %jobs kill while queued"
    assert job.gpus == ()
    from gpumagic.jobs.queue import waiting_tickets

    assert waiting_tickets() == []


@pytest.mark.slow
def test_after_orders_jobs_and_a_failed_dependency_cancels(simulated):
    def fail():
        raise RuntimeError("no")

    a = gpumagic.jobs_with(name="A").submit(variant, 1, 1.0)
    b = gpumagic.jobs_with(name="B", after="A").submit(variant, 2, 0.2)
    f = gpumagic.jobs_with(gpus=0, name="F").submit(fail)
    c = gpumagic.jobs_with(name="C", after=["B", f]).submit(variant, 3)
    wait_until(lambda: b.reason == "waiting for job A to finish", timeout=30)
    assert c.wait("2m") == "cancelled" and b.wait("2m") == "finished"
    assert b.info["started"] >= a.info["ended"]
    assert c.reason == "cancelled: job F, which it runs after, failed"
    with pytest.raises(gpumagic.JobFailed, match="cancelled"):
        c.result()


@pytest.mark.slow
def test_ddp_job_runs_a_process_group(simulated):
    def reduce_ranks():
        import torch
        import torch.distributed as dist

        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value)
        print("world", dist.get_world_size())
        return value.item()

    job = gpumagic.jobs_with(ddp=2, name="pair").submit(reduce_ranks)
    assert job.wait("2m") == "finished"
    assert job.result() == {0: 3.0, 1: 3.0}
    assert sorted(job.logs().splitlines()) == ["[rank 0] world 2", "[rank 1] world 2"]
    assert len(job.gpus) == 2 and job.info["backend"] == "gloo"


def test_names_are_unique_and_sweeps_name_their_points(simulated):
    gpumagic.use("GPU:*")  # keep the jobs queued: only names matter here
    jobs = gpumagic.sweep(variant, {"k": [1, 2], "seconds": [0.5]}, name="lr")
    assert [j.name for j in jobs] == ["lr-k=1,seconds=0.5", "lr-k=2,seconds=0.5"]
    assert [j.info["params"] for j in jobs] == [{"k": "1", "seconds": "0.5"}, {"k": "2", "seconds": "0.5"}]
    assert gpumagic.submit(variant, 1).name == "variant" and gpumagic.submit(variant, 1).name == "variant-2"
    with pytest.raises(gpumagic.InvalidArgument, match="a job named 'variant' exists already"):
        gpumagic.jobs_with(name="variant").submit(variant, 1)
    with pytest.raises(gpumagic.InvalidArgument, match="exists already"):
        gpumagic.sweep(variant, {"k": [3, 1], "seconds": [0.5]}, name="lr")  # one name taken: none submitted
    assert not records.exists("lr-k=3,seconds=0.5")
    assert gpumagic.job("variant-2") == jobs[0].__class__(records.find("variant-2"))
    assert [j.name for j in gpumagic.list_jobs()] == [
        "lr-k=1,seconds=0.5",
        "lr-k=2,seconds=0.5",
        "variant",
        "variant-2",
    ]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"gpus": 5}, "asks for 5 GPUs; this machine has 4"),
        ({"gpus": -1}, "gpus must be from 0 to 64"),
        ({"gpus": "GPU:9"}, "GPU 9"),
        ({"gpus": 1.5}, "number of GPUs or a device spec"),
        ({"gpus": "²"}, "²"),  # str.isdigit says yes; it is no number of GPUs
        ({"min_free": "500GB"}, "more than any GPU here has"),
        ({"min_free": "lots"}, "size"),
        ({"gpus": 0, "min_free": "1GB"}, "min_free needs GPUs"),
        ({"ddp": 0}, "ddp is the number of ranks"),
        ({"ddp": 2, "gpus": 3}, "cannot be split evenly among 2 ranks"),
        ({"after": "nobody"}, "no job named 'nobody'"),
        ({"name": "bad name"}, "job names are"),
        ({"backend": "carrier-pigeon"}, "unknown backend"),
        ({"timeout": "0s"}, "timeout must be more than 0"),
    ],
)
def test_bad_options_are_one_line_errors_and_submit_nothing(simulated, options, message):
    with pytest.raises(gpumagic.GpumagicError, match=message) as caught:
        gpumagic.jobs_with(**options).submit(variant, 1)
    assert "\n" not in str(caught.value)
    assert gpumagic.list_jobs() == []


def test_no_gpu_machine_says_to_use_the_cpu(no_gpu_machine):
    with pytest.raises(gpumagic.InvalidArgument, match=r"this machine has no GPU .*submit with jobs_with\(gpus=0\)"):
        gpumagic.submit(variant, 1)


def test_unpicklable_arguments_are_named(simulated):
    import threading

    with pytest.raises(gpumagic.GpumagicError, match="cannot send 'args\\[0\\]' \\(a lock\\)"):
        gpumagic.submit(variant, threading.Lock())


def test_a_job_whose_runner_vanished_reads_as_lost(simulated):
    gpumagic.use("GPU:*")
    job = gpumagic.submit(variant, 1)
    wait_until(lambda: job.info.get("runner_pid") is not None)
    os.kill(job.info["runner_pid"], signal.SIGKILL)
    wait_until(lambda: job.status == "lost")
    assert "is gone without recording an end" in job.reason
    job.remove()
    assert gpumagic.list_jobs() == []


def test_remove_refuses_an_active_job(simulated):
    gpumagic.use("GPU:*")
    job = gpumagic.submit(variant, 1)
    with pytest.raises(gpumagic.InvalidArgument, match="kill it first"):
        job.remove()


@pytest.mark.parametrize("status", ["finished", "failed", "killed", "cancelled"])
def test_a_job_holds_no_space_once_its_end_can_be_read(simulated, status):
    """The runner freed the job's 64 KiB after recording its end: one who read the end at once (``wait``, CI) still
    found them held. Its end is now recorded in them."""
    from gpumagic.jobs import runner
    from gpumagic.launch.shipping import pack, ship_function

    with records.names_locked():
        path = records.create("ending", pack(ship_function(variant, (1,), {}, rank_first=False)))
    assert RunFiles(path).reserve.stat().st_size == records.RESERVE_BYTES
    runner._Runner(path)._finish(status, status)
    assert gpumagic.Job(path).status == status and not RunFiles(path).reserve.exists()


def test_a_queued_job_killed_while_its_runner_imports_reads_killed(simulated, monkeypatch):
    """A fresh-clone CI run killed a queued job while its runner was creating a class on import: Python 3.11 wraps
    the signal's KeyboardInterrupt raised in ``__set_name__`` in a RuntimeError, and the job read "failed (gpumagic
    could not run the job: RuntimeError: Error calling __set_name__ ...)" instead of killed."""
    from gpumagic.jobs import runner
    from gpumagic.launch.shipping import pack, ship_function

    with records.names_locked():
        path = records.create("importing", pack(ship_function(variant, (1,), {}, rank_first=False)))
    killed = runner._Runner(path)

    class Field:
        def __set_name__(self, owner, name):
            os.kill(os.getpid(), signal.SIGTERM)  # the kill lands here; its handler raises as this returns

    def imports(spec):
        type("Request", (), {"exclude": Field()})
        return True

    monkeypatch.setattr(killed, "_wait_for_dependencies", imports)
    previous = signal.signal(signal.SIGTERM, killed._on_signal)
    try:
        killed._run_job(records.read_spec(path))
    finally:
        signal.signal(signal.SIGTERM, previous)
    job = gpumagic.Job(path)
    assert (job.status, job.reason) == ("killed", "killed by SIGTERM sent to its runner while queued"), job.reason


def test_a_ddp_jobs_last_partial_line_is_in_its_log_once_its_end_can_be_read(simulated):
    """A rank's last line without a newline was written to output.log after the job's end was recorded: logs()
    read at once missed it."""
    from gpumagic.jobs import runner
    from gpumagic.launch.kernel_side.output import RankOutput
    from gpumagic.launch.shipping import pack, ship_function
    from gpumagic.run_dirs import private

    with records.names_locked():
        path = records.create("tail", pack(ship_function(variant, (1,), {}, rank_first=False)))
    ending = runner._Runner(path)
    ending.output = private.open_private(RunFiles(path).output)
    ending.sink = RankOutput(lambda text: ending._output(text.encode()), "all", 2)
    ending.sink.feed(1, b"epoch 3 done\nsaving")
    ending._finish("finished", "finished")
    assert gpumagic.Job(path).logs().splitlines() == ["[rank 1] epoch 3 done", "[rank 1] saving"]


@pytest.mark.slow
def test_a_slurm_job_holds_no_space_for_a_runner_it_does_not_have(monkeypatch):
    """A local job holds 64 KiB for its runner's last record on a full disk until it ends; a Slurm job has no
    runner of ours, and would hold them for good."""
    monkeypatch.setenv("GPUMAGIC_SLURM", "local")
    local = gpumagic.jobs_with(gpus=0, name="local").submit(variant, 1, 0.5)
    on_slurm = gpumagic.jobs_with(gpus=0, name="on-slurm", executor="slurm", slurm={"time": "5m"}).submit(
        variant, 2, 0.5
    )
    assert RunFiles(local.path).reserve.stat().st_size == records.RESERVE_BYTES
    assert [local.wait("2m"), on_slurm.wait("2m")] == ["finished", "finished"]
    assert not RunFiles(local.path).reserve.exists() and not RunFiles(on_slurm.path).reserve.exists()


def job_words(name, gpus, timeout, *, after=None, ddp=None):
    return {"name": name, "gpus": gpus, "timeout": timeout, "after": after, "ddp": ddp}


def test_submit_passes_every_keyword_to_the_function_and_job_options_travel_apart(simulated):
    """submit took name, gpus, timeout, after, ddp ... as the job's options: a function with such parameters could
    not receive them. Now every keyword of submit goes to fn; the job's options go to jobs_with."""
    words = {"name": "n", "gpus": 3, "timeout": "t", "after": "a", "ddp": "d"}
    on_cpu = gpumagic.jobs_with(gpus=0, name="words").submit(job_words, **words)
    by_default = gpumagic.submit(job_words, "m", gpus=2, timeout=1)  # the default options: one GPU, its own name
    assert on_cpu.wait("2m") == "finished" and by_default.wait("2m") == "finished"
    assert on_cpu.result() == words and on_cpu.name == "words" and on_cpu.gpus == ()
    assert by_default.result() == {"name": "m", "gpus": 2, "timeout": 1, "after": None, "ddp": None}
    assert by_default.name == "job_words" and len(by_default.gpus) == 1


def test_job_options_are_checked_when_they_are_set_apart(simulated):
    with pytest.raises(gpumagic.InvalidArgument, match="unknown backend"):
        gpumagic.jobs_with(ddp=2, backend="carrier-pigeon")
    with pytest.raises(TypeError, match="unexpected keyword argument 'lr'"):  # the function's, not the job's
        gpumagic.jobs_with(lr=0.1)
    assert gpumagic.list_jobs() == []

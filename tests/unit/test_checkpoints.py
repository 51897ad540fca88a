"""gpumagic.checkpoint and gpumagic.restore (issue #42): in one process with a run directory, in a DDP launch of
two gloo ranks, with FSDP2 on the CPU, and across a --max-restarts restart. Every test runs on the CPU."""

import json
import os
import re
from pathlib import Path

import pytest

import gpumagic
from gpumagic.errors import InvalidArgument
from gpumagic.run_dirs import checkpoint_files, records
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.store import RUN_DIR_VARIABLE, new_run

torch = pytest.importorskip("torch")


@pytest.fixture
def run_dir(monkeypatch):
    """A run directory of this process, as a script given GPUMAGIC_RUN_DIR has."""
    path = new_run("test-checkpoints")
    monkeypatch.setenv(RUN_DIR_VARIABLE, str(path))
    return path


def make_model(seed=0, width=8):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model, optimizer, steps, start=0, scale=1.0):
    """Deterministic steps: the data of step s comes from s alone, so a resumed run sees what an uninterrupted one
    would."""
    for step in range(start, steps):
        data = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=data) * scale
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_checkpoint_round_trips_model_optimizer_and_values_and_the_last_two_stay(run_dir):
    model, optimizer = make_model()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    extra = {"epoch": 3, "best": 0.25}
    assert gpumagic.restore(model=model, optimizer=optimizer) == 0, "no checkpoint yet: nothing changes, step 0"
    for step in range(1, 4):
        train(model, optimizer, step, step - 1)
        scheduler.step()
        written = gpumagic.checkpoint(step, model=model, optimizer=optimizer, scheduler=scheduler, extra=extra)
    assert written.parent == RunFiles(run_dir).checkpoints and written.name.startswith("step-3.")
    fresh, fresh_optimizer = make_model(seed=1)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=2)
    fresh_extra = {}
    step = gpumagic.restore(model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler, extra=fresh_extra)
    assert step == 3 and fresh_extra == extra and fresh_scheduler.last_epoch == 3
    assert same(fresh, model)
    train(model, optimizer, 5, 3)
    train(fresh, fresh_optimizer, 5, 3)
    assert same(fresh, model), "the optimizer's state came back too: the next steps are the same"
    files = sorted(os.listdir(RunFiles(run_dir).checkpoints))
    assert [f.split(".")[0] for f in files if f.endswith((".pt", ".seal"))] == ["step-2"] * 2 + ["step-3"] * 2
    assert checkpoint_files.restored(run_dir).step == 3


def test_a_ddp_or_compiled_model_is_saved_as_the_module_inside(run_dir):
    model, _ = make_model()

    class Wrapper(torch.nn.Module):  # what DDP and torch.compile look like from outside: the model as an attribute
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    Wrapper.__name__ = "OptimizedModule"
    gpumagic.checkpoint(1, model=Wrapper(model))
    plain, _ = make_model(seed=5)
    assert gpumagic.restore(model=plain) == 1 and same(plain, model)


def test_a_half_written_changed_or_foreign_checkpoint_is_never_loaded(run_dir, caplog):
    model, _ = make_model()
    for step in (1, 2):
        model[0].bias.data.fill_(step)
        gpumagic.checkpoint(step, model=model)
    checkpoint_files.settle()
    where = RunFiles(run_dir).checkpoints
    newest = checkpoint_files.sealed(run_dir)[0]
    assert newest.step == 2

    # a crash after the rename, before the seal: a data file no seal names
    (where / "step-7.0badcafe.pt").write_bytes(newest.path.read_bytes())
    # a seal not made with this user's key
    (where / "step-9.seal").write_bytes(b"GPUMAGIC-HMAC-SHA256\n" + bytes(32) + b'{"step": 9}')
    # the newest file cut short (a full disk, a crash of the machine before its pages were written)
    newest.path.write_bytes(newest.path.read_bytes()[:100])
    fresh, _ = make_model(seed=3)
    assert gpumagic.restore(model=fresh) == 1, "the damaged newest is skipped: the one before it is loaded"
    assert fresh[0].bias.eq(1).all()
    assert "does not match its seal" in caplog.text and "not yours" in caplog.text

    newest.path.unlink()
    for entry in checkpoint_files.sealed(run_dir):
        entry.path.write_bytes(b"changed")
    assert gpumagic.restore(model=fresh) == 0, "nothing sound is left: nothing is loaded"


def test_what_does_not_fit_is_one_line_naming_the_file_and_what_differs(run_dir):
    model, optimizer = make_model()
    gpumagic.checkpoint(4, model=model, optimizer=optimizer)
    name = checkpoint_files.sealed(run_dir)[0].path.name
    wider, _ = make_model(width=16)
    with pytest.raises(gpumagic.CheckpointError) as shapes:
        gpumagic.restore(model=wider)
    message = str(shapes.value)
    assert "\n" not in message and name in message and "'model'" in message
    assert "size mismatch for 0.weight" in message and "[8, 8]" in message and "[16, 8]" in message
    with pytest.raises(gpumagic.CheckpointError, match=rf"{name} \(step 4\) has no 'scheduler'; it holds model, opt"):
        gpumagic.restore(model=model, scheduler={})
    with pytest.raises(gpumagic.CheckpointError, match="this int cannot be changed in place; keep such values"):
        gpumagic.checkpoint(5, model=model, epoch=3)
        gpumagic.restore(model=model, epoch=0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gpumagic.checkpoint(-1, model={}), "whole number >= 0"),
        (lambda: gpumagic.checkpoint(1.5, model={}), "whole number >= 0"),
        (lambda: gpumagic.checkpoint(torch.tensor(3), model={}), r"pass int\(step\)"),
        (lambda: gpumagic.checkpoint(1), "name the state to save"),
        (lambda: gpumagic.restore(), "name the state to load into"),
    ],
)
def test_bad_input_is_one_line(run_dir, call, message):
    with pytest.raises(InvalidArgument, match=message):
        call()


def test_outside_a_run_it_says_where_it_works(monkeypatch):
    monkeypatch.delenv(RUN_DIR_VARIABLE, raising=False)
    with pytest.raises(InvalidArgument, match=r"works in a run's code: %%launch_ddp, %%ddp, a background job"):
        gpumagic.checkpoint(1, model={})


def ddp_checkpoint_and_restore():
    """On each of two gloo ranks: train a DDP model, checkpoint, restore into a fresh one; then the mistakes."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gpumagic

    rank = dist.get_rank()
    model, optimizer = make_model()
    ddp = DistributedDataParallel(model)
    train(ddp, optimizer, 3)
    path = gpumagic.checkpoint(3, model=ddp, optimizer=optimizer)
    fresh, fresh_optimizer = make_model(seed=7)
    step = gpumagic.restore(model=DistributedDataParallel(fresh), optimizer=fresh_optimizer)
    outcome = {"step": step, "same": same(fresh, model), "path": str(path)}
    try:
        gpumagic.checkpoint(4 + rank, model=ddp)
    except InvalidArgument as err:
        outcome["disagree"] = str(err)
    narrow, _ = make_model(width=8 if rank == 0 else 2)
    try:
        gpumagic.restore(model=narrow)
    except gpumagic.CheckpointError as err:
        outcome["misfit"] = str(err)
    return outcome


@pytest.mark.slow
def test_ddp_ranks_agree_on_the_step_rank_0_writes_and_every_rank_restores():
    outcomes = gpumagic.launch_ddp(ddp_checkpoint_and_restore, 2, gpus="none", output="none")
    for rank, outcome in outcomes.items():
        assert outcome["step"] == 3 and outcome["same"], (rank, outcome)
        assert outcome["disagree"] == (
            "every rank checkpoints the same step, got rank 0: 4, rank 1: 5; nothing was saved"
        )
        assert outcome["misfit"].startswith("rank 1: checkpoint step-3.") and "size mismatch" in outcome["misfit"]
    assert outcomes[0]["path"] == outcomes[1]["path"], "one file, written by rank 0, named to every rank"
    run_dir = Path(outcomes[0]["path"]).parent.parent
    assert [entry.step for entry in checkpoint_files.sealed(run_dir)] == [3]


def fsdp_checkpoint_and_restore():
    """On each of two gloo ranks: an FSDP2 (fully_shard) model on the CPU, checkpointed with its optimizer, then
    restored into a fresh one; both train on and must stay equal to each other."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import gpumagic

    def sharded(seed):
        model, _ = make_model(seed)
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    model, optimizer = sharded(0)
    train(model, optimizer, 3)
    gpumagic.checkpoint(3, model=model, optimizer=optimizer)
    fresh, fresh_optimizer = sharded(9)
    step = gpumagic.restore(model=fresh, optimizer=fresh_optimizer)
    train(model, optimizer, 5, 3)
    train(fresh, fresh_optimizer, 5, 3)
    mine = [p.full_tensor() for p in model.parameters()]
    theirs = [p.full_tensor() for p in fresh.parameters()]
    keys = torch.load(gpumagic.checkpoint(5, model=model), weights_only=False)["state"]["model"].keys()
    return step, all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), sorted(keys), dist.get_rank()


@pytest.mark.slow
def test_an_fsdp_model_and_its_optimizer_are_saved_whole_and_loaded_into_the_shards():
    outcomes = gpumagic.launch_ddp(fsdp_checkpoint_and_restore, 2, gpus="none", output="none")
    assert [outcomes[r][0] for r in (0, 1)] == [3, 3]
    assert all(outcomes[r][1] for r in (0, 1)), "restored shards and Adam state: the next steps match"
    assert outcomes[0][2] == ["0.bias", "0.weight", "2.bias", "2.weight"], "the full state dict, unsharded"


def train_with_restarts(steps, crash_at):
    """One rank of a --max-restarts launch: restore, train with a checkpoint each step, and fail once at
    ``crash_at`` in the first attempt; returns the step it resumed from and the final weights."""
    import os

    import gpumagic

    model, optimizer = make_model()
    start = gpumagic.restore(model=model, optimizer=optimizer)
    for step in range(start, steps):
        train(model, optimizer, step + 1, step)
        gpumagic.checkpoint(step + 1, model=model, optimizer=optimizer)
        if step + 1 == crash_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise RuntimeError("the node went away")
    return start, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_a_max_restarts_restart_resumes_from_the_last_checkpoint_with_the_weights_of_an_unbroken_run():
    result = gpumagic.launch_ddp(train_with_restarts, 1, (6, 4), gpus="none", max_restarts=1, output="none")
    start, weights = result[0]
    assert start == 4, "the restart resumed from the checkpoint of step 4, not from 0"
    model, optimizer = make_model()
    train(model, optimizer, 6)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_the_seal_names_its_file_size_and_digest(run_dir):
    gpumagic.checkpoint(2, model=make_model()[0])
    checkpoint_files.settle()
    entry = checkpoint_files.sealed(run_dir)[0]
    record = json.loads(gpumagic.run_dirs.signing.read_sealed(entry.seal, "seal"))
    assert record["file"] == entry.path.name and record["size"] == entry.path.stat().st_size
    assert record["names"] == ["model"] and len(record["sha256"]) == 64


def train_until_killed(steps, stop_at):
    """A background job: restore, then train with a checkpoint each step; the first attempt stops at ``stop_at``
    and waits there to be killed."""
    import time

    import gpumagic

    model, optimizer = make_model()
    start = gpumagic.restore(model=model, optimizer=optimizer)
    for step in range(start, steps):
        train(model, optimizer, step + 1, step)
        gpumagic.checkpoint(step + 1, model=model, optimizer=optimizer)
        gpumagic.log(step + 1, weight=float(model[0].weight.sum()))
        if step + 1 == stop_at and start == 0:
            print("waiting to be killed", flush=True)
            time.sleep(600)
    return start, {k: v.clone() for k, v in model.state_dict().items()}


def wait_until(predicate, timeout=60.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.usefixtures("no_job_left_running")
def test_a_job_killed_mid_run_and_resumed_ends_with_the_weights_of_an_unbroken_run(shell):
    job = gpumagic.jobs_with(gpus=0, name="resumed-A1").submit(train_until_killed, 6, 3)
    wait_until(lambda: "waiting to be killed" in job.logs())
    # step 3's seal is written by a thread after checkpoint() returns: killed before it, the job rightly resumes
    # from step 2 (it did, once, in a fresh-clone run with a core kept busy)
    wait_until(lambda: [c.step for c in checkpoint_files.sealed(job.path)][:1] == [3])
    with pytest.raises(InvalidArgument, match=r"job resumed-A1 is running; resume starts a new attempt of an ended"):
        job.resume()
    assert job.kill(grace_s=1) == "killed"
    shown = shell.run_line_magic("jobs", "resume resumed-A1 --timeout 1h")
    assert repr(shown).startswith("resumed-A1: ")
    assert job.wait("2m") == "finished", job.logs()
    start, weights = job.result()
    assert start == 3, "the second attempt resumed from the checkpoint of step 3"
    model, optimizer = make_model()
    train(model, optimizer, 6)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items()), "optimizer state included"
    assert job.describe().startswith("resumed-A1: finished on the CPU") and "resumed from step 3 (attempt 2)" in (
        job.describe()
    )
    kept = job.path / "attempts" / "1"
    assert "waiting to be killed" in (kept / "output.log").read_text() and "waiting" not in job.logs()
    assert (kept / "kill.json").exists() and not (job.path / "kill.json").exists()
    assert records.attempt_of(job.info) == 2 and job.info["timeout_s"] == 3600.0
    assert list(job.metrics()[0]["weight"].steps) == [4, 5, 6], "this attempt's points; the first's are kept"
    with pytest.raises(InvalidArgument, match="job resumed-A1 finished; there is nothing to resume"):
        job.resume()


@pytest.mark.slow
@pytest.mark.usefixtures("no_job_left_running")
def test_resume_checks_its_options_as_a_submission_does():
    job = gpumagic.jobs_with(gpus=0, name="resumed-B1").submit(int, "not a number")
    assert job.wait("2m") == "failed"
    with pytest.raises(InvalidArgument, match="'soon' is not a duration"):
        job.resume(timeout="soon")
    with pytest.raises(InvalidArgument, match="memory_limit caps a job at the memory it declares"):
        job.resume(memory_limit=True)
    with pytest.raises(InvalidArgument, match="slurm options are for a job that ran on Slurm"):
        job.resume(slurm={"time": "2h"})


@pytest.mark.slow
@pytest.mark.usefixtures("no_job_left_running")
def test_jobs_resume_mistakes_are_one_line_usage_errors(shell):
    from IPython.core.error import UsageError

    job = gpumagic.jobs_with(gpus=0, name="resumed-C1").submit(int, "three")
    assert job.wait("2m") == "failed"
    for line, says in [
        ("resume", "the following arguments are required: name"),
        ("resume nosuch", "no job named 'nosuch'"),
        ("resume resumed-C1 --ddp two", "--ddp needs a number of ranks"),
        ("resume resumed-C1 --bogus 1", "unrecognized arguments: --bogus 1"),
        ("resume resumed-C1 --partition long", "slurm options are for a job that ran on Slurm"),
        ("resume resumed-C1 --gpus 0 --min-free 1GB", "min_free needs GPUs"),
    ]:
        with pytest.raises(UsageError, match=re.escape(says)) as raised:
            shell.run_line_magic("jobs", line)
        assert "\n" not in str(raised.value), line
    assert job.status == "failed" and not (job.path / "attempts").exists(), "no mistake started an attempt"


def test_every_skips_the_steps_between_and_the_time_limit_saves_at_once(run_dir, monkeypatch, capfd):
    from gpumagic.launch.rank_side import checkpoints

    model, _ = make_model()
    saved = [step for step in range(1, 8) if gpumagic.checkpoint(step, every=3, model=model) is not None]
    assert saved == [3, 6]
    with pytest.raises(InvalidArgument, match="every is a whole number of steps >= 1, got 0"):
        gpumagic.checkpoint(9, every=0, model=model)
    monkeypatch.setenv(checkpoints.REQUEUE_VARIABLE, "1/1")  # what a Slurm task that may requeue sets
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    checkpoints.time_limit_near(0, None)
    assert gpumagic.checkpoint(7, every=3, model=model) is not None, "the signal saves the next step at once"
    said = capfd.readouterr().err
    asking = said.index("rank 0: time limit near; saved step 7; asking Slurm to requeue the job")
    assert asking < said.index("saved step 7, but this is not a Slurm job; it runs on to the limit"), said
    assert gpumagic.checkpoint(8, every=3, model=model) is None, "once: the steps between are skipped again"
    assert [e.step for e in checkpoint_files.sealed(run_dir)] == [7, 6]


@pytest.mark.slow
def test_a_checkpoint_is_not_loaded_before_its_seal_is_written(run_dir, monkeypatch):
    """The seal is written by a thread after checkpoint() returns: another process (a requeued attempt, a resumed
    job) restoring meanwhile gets the checkpoint before it, never the unsealed one."""
    import subprocess
    import sys
    import threading

    hashing = threading.Event()
    release = threading.Event()
    digest = checkpoint_files._digest

    def slow_digest(handle):
        if threading.current_thread().name == "gpumagic-checkpoint-seal":
            hashing.set()
            release.wait(60)
        return digest(handle)

    gpumagic.checkpoint(1, extra={"step": 1})
    checkpoint_files.settle()
    monkeypatch.setattr(checkpoint_files, "_digest", slow_digest)
    gpumagic.checkpoint(2, extra={"step": 2})
    assert hashing.wait(60), "the seal's thread started"
    restoring = "import gpumagic; found = {}; print(gpumagic.restore(extra=found), found['step'])"
    try:
        before = subprocess.run([sys.executable, "-c", restoring], capture_output=True, text=True, timeout=120)
    finally:
        release.set()
    checkpoint_files.settle()
    after = subprocess.run([sys.executable, "-c", restoring], capture_output=True, text=True, timeout=120)
    assert before.stdout.split() == ["1", "1"], before.stderr
    assert after.stdout.split() == ["2", "2"], after.stderr


def ranks_that_hear_the_time_limit_apart():
    """On two gloo ranks of a job that may requeue: only rank 1 hears the signal; both must save the same step at
    once, and (no Slurm here) both go on. Then rank 0 cannot list the checkpoints: both ranks fail, none waits."""
    import os

    import torch.distributed as dist

    import gpumagic
    from gpumagic.launch.rank_side import checkpoints
    from gpumagic.run_dirs import checkpoint_files

    os.environ[checkpoints.REQUEUE_VARIABLE] = "1/1"
    os.environ.pop("SLURM_JOB_ID", None)
    rank = dist.get_rank()
    if rank == 1:
        checkpoints.time_limit_near(0, None)
    saved = gpumagic.checkpoint(3, every=100, extra={"rank": rank})
    unsaved = gpumagic.checkpoint(4, every=100, extra={"rank": rank})

    class Unsavable:  # only rank 0 asks it for its state: the others hear why rank 0 could not save
        def state_dict(self):
            raise RuntimeError("the state is on a device that went away")

        def load_state_dict(self, state):
            pass

    try:
        gpumagic.checkpoint(5, broken=Unsavable())
        broke = ""
    except Exception as err:  # noqa: BLE001 - the test reports whatever each rank raised
        broke = f"{type(err).__name__}: {err}"
    if rank == 0:

        def unreadable(run_dir):
            raise PermissionError(13, "Permission denied")

        checkpoint_files.sealed = unreadable
    try:
        gpumagic.restore(extra={})
        failed = ""
    except gpumagic.CheckpointError as err:
        failed = str(err)
    return str(saved), unsaved, failed, broke


@pytest.mark.slow
def test_ranks_agree_on_the_time_limit_and_a_rank_0_failure_fails_every_rank():
    outcomes = gpumagic.launch_ddp(ranks_that_hear_the_time_limit_apart, 2, gpus="none", output="none")
    assert outcomes[0][0] == outcomes[1][0] and outcomes[0][0].endswith(".pt"), "both saved step 3, as one"
    assert outcomes[0][1] is None and outcomes[1][1] is None, "after it, every= skips again"
    for rank in (0, 1):
        assert outcomes[rank][2].startswith("the checkpoints in ") and "Permission denied" in outcomes[rank][2]
    assert outcomes[0][3] == "RuntimeError: the state is on a device that went away"
    assert outcomes[1][3] == (
        "CheckpointError: rank 0 could not save the checkpoint of step 5: RuntimeError: the state is on a device "
        "that went away"
    )


def test_a_checkpoint_or_a_directory_of_another_user_is_never_trusted(run_dir, caplog):
    if os.geteuid() != 0:
        pytest.skip("a file of another user needs chown, as root (CI runs as root)")
    from gpumagic.errors import RunsDirectoryError

    model, _ = make_model()
    for step in (1, 2):
        model[0].bias.data.fill_(step)
        gpumagic.checkpoint(step, model=model)
    checkpoint_files.settle()
    newest = checkpoint_files.sealed(run_dir)[0]
    os.chown(newest.path, 65534, 65534)  # nobody's: what another user could leave where a filesystem let them
    fresh, _ = make_model(seed=4)
    assert gpumagic.restore(model=fresh) == 1 and fresh[0].bias.eq(1).all(), "the foreign file is skipped"
    assert f"checkpoint {newest.path} is not a file of yours" in caplog.text
    where = RunFiles(run_dir).checkpoints
    os.chmod(where, 0o777)
    with pytest.raises(RunsDirectoryError, match="not a run directory of yours that only you can use"):
        gpumagic.checkpoint(3, model=model)
    os.chmod(where, 0o700)
    os.chown(where, 65534, 65534)
    with pytest.raises(RunsDirectoryError, match="not a run directory of yours"):
        gpumagic.checkpoint(3, model=model)

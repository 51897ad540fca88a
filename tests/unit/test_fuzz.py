"""Bad input that fuzzing found escaping as a traceback (#12), on one shared IPython shell and through the API:
each is a one-line error, and a refused command changes nothing (no lease, no CUDA_VISIBLE_DEVICES, no run
directory, no job)."""

import os
import shlex
import socket
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

import gpumagic
from gpumagic.devices import leases
from gpumagic.devices.spec import ACCEPTED_FORMS
from gpumagic.errors import InvalidArgument

pytestmark = pytest.mark.usefixtures("no_job_left_running")

NINES = "9" * 400


def state() -> tuple:
    """What a refused command must leave as it was."""
    runs = Path(os.environ["GPUMAGIC_RUNS_DIR"])
    listening = [c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    return (
        sorted(listening),
        sorted(leases.book().held()),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        os.environ.get("CUDA_DEVICE_ORDER"),
        sorted(p.name for p in Path(os.environ["GPUMAGIC_LEASE_DIR"]).glob("GPU-*")),
        sorted(p.name for p in runs.iterdir()) if runs.exists() else [],
    )


def refused(shell, magic: str, line: str, cell: str | None = None) -> str:
    """Run ``%magic line`` (``%%magic`` with ``cell``); assert it raised a one-line UsageError that changed
    nothing; return its message."""
    before = state()
    with pytest.raises(UsageError) as caught:
        if cell is None:
            shell.run_line_magic(magic, line)
        else:
            shell.run_cell_magic(magic, line, cell)
    message = str(caught.value)
    assert message.strip() and "\n" not in message and len(message) < 600, message
    assert state() == before, f"%{magic} {line} was refused but changed something"
    return message


@pytest.mark.parametrize(
    ("magic", "line", "cell"),
    [
        ("gpu", f"pick 1 --min-free {NINES}GB", None),
        ("gpu", f"pick 1 --min-free {NINES}", None),
        ("gpu", f"pick 1 --min-free {NINES}%", None),
        ("gpu", f"pick 1 --max-util {NINES}", None),
        ("gpu", f"pick 1 --wait {NINES}d", None),
        ("launch_bg", f"--gpus 1 --min-free {NINES}GB", "1"),
    ],
)
def test_four_hundred_nines_are_one_line(shell, simulated, magic, line, cell):
    message = refused(shell, magic, line, cell)
    assert "characters)" in message and NINES not in message  # it names the text without repeating 400 digits


def test_four_hundred_nines_through_the_api(simulated):
    for min_free in (NINES + "GB", NINES, 10**400, 1e300):
        with pytest.raises(InvalidArgument, match="too large a size: at most 1 EiB"):
            gpumagic.pick(min_free=min_free)
        with pytest.raises(InvalidArgument, match="too large a size"):
            gpumagic.jobs_with(gpus=1, min_free=min_free).submit(sum, [1])
    assert gpumagic.list_jobs() == [] and leases.book().held() == ()


def test_a_timeout_past_the_maximum_is_refused_before_anything_runs_or_is_written(shell):
    for line in ("-n 2 --gpus none --timeout 1000000000d", "-n 2 --gpus none --timeout 8d"):
        assert "process group timeout: at most 7d" in refused(shell, "launch_ddp", line, "1")
    for line in ("--gpus 0 --ddp 2 --timeout 1000000000d", "--gpus 0 --ddp 2 --timeout 604801"):
        assert "at most 7d" in refused(shell, "launch_bg", line, "1")
    with pytest.raises(InvalidArgument, match="at most 7d"):
        gpumagic.jobs_with(gpus=0, ddp=2, timeout=10**400).submit(sum, [1])
    assert gpumagic.list_jobs() == []


def test_the_longest_timeout_is_one_torch_takes(shell):
    shell.run_cell_magic(
        "launch_ddp",
        "-n 2 --gpus none --timeout 7d -o out",
        "import torch\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()",
    )
    assert shell.user_ns["out"] == {0: 2.0, 1: 2.0}


@pytest.fixture
def taken_port():
    """A port of 127.0.0.1 that something else listens on."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("-n 2 --gpus 0,1 --gpus-per-rank 2", "--gpus 0,1 names 2 GPU(s), too few for 2 rank(s) × 2 GPU(s) = 4"),
        ("--gpus 0 --gpus-per-rank 2", "--gpus 0 names 1 GPU(s), too few for 1 rank(s) × 2 GPU(s) = 2"),
        ("-n 2 --gpus 0", "--gpus 0 names 1 GPU(s), too few for 2 rank(s) × 1 GPU(s) = 2"),
        ("-n 0 --gpus auto", "the number of ranks must be a whole number from 1 to 256, got 0"),
        ("-n 300 --gpus 0,1", "the number of ranks must be a whole number from 1 to 256, got 300"),
        ("-n 1 --gpus 1 --port {port}", "port {port} is taken on 127.0.0.1"),
        ("-n 1 --gpus '| cat /etc/passwd'", "matches an empty name"),
    ],
)
def test_a_refused_launch_takes_no_gpu_and_leaves_the_environment(shell, simulated, taken_port, line, message):
    gpumagic.use("3")  # what the kernel chose before: it keeps it
    line, message = line.format(port=taken_port), message.format(port=taken_port)
    assert message in refused(shell, "launch_ddp", line, "1")
    assert len(leases.book().held()) == 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("-n 2 --gpus none --timeout 8d", "process group timeout: at most 7d"),
        ("-n 2 --gpus 0,1 --gpus-per-rank 2", "--gpus 0,1 names 2 GPU(s), too few for 2 rank(s) × 2 GPU(s) = 4"),
        ("-n 0 --gpus none", "the number of ranks must be a whole number from 1 to 256, got 0"),
        ("-n 2 --gpus none --backend smoke", "backend"),
        ("-n 1 --gpus 'x?'", "matches an empty name"),
    ],
)
def test_a_refused_launch_without_waiting_says_so_at_once(shell, simulated, line, message):
    """--no-wait launches on a thread; bad input is still a UsageError at once, not a value in -o VAR later."""
    shell.user_ns.pop("out", None)
    assert message in refused(shell, "launch_ddp", f"{line} --no-wait --no-dashboard -o out", "1")
    assert "out" not in shell.user_ns


def test_a_refused_launch_through_the_api_takes_no_gpu(simulated):
    with pytest.raises(InvalidArgument, match="too few"):
        gpumagic.launch_ddp(print, 2, gpus="0,1", gpus_per_rank=2)
    assert leases.book().held() == () and "CUDA_VISIBLE_DEVICES" not in os.environ


@pytest.mark.parametrize(
    ("magic", "line"),
    [
        ("gpu", "use | cat /etc/passwd"),
        ("gpu", "use x?"),
        ("gpu", "use A100|"),
        ("gpu", "use .*"),
        ("gpu", "pick 1 --exclude '|x'"),
        ("launch_bg", "--gpus '| cat /etc/passwd'"),
    ],
)
def test_a_pattern_that_matches_an_empty_name_is_refused(shell, simulated, magic, line):
    message = refused(shell, magic, line, "1" if magic == "launch_bg" else None)
    assert "matches an empty name" in message and "GPU:* or all" in message and ACCEPTED_FORMS in message


def test_a_pattern_that_names_some_gpus_still_works(shell, simulated):
    assert shell.run_line_magic("gpu", "use A100|V100").indices == (0, 1, 2, 3)
    assert shell.run_line_magic("gpu", "use A10.").indices == (0, 1, 2, 3)


OPTIONS = st.tuples(
    st.sampled_from(["-n", "--gpus", "--gpus-per-rank", "--timeout", "--port", "--backend", "--nnodes"]),
    st.sampled_from(
        [
            "1",
            "2",
            "0",
            "-1",
            "3",
            "none",
            "auto",
            "0,1",
            "GPU:*",
            "| x",
            "x?",
            "7d",
            "8d",
            "1000000000d",
            NINES,
            "1e999",
            "nan",
            "gloo",
        ]
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(OPTIONS, max_size=4))
def test_random_launch_options_run_or_are_refused_without_a_trace(shell, simulated, options):
    line = " ".join(f"{flag} {shlex.quote(value)}" for flag, value in options)
    before = state()
    try:
        shell.run_cell_magic("launch_ddp", line + " -o out", "rank")
    except UsageError as err:
        assert str(err).strip() and "\n" not in str(err)
        assert state() == before, f"%%launch_ddp {line} was refused but changed something"
    else:
        assert sorted(shell.user_ns["out"]) == list(range(len(shell.user_ns["out"])))
    finally:
        gpumagic.release()


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("use 'A(1+)+$'", "repeats a repeat"),
        ("use " + ".*" * 11 + "x", "has 11 open-ended repeats (*, +, {n,}), more than 4"),
        ("pick 1 --exclude 'A(B1+)*Z'", "repeats a repeat"),
        ("use 'A(.|\\w)*#'", "repeats a choice of alternatives"),
    ],
)
def test_a_pattern_that_could_match_for_minutes_is_refused(shell, simulated, line, why):
    """Python's regex engine cannot be interrupted: `.*` x 11 took 2.5 s on a GPU name, 4 times more per `.*`."""
    message = refused(shell, "gpu", line)
    assert why in message and "which can take minutes to match" in message


def test_a_refused_elastic_launch_takes_no_gpu(shell, simulated, taken_port):
    gpumagic.use("3")
    message = refused(shell, "launch_ddp", f"-n 1 --gpus 0 --rdzv-endpoint 127.0.0.1:{taken_port}", "1")
    assert f"cannot listen on 127.0.0.1:{taken_port}" in message
    message = refused(shell, "launch_ddp", "-n 1 --gpus 0 --nnodes 1 --runs-dir /proc/1", "1")
    assert "/proc/1" in message
    assert len(leases.book().held()) == 1


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("start --gpus-per-rank 5", "one rank with 5 GPUs needs 5 but 4 are available to this kernel"),
        ("start --gpus all --gpus-per-rank 5", "too few for 1 rank(s) × 5 GPU(s)"),
    ],
)
def test_a_group_wider_than_the_gpus_is_refused_in_one_line_leaving_no_run(shell, simulated, line, says):
    """Issue #24: more GPUs per rank than exist was an IndexError traceback and a failed run left behind."""
    assert says in refused(shell, "ddp", line)

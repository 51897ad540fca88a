"""%gpu on one shared IPython shell: subcommands, help, and random input that must never escape as a traceback."""

import os
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError


def gpu(shell, line):
    return shell.run_line_magic("gpu", line)


def test_status_is_a_table_in_text_and_html(shell, simulated):
    table = gpu(shell, "")
    text, html = repr(table), table._repr_html_()
    assert text.startswith("4 GPUs · SIMULATED (4xA100-80GB)") and "free" in text
    assert "<table" in html and "SIMULATED" in html
    assert repr(gpu(shell, "status")).splitlines()[0] == text.splitlines()[0]


def test_status_shows_leases_and_what_the_kernel_sees(shell, simulated):
    gpu(shell, "pick 2")
    text = repr(gpu(shell, "status"))
    assert text.count("leased by this kernel") == 2 and "cuda:0=GPU 0, cuda:1=GPU 1" in text


def test_pick_use_release_seed(shell, simulated):
    assert "Picked GPU 0, 1" in repr(gpu(shell, "pick 2 --min-free 20GB --max-util 50"))
    assert repr(gpu(shell, "use ['GPU:1', 'GPU:3']")).startswith("Using GPU 1, 3")
    assert gpu(shell, "use A100").indices == (0, 1, 2, 3)
    assert "Released GPU 0, 1, 2, 3" in repr(gpu(shell, "release"))
    assert "held no GPU lease" in repr(gpu(shell, "release"))
    assert "with 3" in repr(gpu(shell, "seed 3"))
    assert os.environ["GPUMAGIC_SEED"] == "3"


def test_variables_expand_in_the_line(shell, simulated):
    shell.user_ns["wanted"] = "0,2"
    assert gpu(shell, "use {wanted}").indices == (0, 2)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("frobnicate", "no subcommand 'frobnicate'"),
        ("pick two", "N must be a whole number"),
        ("pick 0", "from 1 to 64"),
        ("pick 9", "only 4 GPUs"),
        ("pick --min-free lots", "is not a size"),
        ("pick --bogus", "unrecognized arguments"),
        ("pick 1 --wait soon", "is not a duration"),
        ("use", "name the GPUs"),
        ("use 9", "there is no GPU 9"),
        ("use [0", "not a valid list"),
        ("use 0 --bogus", "unknown option"),
        ("seed", "required"),
        ("seed x", "whole number"),
        ("kill abc", "whole number"),
        ("kill 1", "this kernel or one of its parents"),
        ("pick 'unclosed", "No closing quotation"),
        ("watch --interval soon", "is not a duration"),
        ("watch --interval 10ms", "at least 50ms"),
        ("watch --history x", "invalid int"),
        ("watch --history 1", "from 2 to 100000"),
        ("why two", "N must be a whole number"),
        ("why 0", "from 1 to 64"),
        ("why --min-free lots", "is not a size"),
        ("why --wait 1m", "unrecognized arguments"),
    ],
)
def test_bad_input_is_a_one_line_usage_error(shell, simulated, line, message):
    with pytest.raises(UsageError, match=message):
        gpu(shell, line)


def test_help_everywhere(shell):
    assert "%gpu pick" in gpu(shell, "help") and "%gpu use SPEC" in gpu(shell, "--help")
    assert "--min-free SIZE" in gpu(shell, "pick --help")
    assert "GPU:*" in gpu(shell, "help use")
    assert "the process id" in gpu(shell, "kill --help") and "0 to 2**32-1" in gpu(shell, "seed -h")  # required
    doc = shell.find_line_magic("gpu").__doc__
    assert "--deterministic" in doc and "--wait DURATION" in doc  # %gpu? shows every subcommand


def test_why_says_what_a_pick_would_get_and_the_queue_and_takes_nothing(shell, simulated):
    from gpumagic.devices import leases
    from gpumagic.devices.placement import Request, Ticket

    assert repr(gpu(shell, "why")).startswith("A pick of 1 GPU now gets GPU 0 [simulated]\nQueue: nobody waits")
    gpu(shell, "use 0,1")
    Ticket.create("big", Request(3), time.time(), "run-big")
    outlook = repr(gpu(shell, "why 2 --min-free 20GB"))
    assert outlook.startswith("A pick of 2 GPUs with 20.0 GiB free now gets GPU 0, 1"), outlook  # this kernel's
    assert "1. job big: 3 GPUs, waiting 0s; waits — GPU 0: leased by this kernel since" in outlook, outlook
    gpu(shell, "release")
    outlook = repr(gpu(shell, "why 2"))
    assert "gets none (1 of 4 qualify) — GPU 0: goes to job big, ahead in the queue" in outlook, outlook
    assert "1. job big: 3 GPUs, waiting 0s; could start now, on GPU 0, 1, 2" in outlook, outlook
    assert leases.book().held() == () and "why" in gpu(shell, "help")


def test_no_gpus_says_why_and_what_to_do(shell, no_gpu_machine):
    assert "No GPUs: no NVIDIA GPU or driver found" in repr(gpu(shell, "status"))
    with pytest.raises(UsageError, match="GPUMAGIC_SIMULATE"):
        gpu(shell, "pick")


def test_kill_stops_own_gpu_process_and_refuses_others(shell, simulated, no_leftover_children):
    uuid = gpu(shell, "pick 1").uuids[0]
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    report = gpu(shell, f"kill {own.pid}")
    assert own.wait(5) is not None and "SIGTERM" in repr(report)
    stray = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
    )
    try:
        with pytest.raises(UsageError, match="not a compute process on any GPU"):
            gpu(shell, f"kill {stray.pid}")
    finally:
        stray.kill()
        stray.wait()
    if os.getuid() == 0:  # as root, run a GPU process as another user to check the refusal
        other = subprocess.Popen(["sleep", "60"], user=65534, env={"CUDA_VISIBLE_DEVICES": uuid})
        try:
            with pytest.raises(UsageError, match=r"belongs to .*only your own processes"):
                gpu(shell, f"kill {other.pid}")
        finally:
            other.kill()
            other.wait()


def test_kill_refuses_simulated_processes_of_others(shell, tmp_path, monkeypatch):
    path = tmp_path / "s.json"
    path.write_text('{"gpus": [{"processes": [{"pid": 4242, "user": "alice", "memory": "1GB"}]}]}')
    monkeypatch.setenv("GPUMAGIC_SIMULATE", str(path))
    with pytest.raises(UsageError, match="simulated process of alice"):
        gpu(shell, "kill 4242")


SUBCOMMANDS = ["", "status", "pick", "why", "use", "release", "seed", "kill", "help", "bogus"]
WORDS = st.one_of(
    st.sampled_from(
        [
            "2",
            "0",
            "-1",
            "99",
            "--min-free",
            "20GB",
            "50%",
            "--max-util",
            "30",
            "--exclude",
            "0,1",
            "--wait",
            "0s",
            "1ms",
            "--force",
            "--deterministic",
            "--timeout",
            "GPU:*",
            "none",
            "A100",
            "['GPU:0']",
            "-h",
            "'",
            '"',
            "[",
            "{",
            "$x",
            "9999999999",
            "4194304",
            "9" * 400,
            "9" * 400 + "GB",
            "1000000000d",
            "1e999",
            "|",
            "x?",
        ]
    ),
    st.text(max_size=12),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(SUBCOMMANDS), st.lists(WORDS, max_size=5))
def test_random_arguments_work_or_raise_usage_error(shell, simulated, subcommand, words):
    from gpumagic.devices import leases

    line = " ".join([subcommand, *words])
    before = (leases.book().held(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        gpu(shell, line)
    except UsageError as err:
        assert str(err).strip() and "\n" not in str(err)
        assert (leases.book().held(), os.environ.get("CUDA_VISIBLE_DEVICES")) == before, "refused, yet it changed"
    finally:
        gpu(shell, "release")


def test_a_pick_that_no_gpu_can_satisfy_is_refused_in_one_line(shell, simulated):
    with pytest.raises(UsageError) as refused:
        gpu(shell, "pick 1 --min-free 99GB")
    message = str(refused.value)
    assert "\n" not in message and "GPU 0: 80.0 GiB free < 99.0 GiB needed; GPU 1:" in message
    assert message.endswith("or add --wait 10m to wait for one.")

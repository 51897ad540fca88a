"""The project's promises about itself: one test command, binder files, metadata in one place."""

import pytest
import tomllib
from conftest import ROOT


def test_ci_runs_exactly_the_readme_test_command():
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert command.endswith(".venv/bin/python -m pytest -n 3") and "torch==2.13.0" in command  # three workers
    assert "apt-get install -y -qq chromium slurm-wlm munge" in command  # Chromium, a real Slurm, from Debian
    readme = (ROOT / "README.md").read_text()
    assert f"```bash\n{command}\n```" in readme


def test_a_suite_started_in_the_background_starts_its_processes_hearing_sigint():
    """``sh -c 'pytest ...' &`` starts pytest with SIGINT ignored, and every process a test starts inherited it;
    the suite's own set-up turns it back into KeyboardInterrupt, as from a terminal, before any test runs."""
    import signal
    import subprocess
    import sys

    child = "import signal; print(signal.getsignal(signal.SIGINT))"
    session = (
        "import signal, subprocess, sys\n"
        "from conftest import hear_sigint_as_from_a_terminal\n"
        f"before = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True).stdout\n"
        "hear_sigint_as_from_a_terminal()\n"
        f"after = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True).stdout\n"
        "print(before.strip(), '|', after.strip())\n"
    )
    said = subprocess.run(
        [sys.executable, "-c", session],
        capture_output=True,
        text=True,
        cwd=ROOT / "tests",
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as a background command starts
        check=True,
        timeout=60,
    ).stdout.strip()
    assert said == "1 | <built-in function default_int_handler>", said  # 1: SIG_IGN


def test_the_processes_a_session_starts_read_gpumagics_bytecode_instead_of_compiling_it():
    """With PYTHONDONTWRITEBYTECODE set, as here, no process writes bytecode: the session writes gpumagic's and the
    fakes' once, before any test, and a process that imports the ranks' code then compiles none of it."""
    import os
    import subprocess
    import sys

    probe = (
        "from importlib import _bootstrap_external as loading\n"
        "compiled, compile_source = [], loading.SourceLoader.source_to_code\n"
        "def spied(self, data, path, **kw):\n"
        "    compiled.append(path)\n"
        "    return compile_source(self, data, path, **kw)\n"
        "loading.SourceLoader.source_to_code = spied\n"
        "import gpumagic.launch.rank_side.rank, gpumagic.jobs.runner, pynvml\n"
        "print([path for path in compiled if '/gpumagic/' in path or '/fakes/' in path])"
    )
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_longest_shares_of_the_suite_start_first_on_the_workers():
    from collections import OrderedDict

    from conftest import LONGEST_SHARES, longest_first, worker_share

    queue = OrderedDict.fromkeys(["tests/unit/test_a.py", "slurm", "tests/kernel/test_persistent.py", "browser"])
    longest_first(queue)
    assert list(queue) == ["browser", "slurm", "tests/kernel/test_persistent.py", "tests/unit/test_a.py"]
    shares = {worker_share(str(path.relative_to(ROOT))) for path in (ROOT / "tests").rglob("test_*.py")}
    assert set(LONGEST_SHARES) <= shares, set(LONGEST_SHARES) - shares  # none renamed away


def test_binder_has_what_repo2docker_reads():
    binder = ROOT / "binder"
    assert (binder / "runtime.txt").read_text().strip() == "python-3.11"
    requirements = (binder / "requirements.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in requirements
    assert "ipykernel>=7.1" in requirements and "\n.\n" in requirements
    start = (binder / "start").read_text()
    assert "GPUMAGIC_SIMULATE" in start and start.rstrip().endswith('exec "$@"')
    assert (binder / "start").stat().st_mode & 0o111


def test_dependencies_are_the_design_cards():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("<")[0].split("=")[0].strip().lower() for d in project["dependencies"]}
    assert {
        "ipython",
        "ipywidgets",
        "bokeh",
        "jupyter_bokeh",
        "torch",
        "nvidia-ml-py",
        "cloudpickle",
        "psutil",
        "filelock",
        "platformdirs",
    } <= names
    assert "pynvml" not in names  # the deprecated distribution; nvidia-ml-py provides the module
    torch = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert torch == "torch>=2.2,<3"


def test_code_is_lint_clean_and_formatted():
    import subprocess
    import sys

    for command in (["check"], ["format", "--check"]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *command, "gpumagic", "tests", "benchmarks"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "arguments", "expected"),
    [
        (
            "devices.py",
            ["--repeat", "3", "--load-runs", "1"],
            ["%gpu pick 2 --min-free 20GB, 8 simulated GPUs", "pick own work / 20 ms target"],
        ),
        (
            "launch.py",
            [
                "--repeat",
                "1",
                "--steps",
                "20",
                "--cold-runs",
                "1",
                "--throughput-runs",
                "1",
                "--min-runs",
                "1",
                "--skip-accelerate",
                "--dashboard-launches",
                "2",
                "--dashboard-timed",
                "2",  # a p95 needs two
            ],
            ["gpumagic warm relaunch (forkserver)", "throughput gpumagic / torchrun", "the dashboard adds"],
        ),
        (
            "telemetry.py",
            ["--calls", "2000", "--seconds", "0.2", "--watch-seconds", "1"],
            ["gpumagic.log(loss=x)", "per call / 2 µs target", "while %gpu watch streams 8 simulated GPUs"],
        ),
        (
            "jobs.py",
            [
                "--repeats",
                "1",
                "--watch-seconds",
                "2",
                "--watch-jobs",
                "2",
                "--hold-seconds",
                "1",
                "--fair-seconds",
                "3",
            ],
            [
                "job's first line runs after",
                "ratio gpumagic / sleep 5",
                "while %jobs watch follows them",
                "  this checkout                starts",
                "  this checkout                picks",
            ],
        ),
        (
            "dashboards.py",
            ["--skip-watch", "--still-seconds", "2"],
            ["rich view only", "with the picture", "the picture's share"],
        ),
        (
            "compare.py",
            ["--runs", "50", "--points", "100", "--repeat", "1"],
            ["build and first render", "ratio to the 1 s target"],
        ),
        (
            "checkpoint_cost.py",
            ["--mb", "4", "--repeat", "1", "--tensors", "4"],
            ["torch.save", "gpumagic.checkpoint (the call)", "checkpoint / torch.save:"],
        ),
        (
            "tracking.py",
            ["--calls", "2000", "--rounds", "1", "--points", "500", "--launches", "1", "--kinds", "tensorboard"],
            ["ratio tracked / untracked", "the exporter's pace", "MLflow taking connections, never answering"],
        ),
        (
            "big_values.py",
            ["--mb", "4", "--times", "1", "--repeat", "1", "--skip-accelerate"],
            ["through shared memory", "by value, as before", "launch: X adds", "/ one copy of X"],
        ),
    ],
)
def test_benchmark_runs_and_prints_its_table(script, arguments, expected):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *arguments], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr
    for line in expected:
        assert line in result.stdout


@pytest.mark.slow
def test_the_ticket_benchmark_runs_and_prints_its_table():
    import os
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("benchmarks/tickets.py makes two real users (useradd): needs root, as CI runs")
    arguments = ["--only", "reading", "--tickets", "20"]
    result = subprocess.run(
        [sys.executable, "benchmarks/tickets.py", *arguments], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "  this checkout                %gpu status" in result.stdout, result.stdout

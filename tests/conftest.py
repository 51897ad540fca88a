"""Shared fixtures: an isolated lease directory, the devices each test states, the fake NVML, real kernels.

Every test states the devices it needs and never depends on the machine's, so the suite passes the same on
a laptop, in CI and on a GPU server. Outside tests marked ``gpu``, this process and every process it starts
(kernels, ranks, jobs) import the fake ``pynvml`` from ``tests/fakes``; until a test states its devices it
answers as a machine without an NVIDIA driver would, and notes the read, which fails the test. A test
states its devices with the ``simulated`` fixture (or ``GPUMAGIC_SIMULATE``), the ``fake_nvml`` fixture (or
``FAKE_NVML_SCENARIO`` in a kernel), ``no_gpu_machine``, CPU-only launches (``--gpus none``, ``gpus=0``) or the
``gpu`` marker, which gives it the real NVML and CUDA of the machine.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.two_users import shared_tmp, two_users, victim_and_attacker  # noqa: F401 - fixtures of the shared-server tests

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"
UNSTATED = "FAKE_NVML_UNSTATED"  # where the fake notes the reads of a test that stated no devices
STAND_IN_DRIVER = "FAKE_NVML_LIBCUDA"  # the stand-in libcuda.so.1 the fake's nvmlInit loads, as the real one does


def build_stand_in_driver(directory: Path) -> Path:
    """Compile ``tests/fakes/libcuda.c`` into ``directory/libcuda.so.1`` (gcc, about 50 ms)."""
    library = directory / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(FAKES / "libcuda.c")], check=True)
    return library


def load_fake_nvml():
    """A fresh instance of the fake ``pynvml`` module (its scenario from the environment, see its docstring)."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKES / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.hookimpl(tryfirst=True)  # before pytest's own tmp_path factory reads --basetemp
def pytest_configure(config):
    hear_sigint_as_from_a_terminal()
    if not hasattr(config, "workerinput"):  # the session itself, not one of its xdist workers
        config.stash[FOUND_BEFORE] = {place: entries(place) for place in watched_places()}
        write_bytecode_once()
    directory = Path(tempfile.mkdtemp(prefix=SESSION_PREFIX))
    # removed at the interpreter's exit, after what registered later: IPython's history, multiprocessing's pymp-*
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    keep_files_inside(config, directory)
    os.environ[STAND_IN_DRIVER] = str(build_stand_in_driver(directory))
    os.environ[UNSTATED] = str(directory / "unstated-nvml-reads")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKES), os.environ.get("PYTHONPATH")]))
    sys.modules["pynvml"] = load_fake_nvml()


def write_bytecode_once() -> None:
    """Compile gpumagic and the fakes into their ``__pycache__`` before any test: where PYTHONDONTWRITEBYTECODE is
    set (this machine's image sets it) none of the session's 1,800 Python processes (kernels, ranks, job runners)
    writes it, and each compiled what it imports again: about 60 ms of CPU a rank."""
    import compileall

    for folder in (ROOT / "gpumagic", FAKES):
        compileall.compile_dir(folder, quiet=1)


def hear_sigint_as_from_a_terminal() -> None:
    """SIGINT unblocked and turned into KeyboardInterrupt, as when pytest is started from a terminal. A
    non-interactive shell starts a background command (``sh -c 'pytest ...' &``, nohup, some CI runners) with
    SIGINT ignored, and every process the tests start inherited that: an xdist worker's terminal ``%gpu watch``
    printed on through the SIGINT its test sent (3 of 4 fresh-clone runs started so)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)


FOUND_BEFORE = pytest.StashKey[dict]()
# a session's own directory (this one's, or another session's running beside); no "gpumagic" in the tests' paths,
# whose tracebacks are read for it
SESSION_PREFIX = "gm-tests-"


def watched_places() -> list[Path]:
    """Where a test must leave nothing: the machine's temporary directory and this user's home."""
    return [Path(tempfile.gettempdir()), Path(os.path.expanduser("~"))]


def entries(place: Path) -> set[str]:
    try:
        return {name for name in os.listdir(place) if not name.startswith(SESSION_PREFIX)}
    except OSError:
        return set()


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if anything new is left in /tmp or the home directory (``keep_files_inside``)."""
    before = session.config.stash.get(FOUND_BEFORE, None)
    if before is None:
        return
    left = sorted(str(place / name) for place, names in before.items() for name in entries(place) - names)
    if left:
        session.config.stash[LEFT_BEHIND] = left
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


LEFT_BEHIND = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left = config.stash.get(LEFT_BEHIND, None)
    if left:
        terminalreporter.write_line(
            f"FAILED: the session left {len(left)} files behind (keep_files_inside in tests/conftest.py): "
            + ", ".join(left[:20]),
            red=True,
        )


def keep_files_inside(config, directory: Path) -> None:
    """Everything the session writes stays in ``directory``, removed at its end: the tests' ``tmp_path``s, the
    temporary files of every process started (``TMPDIR``: torch's ``pymp-*`` and ``torchelastic_*``, the
    benchmarks' ``gpumagic-bench-*``, the other users' of the shared-server tests) and what kernels, Jupyter,
    Chromium and gpumagic keep in a home directory (``HOME``: ``~/.ipython``, ``~/.local``, ``~/.cache``)."""
    directory.chmod(0o755)  # the other users of the shared-server tests reach their TMPDIR through it
    temporary, home = directory / "tmp", directory / "home"
    temporary.mkdir(mode=0o1777)
    temporary.chmod(0o1777)  # as /tmp: anyone may write, no one may remove another's files
    home.mkdir(mode=0o700)
    os.environ["TMPDIR"] = str(temporary)
    tempfile.tempdir = None  # read TMPDIR again
    os.environ["HOME"] = str(home)
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_RUNTIME_DIR"):
        os.environ.pop(name, None)
    if getattr(config.option, "basetemp", None) is None:
        config.option.basetemp = str(directory / "basetemp")


SLOW_FOLDERS = ("tests/kernel/", "tests/browser/", "tests/gpu/")  # real kernels, browsers, GPUs: seconds each
SLURM_MODULES = (  # share one cluster
    "tests/kernel/test_slurm.py",
    "tests/kernel/test_slurm_cluster.py",
    "tests/kernel/test_slurm_group.py",
)


def pytest_itemcollected(item):
    """The tiers: tests in the folders of real kernels, browsers and GPUs are ``slow`` (unit tests that take seconds
    say so themselves), so ``pytest -m "not slow"`` is the inner loop."""
    if item.nodeid.startswith(SLOW_FOLDERS):
        item.add_marker(pytest.mark.slow)


def worker_share(nodeid: str) -> str:
    """The tests that run on one xdist worker, one after another: a module's (its module fixtures start once),
    every browser test (two Chromiums beside a JupyterLab each starve one another on two cores), every GPU test
    (one machine's GPUs), and the modules that use the session's Slurm cluster (one cluster: its node names and
    network namespaces are the machine's)."""
    module = nodeid.split("::")[0]
    if module.startswith("tests/browser/"):
        return "browser"
    if module.startswith("tests/gpu/"):
        return "gpu"
    return "slurm" if module in SLURM_MODULES else module


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # without pytest-xdist the suite runs in one process
    LoadScopeScheduling = None

# The shares that take longest (summed test times of a fresh-clone run on an idle 2-core machine): started first,
# each on a worker of its own, so that the run does not end waiting for one of them started last
LONGEST_SHARES = (
    "browser",  # 530 s
    "slurm",  # 220 s
    "tests/kernel/test_notebooks.py",  # 160 s
    "tests/unit/test_project.py",  # 140 s
    "tests/kernel/test_launch_trials.py",  # 110 s
    "tests/kernel/test_persistent.py",  # 105 s
)


def longest_first(queue: dict) -> None:
    """Put ``LONGEST_SHARES`` at the head of xdist's queue of shares (an OrderedDict), in that order."""
    for share in reversed(LONGEST_SHARES):
        if share in queue:
            queue.move_to_end(share, last=False)


if LoadScopeScheduling is not None:

    class SharedWorkerScheduling(LoadScopeScheduling):
        """xdist's scheduling by scope, the scopes being ``worker_share``'s (xdist's own ``xdist_group`` marker does
        not reach its scheduler under pytest 9, whose nodes keep their id elsewhere), the longest first."""

        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return worker_share(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first assignment: the queue is whole
                self.ordered = True
                longest_first(self.workqueue)
            super()._assign_work_unit(node)

    @pytest.hookimpl(tryfirst=True)  # before xdist's own choice of scheduler
    def pytest_xdist_make_scheduler(config, log):
        return SharedWorkerScheduling(config, log)


@pytest.fixture(autouse=True)
def devices_stated(request, monkeypatch):
    """Fail a test that read the machine's GPUs (NVML) without stating the devices it needs; give tests
    marked ``gpu`` the machine's real NVML and CUDA instead of the fake."""
    from gpumagic.devices import nvml

    if request.node.get_closest_marker("gpu"):
        machine = machine_environment()
        for name in (UNSTATED, STAND_IN_DRIVER, "FAKE_NVML_SCENARIO", "PYTHONPATH"):
            if name in machine:
                monkeypatch.setenv(name, machine[name])
            else:
                monkeypatch.delenv(name, raising=False)
        monkeypatch.delitem(sys.modules, "pynvml", raising=False)
        nvml.reset()
        yield
        nvml.reset()
        return
    reads = Path(os.environ[UNSTATED])
    before = reads.stat().st_size if reads.exists() else 0
    nvml.reset()
    yield
    nvml.reset()
    if reads.exists() and reads.stat().st_size > before:
        with open(reads, "rb") as handle:
            handle.seek(before)
            who = handle.read().decode(errors="replace").strip()
        pytest.fail(
            "this test read the machine's GPUs without stating the devices it needs (simulated, fake_nvml, "
            f"no_gpu_machine, --gpus none / gpus=0, or the gpu marker); NVML was read by:\n{who}",
            pytrace=False,
        )


_GPU_PROBE = """
import json
facts = {}
try:
    import pynvml
    pynvml.nvmlInit()
    facts["gpus"] = pynvml.nvmlDeviceGetCount()
    facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
except Exception as err:
    facts["nvml"] = f"{type(err).__name__}: {err}"
try:
    import torch
    facts["torch"] = torch.__version__
    facts["cuda"] = torch.version.cuda
except Exception as err:
    facts["torch"] = f"{type(err).__name__}: {err}"
print(json.dumps(facts))
"""


def machine_environment() -> dict[str, str]:
    """This process's environment with the machine's own NVML: no fake ``pynvml`` on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML")}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != FAKES]
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    else:
        env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="session")
def real_gpu() -> dict:
    """For the ``gpu`` set: what the machine has (GPUs, driver, torch and its CUDA), probed once in a child
    process so that this one never starts CUDA. Skips the test, with the reason, where any is missing."""
    out = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True, env=machine_environment())
    try:
        facts = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        pytest.skip(f"could not probe this machine for a GPU: {out.stderr.strip()[-300:]}")
    if "nvml" in facts:
        pytest.skip(f"no NVIDIA driver here ({facts['nvml']})")
    if not facts.get("gpus"):
        pytest.skip("the NVIDIA driver reports no GPU here")
    if not facts.get("cuda"):
        pytest.skip(f"torch {facts.get('torch')} here is not a CUDA build")
    return facts


@pytest.fixture(autouse=True)
def isolated_leases(tmp_path_factory, monkeypatch):
    """Every test gets its own lease directory, a clean CUDA environment and a fresh count of other users'
    hold-ups; no leases leak out."""
    from gpumagic.devices.hold_ups import hold_ups

    hold_ups().clear()
    directory = tmp_path_factory.mktemp("leases")
    monkeypatch.setenv("GPUMAGIC_LEASE_DIR", str(directory))
    monkeypatch.setenv("GPUMAGIC_RUNS_DIR", str(tmp_path_factory.mktemp("runs")))
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPUMAGIC_SIMULATE", "GPUMAGIC_SEED", "GPUMAGIC_RUN_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):  # run inside an allocation
        monkeypatch.delenv(name, raising=False)  # or not, a test sees none unless it makes one (slurm_cluster)
    yield directory
    from gpumagic.devices import leases, visibility

    leases.book().release_all()
    visibility.restore()
    for thread in threading.enumerate():  # the idle-lease thread ends as the last lease goes: no thread of one
        if thread.name == "gpumagic-idle-leases":  # test's is counted in the next's (test_widgets counts them)
            thread.join(timeout=5)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm cluster of two nodes on this machine (``tests/slurm_cluster.py``), for the session. Skipped,
    with the reason, only where the machine cannot start one (not root, no slurm-wlm): a start that fails fails."""
    from tests import slurm_cluster as cluster

    reason = cluster.cannot_start()
    if reason:
        pytest.skip(f"no Slurm cluster here: {reason}")
    running = cluster.start(2)
    yield running
    running.stop()


@pytest.fixture
def on_cluster(slurm_cluster, monkeypatch, no_job_left_running):
    """This process and the kernels it starts use the test cluster; Slurm's answers are not cached."""
    for name, value in slurm_cluster.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("GPUMAGIC_SLURM", raising=False)
    from gpumagic.jobs import slurm  # here: the session imports no part of gpumagic before a test asks for it

    monkeypatch.setattr(slurm, "STATE_CACHE_S", 0.0)
    yield slurm_cluster
    slurm_cluster.run("scancel", "--user=root", check=False)  # the allocations and jobs a test left


@pytest.fixture
def allocation(on_cluster):
    """A two-node allocation, as ``salloc -N 2`` gives a login node's shell; cancelled after the test."""
    job_id, env = on_cluster.allocation(2)
    yield env
    on_cluster.run("scancel", job_id, check=False)


@pytest.fixture
def simulated(monkeypatch):
    """Four simulated A100s."""
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "4xA100-80GB")
    return "4xA100-80GB"


@pytest.fixture
def fake_nvml(monkeypatch):
    """The fake ``pynvml`` with its default 4-GPU scenario, here and in the kernels the test starts."""
    monkeypatch.setenv("FAKE_NVML_SCENARIO", "default")
    module = load_fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    from gpumagic.devices import nvml

    nvml.reset()
    yield module
    nvml.reset()


@pytest.fixture
def no_gpu_machine(fake_nvml, monkeypatch):
    """A machine without an NVIDIA driver (libnvidia-ml.so.1 missing), here and in the kernels the test starts."""
    fake_nvml.configure(fake_nvml.NO_DRIVER)
    monkeypatch.setenv("FAKE_NVML_SCENARIO", "no-driver")
    return fake_nvml


@pytest.fixture(scope="module")
def shell():
    """One in-process IPython shell with gpumagic loaded, for a test module's magics."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.extension_manager.load_extension("gpumagic")
    return ip


@pytest.fixture
def no_job_left_running():
    """Whatever a test does, the background jobs it started end with it."""
    yield
    import gpumagic
    from gpumagic.run_dirs import records

    for job in gpumagic.list_jobs():
        if job.status in records.ACTIVE:
            job.kill(grace_s=1)


@pytest.fixture
def no_leftover_children():
    """After the test, no process started during it is still alive."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline_children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(deadline_children, timeout=5)
    assert not alive, f"processes left behind: {[(p.pid, p.name()) for p in alive]}"


@dataclass
class CellResult:
    """What one execution in a real kernel produced."""

    status: str
    stdout: str = ""
    stderr: str = ""
    text: list[str] = field(default_factory=list)  # text/plain of execute_result and display_data
    html: list[str] = field(default_factory=list)
    mimetypes: list[str] = field(default_factory=list)  # of every display in order
    error: tuple[str, str] | None = None  # (ename, evalue)
    prompts: list[str] = field(default_factory=list)  # what input() asked, in order (``answers``)
    times: list[tuple[float, str]] = field(default_factory=list)  # (monotonic arrival, text) of each stream
    execution_count: int = 0  # the cell's number, as its prompt shows it

    @property
    def all_text(self) -> str:
        return self.stdout + "\n".join(self.text)


class Kernel:
    """A real IPython kernel (jupyter_client) with its own environment."""

    def __init__(self, env: dict[str, str]) -> None:
        from jupyter_client.manager import KernelManager

        for attempt in (1, 2):
            self.manager = KernelManager(kernel_name="python3")
            self.manager.start_kernel(env=env, extra_arguments=["--HistoryManager.enabled=False"])
            self.client = self.manager.client()
            self.client.start_channels()
            try:
                self.client.wait_for_ready(timeout=60)
                return
            except RuntimeError:  # "Kernel died before replying to kernel_info", or no answer in 60 s
                # jupyter_client picks five free TCP ports by binding and closing them; another process of the
                # run can take one before the kernel binds it ("Address already in use", one fresh-clone run):
                # a kernel that died so is started once more, on other ports; one that is alive but silent, or
                # that dies twice, fails the test
                died = not self.manager.is_alive()
                self.client.stop_channels()
                self.manager.shutdown_kernel(now=True)
                if attempt == 2 or not died:
                    raise

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def run(self, code: str, timeout: float = 60, answers: list[str] | None = None) -> CellResult:
        """Run ``code``; ``answers``: the lines typed into its input boxes (``input()``, a debugger's prompt),
        one per prompt, in order (the cell gets an input box only when answers are given)."""
        result = CellResult(status="?")
        remaining = list(answers or [])

        def answer(message: dict) -> None:
            result.prompts.append(message["content"]["prompt"])
            self.client.input(remaining.pop(0) if remaining else "q")

        def collect(message: dict) -> None:
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                result.times.append((time.monotonic(), content["text"]))
                if content["name"] == "stdout":
                    result.stdout += content["text"]
                else:
                    result.stderr += content["text"]
            elif kind in ("execute_result", "display_data", "update_display_data"):
                result.mimetypes += list(content["data"])
                result.text.append(content["data"].get("text/plain", ""))
                if "text/html" in content["data"]:
                    result.html.append(content["data"]["text/html"])
            elif kind == "error":
                result.error = (content["ename"], content["evalue"])

        reply = self.client.execute_interactive(
            code, timeout=timeout, output_hook=collect, allow_stdin=answers is not None, stdin_hook=answer
        )
        result.status = reply["content"]["status"]
        result.execution_count = reply["content"].get("execution_count", 0)
        if result.status == "error" and result.error is None:  # UsageError goes to stderr, not as an error message
            result.error = (reply["content"].get("ename", ""), reply["content"].get("evalue", ""))
        return result

    def interrupt(self, timeout: float = 60) -> tuple[dict, float]:
        """Interrupt the cell running (sent with ``client.execute``): its reply's content and the seconds from the
        interrupt to the reply; the cell's remaining output is drained."""
        interrupted = time.monotonic()
        self.manager.interrupt_kernel()
        reply = self.client.get_shell_msg(timeout=timeout)
        took = time.monotonic() - interrupted
        while True:
            try:
                self.client.get_iopub_msg(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty: drained
                break
        return reply["content"], took

    def ok(self, code: str, timeout: float = 60) -> CellResult:
        result = self.run(code, timeout)
        assert result.status == "ok" and result.error is None, f"{code!r} failed: {result.error} {result.stderr}"
        return result

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def kernel_env(lease_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "GPUMAGIC_", "JPY_"))}
    env["GPUMAGIC_LEASE_DIR"] = str(lease_dir)
    env["GPUMAGIC_RUNS_DIR"] = os.environ.get("GPUMAGIC_RUNS_DIR") or str(lease_dir.parent / "runs")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


@contextlib.contextmanager
def cpu_kernel(tmp_path_factory, setup: str) -> Iterator[Kernel]:
    """A real kernel that sees no GPU (its ranks run on the CPU with gloo), ``setup`` run in it first; for a
    module-scoped fixture: ``with cpu_kernel(tmp_path_factory, "%load_ext gpumagic") as k: yield k``."""
    kernel = Kernel(kernel_env(tmp_path_factory.mktemp("leases"), CUDA_VISIBLE_DEVICES=""))
    try:
        kernel.ok(setup)
        yield kernel
    finally:
        kernel.shutdown()


@pytest.fixture
def start_kernel(isolated_leases):
    """Start real kernels: ``start_kernel(GPUMAGIC_SIMULATE=...)``; all are shut down after the test."""
    kernels: list[Kernel] = []

    def start(**extra: str) -> Kernel:
        kernel = Kernel(kernel_env(isolated_leases, **extra))
        kernels.append(kernel)
        return kernel

    yield start
    for kernel in kernels:
        try:
            kernel.shutdown()
        except Exception:  # noqa: BLE001 - a kernel a test killed on purpose cannot shut down cleanly
            pass


@pytest.fixture(scope="module")
def jupyter_servers(tmp_path_factory):
    """The module's Jupyter servers (``tests/browser/pages.py``: one per front end, started on first use)."""
    from tests.browser.pages import JupyterServers

    servers = JupyterServers(tmp_path_factory.mktemp("jupyter"))
    yield servers
    servers.stop()


@pytest.fixture
def jupyterlab(jupyter_servers):
    """Serve a notebook of the given cells, its kernel in this test's environment: ``url = jupyterlab(cells,
    theme=..., front_end="lab" | "hub" | "notebook", **env)``; the test's kernels end with it."""

    def start(cells: list[str], theme: str | None = None, front_end: str = "lab", **env_extra: str) -> str:
        return jupyter_servers.notebook_url(cells, theme, front_end, env_extra)

    yield start
    jupyter_servers.shut_down_kernels()


@pytest.fixture
def artifacts():
    """Where screenshots go (kept by CI)."""
    from tests.browser.pages import artifacts_folder

    return artifacts_folder()

"""Shared fixtures: an isolated lease directory, the simulated inventory, the fake NVML, real kernels."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"


@pytest.fixture(autouse=True)
def isolated_leases(tmp_path_factory, monkeypatch):
    """Every test gets its own lease directory and a clean CUDA environment; no leases leak out."""
    directory = tmp_path_factory.mktemp("leases")
    monkeypatch.setenv("GPUMAGIC_LEASE_DIR", str(directory))
    monkeypatch.setenv("GPUMAGIC_RUNS_DIR", str(tmp_path_factory.mktemp("runs")))
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPUMAGIC_SIMULATE", "GPUMAGIC_SEED", "GPUMAGIC_RUN_DIR"):
        monkeypatch.delenv(name, raising=False)
    yield directory
    from gpumagic.devices import leases, visibility

    leases.book().release_all()
    visibility.restore()


@pytest.fixture
def simulated(monkeypatch):
    """Four simulated A100s."""
    monkeypatch.setenv("GPUMAGIC_SIMULATE", "4xA100-80GB")
    return "4xA100-80GB"


@pytest.fixture
def fake_nvml(monkeypatch):
    """The fake ``pynvml`` in place of the real one, configured with its default 4-GPU scenario."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKES / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    from gpumagic.devices import nvml

    nvml.reset()
    yield module
    nvml.reset()


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
    from gpumagic.jobs import records

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

    @property
    def all_text(self) -> str:
        return self.stdout + "\n".join(self.text)


class Kernel:
    """A real IPython kernel (jupyter_client) with its own environment."""

    def __init__(self, env: dict[str, str]) -> None:
        from jupyter_client.manager import KernelManager

        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(env=env, extra_arguments=["--HistoryManager.enabled=False"])
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def run(self, code: str, timeout: float = 60) -> CellResult:
        result = CellResult(status="?")

        def collect(message: dict) -> None:
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
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

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=collect)
        result.status = reply["content"]["status"]
        if result.status == "error" and result.error is None:  # UsageError goes to stderr, not as an error message
            result.error = (reply["content"].get("ename", ""), reply["content"].get("evalue", ""))
        return result

    def ok(self, code: str, timeout: float = 60) -> CellResult:
        result = self.run(code, timeout)
        assert result.status == "ok" and result.error is None, f"{code!r} failed: {result.error} {result.stderr}"
        return result

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def kernel_env(lease_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "GPUMAGIC_", "FAKE_NVML", "JPY_"))}
    env["GPUMAGIC_LEASE_DIR"] = str(lease_dir)
    env["GPUMAGIC_RUNS_DIR"] = os.environ.get("GPUMAGIC_RUNS_DIR") or str(lease_dir.parent / "runs")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


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

"""Two real Unix users on this machine, for the shared-server tests (issue #12).

As root, the ``two_users`` fixture creates two users with ``useradd -m`` (``gmA…`` and ``gmB…``: Alice and
Bob), runs code as each with ``runuser -u``, and removes them with ``userdel -r`` after the test, killing
whatever they left running. Elsewhere (not root, no ``useradd``, or a checkout other users cannot read) the
tests that need it skip with the reason.

Each user runs Python with this checkout's ``gpumagic`` and the test environment's packages
(``PYTHONPATH``), and the fake ``pynvml`` of ``tests/fakes``: they state their devices with
``GPUMAGIC_SIMULATE``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"


@dataclass
class UnixUser:
    """A real user of this machine, made for one test."""

    name: str
    uid: int
    gid: int
    home: Path
    python: str
    base_env: dict[str, str] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        return {**self.base_env, "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name, **extra}

    def command(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", self.name, "--", *argv]

    def run(self, code: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        """Run Python ``code`` as this user (in their home); stdout and stderr captured as text. On timeout
        everything it started is killed and ``subprocess.TimeoutExpired`` raised."""
        argv = self.command([self.python, "-c", textwrap.dedent(code)])
        with subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(**env),
            cwd=self.home,
            start_new_session=True,
        ) as process:
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
                raise
        return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)

    def json(self, code: str, timeout: float = 60, **env: str) -> dict:
        """Run ``code`` as this user; it prints one JSON object last; fails the test on a non-zero exit."""
        out = self.run(code, timeout=timeout, **env)
        assert out.returncode == 0, f"{self.name} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
        return json.loads(out.stdout.strip().splitlines()[-1])

    def popen(self, argv: list[str], **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(argv),
            env=self.env(**env),
            cwd=self.home,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def session(self, **env: str) -> Session:
        """A long-lived Python process of this user (a kernel, say) that runs the statements it is sent."""
        process = subprocess.Popen(
            self.command([self.python, "-c", _SESSION]),
            env=self.env(**env),
            cwd=self.home,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        session = Session(process)
        session.pid = session.run("import os; result = os.getpid()")["value"]
        return session

    def sh(self, script: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(["sh", "-c", script]), capture_output=True, text=True, timeout=timeout, env=self.env()
        )


_SESSION = """
import json, sys, traceback
namespace = {}
for line in sys.stdin:
    namespace["result"] = None
    try:
        exec(json.loads(line), namespace)
        answer = {"value": namespace["result"]}
    except BaseException as err:
        answer = {"error": type(err).__name__, "message": str(err), "traceback": traceback.format_exc()}
    print(json.dumps(answer, default=repr), flush=True)
"""


class Session:
    """Statements sent to a user's long-lived Python process; each answers ``{"value": result}`` (what the
    code put in ``result``) or ``{"error", "message", "traceback"}``."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.pid = 0

    def run(self, code: str, timeout: float = 60) -> dict:
        import selectors

        self.process.stdin.write(json.dumps(textwrap.dedent(code)) + "\n")
        self.process.stdin.flush()
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise TimeoutError(f"no answer in {timeout}s to: {code.strip()[:200]}")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the session ended (exit {self.process.wait()}) running: {code.strip()[:200]}")
        return json.loads(line)

    def value(self, code: str, timeout: float = 60):
        answer = self.run(code, timeout)
        assert "error" not in answer, answer.get("traceback")
        return answer["value"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create two real users (useradd, runuser, userdel): CI runs as root"
    for tool in ("useradd", "runuser", "userdel"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed here"
    return None


def _package_path() -> list[str]:
    paths = [str(ROOT), str(FAKES)]
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths()[key]
        if path not in paths:
            paths.append(path)
    return paths


def _python_for(user: str, env: dict[str, str]) -> str | None:
    """A Python interpreter ``user`` can run that imports gpumagic and its dependencies here."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, os.path.realpath(sys.executable), shutil.which(version), f"/usr/bin/{version}"]
    for candidate in dict.fromkeys(c for c in candidates if c):
        out = subprocess.run(
            ["runuser", "-u", user, "--", candidate, "-c", "import gpumagic, psutil, cloudpickle, platformdirs"],
            capture_output=True,
            env=env,
            cwd="/",
        )
        if out.returncode == 0:
            return candidate
    return None


def _create(prefix: str) -> UnixUser:
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True, capture_output=True)
    import pwd

    entry = pwd.getpwnam(name)
    return UnixUser(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir), python="")


def _remove(user: UnixUser) -> None:
    for process in psutil.process_iter(["uids"]):
        with contextlib.suppress(psutil.Error):
            if process.info["uids"] and process.info["uids"].real == user.uid:
                process.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        out = subprocess.run(["userdel", "-r", user.name], capture_output=True, text=True)
        if out.returncode in (0, 6):  # 6: no such user
            return
        time.sleep(0.1)  # "user is currently used by process": the kill has not landed yet
    subprocess.run(["userdel", "-r", "-f", user.name], capture_output=True)


@contextlib.contextmanager
def created_users(package_path: list[str] | None = None, prefixes: tuple[str, str] = ("gma", "gmb")):
    """(alice, bob): two real users running Python with ``package_path`` (this checkout, the fakes and the
    test environment's packages by default), named ``prefixes`` and a random tail, removed on exit. Raises
    ``Unavailable`` with the reason where that cannot be done here."""
    why = _why_not()
    if why:
        raise Unavailable(why)
    users = []
    try:
        for prefix in prefixes:
            users.append(_create(prefix))
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONPATH": os.pathsep.join(package_path or _package_path()),
            "PYTHONDONTWRITEBYTECODE": "1",
            "MPLBACKEND": "Agg",
            "OMP_NUM_THREADS": "1",
            "TMPDIR": tempfile.gettempdir(),  # the session's (sticky, as /tmp), removed with it
        }
        python = _python_for(users[0].name, env)
        if python is None:
            raise Unavailable(
                f"other users cannot run this checkout's Python and packages ({', '.join(_package_path())})"
            )
        for user in users:
            user.python = python
            user.base_env = dict(env)
        yield users[0], users[1]
    finally:
        for user in users:
            _remove(user)


def last_report(process: subprocess.Popen, timeout: float = 30) -> dict:
    """The last JSON line an attacker's process printed, once it ended (killed after ``timeout``)."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    reports = [line for line in output.decode().strip().splitlines() if line.startswith("{")]
    if not reports:
        pytest.fail(f"the attacker reported nothing (exit {process.returncode}): {output.decode()[-2000:]}")
    return json.loads(reports[-1])


class Unavailable(Exception):
    """Two real users cannot be made here; the message says why."""


@pytest.fixture
def two_users(tmp_path):
    """(alice, bob): two real users, removed after the test. ``alice.base_env`` holds the shared settings."""
    try:
        with created_users() as users:
            yield users
    except Unavailable as why:
        pytest.skip(str(why))


@pytest.fixture
def victim_and_attacker(tmp_path):
    """(victim, attacker): two real users named unlike the other tests' (``gmv…``, ``gmx…``), removed after."""
    try:
        with created_users(prefixes=("gmv", "gmx")) as users:
            yield users
    except Unavailable as why:
        pytest.skip(str(why))


@pytest.fixture
def shared_tmp():
    """A root-owned directory (0755) under /tmp that both users can traverse; removed after the test."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="gpumagic-shared-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def shared_directory(path: Path, mode: int = 0o1777) -> Path:
    """A directory as an administrator would make it for everyone: root-owned, ``mode``."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, 0, 0)
    os.chmod(path, mode)
    return path

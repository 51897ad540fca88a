"""A swallowed failure leaves a line in a log. Every broad ``except`` in gpumagic (``Exception``,
``BaseException``, bare; ``OSError`` whose body only passes, continues or returns; ``suppress(Exception)``)
re-raises or logs, read from the source with ``ast``; the ``gpumagic`` logger is quiet, and ``GPUMAGIC_DEBUG=1``
shows the lines on stderr, in a real process and in a launch's ranks."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpumagic.launch.plan import command_environment, launch_environment

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpumagic"
BROAD = {"Exception", "BaseException"}
OS_ERRORS = {"OSError", "IOError", "EnvironmentError", "socket.error", "select.error"}
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "log"}

# (file, function) -> why no line can be logged there. Only where logging cannot help: keep it short.
WHITELIST = {
    ("gpumagic/launch/rank_side/rank_server.py", "_end_children"): (
        "the rank server's last flush of stdout and stderr before os._exit: a line would go to the very stream "
        "that failed, and nothing reads the server after"
    ),
}


def _caught(handler: ast.ExceptHandler) -> set[str]:
    if handler.type is None:
        return {"<bare>"}
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return {ast.unparse(t) for t in types}


def _only_leaves(body: list[ast.stmt]) -> bool:
    """A body that does nothing but pass, continue or return (a value or not)."""
    return all(isinstance(s, ast.Pass | ast.Continue | ast.Return) for s in body)


def _own_nodes(body: list[ast.stmt]):
    """The nodes of ``body``, not those of functions or classes defined in it (they run later, if ever)."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))


def _loggers(tree: ast.Module) -> set[str]:
    """The module-level names bound to ``logging.getLogger(...)``."""
    return {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        if ast.unparse(node.value.func) == "logging.getLogger"
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _logs_or_raises(body: list[ast.stmt], loggers: set[str]) -> bool:
    for node in _own_nodes(body):
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_METHODS:
            if isinstance(node.func.value, ast.Name) and node.func.value.id in loggers:
                return True
    return False


def swallowed(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) of each broad handler in ``source`` that neither re-raises nor logs."""
    tree = ast.parse(source)
    loggers = _loggers(tree)
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if isinstance(node, ast.ExceptHandler):
            caught = _caught(node)
            broad = caught & (BROAD | {"<bare>"}) or (caught & OS_ERRORS and _only_leaves(node.body))
            if broad and not _logs_or_raises(node.body, loggers):
                found.append((node.lineno, function, "except " + ", ".join(sorted(caught))))
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and ast.unparse(call.func).split(".")[-1] == "suppress":
                    if {ast.unparse(a) for a in call.args} & BROAD:
                        found.append((node.lineno, function, ast.unparse(call)))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


def package_swallows() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(ROOT))
        for line, function, what in swallowed(path.read_text()):
            found.setdefault((name, function), []).append(f"{name}:{line} ({function}): {what}")
    return found


def test_every_broad_except_in_gpumagic_logs_or_re_raises():
    silent = [line for key, lines in package_swallows().items() if key not in WHITELIST for line in lines]
    assert not silent, (
        "a swallowed failure must leave a line: add _log.debug('what failed and what was done instead', "
        "exc_info=True) (_log = logging.getLogger(__name__)), or re-raise:\n" + "\n".join(silent)
    )


def test_the_whitelist_names_only_places_that_still_swallow():
    found = package_swallows()
    stale = [key for key in WHITELIST if key not in found]
    assert not stale, f"these places no longer swallow: take them off the whitelist: {stale}"


def test_the_checker_sees_each_kind_of_silent_swallow():
    source = textwrap.dedent(
        """
        import contextlib, logging
        _log = logging.getLogger(__name__)

        def f():
            try: g()
            except Exception: pass
            try: g()
            except: return None
            try: g()
            except (OSError, ValueError): continue
            with contextlib.suppress(Exception): g()
            try: g()
            except BaseException as err: record(err)

        def fine():
            try: g()
            except Exception: _log.debug("g failed; none", exc_info=True)
            try: g()
            except BaseException: cleanup(); raise
            try: g()
            except FileNotFoundError: pass
            try: g()
            except OSError as err: value = str(err)
            with contextlib.suppress(OSError): g()
            try: g()
            except Exception:
                def later(): raise
        """
    )
    found = [(line, function) for line, function, _ in swallowed(source)]
    assert found == [(7, "f"), (9, "f"), (11, "f"), (12, "f"), (14, "f"), (27, "fine")]


def test_every_module_logs_under_its_own_name():
    """One logger per module, named for it: every line falls under the ``gpumagic`` logger and says its room."""
    other = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "logging.getLogger":
                if [ast.unparse(a) for a in node.args] != ["__name__"] and path.name != "debug_log.py":
                    other.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not other, "use logging.getLogger(__name__): " + ", ".join(other)


SCRIPT = """
import logging, sys
from pathlib import Path
from gpumagic.run_dirs.outcomes import read_json

assert read_json(Path(sys.argv[1])) is None  # not JSON: swallowed, and logged
logging.getLogger("gpumagic.elsewhere").warning("a warning, as before")
logging.basicConfig(format="root: %(message)s")
logging.getLogger("gpumagic.elsewhere").warning("once")
"""


def _environment(debug: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GPUMAGIC_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env if debug is None else {**env, "GPUMAGIC_DEBUG": debug}


@pytest.mark.parametrize("debug", [None, "0", "1"])
def test_a_swallowed_failure_prints_its_line_with_gpumagic_debug_only(tmp_path, debug):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(bad)],
        capture_output=True,
        text=True,
        env=_environment(debug),
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    if debug != "1":  # quiet: warnings reach stderr as Python's last resort put them, once
        assert done.stderr == "a warning, as before\nroot: once\n"
        return
    lines = done.stderr.splitlines()
    first = next(line for line in lines if "gpumagic.run_dirs.outcomes" in line)
    assert first.endswith(f"gpumagic.run_dirs.outcomes DEBUG: {bad} is unreadable or not JSON; taken as absent")
    assert "json.decoder.JSONDecodeError: Expecting property name enclosed in double quotes" in done.stderr
    assert sum(line.endswith("WARNING: a warning, as before") for line in lines) == 1
    onces = [line for line in lines if line.endswith(": once")]  # GPUMAGIC_DEBUG's own line, and the root's
    assert len(onces) == 2 and onces[0].endswith("gpumagic.elsewhere WARNING: once") and onces[1] == "root: once"


def test_importing_gpumagic_quietly_leaves_logging_unimported(tmp_path):
    """Quiet is Python's default: ``import gpumagic`` pays nothing for it (it stays about 20 ms)."""
    code = "import sys, gpumagic; print('logging' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_environment(None), cwd=tmp_path, check=True
    )
    assert done.stdout == "False\n", done.stderr


def test_processes_gpumagic_starts_inherit_gpumagic_debug(monkeypatch):
    monkeypatch.setenv("GPUMAGIC_DEBUG", "1")
    assert launch_environment()["GPUMAGIC_DEBUG"] == "1"  # ranks
    assert command_environment()["GPUMAGIC_DEBUG"] == "1"  # agents and job runners (python -m gpumagic...)


RANKS = """
import os, sys
from pathlib import Path

import gpumagic
from gpumagic.run_dirs.outcomes import read_json


def read_bad_json(path):
    assert read_json(Path(path)) is None


if __name__ == "__main__":
    gpumagic.launch_ddp(read_bad_json, 1, args=(sys.argv[1],), gpus="none", output="all")
    print("--- GPUMAGIC_DEBUG=1 ---", flush=True)
    os.environ["GPUMAGIC_DEBUG"] = "1"  # the rank server is running, quiet: the launch's environment decides
    gpumagic.launch_ddp(read_bad_json, 1, args=(sys.argv[1],), gpus="none", output="all")
"""


def test_a_ranks_swallowed_failure_shows_with_gpumagic_debug_at_its_launch(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    done = subprocess.run(
        [sys.executable, "-c", RANKS, str(bad)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_environment(None),
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout
    quiet, loud = done.stdout.split("--- GPUMAGIC_DEBUG=1 ---\n")
    assert "DEBUG" not in quiet, quiet
    shown = [line for line in loud.splitlines() if "is unreadable or not JSON" in line]
    assert len(shown) == 1, loud
    assert shown[0].startswith("[rank 0]") and "gpumagic.run_dirs.outcomes DEBUG" in shown[0], loud

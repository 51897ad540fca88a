"""The house's floors, read from the source with ``ast`` (imports inside functions included): no import runs up a
floor, no circle, nothing imports the package's face, no file over 700 lines, no function over 12 parameters, and
every import inside a function says why it waits (``# lazy: ...``). ``docs/architecture.md`` draws the same floors."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpumagic"

FLOORS = (  # lowest first; a module imports only from its own floor or a lower one
    ("gpumagic.errors", "gpumagic.debug_log"),
    ("gpumagic.units",),
    ("gpumagic.devices",),
    ("gpumagic.run_dirs",),
    ("gpumagic.telemetry",),
    ("gpumagic.launch",),  # the values both sides share: plan, options, shipping, failures, ...
    ("gpumagic.launch.rank_side",),
    ("gpumagic.launch.kernel_side",),
    ("gpumagic.jobs",),
    ("gpumagic.widgets",),
    ("gpumagic.magics",),
    (
        "gpumagic",
        "gpumagic.agent",
        "gpumagic.host",
    ),  # the face (``import gpumagic``), the agent's and host's entry points
)
MAX_LINES = 700
MAX_PARAMETERS = 12
# public functions that take every option of their surface of the option table as a keyword-only parameter, so
# help() and type checkers see each one: tests/unit/test_option_table.py holds their signatures to the table
WIDE_BY_DESIGN = {
    "gpumagic.launch.kernel_side.ddp:launch_ddp": "fn, nprocs, args, kwargs and the launch surface's options",
    "gpumagic.launch.kernel_side.ddp:spawn": "torch.multiprocessing.spawn's four and the launch surface's options",
    "gpumagic.jobs.api:jobs_with": "the job surface's options, no more",
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the gpumagic module imported (the face is "gpumagic")
    line: int
    lazy: bool  # inside a function
    commented: bool  # a ``# lazy:`` comment says why


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
SOURCES = {module: path.read_text() for module, path in MODULES.items()}


def floor(module: str) -> int:
    """The floor of a module: that of the longest room name it starts with."""
    best, found = -1, None
    for number, rooms in enumerate(FLOORS):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and len(room) > best:
                best, found = len(room), number
    assert found is not None, f"{module} is in no floor: add its room to FLOORS and docs/architecture.md"
    return found


def _targets(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name.split(".")[0] == "gpumagic")
        return
    base = node.module or ""
    if node.level:  # relative: resolved against the importing package
        package = module.split(".") if any(m.startswith(module + ".") for m in modules) else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    if base.split(".")[0] != "gpumagic":
        return
    for alias in node.names:
        yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base


def _lazy_comment(lines: list[str], run: list[ast.stmt]) -> bool:
    """A ``# lazy:`` comment on the line above a run of imports (consecutive import statements), or in it."""
    first, last = run[0].lineno - 1, run[-1].end_lineno or run[-1].lineno
    return any("# lazy:" in line for line in lines[max(first - 1, 0) : last])


def _runs(body: list[ast.stmt]) -> dict[int, list[ast.stmt]]:
    """Each import statement of ``body`` (by id) -> the run of consecutive imports it belongs to."""
    runs: dict[int, list[ast.stmt]] = {}
    run: list[ast.stmt] = []
    for statement in [*body, None]:
        if isinstance(statement, ast.Import | ast.ImportFrom):
            run.append(statement)
            continue
        runs.update({id(member): run for member in run})
        run = []
    return runs


def _walk(module: str, node: ast.AST, lines: list[str], sources: dict[str, str], in_function: bool) -> Iterator[Import]:
    for _, value in ast.iter_fields(node):
        if not isinstance(value, list):
            continue
        runs = _runs([child for child in value if isinstance(child, ast.stmt)])
        for child in value:
            if isinstance(child, ast.Import | ast.ImportFrom):
                commented = in_function and _lazy_comment(lines, runs[id(child)])
                targets = list(_targets(module, child, sources))
                for target in targets or ([""] if in_function else []):  # "": torch, bokeh, the standard library
                    yield Import(module, target, child.lineno, in_function, commented)
            if isinstance(child, ast.AST):
                inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                yield from _walk(module, child, lines, sources, inner)


def read_imports(sources: dict[str, str]) -> list[Import]:
    """Every import of gpumagic modules (and every import inside a function) in ``{module: source}``."""
    found = []
    for module, text in sources.items():
        found += _walk(module, ast.parse(text), text.splitlines(), sources, False)
    return found


IMPORTS = read_imports(SOURCES)


def test_every_module_has_a_floor_and_no_import_runs_up():
    up = [
        f"{i.source}:{i.line} imports {i.target} (floor {floor(i.source)} -> {floor(i.target)})"
        for i in IMPORTS
        if i.target and floor(i.target) > floor(i.source)
    ]
    assert not up, "imports running up a floor:\n" + "\n".join(up)


def test_nothing_imports_the_face():
    face = [f"{i.source}:{i.line}" for i in IMPORTS if i.target == "gpumagic" and i.source != "gpumagic"]
    assert not face, "import the module that owns the thing, not the package's face: " + ", ".join(face)


def circles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected groups of modules (Tarjan), over every import, lazy ones included."""
    graph: dict[str, set[str]] = {i.source: set() for i in imports}
    for i in imports:
        if i.target in graph and i.target != i.source:
            graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return groups


def test_no_circle_of_imports():
    found = circles(IMPORTS)
    assert not found, "import circles (lazy imports included): " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_inside_functions_say_why():
    silent = [f"{i.source}:{i.line}" for i in IMPORTS if i.lazy and not i.commented]
    assert not silent, "an import inside a function needs a '# lazy: why' comment, or belongs at the top: " + ", ".join(
        sorted(set(silent))
    )


def test_no_file_over_700_lines_and_no_function_over_12_parameters():
    long_files = [f"{m} ({n})" for m, text in SOURCES.items() if (n := len(text.splitlines())) > MAX_LINES]
    wide = []
    for module, text in SOURCES.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                count = len(names) + bool(a.vararg) + bool(a.kwarg) - bool(names and names[0].arg in ("self", "cls"))
                if count > MAX_PARAMETERS and f"{module}:{node.name}" not in WIDE_BY_DESIGN:
                    wide.append(f"{module}:{node.name} ({count})")
    assert not long_files and not wide, f"files over {MAX_LINES} lines: {long_files}; wide functions: {wide}"


def test_the_architecture_page_draws_every_room():
    page = (ROOT / "docs" / "architecture.md").read_text()
    rooms = {room for rooms in FLOORS for room in rooms if room != "gpumagic"}
    missing = [room for room in rooms if room.removeprefix("gpumagic.").replace(".", "/") not in page]
    assert not missing, f"docs/architecture.md does not describe {missing}"


def test_the_checker_sees_arrows_circles_and_silent_lazy_imports():
    """The checks above fail on a small house that breaks them, read the same way."""
    bad = {
        "gpumagic.errors": "from gpumagic.devices import model\n",
        "gpumagic.devices": "",
        "gpumagic.devices.model": "def f():\n    from gpumagic.errors import E\n    E()\n    import torch  # lazy: x\n",
        "gpumagic.jobs.api": "import gpumagic\n",
    }
    imports = read_imports(bad)
    arrows_up = [(i.source, i.target) for i in imports if i.target and floor(i.target) > floor(i.source)]
    assert arrows_up == [("gpumagic.errors", "gpumagic.devices.model"), ("gpumagic.jobs.api", "gpumagic")]
    assert circles(imports) == [["gpumagic.devices.model", "gpumagic.errors"]]
    silent = [(i.source, i.line) for i in imports if i.lazy and not i.commented]
    assert silent == [("gpumagic.devices.model", 2)]  # the commented torch import passes
    assert [i.source for i in imports if i.target == "gpumagic"] == ["gpumagic.jobs.api"]

"""Shipping notebook code to other processes by value.

A notebook's functions and classes live in ``__main__``, which a fresh process does not have: that is why
plain ``mp.spawn`` fails with "Can't get attribute 'train' on <module '__main__'>". gpumagic pickles the
names a cell uses with cloudpickle (functions and classes by value), imports modules by name, and carries
the source of notebook cells so that tracebacks in the workers show the user's lines.
"""

from __future__ import annotations

import ast
import builtins
import collections
import importlib
import io
import linecache
import os
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from gpumagic.errors import GpumagicError
from gpumagic.launch.shared_values import SharedBatch

PROVIDED_NAMES = ("rank", "local_rank", "world_size", "device", "gpumagic")


class ShippingError(GpumagicError):
    """A name the code uses cannot be sent to the worker processes."""


@dataclass
class CellPayload:
    """A cell to run on every rank: its source, the notebook names it uses, and their modules."""

    source: str
    filename: str
    names: dict[str, Any] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    sources: dict[str, list[str]] = field(default_factory=dict)

    def parts(self) -> dict[str, Any]:
        """What travels by value, by the name a user knows it by (to name what cannot be pickled)."""
        return dict(self.names)

    def prepare(self) -> None:
        """Import the cell's modules and register its source (before the user's code: a failure here is setup's)."""

        _register_sources({self.filename: self.source.splitlines(True), **self.sources})
        self._imported = {alias: importlib.import_module(module) for alias, module in self.modules.items()}

    def run(self, context: Mapping[str, Any], namespace: dict[str, Any] | None = None) -> Any:
        """Execute the cell in ``namespace`` (the rank's ``__main__`` module's, so what it defines pickles by
        reference; default: a fresh one); return its last expression's value."""
        if not hasattr(self, "_imported"):
            self.prepare()
        namespace = {} if namespace is None else namespace
        namespace.update({"__name__": "__main__", "__builtins__": builtins})
        namespace.update(self._imported)
        namespace.update(self.names)
        namespace.update(context)
        tree = ast.parse(self.source, self.filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, self.filename, "exec"), namespace)
        if last is None:
            return None
        return eval(compile(ast.Expression(last.value), self.filename, "eval"), namespace)


@dataclass
class FunctionPayload:
    """A function to call on every rank: ``fn(*args, **kwargs)``, or ``fn(rank, *args)`` in spawn style."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    rank_first: bool = False
    sources: dict[str, list[str]] = field(default_factory=dict)

    def parts(self) -> dict[str, Any]:
        return {
            getattr(self.fn, "__name__", "fn"): self.fn,
            **{f"args[{i}]": a for i, a in enumerate(self.args)},
            **{f"kwargs[{k!r}]": v for k, v in self.kwargs.items()},
        }

    def prepare(self) -> None:
        _register_sources(self.sources)

    def run(self, context: Mapping[str, Any], namespace: dict[str, Any] | None = None) -> Any:
        """Call the function; ``namespace`` (the rank's ``__main__``) gets the notebook names it refers to, so
        they pickle by reference as they would in the notebook."""
        if namespace is not None:
            for value in (self.fn, *self.args, *self.kwargs.values()):
                if getattr(value, "__module__", None) == "__main__" and hasattr(value, "__qualname__"):
                    namespace.setdefault(value.__qualname__.split(".")[0], value)
                    for name, known in getattr(value, "__globals__", {}).items():
                        namespace.setdefault(name, known)
        if self.rank_first:
            return self.fn(context["local_rank"], *self.args, **self.kwargs)
        return self.fn(*self.args, **self.kwargs)


def parse_cell(source: str, filename: str) -> ast.Module:
    """The cell's syntax tree.

    Raises:
        ShippingError: the cell is not valid Python.
    """
    try:
        return ast.parse(source, filename)
    except SyntaxError as err:
        raise ShippingError(f"the cell is not valid Python: {err.msg} (line {err.lineno})") from None


def ship_cell(
    source: str,
    namespace: Mapping[str, Any],
    filename: str,
    hidden: Collection[str] = (),
    tree: ast.Module | None = None,
) -> CellPayload:
    """The payload for running ``source`` (plain Python) with the names it uses from ``namespace``.

    ``hidden`` names (IPython's ``In``, ``Out``, ``_``, ``get_ipython``, ...) are never shipped. ``tree``: the
    cell parsed already (``parse_cell``), by a caller that reads it too.

    Raises:
        ShippingError: the cell is not valid Python, or uses IPython magics. (``pack`` tells which name
            cannot be pickled.)
    """
    used = _needed_names(tree if tree is not None else parse_cell(source, filename))
    if "get_ipython" in used:
        raise ShippingError("magics and !shell commands do not run in launched cells; use plain Python there")
    payload = CellPayload(source, filename)
    for name in sorted(used - set(PROVIDED_NAMES) - set(hidden)):
        if name not in namespace:
            continue
        value = namespace[name]
        if isinstance(value, types.ModuleType):
            payload.modules[name] = value.__name__
        else:
            payload.names[name] = value
    payload.sources = notebook_sources(payload.names.values())
    return payload


def ship_function(fn: Callable[..., Any], args: tuple, kwargs: dict, rank_first: bool) -> FunctionPayload:
    """The payload for calling ``fn`` on every rank.

    Raises:
        ShippingError: ``fn`` is not callable. (``pack`` tells which argument cannot be pickled.)
    """
    if not callable(fn):
        raise ShippingError(f"fn must be callable, got {type(fn).__name__}")
    return FunctionPayload(fn, tuple(args), dict(kwargs), rank_first, notebook_sources([fn]))


def dumps(value: Any, shared: SharedBatch | None = None) -> bytes:
    """``cloudpickle.dumps(value)``, keeping the file name of every function's code: cloudpickle 3.1.3 writes
    ``<dynamic-code>`` there, which would cut a rank's traceback off from the notebook cell's lines. ``shared``:
    big tensors and arrays travel through its shared memory (``shared_values``), for ranks on this machine."""

    buffer = io.BytesIO()
    if shared is None:
        pickler_class()(buffer).dump(value)
    else:
        pickler = sharing_pickler_class()(buffer)
        pickler.shared = shared
        pickler.dump(value)
    return buffer.getvalue()


_PICKLER: type | None = None


def pickler_class() -> type:
    """cloudpickle's Pickler, made on first use to keep code objects' file names (``dumps``)."""
    global _PICKLER
    if _PICKLER is None:
        original = cloudpickle.Pickler.dispatch_table[types.CodeType]

        def reduce_code(code: types.CodeType) -> Any:
            constructor, args = original(code)[:2]
            args = tuple(code.co_filename if a == "<dynamic-code>" and isinstance(a, str) else a for a in args)
            return constructor, args

        table = collections.ChainMap({types.CodeType: reduce_code}, cloudpickle.Pickler.dispatch_table)
        _PICKLER = type("Pickler", (cloudpickle.Pickler,), {"dispatch_table": table})
    return _PICKLER


_SHARING_PICKLER: type | None = None


def sharing_pickler_class() -> type:
    """``pickler_class()`` that sends big tensors and arrays through its ``shared`` batch, made on first use."""
    global _SHARING_PICKLER
    if _SHARING_PICKLER is None:
        base = pickler_class()

        class SharingPickler(base):  # type: ignore[valid-type,misc]
            shared: SharedBatch

            def reducer_override(self, obj: Any) -> Any:
                reduction = self.shared.reduce(obj)
                return super().reducer_override(obj) if reduction is NotImplemented else reduction

        _SHARING_PICKLER = SharingPickler
    return _SHARING_PICKLER


def dumps_to_cpu(value: Any) -> bytes:
    """``value`` pickled (cloudpickle: what the notebook's ranks defined travels by value) with every GPU
    tensor copied to the CPU, so the kernel can load it without a GPU."""
    # lazy: torch takes seconds to import; only rank processes call this
    import torch

    class ToCpu(pickler_class()):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
                copy = obj.detach().to("cpu")
                if isinstance(obj, torch.nn.Parameter):
                    copy = torch.nn.Parameter(copy, requires_grad=obj.requires_grad)
                return copy.__reduce_ex__(self.proto)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    ToCpu(buffer).dump(value)
    return buffer.getvalue()


def pack(payload: CellPayload | FunctionPayload, shared: SharedBatch | None = None) -> bytes:
    """The payload as the ranks receive it, pickled once (names that share objects keep sharing them); big
    tensors and arrays through ``shared``'s memory, where all ranks run on this machine (``shared_batch``).

    Raises:
        ShippingError: it cannot be pickled; the message names the variable or argument that cannot travel.
    """
    try:
        return dumps(payload, shared)
    except Exception as err:  # noqa: BLE001 - pickling fails with many exception types
        for name, value in payload.parts().items():  # only now pickle each part alone, to name the culprit
            try:
                dumps(value, shared)
            except Exception as part_err:  # noqa: BLE001
                raise ShippingError(
                    f"cannot send {name!r} (a {type(value).__name__}) to the ranks: {type(part_err).__name__}: "
                    f"{part_err}. Create it inside the cell (or the function) instead, or pass something picklable."
                ) from None
        raise ShippingError(f"cannot send the code to the ranks: {type(err).__name__}: {err}") from None


def notebook_sources(values: Any) -> dict[str, list[str]]:
    """Source lines of the notebook cells that defined these functions/classes, for readable tracebacks.

    Cells exist only in the kernel's ``linecache`` (their file names do not exist on disk).
    """
    files: dict[str, list[str]] = {}
    for value in values:
        for code in _code_objects(value):
            filename = code.co_filename
            entry = linecache.cache.get(filename)
            if entry and filename not in files and not os.path.exists(filename):
                files[filename] = list(entry[2])
    return files


def _code_objects(value: Any) -> list[types.CodeType]:
    if isinstance(value, types.FunctionType):
        return [value.__code__]
    if isinstance(value, type) and value.__module__ == "__main__":
        return [m.__code__ for m in vars(value).values() if isinstance(m, types.FunctionType)]
    return []


def _register_sources(sources: Mapping[str, list[str]]) -> None:
    for filename, lines in sources.items():
        linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)


def _needed_names(tree: ast.AST) -> set[str]:
    """Names the cell reads before (in source order) it binds them: those must come from the notebook.

    A name the cell binds first (``model = ...``, ``def train``, ``import torch``, a loop or comprehension
    variable) is the cell's own, even if the notebook also has one: shipping that would be wasted, or fail.
    """
    events: list[tuple[int, int, int, str]] = []  # (line, column, 0 = binds / 1 = reads, name)

    def at(node: ast.AST, kind: int, name: str, anchor: ast.AST | None = None) -> None:
        where = anchor or node
        events.append((getattr(where, "lineno", 0), getattr(where, "col_offset", 0), kind, name))

    augmented = {id(n.target) for n in ast.walk(tree) if isinstance(n, ast.AugAssign)}  # x += 1 reads x first
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            at(node, 1 if isinstance(node.ctx, ast.Load) or id(node) in augmented else 0, node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            at(node, 0, node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                at(node, 0, (alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for generator in node.generators:
                for target in ast.walk(generator.target):
                    if isinstance(target, ast.Name):
                        at(target, 0, target.id, anchor=node)
    first: dict[str, int] = {}
    for _, _, kind, name in sorted(events):
        first.setdefault(name, kind)
    return {name for name, kind in first.items() if kind == 1}

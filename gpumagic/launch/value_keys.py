"""Cheap keys that change when a notebook value would travel differently, so that a persistent group sends a
name again only when it changed, without pickling it on every cell to find out.

A function's key is its identity, code, defaults, closure and the keys of the globals it reads; a notebook
class's is its identity, its bases and the keys of its attributes (methods included). Numbers and strings are
their own keys, a tensor is its identity and version (in-place changes bump it), an importable function or
class its qualified name. Anything else (lists, dicts, objects) has no cheap key: the caller digests its pickle.
"""

from __future__ import annotations

import dis
import functools
import sys
import types
from collections.abc import Callable, Hashable
from typing import Any

IMMUTABLE = (int, float, complex, str, bytes, bool, type(None))
# what a class's pickle leaves out, or Python's bookkeeping (_abc_impl: an ABC's caches, unpicklable)
_SKIPPED_CLASS_ATTRIBUTES = frozenset({"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__", "_abc_impl"})
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"})


def has_cheap_key(value: Any) -> bool:
    """Whether ``change_key`` tells ``value``'s changes without pickling all of it (a notebook function or class,
    a tensor, a number or string, a tuple of such); for anything else its pickle is the only test."""
    torch = sys.modules.get("torch")
    return isinstance(value, (types.FunctionType, type, tuple, frozenset, *IMMUTABLE)) or (
        torch is not None and isinstance(value, torch.Tensor)
    )


def change_key(value: Any, other: Callable[[Any], Hashable]) -> tuple[Hashable, list[Any]]:
    """The key of ``value`` (``other(v)`` keys the values without a cheap key of their own: a pickle digest),
    and the objects the key names by identity: keep them with the key, so that no new object takes the
    identity of one that was freed."""
    keys = _Keys(other)
    return keys.key(value), keys.held


class _Keys:
    def __init__(self, other: Callable[[Any], Hashable]) -> None:
        self.other = other
        self.seen: dict[int, Hashable] = {}  # a function or class met again (recursion, shared globals)
        self.held: list[Any] = []

    def key(self, value: Any) -> Hashable:
        if isinstance(value, IMMUTABLE):
            return (type(value).__name__, value)
        if isinstance(value, types.ModuleType):
            return ("module", value.__name__)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            self.held.append(value)
            return ("tensor", id(value), value._version)
        if isinstance(value, (types.FunctionType, type)):
            if getattr(value, "__module__", None) != "__main__":
                return ("by reference", value.__module__, value.__qualname__)
            known = self.seen.get(id(value))
            if known is not None:
                return known
            self.seen[id(value)] = ("again", id(value))
            self.held.append(value)
            found = self._function(value) if isinstance(value, types.FunctionType) else self._class(value)
            self.seen[id(value)] = found
            return found
        if isinstance(value, (tuple, frozenset)):
            return (type(value).__name__, tuple(self.key(v) for v in value))
        if isinstance(value, (staticmethod, classmethod)):
            return (type(value).__name__, self.key(value.__func__))
        if isinstance(value, property):
            return ("property", self.key(value.fget), self.key(value.fset), self.key(value.fdel))
        return ("other", self.other(value))

    def _function(self, fn: types.FunctionType) -> Hashable:
        cells = tuple(self.key(_cell_contents(c)) for c in fn.__closure__ or ())
        read = sorted(_global_names(fn.__code__) & fn.__globals__.keys())
        return (
            "function",
            id(fn),
            id(fn.__code__),
            self.key(fn.__defaults__),
            self.key(tuple(sorted((fn.__kwdefaults__ or {}).items()))),
            cells,
            tuple((name, self.key(fn.__globals__[name])) for name in read if name != fn.__name__),
        )

    def _class(self, cls: type) -> Hashable:
        attributes = tuple(
            (name, self.key(member)) for name, member in vars(cls).items() if name not in _SKIPPED_CLASS_ATTRIBUTES
        )
        return ("class", id(cls), tuple(self.key(base) for base in cls.__bases__), attributes)


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> frozenset[str]:
    """The globals a code object (and the code nested in it) reads or writes, as cloudpickle finds them: by the
    instructions that name a global, not every name in ``co_names`` (``o.writer`` reads no global ``writer``)."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return frozenset(names)


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None

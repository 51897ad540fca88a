"""What a rank that replaces a dead one can get back from the cells the group ran: their imports (``import x``,
``from x import y``) and their function and class definitions, run again in order on the fresh rank (each
statement alone, not the rest of its line).

The kernel keeps a ``ReplayLog`` of the top-level import, ``def`` and ``class`` statements of every cell that
finished on a rank (with the ranks it finished on), one entry per bound name: a later definition of the same
names replaces the earlier one. ``replay`` runs on the fresh rank, each statement with its cell's file name and
line numbers, so tracebacks show the notebook's lines.
"""

from __future__ import annotations

import ast
import linecache
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_log = logging.getLogger(__name__)

REPLAYED = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True)
class Definition:
    """One top-level statement of a cell: the names it binds, where it is (the ``index``-th statement of the
    cell's body) and the cell it is in."""

    names: tuple[str, ...]
    filename: str
    index: int
    source: str  # the whole cell: for the statement, at its own lines and columns, and for tracebacks
    text: str  # the statement's lines (a repeated one keeps its place in the log)

    def code(self) -> Any:
        """The statement alone (not the rest of its line: ``import os; print()``), compiled at its lines."""
        statement = ast.parse(self.source, self.filename).body[self.index]
        return compile(ast.Module(body=[statement], type_ignores=[]), self.filename, "exec")


def definitions(source: str, filename: str, tree: ast.Module | None = None) -> list[Definition]:
    """The replayable statements of a cell, in order (none if it does not parse). ``tree``: the cell parsed
    already (a cell is parsed once on its way to the ranks)."""
    if tree is None:
        try:
            tree = ast.parse(source, filename)
        except SyntaxError:
            return []
    lines = source.splitlines(True)
    found = []
    for index, node in enumerate(tree.body):
        if not isinstance(node, REPLAYED):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = tuple((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            names = (node.name,)
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
        text = "".join(lines[first - 1 : node.end_lineno or node.lineno])  # its lines, to know it repeated
        found.append(Definition(names, filename, index, source, text))
    return found


class ReplayLog:
    """The definitions each rank holds from the cells it finished, in the order they ran."""

    def __init__(self) -> None:
        self._entries: list[tuple[Definition, frozenset[int]]] = []

    def record(self, found: Iterable[Definition], ranks: Iterable[int]) -> None:
        """``found`` ran on ``ranks``: each replaces earlier entries binding the same names on the same ranks, at
        the end of the log; one that only repeats an entry (``import torch`` again) keeps the entry's place."""
        where = frozenset(ranks)
        if not where:
            return
        for new in found:
            if any(d.names == new.names and d.text == new.text and r == where for d, r in self._entries):
                continue
            if "*" not in new.names:
                self._entries = [(d, r) for d, r in self._entries if not (d.names == new.names and r <= where)]
            self._entries.append((new, where))

    def for_rank(self, rank: int) -> list[Definition]:
        return [d for d, ranks in self._entries if rank in ranks]

    def __len__(self) -> int:
        return len(self._entries)


def replay(namespace: dict[str, Any], found: list[Definition]) -> tuple[list[str], list[Definition], dict[str, str]]:
    """Run ``found`` in ``namespace`` (a fresh rank's), in order, then again those that failed while any pass
    makes progress (a definition may need one that comes later in the log): the names now bound, the
    definitions that still fail (one may need a name restored later: try them again then) and, per name, why."""
    bound: list[str] = []
    why: dict[str, str] = {}
    pending = list(found)
    while pending:
        failed = []
        for definition in pending:
            lines = definition.source.splitlines(True)
            linecache.cache[definition.filename] = (len(definition.source), None, lines, definition.filename)
            try:
                exec(definition.code(), namespace)
            except Exception as err:  # noqa: BLE001 - what cannot be redone is listed as lost
                _log.debug("a definition of %s cannot be redone; listed as lost", definition.names, exc_info=True)
                failed.append(definition)
                why.update(dict.fromkeys(definition.names, f"{type(err).__name__}: {err}"))
                continue
            bound.extend(definition.names)
            for name in definition.names:
                why.pop(name, None)
        if len(failed) == len(pending):
            break
        pending = failed
    return sorted(set(bound)), pending, why

"""Records that cross modules and reach users who index them as the dicts they used to be: frozen dataclasses
that also read as mappings (``row["cell"]``, ``row.get("rss")``, ``dict(row)``), equal to the dict of their
fields, and shown as that dict (a notebook shows the same as before).

``RankState`` is what a persistent group's rank says of itself on its status channel; ``RankStatus`` and
``MemoryFreed`` are the rows of ``RankGroup.status()`` and ``RankGroup.free()``. ``hang_reports.HangReport`` is one
too. They are plain values: no logic beyond reading them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any


class Record(Mapping[str, Any]):
    """A frozen dataclass read as a mapping of its fields (``keys()`` may leave some out: ``_keys``). Subclasses
    are declared ``@dataclass(frozen=True, eq=False, repr=False)``: equality and repr are the mapping's."""

    def _keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __repr__(self) -> str:
        return repr(dict(self))

    def as_json(self) -> dict[str, Any]:
        """A plain dict of the record (for ``json.dumps``)."""
        return dict(self)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class RankState(Record):
    """A rank's answer on its status channel: the cell it runs and since when, the collective it is in (its name,
    since when), GPU memory allocated and reserved (bytes; ``None`` on a CPU rank), resident memory (bytes)."""

    rank: int
    pid: int
    cell: str | None
    since: float | None
    collective: tuple[str, float] | None
    allocated: int | None
    reserved: int | None
    rss: int | None


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class RankStatus(Record):
    """One row of ``RankGroup.status()``: the rank, its pid, whether it is alive, and what it said of itself
    (``state``; ``None``: it did not answer, and the row has only the first three keys, as before)."""

    rank: int
    pid: int
    alive: bool
    state: RankState | None = None
    node: str | None = None  # where a group across an allocation's nodes runs it (then a key of the row too)

    def _keys(self) -> tuple[str, ...]:
        own = ("rank", "pid", "alive") + (("node",) if self.node else ())
        return own if self.state is None else own + tuple(k for k in self.state if k not in own)

    def __getitem__(self, key: str) -> Any:
        if self.state is not None and key in self.state:
            return self.state[key]
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    @property
    def cell(self) -> str | None:
        return None if self.state is None else self.state.cell

    @property
    def since(self) -> float | None:
        return None if self.state is None else self.state.since

    @property
    def collective(self) -> tuple[str, float] | None:
        return None if self.state is None else self.state.collective

    @property
    def allocated(self) -> int | None:
        return None if self.state is None else self.state.allocated

    @property
    def reserved(self) -> int | None:
        return None if self.state is None else self.state.reserved

    @property
    def rss(self) -> int | None:
        return None if self.state is None else self.state.rss


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class MemoryFreed(Record):
    """One row of ``RankGroup.free()``: objects the rank's garbage collection found, the GPU memory it reserved
    before and after emptying the cache (bytes), and whether it uses CUDA at all."""

    rank: int
    collected: int
    reserved_before: int
    reserved_after: int
    cuda: bool

"""A persistent group's output (``group.RankGroup``): each cell's, in the group's mode (``all``, ``rank0``,
``none``), and what the ranks print between cells, shown before the next cell's."""

from __future__ import annotations

import codecs
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from gpumagic.launch.kernel_side.output import ProgressLines, RankOutput, progress_lines, rank_prefix

MAX_BUFFERED_LINES = 2000


class GroupOutput:
    """Where the ranks' output goes: the running cell's ``CellOutput``, or held until the next cell starts.

    ``bars``: progress bars as one line per rank, updated in place (in a notebook).
    """

    def __init__(self, bars: bool) -> None:
        self.bars = bars
        self.hosts: dict[int, str] = {}  # rank -> node, for a group across nodes (its lines say where)
        self._sink: CellOutput | None = None
        self._between_cells: list[tuple[int, bytes]] = []

    def feed(self, rank: int, data: bytes) -> None:
        if self._sink is not None:
            self._sink.feed(rank, data)
        else:
            self._between_cells.append((rank, data))

    @contextlib.contextmanager
    def cell(self, write: Callable[[str], None], mode: str, nprocs: int, ranks: int) -> Iterator[None]:
        """A cell on ``ranks`` of the group's ``nprocs``, its output written in ``mode`` (every rank's, whatever
        the mode, when the cell runs on one rank), after what came between cells."""
        bars = progress_lines() if self.bars else None
        self._sink = CellOutput(write, mode if ranks > 1 else "all", nprocs, bars, self.hosts)
        self._show_between_cells(write, nprocs)
        try:
            yield
        finally:
            self._sink.finish()
            self._sink = None

    def _show_between_cells(self, write: Callable[[str], None], nprocs: int) -> None:
        pending, self._between_cells = self._between_cells, []
        if not pending:
            return
        sink = RankOutput(write, "all", nprocs, hosts=self.hosts)
        for rank, data in pending:
            sink.feed(rank, data)
        sink.flush()


class CellOutput:
    """A cell's output on the group. ``all``: every rank's lines, live and prefixed. ``rank0``: rank 0's lines
    live; the other ranks' lines at the end, where they differ from rank 0's, else "(same on ranks 1–3)".
    ``none``: nothing (failures still show their traceback)."""

    def __init__(self, write: Callable[[str], None], mode: str, nprocs: int, bars: ProgressLines | None = None,
                 hosts: dict[int, str] | None = None) -> None:  # fmt: skip
        self.write = write
        self.mode = mode
        self.nprocs = nprocs
        self.hosts = hosts or {}
        self.live = RankOutput(write, "none" if mode == "none" else "all", nprocs, bars, self.hosts)
        self.lines: dict[int, list[str]] = {}
        self.partial: dict[int, str] = {}
        self.decoders: dict[int, Any] = {}

    def feed(self, rank: int, data: bytes) -> None:
        if self.mode == "all" or (self.mode == "rank0" and rank == 0):
            self.live.feed(rank, data)
        if self.mode != "rank0":
            return
        decoder = self.decoders.setdefault(rank, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        text = self.partial.pop(rank, "") + decoder.decode(data)
        *done, rest = text.split("\n")
        lines = self.lines.setdefault(rank, [])
        lines.extend(line.rstrip("\r").rsplit("\r", 1)[-1] for line in done)
        del lines[:-MAX_BUFFERED_LINES]
        if rest:
            self.partial[rank] = rest

    def finish(self) -> None:
        self.live.flush()
        if self.mode != "rank0":
            return
        for rank, rest in self.partial.items():
            self.lines.setdefault(rank, []).append(rest.rsplit("\r", 1)[-1])
        first = self.lines.get(0, [])
        same = []
        for rank in range(1, self.nprocs):
            lines = self.lines.get(rank, [])
            if not lines:
                continue
            if lines == first:
                same.append(rank)
                continue
            seen = list(first)
            width = len(str(self.nprocs - 1))
            for line in lines:
                if line in seen:
                    seen.remove(line)
                else:
                    self.write(f"{rank_prefix(rank, width, self.hosts)}{line}\n")
        if same:
            self.write(f"(same on {_ranks_text(same)})\n")


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}–{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))

"""Per-rank output: split the bytes each rank writes into lines, prefix them with the rank, keep each rank's
lines in order, and render progress bars (lines rewritten with ``\\r``) as one updating line per rank."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Mapping
from typing import Any


class RankOutput:
    """Feed it ``(rank, bytes)``; it calls ``write(text)`` with whole, prefixed lines.

    A line a rank keeps rewriting with ``\r`` (a tqdm bar) goes to ``bars`` while it is open (in a notebook:
    one line per rank, updated in place) and is written as a line once the rank ends it; without ``bars`` its
    latest state is written over itself, and closed before any other line is written, so that no finished
    line ever joins a bar.
    """

    def __init__(
        self,
        write: Callable[[str], None],
        mode: str = "all",
        nprocs: int = 1,
        bars: ProgressLines | None = None,
        hosts: Mapping[int, str] | None = None,
    ) -> None:
        self.write = write
        self.mode = mode
        self.bars = bars
        self.width = len(str(max(0, nprocs - 1)))
        self.hosts = hosts or {}  # rank -> its node, for ranks on several nodes: ``[rank 3 @gpu02]``
        self._partial: dict[int, str] = {}
        self._decoders: dict[int, object] = {}
        self._open_bar: int | None = None  # the rank whose bar the stream shows unfinished (no ``bars``)

    def prefix(self, rank: int) -> str:
        return rank_prefix(rank, self.width, self.hosts)

    def feed(self, rank: int, data: bytes) -> None:
        if self.mode == "none" or (self.mode == "rank0" and rank != 0):
            return
        text = self._decode(rank, data)
        buffered = self._partial.pop(rank, "") + text
        *lines, rest = buffered.split("\n")
        prefix = self.prefix(rank)
        out = [prefix + line.rstrip("\r").rsplit("\r", 1)[-1] + "\n" for line in lines]  # CRLF is a line end
        bar = None
        if "\r" in rest:  # a progress bar redrawing its line: its latest state; the line stays open, and a
            bar = rest.rsplit("\r", 1)[-1] or rest.rstrip("\r").rsplit("\r", 1)[-1]
            rest = "\r" + bar  # newline coming later ends it in that state
        if rest:
            self._partial[rank] = rest
        if self.bars is not None:
            if out:
                self.write("".join(out))
                self.bars.done(rank)
            if bar is not None:
                self.bars.set(rank, prefix + bar)
            return
        if out and self._open_bar is not None:  # a finished line never joins a bar
            if self._open_bar == rank:
                out[0] = "\r" + out[0]  # the bar's own final state overwrites it
            else:
                out.insert(0, "\n")  # another rank's line starts below it
            self._open_bar = None
        if bar is not None:
            out.append("\r" + prefix + bar)
        if out:
            self.write("".join(out))
        if bar is not None:
            self._open_bar = rank

    def flush(self) -> None:
        """Write what is left of unfinished lines (a rank that ended without a newline), and clear the bars."""
        if self._open_bar is not None:
            self.write("\n")
            self._open_bar = None
        for rank in sorted(self._partial):
            self.write(f"{self.prefix(rank)}{self._partial[rank].rsplit(chr(13), 1)[-1]}\n")
        self._partial.clear()
        if self.bars is not None:
            self.bars.close()

    def _decode(self, rank: int, data: bytes) -> str:

        decoder = self._decoders.setdefault(rank, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        return decoder.decode(data)  # type: ignore[attr-defined]


class ProgressLines:
    """The ranks' open progress bars, one line each, in one output updated in place (at most 5 times a second);
    a bar leaves it when its rank ends the line (the line is then written to the stream)."""

    def __init__(self, min_interval: float = 0.2) -> None:
        self.min_interval = min_interval
        self.lines: dict[int, str] = {}
        self._handle: Any = None
        self._shown = ""
        self._last = 0.0

    def set(self, rank: int, line: str) -> None:
        self.lines[rank] = line
        self._show()

    def done(self, rank: int) -> None:
        if self.lines.pop(rank, None) is not None:
            self._show(force=True)

    def close(self) -> None:
        self.lines.clear()
        self._show(force=True)

    def _show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return
        text = "\n".join(self.lines[rank] for rank in sorted(self.lines))
        if text == self._shown:
            return
        # lazy: IPython, only in a kernel
        from IPython.display import display

        bundle = {"text/plain": text}
        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)
        self._shown = text
        self._last = now


def progress_lines() -> ProgressLines | None:
    """Bars shown in place, in a Jupyter kernel; ``None`` elsewhere (a terminal shows them with ``\r``)."""
    return ProgressLines() if in_kernel() else None


def cell_number(shell: Any) -> int:
    """The number of the cell running now, as its prompt shows it (``In[7]``): IPython's result of that cell
    holds it (IPython 9 moves its own count past it before the cell runs, IPython 8 after)."""
    running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    count = getattr(running, "execution_count", None)
    return count if isinstance(count, int) and count > 0 else shell.execution_count


def in_kernel() -> bool:
    """True in a Jupyter kernel (where displays and widgets reach a notebook), not in a terminal or a script."""
    try:
        # lazy: IPython, only in a kernel
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def rank_prefix(rank: int, width: int, hosts: Mapping[int, str] | None = None) -> str:
    """``[rank 3] ``, or ``[rank 3 @gpu02] `` where the ranks run on several nodes (``hosts``: rank -> node)."""
    host = (hosts or {}).get(rank)
    return f"[rank {rank:>{width}}{f' @{host}' if host else ''}] "

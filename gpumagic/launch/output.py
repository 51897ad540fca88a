"""Per-rank output: split the bytes each rank writes into lines, prefix them with the rank, keep each rank's
lines in order, and render progress bars (lines rewritten with ``\\r``) as one updating line per rank."""

from __future__ import annotations

from collections.abc import Callable

OUTPUT_MODES = ("all", "rank0", "none")


class RankOutput:
    """Feed it ``(rank, bytes)``; it calls ``write(text)`` with whole, prefixed lines."""

    def __init__(self, write: Callable[[str], None], mode: str = "all", nprocs: int = 1) -> None:
        self.write = write
        self.mode = mode
        self.width = len(str(max(0, nprocs - 1)))
        self._partial: dict[int, str] = {}
        self._decoders: dict[int, object] = {}

    def feed(self, rank: int, data: bytes) -> None:
        if self.mode == "none" or (self.mode == "rank0" and rank != 0):
            return
        text = self._decode(rank, data)
        buffered = self._partial.pop(rank, "") + text
        *lines, rest = buffered.split("\n")
        prefix = f"[rank {rank:>{self.width}}] "
        out = []
        for line in lines:
            out.append(prefix + line.rsplit("\r", 1)[-1] + "\n")
        if "\r" in rest:  # a progress bar redrawing its line: show its latest state, keep the line open
            latest = rest.rsplit("\r", 1)[-1] or rest.rstrip("\r").rsplit("\r", 1)[-1]
            out.append("\r" + prefix + latest)
            rest = ""
        if out:
            self.write("".join(out))
        if rest:
            self._partial[rank] = rest

    def flush(self) -> None:
        """Write what is left of unfinished lines (a rank that ended without a newline)."""
        for rank in sorted(self._partial):
            self.write(f"[rank {rank:>{self.width}}] {self._partial[rank]}\n")
        self._partial.clear()

    def _decode(self, rank: int, data: bytes) -> str:
        import codecs

        decoder = self._decoders.setdefault(rank, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        return decoder.decode(data)  # type: ignore[attr-defined]

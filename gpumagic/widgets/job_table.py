"""The ``%jobs`` table: one row per job, as HTML in a notebook and as text in a terminal."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from gpumagic.units import format_duration

COLUMNS = ("name", "status", "GPUs", "elapsed", "latest", "why")  # why last: it can be long
STATUS_COLOURS = {
    "running": "#1a7f37",
    "queued": "#9a6700",
    "finished": "#57606a",
    "failed": "#cf222e",
    "killed": "#cf222e",
    "cancelled": "#9a6700",
    "lost": "#cf222e",
}


@dataclass(frozen=True)
class JobRow:
    name: str
    status: str
    gpus: str
    elapsed: str
    why: str
    latest: str

    def cells(self) -> tuple[str, ...]:
        return (self.name, self.status, self.gpus, self.elapsed, self.latest, self.why)


def job_row(
    job: Any, info: dict[str, Any] | None = None, latest: dict[str, tuple[float, float]] | None = None
) -> JobRow:
    """A job's row, read once from its directory (``info`` and rank 0's ``latest`` metrics if known)."""
    from gpumagic.jobs import records
    from gpumagic.jobs.api import _format_metrics
    from gpumagic.jobs.executors import executor_of

    info = info if info is not None else job.info
    runs_on = executor_of(info)
    status = runs_on.status(info)
    gpus = runs_on.resources(info) or ("-" if status in ("queued", "cancelled") else "cpu")
    why = "" if status == "finished" else runs_on.why(info, brief=True)
    shown = ""
    if status not in ("queued", "cancelled"):
        shown = _format_metrics(latest if latest is not None else job.last_metrics())
    return JobRow(info["name"], status, gpus, format_duration(records.elapsed(info)), why, shown)


class JobTable:
    """Rows of jobs; ``rows`` holds the data."""

    def __init__(self, jobs: list[Any]) -> None:
        self.rows = [job_row(j) for j in jobs]

    def __repr__(self) -> str:
        if not self.rows:
            return "No background jobs yet: %%launch_bg or gpumagic.submit starts one."
        table = [COLUMNS] + [r.cells() for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS) - 1)]
        lines = []
        for row in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
        return "\n".join(line.rstrip() for line in lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<p>{html.escape(repr(self))}</p>"
        head = "".join(f"<th style='text-align:left'>{c}</th>" for c in COLUMNS)
        body = []
        for row in self.rows:
            cells = [html.escape(c) for c in row.cells()]
            colour = STATUS_COLOURS.get(row.status, "inherit")
            cells[1] = f"<b style='color:{colour}'>{cells[1]}</b>"
            body.append("<tr>" + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells) + "</tr>")
        return f"<table class='gpumagic-jobs'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"

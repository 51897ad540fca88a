"""The ``%jobs`` table: one row per job, as HTML in a notebook and as text in a terminal."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from gpumagic.devices.placement import Request
from gpumagic.jobs import notify
from gpumagic.jobs.api import format_metrics, resumed_note
from gpumagic.jobs.executors import executor_of
from gpumagic.jobs.queue import one_line_why
from gpumagic.run_dirs import records
from gpumagic.telemetry.tracking import tracked_summary
from gpumagic.units import format_duration
from gpumagic.widgets.live import TEXT

COLUMNS = ("name", "status", "GPUs", "elapsed", "latest", "why")  # why last: it can be long
TRACKED_COLUMNS = (*COLUMNS[:-1], "tracked", COLUMNS[-1])  # when a job of the table was tracked (gpumagic.track)
# The status's hue on a dot beside its word, which keeps the theme's text colour (4.5:1 on light and dark
# alike): each hue is at least 3:1 against white and against JupyterLab's dark backgrounds (#111, #212121).
STATUS_HUES = {
    "running": "#2ea043",
    "queued": "#b58300",
    "finished": "#8a8a8a",
    "failed": "#cf222e",
    "killed": "#cf222e",
    "cancelled": "#b58300",
    "lost": "#cf222e",
}
# inline: JupyterLab right-aligns and wraps table cells; a row's cells but its why stay on one line
CELL = f"padding:2px 8px;text-align:left;vertical-align:top;white-space:nowrap;{TEXT}"


@dataclass(frozen=True)
class JobRow:
    name: str
    status: str
    gpus: str
    elapsed: str
    why: str
    latest: str
    line: str = ""  # the why in one short line, for a table cell (``why`` in full: its tooltip)
    tracked: str = ""  # what it is exported as (``gpumagic.track``): its tracker runs, or what failed

    def cells(self, tracked: bool = False) -> tuple[str, ...]:
        """Its cells; ``tracked``: with the tracked column (shown when a job of the table was tracked)."""
        shown = (self.tracked,) if tracked else ()
        return (self.name, self.status, self.gpus, self.elapsed, self.latest, *shown, self.why)


def job_row(
    job: Any,
    info: dict[str, Any] | None = None,
    latest: dict[str, tuple[float, float]] | None = None,
    place: tuple[int, int] | None = None,
) -> JobRow:
    """A job's row, read once from its directory (``info`` and rank 0's ``latest`` metrics if known; ``place``:
    where it waits in the machine's queue, ``jobs.queue.places``)."""
    info = info if info is not None else job.info
    runs_on = executor_of(info)
    ended = runs_on.end(info)
    status = ended.status
    notify.tell_silent_end(job.path, info, status)
    gpus = runs_on.resources(info) or ("-" if status in ("queued", "cancelled") else "cpu")
    why = "" if status == "finished" else ended.short
    shown = ""
    if status not in ("queued", "cancelled"):
        shown = format_metrics(latest if latest is not None else job.last_metrics())
    for note in (resumed_note(job.path, info), info.get("notify_problem")):
        if note:
            why = f"{why} · {note}" if why else note
    line = one_line_why(why, _request(info) if status == "queued" else None, place)
    elapsed = format_duration(records.elapsed(info))
    return JobRow(info["name"], status, gpus, elapsed, why, shown, line, tracked_summary(info))


def _request(info: dict[str, Any]) -> Any:
    try:
        return Request.from_json(info["request"]) if info.get("request") else None
    except (KeyError, TypeError, ValueError):  # an older or foreign record: the why's first line instead
        return None


def status_html(status: str) -> str:
    """The status word in bold, in the theme's text colour, after a dot of its hue."""
    hue = STATUS_HUES.get(status, "#8a8a8a")
    return f"<b style='{TEXT}'><span style='color:{hue}'>●</span> {html.escape(status)}</b>"


class JobTable:
    """Rows of jobs; ``rows`` holds the data."""

    def __init__(self, jobs: list[Any]) -> None:
        self.rows = [job_row(j) for j in jobs]
        self.tracked = any(row.tracked for row in self.rows)
        self.columns = TRACKED_COLUMNS if self.tracked else COLUMNS

    def __repr__(self) -> str:
        if not self.rows:
            return "No background jobs yet: %%launch_bg or gpumagic.submit starts one."
        table = [self.columns] + [r.cells(self.tracked) for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(self.columns) - 1)]
        lines = []
        for row in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
        return "\n".join(line.rstrip() for line in lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<p>{html.escape(repr(self))}</p>"
        head = "".join(f"<th style='{CELL}'>{c}</th>" for c in self.columns)
        body = []
        for row in self.rows:
            cells = [html.escape(c) for c in row.cells(self.tracked)]
            cells[1] = status_html(row.status)
            cells[-1] = f"<div style='white-space:normal;min-width:24em'>{cells[-1]}</div>"  # why: in full
            body.append("<tr>" + "".join(f"<td style='{CELL}'>{c}</td>" for c in cells) + "</tr>")
        table = "<table class='gpumagic-jobs' style='border-collapse:collapse;table-layout:auto;margin:0'>"
        return f"{table}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"

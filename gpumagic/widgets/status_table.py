"""The ``%gpu status`` table: HTML in a notebook, text in a terminal, from one ``GpuStatus`` snapshot."""

from __future__ import annotations

import html
import time

from gpumagic.devices.leases import Lease, idle_for
from gpumagic.devices.model import GpuInfo, GpuProcess
from gpumagic.devices.placement import describe_holders, passing_over
from gpumagic.devices.shared_files import describe_ignored
from gpumagic.devices.status import GpuStatus
from gpumagic.units import GIB, format_bytes
from gpumagic.widgets.plots import load_colour


class StatusTable:
    """A rendered snapshot; ``.status`` holds the data. Cheap to build, renders on display."""

    def __init__(self, status: GpuStatus) -> None:
        self.status = status

    def __repr__(self) -> str:
        return render_text(self.status)

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython's terminal hook
        printer.text(render_text(self.status))

    def _repr_html_(self) -> str:
        return render_html(self.status)


def headline(status: GpuStatus) -> str:
    inventory = status.inventory
    if not inventory.gpus:
        return f"No GPUs: {inventory.problem}"
    parts = [f"{len(inventory.gpus)} GPU{'s' if len(inventory.gpus) != 1 else ''}"]
    if inventory.simulated:
        parts.append(f"SIMULATED ({inventory.simulation})")
    elif inventory.driver_version:
        parts.append(f"driver {inventory.driver_version}")
    parts.append(status.visibility.describe())
    return " · ".join(parts)


def notes(status: GpuStatus) -> list[str]:
    result = []
    if status.too_late:
        result.append(f"⚠ {status.too_late}: changing CUDA_VISIBLE_DEVICES now affects only processes started later")
    if status.lease_problem:
        result.append(f"⚠ leases unavailable: {status.lease_problem}")
    if status.ignored:
        listed = describe_ignored(status.ignored, status.ignored_more, shown=5)
        result.append(f"⚠ ignored in the lease directory: {listed}")
    if status.passed_over:
        result.append(f"⚠ {passing_over(status.passed_over)}")
    return result + status.policy.notes()


def render_text(status: GpuStatus) -> str:
    lines = [headline(status)]
    if status.inventory.gpus:
        header = (
            f" {'GPU':>3} {'cuda':>4}  {'name':<18} {'memory used':<32} {'util':>5} {'temp':>5} {'power':>11}"
            "  lease, processes"
        )
        lines.append(header)
        for gpu in status.inventory.gpus:
            lines += _text_rows(status, gpu)
    lines += notes(status)
    return "\n".join(lines)


def _text_rows(status: GpuStatus, gpu: GpuInfo) -> list[str]:
    cuda = status.visibility.cuda_index(gpu.nvml_index)
    marker = "▶" if cuda is not None else " "
    cuda_text = str(cuda) if cuda is not None else ""
    if not gpu.healthy:
        return [f"{marker}{gpu.nvml_index:>3} {cuda_text:>4}  {gpu.short_name[:18]:<18} ✖ {gpu.problem}"]
    memory = f"{_bar(gpu, 12)} {_memory(gpu)}"
    util = f"{gpu.utilization:.0f}%" if gpu.utilization is not None else "n/a"
    temp = f"{gpu.temperature:.0f}°C" if gpu.temperature is not None else "n/a"
    power = _power(gpu)
    holders = describe_holders(status.leases.get(gpu.uuid, ()))
    first = f"{marker}{gpu.nvml_index:>3} {cuda_text:>4}  {gpu.short_name[:18]:<18} {memory:<32} "
    first += f"{util:>5} {temp:>5} {power:>11}  "
    first += holders
    rows = [first]
    rows += [f"{'':60}  └ {_process(p)}" for p in gpu.processes]
    return rows


# Inline styles: JupyterLab right-aligns table cells, wraps them and lays tables out fixed. Every cell stays on
# one line; the lease and process cells cut what does not fit with an ellipsis (in full under the mouse), the
# processes taking whatever width is left, so the table fits a 900 px output and reads well at 1300 px. Text is
# in the theme's colours (at least 4.5:1 on JupyterLab's light and dark themes); load shows as coloured marks.
TEXT = "color:var(--jp-content-font-color1)"
CELL = f"padding:2px 6px;text-align:left;vertical-align:top;white-space:nowrap;{TEXT}"
CUT = "overflow:hidden;text-overflow:ellipsis;white-space:nowrap"
HEADINGS = ("GPU", "cuda", "name", "memory", "util", "temp", "power", "lease", "processes")


def _idle_first(leases: tuple[Lease, ...], holders: str) -> str:
    """The lease cell's text: an idle holder's idle time first, where the cell's cut cannot hide it."""
    for lease in leases:
        idle = lease.idle_s()
        if idle is not None:
            shown = f", idle {idle_for(idle)}"
            return f"idle {idle_for(idle)} · " + (holders[: -len(shown)] if holders.endswith(shown) else holders)
    return holders


def render_html(status: GpuStatus) -> str:
    esc = html.escape
    head = f"<div style='font-weight:600;margin:4px 0'>{esc(headline(status))}</div>"
    if not status.inventory.gpus:
        return f"<div class='gpumagic-status' style='{TEXT}'>{head}</div>"
    rows = []
    for gpu in status.inventory.gpus:
        cuda = status.visibility.cuda_index(gpu.nvml_index)
        leases = status.leases.get(gpu.uuid, ())
        holders = describe_holders(leases)
        # this kernel's GPUs: a tint and a green edge, both visible on light and dark themes
        style = "background:rgba(46,160,67,0.18);box-shadow:inset 4px 0 #2ea043" if cuda is not None else ""
        first = (
            f"<td style='{CELL}'>{gpu.nvml_index}</td><td style='{CELL}'>{'' if cuda is None else f'cuda:{cuda}'}</td>"
        )
        name = f"<td style='{CELL};max-width:10em;{CUT}' title='{esc(gpu.uuid)} {esc(gpu.pci_bus_id or '')}'>"
        if not gpu.healthy:
            rows.append(
                f"<tr style='{style}'>{first}{name}{esc(gpu.short_name)}</td>"
                f"<td colspan='6' style='{CELL};max-width:0;{CUT}' title='{esc(gpu.problem or '')}'>"
                f"<span style='color:var(--jp-error-color1)'>✖</span> {esc(gpu.problem or '')}</td></tr>"
            )
            continue
        processes = "".join(
            f"<div style='{CUT}' title='{esc(_process(p, cut=False))}'>{esc(_process(p))}</div>" for p in gpu.processes
        )
        rows.append(
            f"<tr style='{style}'>{first}{name}{esc(gpu.short_name)}</td>"
            f"<td style='{CELL}'>{_html_bar(gpu)}</td>"
            f"<td style='{CELL}'>{_html_utilization(gpu.utilization)}</td>"
            f"<td style='{CELL}'>{'n/a' if gpu.temperature is None else f'{gpu.temperature:.0f}°C'}</td>"
            f"<td style='{CELL}'>{esc(_power(gpu))}</td>"
            f"<td style='{CELL};max-width:12em;{CUT}' title='{esc(holders)}'>{esc(_idle_first(leases, holders))}</td>"
            f"<td style='{CELL};max-width:0;width:100%;{CUT}'>{processes or 'none'}</td></tr>"
        )
    header = "".join(f"<th style='{CELL}'>{h}</th>" for h in HEADINGS)
    table = (
        "<table class='gpumagic-status' style='border-collapse:collapse;font-size:12px;table-layout:auto;"
        f"width:100%;margin:0'><thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )
    extra = "".join(f"<div>{esc(n)}</div>" for n in notes(status))
    stamp = time.strftime("%H:%M:%S", time.localtime(status.inventory.taken_at))
    foot = f"<div style='font-size:11px'>as of {stamp}; green rows: the GPUs this kernel sees</div>"
    return f"<div class='gpumagic-status' style='{TEXT}'>{head}{table}{extra}{foot}</div>"


def _html_utilization(utilization: float | None) -> str:
    """The percentage in the text colour after a mark coloured by load (green, amber, red)."""
    if utilization is None:
        return "n/a"
    return f"<span style='color:{load_colour(utilization)}'>●</span> {utilization:.0f}%"


def _memory(gpu: GpuInfo) -> str:
    if gpu.memory_total is None:
        return "n/a"
    if gpu.memory_total >= GIB:
        return f"{(gpu.memory_used or 0) / GIB:.1f}/{gpu.memory_total / GIB:.1f} GiB"
    return f"{format_bytes(gpu.memory_used)}/{format_bytes(gpu.memory_total)}"


def _bar(gpu: GpuInfo, width: int) -> str:
    if not gpu.memory_total:
        return "[" + "?" * width + "]"
    filled = round(width * (gpu.memory_used or 0) / gpu.memory_total)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _html_bar(gpu: GpuInfo) -> str:
    if not gpu.memory_total:
        return "n/a"
    percent = 100 * (gpu.memory_used or 0) / gpu.memory_total
    color = load_colour(percent)
    return (
        "<div style='display:flex;align-items:center;gap:6px'>"
        "<div style='width:80px;height:10px;background:rgba(128,128,128,0.25);border-radius:3px;overflow:hidden'>"
        f"<div style='width:{percent:.1f}%;height:100%;background:{color}'></div></div>"
        f"<span>{html.escape(_memory(gpu))}</span></div>"
    )


def _power(gpu: GpuInfo) -> str:
    if gpu.power is None:
        return "n/a"
    limit = f"/{gpu.power_limit:.0f}" if gpu.power_limit else ""
    return f"{gpu.power:.0f}{limit} W"


def _process(process: GpuProcess, cut: bool = True) -> str:
    """``pid 12 bob: python train.py (20 GiB)``; ``cut``: a command over 60 characters ends in ``...``."""
    memory = format_bytes(process.gpu_memory) if process.gpu_memory is not None else "? memory"
    if not process.alive:
        return f"pid {process.pid} (not visible here: exited or another container) {memory}"
    command = process.command or "?"
    if cut and len(command) > 60:
        command = command[:57] + "..."
    return f"pid {process.pid} {process.user or '?'}: {command} ({memory})"

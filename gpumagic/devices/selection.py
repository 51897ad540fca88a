"""Choosing this kernel's GPUs: ``pick`` (the best free ones), ``use`` (named ones), ``release``.

Each choice takes leases so that other notebooks do not pick the same GPUs, and sets
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES`` (UUIDs) so that ``cuda:0`` is the lowest
numbered GPU chosen, and so on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpumagic.devices import idle_release, shared_files, visibility
from gpumagic.devices import leases as leasing
from gpumagic.devices.cuda_state import cuda_initialized
from gpumagic.devices.hold_ups import hold_ups
from gpumagic.devices.inventory import read_inventory, require_gpus
from gpumagic.devices.model import MAX_GPUS, GpuInfo, Inventory
from gpumagic.devices.pick_lock import LeaseBusy, pick_lock
from gpumagic.devices.placement import (
    Placement,
    Request,
    Served,
    Ticket,
    describe_holders,
    explain,
    passing_over,
    place,
    place_and_take,
)
from gpumagic.devices.policy import Policy, over_cap, read_policy
from gpumagic.devices.spec import SpecError, parse_spec, resolve
from gpumagic.errors import GpuCapError, GpuLeasedError, InvalidArgument, NotEnoughGpusError
from gpumagic.units import GIB, format_duration, parse_duration, parse_percent, parse_size_or_percent


@dataclass(frozen=True)
class Selection:
    """The GPUs this kernel chose, why, and what it set. Its repr is the one line ``%gpu`` prints."""

    gpus: tuple[GpuInfo, ...]
    summary: str
    environment: dict[str, str] = field(default_factory=dict)
    too_late: str | None = None
    simulated: bool = False
    shared: tuple[int, ...] = ()

    @property
    def indices(self) -> tuple[int, ...]:
        """NVML indices (the numbers ``%gpu`` and nvidia-smi show) of the chosen GPUs, in cuda order."""
        return tuple(g.nvml_index for g in self.gpus)

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self.gpus)

    def __repr__(self) -> str:
        text = self.summary + (" [simulated]" if self.simulated else "")
        if self.too_late:
            chosen = ", ".join(map(str, self.indices)) or "no GPU"
            text += (
                f"\n⚠ Too late for this kernel: {self.too_late}, so it keeps the devices it had; processes it "
                f"starts from now on will use {chosen}. Restart the kernel and run %gpu first to move this kernel too."
            )
        return text

    _repr_pretty_ = lambda self, printer, cycle: printer.text(repr(self))  # noqa: E731 - IPython hook


def pick(
    n: int = 1,
    *,
    min_free: str | int | None = None,
    max_util: str | float | None = None,
    exclude: str | Iterable[int] | None = None,
    wait: str | float | None = None,
    poll_interval: float = 0.25,
    on_wait: Callable[[str], None] | None = None,
) -> Selection:
    """Lease the ``n`` best free GPUs and make them this kernel's ``cuda:0..n-1``.

    Best means most free memory, then lowest utilization. GPUs leased by other notebooks never qualify.

    Args:
        n: how many GPUs.
        min_free: memory each needs free: ``"20GB"``, bytes, or ``"50%"`` of the GPU.
        max_util: highest utilization allowed, percent.
        exclude: GPUs never to pick, as a device spec (``"0,1"``) or NVML indices.
        wait: keep trying this long (``"10m"``, seconds) until enough qualify; ``on_wait`` hears why not.

    Raises:
        NotEnoughGpusError: too few GPUs qualify (after ``wait``); lists what each one lacked.
        GpuCapError: the administrator's policy allows this user fewer GPUs (``policy.toml``), still after
            ``wait``.
        NoGpuError: no GPUs at all. InvalidArgument: malformed argument.

    Example: ``pick(2, min_free="20GB", wait="10m")``.
    """
    _check_count(n)
    timeout = parse_duration(wait) if wait is not None else 0.0
    deadline = time.monotonic() + timeout
    inventory = require_gpus(read_inventory())
    request = _pick_request(n, min_free, max_util, exclude, inventory)
    if n > len(inventory.gpus):
        raise NotEnoughGpusError(n, (), {}, f" (this machine has only {len(inventory.gpus)} GPUs)")
    idle_release.watch_cells()  # before any lease is taken: its record then tells others whether it is used
    ticket = None  # a waiting kernel holds a place in the queue, served in order with jobs and other kernels
    try:
        while True:
            try:
                placed = place_and_take(request, inventory, _lease, ticket)
                if placed.gpus:
                    idle_release.follow_leases()
                    return _select(inventory, list(placed.gpus), _why_picked(placed, request))
                never = placed.capped and n > (read_policy().max_gpus_per_user or 0)
                if placed.capped and (never or time.monotonic() >= deadline):  # --wait: until under the cap
                    raise GpuCapError(f"Refused: {placed.capped}")
            except LeaseBusy as busy:
                if time.monotonic() >= deadline:
                    raise
                if on_wait is not None:
                    on_wait(f"Waiting for the GPU lease directory: {busy.holder} keeps its pick lock")
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                note = f" after waiting {format_duration(timeout)}" if timeout else ""
                chosen = tuple(g.nvml_index for g in placed.qualify)
                why = explain(placed.reasons, len(placed.reasons)) if placed.reasons else ""
                raise NotEnoughGpusError(n, chosen, placed.reasons, note, why)
            if ticket is None:
                label = leasing.book().holder_name() or f"pid {os.getpid()}"
                ticket = Ticket.create(label[:80], request, time.time(), f"pick-{os.getpid()}", kind="pick")
            if on_wait is not None:
                on_wait(
                    f"Waiting for {n} GPU(s), {len(placed.qualify)} qualify ({format_duration(remaining)} left) — "
                    + (placed.capped or explain(placed.reasons, len(inventory.gpus)))
                    + placed.note(countdown=True)
                )
            time.sleep(min(poll_interval, max(remaining, 0.01)))
            inventory = require_gpus(read_inventory())
    finally:
        if ticket is not None:
            ticket.remove()


def _pick_request(
    n: int, min_free: str | int | None, max_util: str | float | None, exclude: object, inventory: Inventory
) -> Request:
    """A kernel's pick as a placement request, every argument checked (``pick``'s arguments; ``n`` by
    ``_check_count`` before)."""
    free_bytes, free_percent = parse_size_or_percent(min_free) if min_free is not None else (None, None)
    util = parse_percent(max_util) if max_util is not None else None
    return Request(n, (), free_bytes, False, free_percent, util, _excluded(exclude, inventory))


def _check_count(n: object) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_GPUS:
        raise InvalidArgument(f"the number of GPUs must be a whole number from 1 to {MAX_GPUS}, got {n!r}")


@dataclass(frozen=True)
class PickOutlook:
    """What a pick would get now and why: every GPU's reason, the machine's queue in the order it is served
    (what each ticket does), and what this process ignores or passes over in the lease directory. Its repr is
    what ``%gpu why`` prints."""

    placement: Placement
    queue: tuple[Served, ...]
    passed_over: tuple[str, ...]
    ignored: dict[str, str]
    ignored_more: int
    simulated: bool
    policy: Policy = field(default_factory=Policy)  # the administrator's (``devices.policy``)

    def __repr__(self) -> str:
        placed = self.placement
        wants = placed.request.describe()
        if placed.gpus:
            head = f"A pick of {wants} now gets GPU {_list(g.nvml_index for g in placed.gpus)}"
        elif placed.request.wants > placed.total:
            head = f"A pick of {wants} gets none: this machine has only {placed.total}"
        elif placed.capped:
            head = f"A pick of {wants} is refused: {placed.capped}"
        else:
            qualify = f"{len(placed.qualify)} of {placed.total} qualify"
            head = f"A pick of {wants} now gets none ({qualify}) — {explain(placed.reasons, placed.total)}"
        lines = [head + (" [simulated]" if self.simulated else "")]
        if self.queue:
            lines.append(f"Queue ({len(self.queue)} waiting, in the order they are served):")
            now = time.time_ns()
            for k, served in enumerate(self.queue, 1):
                ticket = served.ticket
                waited = format_duration(max(now - ticket.made_ns, 0) / 1e9)
                wants = ticket.request.describe()
                lines.append(f"  {k}. {ticket.label}: {wants}, waiting {waited}; {served.describe()}")
        else:
            lines.append("Queue: nobody waits")
        if self.passed_over:
            lines.append(f"⚠ {passing_over(self.passed_over)}")
        if self.ignored:
            ignored = shared_files.describe_ignored(self.ignored, self.ignored_more)
            lines.append(f"⚠ ignored in the lease directory: {ignored}")
        return "\n".join(lines + self.policy.notes())

    _repr_pretty_ = lambda self, printer, cycle: printer.text(repr(self))  # noqa: E731 - IPython hook


def why(
    n: int = 1,
    *,
    min_free: str | int | None = None,
    max_util: str | float | None = None,
    exclude: str | Iterable[int] | None = None,
) -> PickOutlook:
    """What ``pick(n, ...)`` (without ``--wait``: behind every ticket) would get now, and why; the queue.

    Takes nothing. Raises as ``pick`` does for bad arguments (``InvalidArgument``, ``NoGpuError``).
    """
    _check_count(n)
    inventory = require_gpus(read_inventory())
    request = _pick_request(n, min_free, max_util, exclude, inventory)
    with pick_lock(exclusive=False):
        placed = place(request, inventory, leasing.read_view(leasing.book()))
        ignored, more = shared_files.ignored(limit=10)
    passed = hold_ups().passed_over_names()
    return PickOutlook(placed, placed.served, passed, ignored, more, inventory.simulated, read_policy())


def _lease(gpus: Iterable[GpuInfo]) -> bool:
    """Lease ``gpus`` (under ``pick_lock()``), keeping none of this kernel's others; False (nothing taken) if
    a holder took one without the pick lock (it cannot, unless the lease directory was tampered with)."""
    before = set(leasing.book().held())
    acquired = [g for g in gpus if leasing.book().try_acquire(g.uuid)]
    if len(acquired) == len(list(gpus)):
        _keep_only(gpus)
        return True
    leasing.book().release(g.uuid for g in acquired if g.uuid not in before)
    return False


def use(spec: object, *, force: bool = False) -> Selection:
    """Make exactly the GPUs ``spec`` names this kernel's GPUs, leasing them.

    ``spec``: ``"0,2"``, ``"GPU:1"``, ``['GPU:0', 'GPU:1']``, ``"GPU:*"``, a name pattern (``"A100"``),
    a UUID or its prefix, or ``"none"``/``"cpu"`` for no GPU at all.

    Raises:
        SpecError: malformed spec or a GPU that does not exist (lists the accepted forms).
        GpuLeasedError: a named GPU is leased by someone else (``force=True`` shares it, unleased).
    """
    parsed = parse_spec(spec)
    if parsed.none:
        leasing.book().release_all()
        environment = visibility.show_only([])
        inventory = read_inventory()
        return _finish(
            inventory,
            (),
            "Using no GPU: CUDA_VISIBLE_DEVICES is empty, so this kernel and what it starts run on the CPU",
            environment,
        )
    inventory = require_gpus(read_inventory())
    gpus = resolve(parsed, inventory)
    broken = [g for g in gpus if not g.healthy]
    if broken:
        raise SpecError("; ".join(f"GPU {g.nvml_index} cannot be used: {g.problem}" for g in broken))
    idle_release.watch_cells()
    with pick_lock():
        view = leasing.read_view(leasing.book())
        taken = [g for g in gpus if any(not lease.mine for lease in view.on(g.uuid))]
        if taken and not force:
            raise GpuLeasedError(
                "; ".join(f"GPU {g.nvml_index} is {describe_holders(view.on(g.uuid))}" for g in taken)
                + ". Pick others (%gpu pick), or add --force to share it without a lease."
            )
        # GPUs shared with --force count too: the cap is on the GPUs a user works on
        capped = over_cap(read_policy(), _holdings(inventory, view), os.getuid(), len(gpus), os.getpid())
        if capped:
            raise GpuCapError(f"Refused: {capped}")
        shared = []
        for gpu in gpus:
            if not leasing.book().try_acquire(gpu.uuid):
                shared.append(gpu.nvml_index)
        _keep_only(gpus)
    idle_release.follow_leases()
    summary = f"Using GPU {_list(g.nvml_index for g in gpus)} ({_names(gpus)}) as named"
    if shared:
        summary += f"; sharing GPU {_list(shared)} without a lease (--force)"
    return _select(inventory, list(gpus), summary, tuple(shared))


def release() -> tuple[int, ...]:
    """Give back this kernel's leases and restore ``CUDA_VISIBLE_DEVICES`` as it was before gpumagic.

    Returns the NVML indices released (where the inventory still knows them).
    """
    uuids = leasing.book().release_all()
    visibility.restore()
    if not uuids:
        return ()
    inventory = read_inventory()
    return tuple(g.nvml_index for g in inventory.gpus if g.uuid in uuids)


def _holdings(inventory: Inventory, view: leasing.LeaseView) -> list[tuple[int, tuple[leasing.Lease, ...]]]:
    return [(gpu.nvml_index, view.on(gpu.uuid)) for gpu in inventory.gpus]


def _excluded(exclude: str | Iterable[int] | None, inventory: Inventory) -> frozenset[int]:
    if exclude is None or exclude == "":
        return frozenset()
    if isinstance(exclude, str):
        return frozenset(g.nvml_index for g in resolve(parse_spec(exclude), inventory))
    try:
        indices = frozenset(int(i) for i in exclude)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"exclude must be a device spec like '0,1' or a list of indices, got {exclude!r}"
        ) from None
    return frozenset(g.nvml_index for g in inventory.gpus if g.nvml_index in indices)  # others exclude nothing


def _keep_only(chosen: Iterable[GpuInfo]) -> None:
    keep = {g.uuid for g in chosen}
    leasing.book().release(u for u in leasing.book().held() if u not in keep)


def _select(inventory: Inventory, chosen: list[GpuInfo], summary: str, shared: tuple[int, ...] = ()) -> Selection:
    ordered = tuple(sorted(chosen, key=lambda g: g.nvml_index))
    environment = visibility.show_only(ordered)
    mapping = ", ".join(f"cuda:{k}=GPU {g.nvml_index}" for k, g in enumerate(ordered))
    return _finish(inventory, ordered, f"{summary} → {mapping}", environment, shared)


def _finish(
    inventory: Inventory,
    gpus: tuple[GpuInfo, ...],
    summary: str,
    environment: dict[str, str],
    shared: tuple[int, ...] = (),
) -> Selection:
    return Selection(gpus, summary, environment, cuda_initialized(), inventory.simulated, shared)


def _why_picked(placed: Placement, request: Request) -> str:
    ordered = sorted(placed.gpus, key=lambda g: g.nvml_index)
    free = "/".join(f"{(g.memory_free or 0) / GIB:.1f}" for g in ordered) + " GiB"
    busy = "/".join(f"{g.utilization or 0:.0f}" for g in ordered)
    needs = request.describe().partition(" with ")[2]
    condition = f" with {needs}" if needs else ""
    return (
        f"Picked GPU {_list(g.nvml_index for g in ordered)} ({_names(ordered)}): most free memory of "
        f"{len(placed.qualify)} qualifying{condition} ({free} free, {busy}% busy)"
    )


def _names(gpus: Iterable[GpuInfo]) -> str:
    return ", ".join(dict.fromkeys(g.short_name for g in gpus)) or "none"


def _list(indices: Iterable[int]) -> str:
    return ", ".join(str(i) for i in indices)

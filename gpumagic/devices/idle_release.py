"""Idle leases: a kernel's cells watched, and its idle GPUs let go to a waiter where the administrator says so.

``watch_cells()`` (called before a kernel takes a lease, and by ``%load_ext gpumagic``) hooks IPython's cell
events: a cell's start and end rewrite the activity in this kernel's lease records (``devices.activity``), so
``%gpu``, ``%gpu why`` and every waiting pick or job can say how long each holder has been idle. A thread
(``follow_leases``, after leases are taken; it ends when the last is given back) looks every ``LOOK_S`` while no
cell runs:

- a GPU its processes (the kernel, its ranks) keep busy, where NVML tells, moves its idle start to now;
- with the policy's ``idle_release`` (``devices.policy``) and the kernel idle that long, it gives back each idle
  GPU that a waiting ticket of another process would start on once free (the queue served with and without
  it, ``devices.placement``), frees torch's cached CUDA memory, and the kernel's next cell says so in one line.

Nothing is killed or interrupted: a lease is its holder's own to give back, and only while nothing runs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from gpumagic.devices import leases as leasing
from gpumagic.devices import placement
from gpumagic.devices.activity import cell_activity
from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.model import Inventory
from gpumagic.devices.pick_lock import pick_lock
from gpumagic.devices.policy import Policy, read_policy
from gpumagic.devices.processes import Ancestry
from gpumagic.units import format_duration

_log = logging.getLogger(__name__)

LOOK_S = 2.0  # how often a kernel holding leases looks at its GPUs' use and at the queue (NVML samples 5 s back)
USED_PERCENT = 1.0  # a process that keeps a GPU busier than this uses it


@dataclass(frozen=True)
class _Given:
    """GPUs given away, to whom, under which policy: owed to the next cell in one line."""

    indices: tuple[int, ...]
    waiters: tuple[str, ...]
    policy: Policy


class _Watch:
    """The kernel whose cells are watched, the looking thread, and the GPUs given away that the next cell hears of."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the shell and the thread
        self.notice_lock = threading.Lock()  # the line owed (taken inside the activity's lock: never the other way)
        self.shell: Any = None
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()  # set when the last lease is given back: the thread ends at once
        self.owed: list[_Given] = []


_watch = _Watch()


def watch_cells(shell: Any = None) -> bool:
    """Follow the cells of ``shell`` (default: this process's IPython kernel, if any) from now on, once per
    kernel; False where there is none (a script, a job's runner: their leases are never idle)."""
    if shell is None:
        if "IPython" not in sys.modules:
            return False
        # lazy: IPython is loaded already (checked above); a script never imports it
        from IPython import get_ipython

        shell = get_ipython()
    if shell is None or not hasattr(shell, "events"):
        return False
    with _watch.lock:
        if _watch.shell is not shell:
            shell.events.register("pre_run_cell", _cell_started)
            shell.events.register("post_run_cell", _cell_ended)
            _watch.shell = shell
            cell_activity().track(running=True)  # called from a cell (%load_ext, a pick): its end makes it idle
    return True


def follow_leases() -> None:
    """Look at this kernel's leases while it holds any (call after taking some): a thread that ends when the
    last is given back, so an idle kernel without leases runs nothing of gpumagic's."""
    if cell_activity().now() is None:  # cells not watched: never idle, nothing to look at
        return
    leasing.book().when_empty(_watch.wake.set)
    with _watch.lock:
        if _watch.thread is None or not _watch.thread.is_alive():
            _watch.wake.clear()
            _watch.thread = threading.Thread(target=_look_for_ever, name="gpumagic-idle-leases", daemon=True)
            _watch.thread.start()


def _cell_started(info: object = None) -> None:
    """IPython's ``pre_run_cell``: busy from now; the line owed since a lease was given away. A front end's own
    executions (``store_history`` False: a variable explorer's refresh) are not the user's: they change nothing."""
    if getattr(info, "store_history", True) is False:
        return
    try:
        cell_activity().cell_started(leasing.book().write_activity)
        with _watch.notice_lock:
            owed, _watch.owed = _watch.owed, []
        if owed:
            print(_notice(owed), file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a hook in every cell of the user's: it must never break one
        _log.debug("a cell's start could not be noted in this kernel's lease records", exc_info=True)


def _cell_ended(result: object = None) -> None:
    """IPython's ``post_run_cell``: idle from now."""
    if getattr(getattr(result, "info", None), "store_history", True) is False:
        return
    try:
        cell_activity().cell_ended(leasing.book().write_activity)
    except Exception:  # noqa: BLE001 - a hook in every cell of the user's: it must never break one
        _log.debug("a cell's end could not be noted in this kernel's lease records", exc_info=True)


def _look_for_ever() -> None:
    while True:
        _watch.wake.wait(LOOK_S)
        _watch.wake.clear()
        if not leasing.book().held():
            with _watch.lock:  # a pick that takes leases now starts the next thread (``follow_leases``)
                if not leasing.book().held():
                    _watch.thread = None
                    return
            continue
        try:
            look()
        except Exception:  # noqa: BLE001 - a thread of the user's kernel: whatever failed, the next look tries again
            _log.debug("a look at this kernel's idle leases failed; the next one tries again", exc_info=True)


def look(now: float | None = None) -> tuple[str, ...]:
    """One look (the thread's): note GPU use by this kernel's processes; give idle GPUs to waiters if the policy
    says so. Returns the UUIDs given back."""
    activity = cell_activity().now()
    held = leasing.book().held()
    if activity is None or activity.busy or not held:
        return ()
    inventory = read_inventory()
    now = time.time() if now is None else now
    if _used(inventory, set(held)):
        cell_activity().gpu_used(now, leasing.book().write_activity)
        return ()
    policy = read_policy()
    idle = activity.idle_s(now)
    if policy.idle_release is None or idle is None or idle < policy.idle_release:
        return ()
    with pick_lock(exclusive=False):  # most looks find nobody waiting: under the shared lock
        wanted = wanted_by_waiters(inventory, leasing.read_view(leasing.book()), set(held))
    if not wanted:
        return ()
    with pick_lock():  # again under the exclusive one, where waiters take: another idle kernel that gave a GPU
        wanted = wanted_by_waiters(inventory, leasing.read_view(leasing.book()), set(held))  # to this waiter first
        if not wanted:  # leaves it nothing more to want
            return ()

        def give_back() -> tuple[str, ...]:  # a cell that starts meanwhile waits for this, and then hears of it
            given = tuple(leasing.book().release(wanted))
            if given:
                _owe(inventory, given, wanted, policy)
            return given

        given = cell_activity().if_unchanged(activity, give_back) or ()
    if given:
        _free_cached_memory()
    return given


def wanted_by_waiters(inventory: Inventory, view: leasing.LeaseView, mine: set[str]) -> dict[str, str]:
    """Of this process's GPUs ``mine``, those that waiting tickets of other processes would start on if it let
    them go (the queue served with and without them): UUID -> the first such waiter's label."""
    me, pid = os.getuid(), os.getpid()
    waiting = placement.queue_order(
        placement.Ticket.of(f) for f in view.tickets if not (f.uid == me and f.key == f"pick-{pid}")
    )
    if not waiting:
        return {}
    passed, unheld = placement.left_out(waiting)  # the users this process no longer believes are left out here too
    now = placement.serve_queue(waiting, placement.slots(inventory, view), passed, unheld)
    freed = {uuid: tuple(x for x in leases if not (x.mine and uuid in mine)) for uuid, leases in view.leases.items()}
    then_view = leasing.LeaseView(freed, view.tickets, view.ignored_ticket_owners)
    then = placement.serve_queue(waiting, placement.slots(inventory, then_view), passed, unheld)
    started = [
        after
        for before, after in zip(now, then, strict=True)
        if before.outcome is not placement.Outcome.STARTS and after.outcome is placement.Outcome.STARTS
    ]
    if not started:
        return {}
    by_index = {gpu.nvml_index: gpu.uuid for gpu in inventory.gpus}
    wanted: dict[str, str] = {}
    for served in then:  # whoever takes them once free (an earlier ticket may move onto one, the waiter behind it)
        if served.outcome is placement.Outcome.STARTS:
            for index in served.gpus:
                uuid = by_index.get(index)
                if uuid in mine:
                    wanted.setdefault(uuid, started[0].ticket.label)
    return wanted


def _used(inventory: Inventory, mine: set[str]) -> bool:
    """Whether this process or one it started keeps one of ``mine`` busy, where NVML tells."""
    me, ancestry = os.getpid(), Ancestry()
    for gpu in inventory.gpus:
        if gpu.uuid not in mine:
            continue
        for process in gpu.processes:
            if (process.utilization or 0.0) > USED_PERCENT and ancestry.descends(process.pid, me):
                return True
    return False


def _free_cached_memory() -> None:
    """``torch.cuda.empty_cache()`` where torch is loaded and CUDA started: the memory its allocator keeps for
    reuse goes back to the GPU; tensors the kernel still holds stay."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a half-imported torch, a lost GPU: the lease is given back all the same
        _log.debug("torch's cached CUDA memory could not be freed", exc_info=True)


def _owe(inventory: Inventory, given: tuple[str, ...], wanted: dict[str, str], policy: Policy) -> None:
    """Owe the next cell a line for the GPUs ``given`` away (with any owed already: one line for all)."""
    indices = sorted(gpu.nvml_index for gpu in inventory.gpus if gpu.uuid in given)
    waiters = sorted({wanted[uuid] for uuid in given})
    with _watch.notice_lock:
        _watch.owed.append(_Given(tuple(indices), tuple(waiters), policy))
    _log.debug("gave GPU %s to %s: this kernel was idle past %s", indices, waiters, policy.idle_release)


def _notice(owed: list[_Given]) -> str:
    """``gpumagic: this kernel's lease on GPU 2 was given to job A1, who waited, after this kernel was idle
    2h00m (...policy.toml: idle_release); ...``."""
    indices = sorted({i for given in owed for i in given.indices})
    waiters = ", ".join(sorted({w for given in owed for w in given.waiters}))
    policy = owed[-1].policy
    gpus = f"GPU{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"
    plural = "them" if len(indices) > 1 else "it"
    return (
        f"gpumagic: this kernel's lease on {gpus} was given to {waiters}, who waited, after this kernel was idle "
        f"{format_duration(policy.idle_release or 0)} ({policy.path}: idle_release); CUDA_VISIBLE_DEVICES still "
        f"names {plural}: %gpu pick to pick again"
    )

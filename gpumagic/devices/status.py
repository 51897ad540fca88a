"""One consistent snapshot of everything ``%gpu status`` shows: GPUs, leases, this kernel's view."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumagic.devices import leases as leasing
from gpumagic.devices import shared_files
from gpumagic.devices.cuda_state import cuda_initialized
from gpumagic.devices.hold_ups import hold_ups
from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.model import Inventory
from gpumagic.devices.pick_lock import pick_lock
from gpumagic.devices.policy import Policy, read_policy
from gpumagic.devices.visibility import Visibility, current_visibility
from gpumagic.errors import LeaseDirectoryError


@dataclass(frozen=True)
class GpuStatus:
    inventory: Inventory
    leases: dict[str, tuple[leasing.Lease, ...]]  # every holder of each GPU (all the jobs sharing one)
    visibility: Visibility
    too_late: str | None
    lease_problem: str | None = None
    ignored: dict[str, str] = field(default_factory=dict)  # lease directory file -> why gpumagic ignored it
    ignored_more: int = 0  # ignored files not in ``ignored`` (junk names beyond the first few)
    passed_over: tuple[str, ...] = ()  # users whose queue tickets this process passes over (``hold_ups``)
    policy: Policy = field(default_factory=Policy)  # the administrator's (``devices.policy``)


def gather_status() -> GpuStatus:
    """Read the inventory, the leases on it and this kernel's visibility, now."""
    inventory = read_inventory()
    held: dict[str, tuple[leasing.Lease, ...]] = {}
    problem = None
    ignored: dict[str, str] = {}
    more = 0
    if inventory.gpus:
        try:
            with pick_lock(exclusive=False):
                held = leasing.read_view(leasing.book()).leases
                ignored, more = shared_files.ignored(limit=5)
        except LeaseDirectoryError as err:
            problem = str(err)
    visible, passed = current_visibility(inventory), hold_ups().passed_over_names()
    policy = read_policy() if inventory.gpus and problem is None else Policy()
    return GpuStatus(inventory, held, visible, cuda_initialized(), problem, ignored, more, passed, policy)

"""What gpumagic does when its kernel is asked to end (a shutdown or restart from Jupyter, a Jupyter server
that stops, ``exit`` in a cell): end the rank server with every rank and all they started, close every
persistent group, let multiprocessing's resource tracker end and close the values shared with ranks, before
ipykernel ends the kernel.

Why before: ipykernel (7.x) answers a shutdown request by signalling every child in the kernel's process group
(SIGTERM, then SIGKILL) and waits until none is left, up to 29 s, counting children that died but were never
reaped; the resource tracker ignores SIGTERM. Jupyter kills the kernel long before that (after 2.5 s), so the
kernel's own exit handlers never ran, and the ranks' children were left running. Ended here, the kernel has no
child left when ipykernel looks: its shutdown takes as long as without gpumagic. A kernel that is killed
outright is covered by the rank server, which ends its ranks when the kernel's end of its alive pipe closes
(``launch.rank_side.rank_server``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)


def watch_kernel_end(shell: Any) -> bool:
    """Have ``end_kernel_work`` run when ``shell``'s kernel is asked to end; True if it will (an ipykernel
    kernel's shell), False elsewhere (a terminal IPython: its exit handlers run as the process exits).
    Calling it again for the same shell changes nothing."""
    if getattr(shell, "kernel", None) is None or not shell.has_trait("exit_now"):
        return False
    # No event of IPython or ipykernel fires before ipykernel signals the kernel's children at a shutdown
    # request (``_at_shutdown``, right after ``do_shutdown``), and wrapping ``do_shutdown`` would patch the
    # kernel. ipykernel's ``do_shutdown`` sets the shell's ``exit_now`` trait, on the control thread before it
    # replies, and ``exit`` in a cell sets it too (the kernel ends 0.1 s later): traitlets lets us observe it,
    # as ipykernel's own shell does. traitlets adds the same handler only once.
    shell.observe(_on_exit_now, names="exit_now")
    return True


def watch_this_kernel() -> bool:
    """``watch_kernel_end`` for the IPython shell this process runs, if any: for ranks started from Python
    (``gpumagic.ranks``, ``launch_ddp``) in a kernel where ``%load_ext gpumagic`` was never run."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and watch_kernel_end(shell)


def _on_exit_now(change: dict[str, Any]) -> None:
    if change["new"]:
        end_kernel_work()


def end_kernel_work() -> None:
    """End the rank server for good (every rank and what they started end with it), close every group of ranks
    (its leases, its run's record), then let the resource tracker end. Never raises: the kernel's shutdown
    must go on whatever happens here."""
    # not imported, or imported but never used (%load_ext imports them): nothing of gpumagic's to end there
    rank_server = sys.modules.get("gpumagic.launch.rank_side.rank_server")
    if rank_server is not None and not rank_server.started():
        rank_server = None
    persistent = sys.modules.get("gpumagic.launch.kernel_side.group")
    # the ranks end first, at once: a cell still running on them (on the main thread) cannot hold this up,
    # and the groups only have to record their end; the tracker is held by the ranks until they end
    steps = [getattr(rank_server, "stop_for_good", None), getattr(persistent, "close_open_groups", None)]
    steps.append(getattr(rank_server, "stop_resource_tracker", None))
    steps.append(getattr(sys.modules.get("gpumagic.launch.shared_values"), "close_kernel_store", None))
    for step in filter(None, steps):
        try:
            step()
        except BaseException:  # logged: the shutdown goes on
            log.exception("gpumagic could not %s as its kernel ends", step.__name__)

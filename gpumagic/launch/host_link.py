"""The link between a kernel and the host of one node of its persistent group (``%ddp start --nnodes N``): the
frames each side sends, over one ``secure_store`` session (the run's key, role ``HOST``, the kernel's published
address), so only the user's own host can join and every frame is tagged.

The host (``rank_side.node_host``) forks, signals and watches its node's ranks; the kernel (``kernel_side.
node_hosts``) sees each remote rank through the same three pipes a local rank has. A message-pipe or status-pipe
unit crosses the link whole (``MSG``/``STATUS``: the bytes ``Connection.send_bytes`` wrote), so neither side
ever unpickles what the other relays; only ``START`` carries a pickle, on the proven session.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass

from gpumagic.launch.plan import LaunchPlan

HOST_VARIABLE = "GPUMAGIC_NODE_ADDRESS"  # a remote rank's node address: rank 0 serves the group's store there
PING_S = 1.0  # each side sends something at least this often
KERNEL_SILENCE_S = 10.0  # a host ends its ranks when its kernel said nothing for this long (a link gone quiet)


class Frame(enum.IntEnum):
    """A link frame's code; its fields (bytes) follow the comment."""

    HELLO = 1  # host → kernel: node name, host pid, node address
    START = 2  # kernel → host: a pickled ``HostStart``
    SPAWN = 3  # kernel → host: rank (global), start it (a first start or a replacement)
    STARTED = 4  # host → kernel: rank, pid
    MSG = 5  # both: rank, one unit of the rank's message pipe
    STATUS = 6  # both: rank, one unit of its status pipe
    OUT = 7  # host → kernel: rank, output bytes
    SIGNAL = 8  # kernel → host: rank, signal number (an interrupt)
    KILL = 9  # kernel → host: rank (SIGKILL its process group: it stayed stuck)
    EXIT = 10  # host → kernel: rank, pid, exit code ("" unknown), time, stopped ("1"/"0"); after its pipes drained
    STOP = 11  # kernel → host: first signal, grace seconds (every rank; the group closes)
    PING = 12  # both: nothing to say
    FAILED = 13  # host → kernel: why the host cannot run its ranks
    BYE = 14  # host → kernel: every rank ended after STOP; the host exits


@dataclass(frozen=True)
class HostStart:
    """What a host needs to start its node's ranks: the group's plan as the kernel made it (``node_rank``,
    ``launcher_pid`` and the GPUs are the host's to fill in) and how many GPUs each rank gets from those Slurm gave
    the host's step (0: CPU ranks)."""

    plan: LaunchPlan
    node_rank: int
    gpus_per_rank: int

    def encode(self) -> bytes:
        return pickle.dumps(self)

    @staticmethod
    def decode(data: bytes) -> HostStart:
        start = pickle.loads(data)  # from the proven, tagged session only
        if not isinstance(start, HostStart):
            raise ValueError("a host's START frame did not carry a HostStart")
        return start


def number(value: int | float) -> bytes:
    return str(value).encode()


def whole(field: bytes) -> int:
    return int(field.decode())

"""``python -m gpumagic.host --connect tcp:HOST:PORT --run-dir DIR``: the host of one node of a persistent group
across a Slurm allocation, started by ``%ddp start --nnodes N`` through srun. See
``gpumagic.launch.rank_side.node_host``."""

import sys

from gpumagic.launch.rank_side.node_host import main

if __name__ == "__main__":
    sys.exit(main())

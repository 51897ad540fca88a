"""``python -m gpumagic.agent --rdzv-endpoint HOST:PORT --run-dir DIR``: run one node of a multi-node launch
(``%%launch_ddp --nnodes N`` prints the exact command). See ``gpumagic.launch.rank_side.agent``."""

import sys

from gpumagic.launch.rank_side.agent import main

if __name__ == "__main__":
    sys.exit(main())

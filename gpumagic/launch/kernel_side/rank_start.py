"""The context a kernel starts ranks from on its own machine (``rank_side.starter`` starts them): the rank
server's, which ends before the kernel does."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from gpumagic.launch.kernel_side.kernel_end import watch_this_kernel
from gpumagic.launch.rank_side.starter import starting_context


@contextlib.contextmanager
def rank_context(start_method: str) -> Iterator[Any]:
    """The multiprocessing context ranks start from, held until they ended: the rank server's (``forkserver``:
    not restarted under them; in a kernel, it and its ranks end before the kernel does), or ``spawn``'s."""
    with starting_context(start_method) as context:
        if start_method == "forkserver":
            watch_this_kernel()
        yield context

"""A launch's rank: one run of the shipped code, the same wherever it was started (a local forkserver rank, an
elastic agent's worker, a Slurm task): the runtime's set-up (``runtime.RankRuntime``), the code, its report (a
sealed value, or how it failed), the teardown.

Entry points: ``run_local_rank`` (the target of ``launch.kernel_side.local``'s rank processes) and ``run_rank``
(ranks started with torchrun's environment: ``python -m gpumagic.launch.rank_side.rank RUN_DIR``, Slurm
tasks). Imported by the rank server (with torch preloaded) and, for pickling by reference, by the kernel: so
torch is imported only where it is used.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle

from gpumagic.launch.plan import LaunchPlan
from gpumagic.launch.rank_side.debugging import serve_post_mortem
from gpumagic.launch.rank_side.failure_reports import report_failure
from gpumagic.launch.rank_side.lifeline import die_with_parent
from gpumagic.launch.rank_side.memory_cap import name_memory_limit
from gpumagic.launch.rank_side.output_routing import flush, output_to
from gpumagic.launch.rank_side.process_group import environment_store_place, leave_process_group
from gpumagic.launch.rank_side.runtime import (
    DEFAULT_TIMEOUT_S,
    RankRuntime,
    RankSetup,
    become_rank,
    exit_rank,
    plan_setup,
)
from gpumagic.run_dirs.launch_files import read_spec
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.private import write_private
from gpumagic.run_dirs.signing import read_sealed, write_sealed
from gpumagic.run_dirs.store import RUN_DIR_VARIABLE

_log = logging.getLogger(__name__)


class Rank(RankRuntime):
    """Set-up, execute, report, teardown of one rank; ``run`` does them in order and returns the exit code."""

    def __init__(self, setup: RankSetup) -> None:
        super().__init__(setup)
        self.payload: Any = None

    def run(self) -> int:
        try:
            self.set_up()
            self.phase = "user code"
            value = self.execute()
            self.report(value)
            self.tear_down()
        except BaseException as err:  # noqa: BLE001 - every way a rank ends must be reported
            _log.debug("the rank failed in %s; the failure is reported", self.phase, exc_info=True)
            return self.report_failure(name_memory_limit(err))
        finally:
            flush()
        return 0

    def prepare(self) -> None:
        """Load the shipped code (before the device: a failure to load it is setup's); record the collectives."""
        if self.recorder is not None:
            self.recorder.install()
        path = self.setup.files.payload
        self.payload = cloudpickle.loads(read_sealed(path, f"the code sent to the ranks ({path})"))
        self.payload.prepare()

    def execute(self) -> Any:
        return self.payload.run(self.context(), self.main_module.__dict__)

    def report(self, value: Any) -> None:
        write_sealed(self.setup.files.rank_result(self.setup.rank), cloudpickle.dumps(value))

    def tear_down(self) -> None:
        if self.setup.backend is not None:
            leave_process_group()

    def report_failure(self, err: BaseException) -> int:
        """Write how the rank failed (``ranks/rank-R.error.A.json``); the exit code (0 for ``sys.exit(0)``).
        With ``--pdb``, a failure of the user's code then waits for the notebook's post-mortem debugger."""
        setup = self.setup
        code = report_failure(setup.files.rank_error(setup.rank, setup.attempt), setup.rank, self.phase, err)
        if setup.post_mortem and self.phase == "user code" and isinstance(err, Exception):
            flush()
            if self.hang_watch is not None:
                self.hang_watch.debugging = "kept for the post-mortem debugger"
            serve_post_mortem(setup.files.rank_debug_socket(setup.rank), err.__traceback__)
        return code


def run_local_rank(local_rank: int, plan: LaunchPlan, outputs: list[Any], listener: Any) -> None:
    """The target of a local rank process (``launch.kernel_side.local`` starts it with the rank's local index)."""
    become_rank(plan, local_rank, outputs, local_rank)
    if plan.global_rank(local_rank) != 0 and listener is not None:
        listener.close()
        listener = None
    exit_rank(Rank(plan_setup(plan, local_rank, listener)).run())


def run_rank(run_dir: Path) -> int:
    """Run this process's rank of the code in ``run_dir`` (torchrun's variables must be set); its exit code.

    Output goes to ``ranks/rank-R.log`` for the time of the call; the value to ``rank-R.result.pkl``; a
    failure to ``rank-R.error.A.json`` with the user's traceback.
    """
    files = RunFiles(run_dir)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.environ[RUN_DIR_VARIABLE] = str(run_dir)
    with output_to(files.rank_log(rank)):
        started = {"rank": rank, "attempt": attempt, "pid": os.getpid(), "host": socket.gethostname()}
        write_private(files.rank_start(rank), json.dumps({**started, "started": time.time()}).encode())
        try:
            spec = read_spec(files)
        except BaseException as err:  # noqa: BLE001 - a changed or missing description is setup's failure
            _log.debug("the launch description cannot be read; reported as setup's failure", exc_info=True)
            return report_failure(files.rank_error(rank, attempt), rank, "setup", err)
        sys.path[:0] = [p for p in spec.get("sys_path", []) if p not in sys.path]  # the notebook's modules
        use_cuda = bool(spec.get("use_cuda"))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if use_cuda:
            try:
                _own_gpus(local_rank, local_world_size)
            except RuntimeError as err:
                return report_failure(files.rank_error(rank, attempt), rank, "setup", err)
        else:  # a CPU group on a GPU machine: its ranks see no GPU, on every node
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        setup = RankSetup(
            files=files,
            rank=rank,
            local_rank=local_rank,
            world_size=int(os.environ["WORLD_SIZE"]),
            backend=spec.get("backend") or None,
            store=environment_store_place(files, spec),
            timeout_s=float(spec.get("timeout_s", DEFAULT_TIMEOUT_S)),
            use_cuda=use_cuda,
            threads=int(spec.get("threads_per_rank") or 1),
            attempt=attempt,
            hang_after_s=float(spec.get("hang_after_s") or 0.0),
        )
        return Rank(setup).run()


def _own_gpus(local_rank: int, local_world_size: int) -> None:
    """Narrow ``CUDA_VISIBLE_DEVICES`` to this rank's share of the node's GPUs (the same number each)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        visible = [str(i) for i in range(local_world_size)]
    per_rank = max(1, len(visible) // max(1, local_world_size))
    mine = visible[local_rank * per_rank : (local_rank + 1) * per_rank]
    if not mine:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: this node shows {len(visible)} GPU(s) to {local_world_size} ranks"
        )
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m gpumagic.launch.rank_side.rank RUN_DIR  (gpumagic's agent starts it)\n")
        return 2
    die_with_parent()
    exit_rank(run_rank(Path(argv[0])))  # as a local rank does: skip teardown that could hang in a destructor


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``%%launch_ddp``: the cell on N DDP ranks, a thin shell over ``launch.kernel_side.ddp`` (on this machine or
several, blocking or ``--no-wait``) and ``jobs.api`` (``--executor slurm``). Its arguments become one
``LaunchOptions``, checked before anything is shipped or leased."""

from __future__ import annotations

import argparse
import functools
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class

from gpumagic.errors import GpumagicError
from gpumagic.jobs.api import JobRequest, submit_cell
from gpumagic.launch.failures import LaunchError, LaunchInterrupted
from gpumagic.launch.kernel_side.ddp import check_named_gpus, launch_packed, launch_sharing, prepare_cell, shared_for
from gpumagic.launch.kernel_side.launch_handle import LaunchHandle, Outcome
from gpumagic.launch.kernel_side.output import cell_number, in_kernel
from gpumagic.launch.kernel_side.session import SESSION
from gpumagic.launch.options import LaunchOptions
from gpumagic.launch.shared_values import SharedBatch
from gpumagic.magics.parsing import (
    Help,
    Parser,
    add_options,
    add_slurm_arguments,
    first_line,
    given_options,
    parse_cell_line,
    slurm_options,
)
from gpumagic.widgets.launch_dashboard import LaunchDashboard


def _launch_parser() -> Parser:
    parser = Parser(
        "%%launch_ddp",
        "Run the cell on N processes with DistributedDataParallel ready: rank, local_rank, world_size and\n"
        "device are defined and the process group is initialized (nccl with GPUs, gloo on CPU). Functions,\n"
        "classes and data the cell uses from the notebook are shipped by value. Each rank's output streams\n"
        "in, prefixed with its rank; a failing rank raises one error with its own traceback.\n"
        "Example: %%launch_ddp -n 2 -o results",
    )
    add_options(parser, "launch")
    parser.add_argument("-o", metavar="VAR", help="store {rank: value of the cell's last expression} in VAR")
    parser.add_argument("--no-dashboard", action="store_true", help="no live status, metric and resource plots")
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="return at once; the dashboard (with Stop) stays live and -o VAR is set when done",
    )
    add_slurm_arguments(parser, shape=False)
    return parser


_LAUNCH_PARSER = _launch_parser()


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The launch ``%%launch_ddp``'s arguments ask for, checked (``InvalidArgument``, one line)."""
    return LaunchOptions(**given_options(args, "launch"))


@magics_class
class LaunchMagics(Magics):
    """``%%launch_ddp``: run a cell on N DDP ranks. The kernel's session (``SESSION``) keeps the latest
    ``--no-wait`` launch and the latest dashboard."""

    @cell_magic
    def launch_ddp(self, line: str, cell: str) -> Any:
        args = parse_cell_line(_LAUNCH_PARSER, line)
        if args is None:
            return Help(_LAUNCH_PARSER.format_help())
        filename = f"<%%launch_ddp cell In[{cell_number(self.shell)}]>"
        slurm = slurm_options(args, _LAUNCH_PARSER.prog)
        if args.pdb and (args.no_wait or slurm is not None):
            raise UsageError(
                "%%launch_ddp: --pdb reads the debugger's lines while the cell waits; leave out "
                + ("--no-wait" if args.no_wait else "--executor slurm")
            )
        if slurm is not None:
            return self._launch_on_slurm(args, slurm, cell, filename)
        dashboard = None
        if not args.no_dashboard and in_kernel():
            dashboard = LaunchDashboard(stoppable=args.no_wait)
            SESSION.last_dashboard = dashboard
        shared = None
        try:
            launch = launch_options(args)
            if args.no_wait:
                check_named_gpus(launch)  # bad input is an error now, not a value in -o VAR later
            shared = shared_for(launch)
            packed = prepare_cell(
                self.shell.transform_cell(cell),
                self.shell.user_ns,
                filename=filename,
                hidden=set(self.shell.user_ns_hidden),
                shared=shared,
            )
            if args.no_wait:
                if dashboard is not None:  # here, in this cell's output; a blocking launch shows it as ranks start
                    dashboard.show()
                self._launch_in_background(packed, launch, args.o, dashboard, shared)
                shared = None  # the launch's thread releases it
                return None
            try:
                results = launch_packed(packed, launch, dashboard=dashboard)
            finally:
                if dashboard is not None:
                    # the cell ends once the dashboard is its static copy: a page reloaded meanwhile asks the kernel
                    # for the widgets when the cell ends, and must not get a frame showing a widget just closed
                    dashboard.join()
        except (LaunchError, LaunchInterrupted):
            raise  # they render as the failing rank's traceback and the ranks' fates
        except GpumagicError as err:
            raise UsageError(str(err)) from None
        finally:
            if shared is not None:
                shared.release()
        if args.o is not None:
            self.shell.user_ns[args.o] = results
        return None

    def _launch_on_slurm(self, args: argparse.Namespace, slurm: dict[str, Any], cell: str, filename: str) -> Any:
        """--executor slurm: submit the cell as a Slurm job of --nnodes × -n ranks, follow its output here, and
        set -o VAR at the end; an interrupt cancels the job."""
        local_only = {
            "--rdzv-endpoint": args.rdzv_endpoint,
            "--rdzv-id": args.rdzv_id,
            "--node-rank": args.node_rank,
            "--max-restarts": args.max_restarts or None,
            "--runs-dir": args.runs_dir,
            "--port": args.port,
            "--no-wait": args.no_wait or None,
        }
        given = [flag for flag, value in local_only.items() if value is not None]
        if given:
            raise UsageError(
                f"%%launch_ddp: with --executor slurm, Slurm places the ranks: leave out {', '.join(given)} "
                "(%%launch_bg --executor slurm submits and returns at once)"
            )
        ranks_per_node = args.nprocs or 1
        try:
            request = JobRequest.of(
                gpus=args.gpus,
                ddp=args.nnodes * ranks_per_node,
                backend=args.backend,
                timeout=args.timeout,
                executor="slurm",
                slurm={**slurm, "nodes": args.nnodes, "tasks_per_node": ranks_per_node},
            )
            job = submit_cell(
                self.shell.transform_cell(cell),
                self.shell.user_ns,
                request,
                filename=filename,
                hidden=set(self.shell.user_ns_hidden),
            )
        except GpumagicError as err:
            raise UsageError(f"%%launch_ddp: {err}") from None
        print(f"[gpumagic] submitted as job {job.name} ({job.reason}); its output follows, an interrupt cancels it")
        status = job.follow(tail=None)
        if status in ("queued", "running"):  # the follow was interrupted
            job.kill()
            raise LaunchInterrupted(f"interrupted; job {job.name} was cancelled through Slurm")
        results = job.result()  # raises JobFailed with the failing rank's traceback
        if args.o is not None:
            self.shell.user_ns[args.o] = results if isinstance(results, dict) else {0: results}
        return None

    def _launch_in_background(
        self,
        packed: bytes,
        launch: LaunchOptions,
        variable: str | None,
        dashboard: LaunchDashboard | None,
        shared: SharedBatch | None,
    ) -> None:
        """--no-wait: launch on a thread; ``variable`` gets the results (or the error) when the ranks end, and
        ``shared`` is released then. The cell was packed already, so what cannot be shipped is an error now."""
        namespace = self.shell.user_ns

        def ended(outcome: Outcome) -> None:
            if isinstance(outcome, BaseException) and dashboard is not None:  # refused, or failed: say so
                dashboard.add_note(f"<span style='color:#b00'>{type(outcome).__name__}: {first_line(outcome)}</span>")
                if dashboard.state == "starting":  # refused before any rank started
                    dashboard.finish("refused")
            if variable is not None:
                namespace[variable] = outcome

        run = functools.partial(launch_sharing, packed, launch, shared, dashboard=dashboard)
        SESSION.last_launch = LaunchHandle(run, on_end=ended).start()


LaunchMagics.launch_ddp.__doc__ = _LAUNCH_PARSER.format_help()

"""The IPython shell over gpumagic's API: parse a magic's arguments, call the API, return what to show.

Every bad input becomes a one-line ``UsageError``; work that could not be done (too few GPUs, a GPU
leased by someone else) too, with the API's message, so no magic ever shows a raw traceback.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

import gpumagic
from gpumagic.errors import GpumagicError
from gpumagic.launch.failures import LaunchError, LaunchInterrupted
from gpumagic.launch.kernel_side.output import cell_number, in_kernel


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``UsageError`` instead of exiting."""

    def __init__(self, prog: str, description: str, **kwargs: Any) -> None:
        super().__init__(
            prog=prog,
            description=description,
            add_help=False,
            allow_abbrev=False,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kwargs,
        )
        self.add_argument("-h", "--help", action="store_true", help="show this help")

    def error(self, message: str) -> None:  # type: ignore[override]
        message = message.replace("\r", "\\r").replace("\n", "\\n")  # one line, even for odd input
        raise UsageError(f"{self.prog}: {message}. See {self.prog} --help")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise UsageError(message or f"{self.prog}: invalid arguments")


def _add_pick_options(parser: _Parser) -> None:
    """What ``%gpu pick`` and ``%gpu why`` both take: N and the conditions a GPU must meet."""
    parser.add_argument("n", nargs="?", default="1", help="how many GPUs (default 1)")
    parser.add_argument("--min-free", metavar="SIZE", help="free memory each needs: 20GB, 512MB, 50%%")
    parser.add_argument("--max-util", metavar="PCT", help="highest utilization allowed, percent")
    parser.add_argument("--exclude", metavar="IDS", help="GPUs never to pick: 0,1 or any device spec")


def _parsers() -> dict[str, _Parser]:
    status = _Parser(
        "%gpu status",
        "Table of all GPUs: memory, utilization, temperature, power, processes and "
        "their users, leases, and which GPUs this kernel sees (cuda:N).",
    )
    pick = _Parser(
        "%gpu pick",
        "Lease the N best free GPUs (most free memory, then lowest utilization; GPUs leased by other notebooks\n"
        "never qualify) and set CUDA_DEVICE_ORDER=PCI_BUS_ID and CUDA_VISIBLE_DEVICES so cuda:0.. are them.\n"
        "Example: %gpu pick 2 --min-free 20GB --max-util 30 --wait 10m",
    )
    _add_pick_options(pick)
    pick.add_argument("--wait", metavar="DURATION", help="keep trying this long (30s, 10m, 2h) until enough qualify")
    why = _Parser(
        "%gpu why",
        "What %gpu pick N would get now and why: every GPU's reason, the machine's queue in the order it is\n"
        "served (what each waiting job or kernel does), and what gpumagic ignores or passes over in the lease\n"
        "directory. Takes nothing. Example: %gpu why 2 --min-free 20GB",
    )
    _add_pick_options(why)
    use = _Parser(
        "%gpu use",
        "Use exactly the GPUs SPEC names, leasing them. SPEC: 0,2 | GPU:1 | ['GPU:0','GPU:1'] | GPU:* | all |\n"
        "a name pattern (A100, 'RTX.*') | a UUID or its prefix (GPU-5e0f) | none or cpu (no GPU).",
    )
    use.add_argument("spec", nargs="*", help="the GPUs to use")
    use.add_argument("--force", action="store_true", help="use GPUs leased by someone else too (no lease taken)")
    release = _Parser("%gpu release", "Give back this kernel's leases and restore CUDA_VISIBLE_DEVICES.")
    seed = _Parser(
        "%gpu seed",
        "Seed python, numpy and torch (CPU and all CUDA devices) in this kernel, and "
        "export the seed to processes it starts.",
    )
    seed.add_argument("value", help="the seed, 0 to 2**32-1")
    seed.add_argument(
        "--deterministic", action="store_true", help="deterministic torch algorithms, no cuDNN autotuning"
    )
    kill = _Parser(
        "%gpu kill", "Stop one of your own GPU processes (SIGTERM, then SIGKILL). Other users' processes are refused."
    )
    kill.add_argument("pid", help="the process id, as %%gpu status shows it")
    kill.add_argument("--timeout", default="5s", metavar="DURATION", help="how long to wait before SIGKILL (5s)")
    watch = _Parser(
        "%gpu watch",
        "Live dashboard of every GPU: memory (this kernel's share apart from other users'),\n"
        "utilization; with pause and stop. Sampling runs on a background thread: the kernel stays free.",
    )
    watch.add_argument("--interval", default="1s", metavar="DURATION", help="time between samples (1s)")
    watch.add_argument("--history", type=int, default=600, metavar="N", help="samples kept per GPU (600)")
    helper = _Parser("%gpu help", "Help on %gpu or one subcommand.")
    helper.add_argument("subcommand", nargs="?", help="a subcommand")
    return {
        "status": status,
        "pick": pick,
        "why": why,
        "use": use,
        "release": release,
        "seed": seed,
        "kill": kill,
        "watch": watch,
        "help": helper,
    }


_PARSERS = _parsers()
_OVERVIEW = (
    "%gpu [SUBCOMMAND] [OPTIONS] — see, pick and use GPUs.\n\n"
    "  %gpu                        table of GPUs, processes, leases (same as %gpu status)\n"
    "  %gpu pick [N] [--min-free SIZE] [--max-util PCT] [--exclude IDS] [--wait DURATION]\n"
    "  %gpu why [N] [--min-free SIZE] [--max-util PCT] [--exclude IDS]   why a pick would (not) get GPUs; the queue\n"
    "  %gpu use SPEC [--force]     0,2 | GPU:1 | ['GPU:0','GPU:1'] | GPU:* | A100 | GPU-5e0f | none\n"
    "  %gpu release                give back this kernel's GPUs\n"
    "  %gpu seed N [--deterministic]\n"
    "  %gpu kill PID [--timeout DURATION]\n"
    "  %gpu watch [--interval 1s] [--history 600]   live dashboard of all GPUs\n"
    "  %gpu help SUBCOMMAND        or %gpu SUBCOMMAND --help\n\n"
    "Set GPUMAGIC_SIMULATE=4xA100-80GB to try it without GPUs. Python API: gpumagic.pick(), gpumagic.use(), ..."
)


@magics_class
class GpuMagics(Magics):
    """``%gpu``: see the GPUs, pick the best free ones, or name them."""

    @line_magic
    def gpu(self, line: str) -> Any:
        name, rest = _subcommand(line, "%gpu", "status", _PARSERS)
        if name is None:
            return _Help(_OVERVIEW)
        parser = _PARSERS[name]
        try:
            args = _parse_use(rest) if name == "use" else _parse(parser, rest)
            if args is None or args.help:
                return _Help(parser.format_help())
            return _HANDLERS[name](args)
        except GpumagicError as err:
            raise UsageError(str(err)) from None
        except KeyboardInterrupt:
            raise UsageError(f"{parser.prog} interrupted; nothing was changed") from None


GpuMagics.gpu.__doc__ = _OVERVIEW + "\n\n" + "\n".join(p.format_help() for p in _PARSERS.values())


class _Help(str):
    """Help text shown without quotes."""

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def _subcommand(line: str, magic: str, default: str, parsers: Mapping[str, _Parser]) -> tuple[str | None, str]:
    """(subcommand, the rest of the line) of a line magic with subcommands; ``None`` for ``-h``/``--help``.

    Raises:
        UsageError: no such subcommand (the message lists them).
    """
    words = line.strip().split(None, 1)
    name = words[0] if words else default
    rest = words[1] if len(words) > 1 else ""
    if name in ("-h", "--help"):
        return None, rest
    if name not in parsers:
        raise UsageError(f"{magic} has no subcommand {name!r}; use one of: {', '.join(parsers)} (see {magic} help)")
    return name, rest


def _parse(parser: _Parser, rest: str) -> argparse.Namespace | None:
    """A subcommand's arguments, or ``None`` when the line asks for help: checked before parsing, where a
    missing required argument would fail first."""
    words = _split(rest, parser.prog)
    if "-h" in words or "--help" in words:
        return None
    return parser.parse_args(words)


def _split(rest: str, prog: str) -> list[str]:
    try:
        return shlex.split(rest)
    except ValueError as err:
        raise UsageError(f"{prog}: {err} in {rest!r}") from None


def _parse_use(rest: str) -> argparse.Namespace:
    """``use`` keeps its SPEC raw: quotes and spaces belong to list literals like ['GPU:0', 'GPU:1']."""
    words = rest.split()
    flags = {w for w in words if w in ("--force", "-h", "--help")}
    unknown = [w for w in words if w.startswith("--") and w not in flags]
    if unknown:
        raise UsageError(f"%gpu use: unknown option {unknown[0]}; see %gpu use --help")
    spec = " ".join(w for w in words if w not in flags)
    return argparse.Namespace(spec=spec, force="--force" in flags, help=bool(flags & {"-h", "--help"}))


def _status(args: argparse.Namespace) -> Any:
    return gpumagic.status()


def _count(args: argparse.Namespace, subcommand: str) -> int:
    try:
        return int(args.n)
    except ValueError:
        raise UsageError(f"%gpu {subcommand}: N must be a whole number of GPUs, got {args.n!r}") from None


def _pick(args: argparse.Namespace) -> Any:
    n = _count(args, "pick")
    waiting = _WaitLine()
    try:
        return gpumagic.pick(
            n,
            min_free=args.min_free,
            max_util=args.max_util,
            exclude=args.exclude,
            wait=args.wait,
            on_wait=waiting.update,
        )
    finally:
        waiting.close()


def _why(args: argparse.Namespace) -> Any:
    return gpumagic.why(_count(args, "why"), min_free=args.min_free, max_util=args.max_util, exclude=args.exclude)


def _use(args: argparse.Namespace) -> Any:
    if not args.spec:
        raise UsageError("%gpu use: name the GPUs, e.g. %gpu use 0,2 (see %gpu use --help)")
    return gpumagic.use(args.spec, force=args.force)


def _release(args: argparse.Namespace) -> Any:
    released = gpumagic.release()
    if not released:
        return _Help("This kernel held no GPU lease; CUDA_VISIBLE_DEVICES is as it was before gpumagic.")
    return _Help(f"Released GPU {', '.join(map(str, released))}; CUDA_VISIBLE_DEVICES is as it was before gpumagic.")


def _seed(args: argparse.Namespace) -> Any:
    try:
        value = int(args.value)
    except ValueError:
        raise UsageError(f"%gpu seed: the seed must be a whole number, got {args.value!r}") from None
    return gpumagic.seed(value, deterministic=args.deterministic)


def _kill(args: argparse.Namespace) -> Any:
    from gpumagic.units import parse_duration

    try:
        pid = int(args.pid)
    except ValueError:
        raise UsageError(f"%gpu kill: PID must be a whole number, got {args.pid!r}") from None
    return gpumagic.kill(pid, timeout=parse_duration(args.timeout))


def _watch(args: argparse.Namespace) -> Any:
    from gpumagic.units import parse_duration

    interval = parse_duration(args.interval)
    if interval < 0.05:
        raise UsageError("%gpu watch: --interval must be at least 50ms")
    if not 2 <= args.history <= 100_000:
        raise UsageError("%gpu watch: --history must be from 2 to 100000 samples")
    inventory = gpumagic.gpus()
    if not inventory.gpus:
        raise UsageError(f"No GPUs to watch: {inventory.problem}")
    if not in_kernel():
        return _watch_in_terminal(interval)
    from gpumagic.widgets.gpu_watch import GpuWatch

    _close_previous_watch()
    watch = GpuWatch(interval=interval, history=args.history)
    _WATCHES.append(watch)
    return watch


_WATCHES: list[Any] = []


def _close_previous_watch() -> None:
    """Re-running %gpu watch replaces the dashboard: the old one's threads stop."""
    while _WATCHES:
        _WATCHES.pop().close()


def _watch_in_terminal(interval: float) -> Any:
    """In a terminal: one compact line per sample until Ctrl-C."""
    import time

    from gpumagic.telemetry.samplers import GpuSampler
    from gpumagic.widgets.gpu_watch import text_view

    sampler = GpuSampler()
    try:
        while True:
            inventory, samples = sampler.sample()
            print(text_view(samples, inventory.simulated), flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return _Help("stopped watching")


def _help(args: argparse.Namespace) -> Any:
    if args.subcommand is None:
        return _Help(_OVERVIEW)
    parser = _PARSERS.get(args.subcommand)
    if parser is None:
        raise UsageError(f"%gpu has no subcommand {args.subcommand!r}; use one of: {', '.join(_PARSERS)}")
    return _Help(parser.format_help())


_HANDLERS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "status": _status,
    "watch": _watch,
    "pick": _pick,
    "why": _why,
    "use": _use,
    "release": _release,
    "seed": _seed,
    "kill": _kill,
    "help": _help,
}


class _WaitLine:
    """One status line under the cell, updated in place while ``pick --wait`` waits."""

    def __init__(self) -> None:
        self._handle: Any = None
        self._last = ""

    def update(self, text: str) -> None:
        from IPython.display import display

        if text == self._last:
            return
        self._last = text
        if self._handle is None:
            self._handle = display(_Help(text), display_id=True)
        else:
            self._handle.update(_Help(text))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.update(_Help(""))


_SLURM_FLAGS = ("partition", "time", "nodes", "tasks_per_node", "gres", "account", "qos", "constraint")


def add_slurm_arguments(parser: argparse.ArgumentParser, shape: bool) -> None:
    """``--executor slurm`` and the Slurm options (``shape``: --nodes and --tasks-per-node too)."""
    group = parser.add_argument_group("on Slurm (submitit; docs/multi-node.md)")
    group.add_argument("--executor", default="local", choices=("local", "slurm"), help="where the job runs (local)")
    group.add_argument("--partition", help="Slurm partition")
    group.add_argument("--time", metavar="DURATION", help="Slurm time limit: 90m, 2h (default 1h)")
    if shape:
        group.add_argument("--nodes", metavar="N", help="nodes (1)")
        group.add_argument("--tasks-per-node", metavar="K", help="tasks (ranks) per node (1, or --ddp / nodes)")
    group.add_argument("--gres", metavar="GRES", help="generic resources instead of --gpus: gpu:a100:4")
    group.add_argument("--account", help="Slurm account")
    group.add_argument("--qos", help="Slurm QOS")
    group.add_argument("--constraint", help="Slurm node features")
    group.add_argument("--cpus-per-task", metavar="N", help="CPUs per task")
    group.add_argument("--mem", metavar="SIZE", help="memory per node: 64GB")
    group.add_argument(
        "--sbatch", action="append", metavar="KEY=VALUE", help="any other sbatch option, repeatable: exclusive=1"
    )


def slurm_options(args: argparse.Namespace, prog: str) -> dict[str, Any] | None:
    """The ``slurm=`` dict of the Slurm options given; None without --executor slurm (which then allows none)."""
    given = {key: getattr(args, key, None) for key in (*_SLURM_FLAGS, "cpus_per_task", "mem")}
    given = {key: value for key, value in given.items() if value is not None}
    extra = {}
    for item in args.sbatch or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{prog}: --sbatch takes KEY=VALUE (exclusive=1, mail-type=END), got {item!r}")
        extra[key.strip()] = value.strip()
    if args.executor != "slurm":
        if given or extra:
            flags = ", ".join("--" + key.replace("_", "-") for key in [*given, *(["sbatch"] if extra else [])])
            raise UsageError(f"{prog}: {flags} need --executor slurm")
        return None
    if extra:
        given["additional"] = extra
    return given


def _launch_parser() -> _Parser:
    parser = _Parser(
        "%%launch_ddp",
        "Run the cell on N processes with DistributedDataParallel ready: rank, local_rank, world_size and\n"
        "device are defined and the process group is initialized (nccl with GPUs, gloo on CPU). Functions,\n"
        "classes and data the cell uses from the notebook are shipped by value. Each rank's output streams\n"
        "in, prefixed with its rank; a failing rank raises one error with its own traceback.\n"
        "Example: %%launch_ddp -n 2 -o results",
    )
    parser.add_argument("-n", "--nprocs", type=int, help="number of ranks (default: one per visible GPU, or 2)")
    parser.add_argument(
        "--gpus", metavar="SPEC", help="GPUs for the ranks: a %%gpu use spec, or auto to pick free ones"
    )
    parser.add_argument("--gpus-per-rank", type=int, default=1, metavar="K", help="GPUs per rank (model parallel)")
    parser.add_argument("--backend", help="process group backend: nccl, gloo, mpi, ucc")
    parser.add_argument("--port", type=int, help="rendezvous port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--timeout", default="30m", metavar="DURATION", help="process group timeout (30m)")
    parser.add_argument("--start-method", default="forkserver", choices=("forkserver", "spawn"))
    parser.add_argument("--output", default="all", choices=("all", "rank0", "none"), help="whose output to show")
    parser.add_argument("-o", metavar="VAR", help="store {rank: value of the cell's last expression} in VAR")
    parser.add_argument("--no-dashboard", action="store_true", help="no live status, metric and resource plots")
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="return at once; the dashboard (with Stop) stays live and -o VAR is set when done",
    )
    elastic = parser.add_argument_group("multi-node and elastic (torch.distributed.elastic; docs/multi-node.md)")
    elastic.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes, each running -n ranks (1)")
    elastic.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous on this machine's HOST:PORT (0: a free port)"
    )
    elastic.add_argument("--rdzv-id", metavar="ID", help="c10d rendezvous id (default: the run's id)")
    elastic.add_argument("--node-rank", type=int, metavar="R", help="fixed node numbers: this node is R")
    elastic.add_argument(
        "--max-restarts", type=int, default=0, metavar="K", help="restart the whole group up to K times (0)"
    )
    elastic.add_argument("--runs-dir", metavar="DIR", help="make the run directory here: a filesystem all nodes share")
    add_slurm_arguments(parser, shape=False)
    return parser


_LAUNCH_PARSER = _launch_parser()


def _elastic_options(args: argparse.Namespace) -> dict[str, Any]:
    """The multi-node options given (none given: the local launcher)."""
    given = {
        "nnodes": args.nnodes,
        "rdzv_endpoint": args.rdzv_endpoint,
        "node_rank": args.node_rank,
        "rdzv_id": args.rdzv_id,
        "max_restarts": args.max_restarts,
        "runs_dir": args.runs_dir,
    }
    defaults = {"nnodes": 1, "max_restarts": 0}
    return {k: v for k, v in given.items() if v != defaults.get(k)}


def _first_line(err: BaseException) -> str:
    import html

    return html.escape(str(err).splitlines()[0] if str(err) else "")


@magics_class
class LaunchMagics(Magics):
    """``%%launch_ddp``: run a cell on N DDP ranks."""

    last_dashboard: Any = None

    @cell_magic
    def launch_ddp(self, line: str, cell: str) -> Any:
        from gpumagic.launch.kernel_side.ddp import check_launch, launch_prepared, prepare_cell

        args = _LAUNCH_PARSER.parse_args(_split(line, _LAUNCH_PARSER.prog))
        if args.help:
            return _Help(_LAUNCH_PARSER.format_help())
        if args.o is not None and not args.o.isidentifier():
            raise UsageError(f"%%launch_ddp: -o needs a variable name, got {args.o!r}")
        filename = f"<%%launch_ddp cell In[{cell_number(self.shell)}]>"
        slurm = slurm_options(args, _LAUNCH_PARSER.prog)
        if slurm is not None:
            return self._launch_on_slurm(args, slurm, cell, filename)
        dashboard = None
        if not args.no_dashboard and in_kernel():
            from gpumagic.widgets.launch_dashboard import LaunchDashboard

            dashboard = LaunchDashboard(stoppable=args.no_wait)
            LaunchMagics.last_dashboard = dashboard
        options = dict(
            nprocs=args.nprocs,
            gpus=args.gpus,
            gpus_per_rank=args.gpus_per_rank,
            backend=args.backend,
            port=args.port,
            timeout=args.timeout,
            start_method=args.start_method,
            output=args.output,
            dashboard=dashboard,
            **_elastic_options(args),
        )
        try:
            if args.no_wait:
                check_launch(**options)  # bad input is an error now, not a value in -o VAR later
            packed = prepare_cell(
                self.shell.transform_cell(cell),
                self.shell.user_ns,
                filename=filename,
                hidden=set(self.shell.user_ns_hidden),
            )
            if args.no_wait:
                if dashboard is not None:  # here, in this cell's output; a blocking launch shows it as ranks start
                    dashboard.show()
                return self._launch_in_background(packed, args.o, dashboard, options)
            results = launch_prepared(packed, **options)
        except (LaunchError, LaunchInterrupted):
            raise  # they render as the failing rank's traceback and the ranks' fates
        except GpumagicError as err:
            raise UsageError(str(err)) from None
        if args.o is not None:
            self.shell.user_ns[args.o] = results
        return None

    def _launch_on_slurm(self, args: argparse.Namespace, slurm: dict[str, Any], cell: str, filename: str) -> Any:
        """--executor slurm: submit the cell as a Slurm job of --nnodes × -n ranks, follow its output here, and
        set -o VAR at the end; an interrupt cancels the job."""
        from gpumagic.jobs.api import submit_cell

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
            job = submit_cell(
                self.shell.transform_cell(cell),
                self.shell.user_ns,
                filename=filename,
                hidden=set(self.shell.user_ns_hidden),
                gpus=args.gpus,
                ddp=args.nnodes * ranks_per_node,
                backend=args.backend,
                timeout=args.timeout,
                executor="slurm",
                slurm={**slurm, "nodes": args.nnodes, "tasks_per_node": ranks_per_node},
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

    def _launch_in_background(self, packed: bytes, variable: str | None, dashboard: Any, options: dict) -> Any:
        """--no-wait: launch on a thread; ``variable`` gets the results (or the LaunchError) when the ranks end.
        The cell was packed already, so what cannot be shipped is an error now, not later."""
        import threading

        from gpumagic.launch.kernel_side.ddp import launch_prepared

        namespace = self.shell.user_ns

        def run() -> None:
            try:
                outcome: Any = launch_prepared(packed, **options)
            except Exception as err:  # noqa: BLE001 - handed to the user through the variable
                outcome = err
                if dashboard is not None:  # refused before its ranks started, or failed: say so under the status
                    dashboard.add_note(f"<span style='color:#b00'>{type(err).__name__}: {_first_line(err)}</span>")
                    if dashboard.state == "starting":  # refused before any rank started
                        dashboard.finish("refused")
            if variable is not None:
                namespace[variable] = outcome

        threading.Thread(target=run, name="gpumagic-launch", daemon=True).start()
        return None


LaunchMagics.launch_ddp.__doc__ = _LAUNCH_PARSER.format_help()

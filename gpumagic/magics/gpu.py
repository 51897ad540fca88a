"""``%gpu``: see every GPU, pick the best free ones or name them, seed, kill, watch; a thin shell over
``devices.selection`` and the other modules that own each thing."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from gpumagic.devices import selection
from gpumagic.devices.inventory import read_inventory
from gpumagic.devices.own_processes import kill_gpu_process
from gpumagic.devices.status import gather_status
from gpumagic.errors import GpumagicError
from gpumagic.launch.kernel_side.output import in_kernel
from gpumagic.launch.seeding import seed
from gpumagic.magics.parsing import Help, Parser, parse, subcommand, whole_number
from gpumagic.telemetry.samplers import GpuSampler
from gpumagic.units import parse_duration
from gpumagic.widgets.gpu_watch import GpuWatch, text_view
from gpumagic.widgets.status_table import StatusTable


def _add_pick_options(parser: Parser) -> None:
    """What ``%gpu pick`` and ``%gpu why`` both take: N and the conditions a GPU must meet."""
    parser.add_argument("n", nargs="?", default="1", help="how many GPUs (default 1)")
    parser.add_argument("--min-free", metavar="SIZE", help="free memory each needs: 20GB, 512MB, 50%%")
    parser.add_argument("--max-util", metavar="PCT", help="highest utilization allowed, percent")
    parser.add_argument("--exclude", metavar="IDS", help="GPUs never to pick: 0,1 or any device spec")


def _parsers() -> dict[str, Parser]:
    status = Parser(
        "%gpu status",
        "Table of all GPUs: memory, utilization, temperature, power, processes and "
        "their users, leases (how long each holder's kernel has been idle), which GPUs this kernel sees (cuda:N),\n"
        "and the administrator's policy (policy.toml in the lease directory) if there is one.",
    )
    pick = Parser(
        "%gpu pick",
        "Lease the N best free GPUs (most free memory, then lowest utilization; GPUs leased by other notebooks\n"
        "never qualify) and set CUDA_DEVICE_ORDER=PCI_BUS_ID and CUDA_VISIBLE_DEVICES so cuda:0.. are them.\n"
        "An administrator's policy may cap each user's GPUs, and give an idle kernel's lease to a waiter.\n"
        "Example: %gpu pick 2 --min-free 20GB --max-util 30 --wait 10m",
    )
    _add_pick_options(pick)
    pick.add_argument("--wait", metavar="DURATION", help="keep trying this long (30s, 10m, 2h) until enough qualify")
    why = Parser(
        "%gpu why",
        "What %gpu pick N would get now and why: every GPU's reason, the machine's queue in the order it is\n"
        "served (what each waiting job or kernel does), and what gpumagic ignores or passes over in the lease\n"
        "directory. Takes nothing. Example: %gpu why 2 --min-free 20GB",
    )
    _add_pick_options(why)
    use = Parser(
        "%gpu use",
        "Use exactly the GPUs SPEC names, leasing them. SPEC: 0,2 | GPU:1 | ['GPU:0','GPU:1'] | GPU:* | all |\n"
        "a name pattern (A100, 'RTX.*') | a UUID or its prefix (GPU-5e0f) | none or cpu (no GPU).",
    )
    use.add_argument("spec", nargs="*", help="the GPUs to use")
    use.add_argument("--force", action="store_true", help="use GPUs leased by someone else too (no lease taken)")
    release = Parser("%gpu release", "Give back this kernel's leases and restore CUDA_VISIBLE_DEVICES.")
    seed = Parser(
        "%gpu seed",
        "Seed python, numpy and torch (CPU and all CUDA devices) in this kernel, and "
        "export the seed to processes it starts.",
    )
    seed.add_argument("value", help="the seed, 0 to 2**32-1")
    seed.add_argument(
        "--deterministic", action="store_true", help="deterministic torch algorithms, no cuDNN autotuning"
    )
    kill = Parser(
        "%gpu kill", "Stop one of your own GPU processes (SIGTERM, then SIGKILL). Other users' processes are refused."
    )
    kill.add_argument("pid", help="the process id, as %%gpu status shows it")
    kill.add_argument("--timeout", default="5s", metavar="DURATION", help="how long to wait before SIGKILL (5s)")
    watch = Parser(
        "%gpu watch",
        "Live dashboard of every GPU: memory (this kernel's share apart from other users'),\n"
        "utilization; with pause and stop. Sampling runs on a background thread: the kernel stays free.",
    )
    watch.add_argument("--interval", default="1s", metavar="DURATION", help="time between samples (1s)")
    watch.add_argument("--history", type=int, default=600, metavar="N", help="samples kept per GPU (600)")
    helper = Parser("%gpu help", "Help on %gpu or one subcommand.")
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
        name, rest = subcommand(line, "%gpu", "status", _PARSERS)
        if name is None:
            return Help(_OVERVIEW)
        parser = _PARSERS[name]
        try:
            args = _parse_use(rest) if name == "use" else parse(parser, rest)
            if args is None or args.help:
                return Help(parser.format_help())
            return _HANDLERS[name](args)
        except GpumagicError as err:
            raise UsageError(str(err)) from None
        except KeyboardInterrupt:
            raise UsageError(f"{parser.prog} interrupted; nothing was changed") from None


GpuMagics.gpu.__doc__ = _OVERVIEW + "\n\n" + "\n".join(p.format_help() for p in _PARSERS.values())


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
    return StatusTable(gather_status())


def _count(args: argparse.Namespace, subcommand: str) -> int:
    return whole_number(args.n, f"%gpu {subcommand}: N must be a whole number of GPUs")


def _pick(args: argparse.Namespace) -> Any:
    n = _count(args, "pick")
    waiting = _WaitLine()
    try:
        return selection.pick(
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
    return selection.why(_count(args, "why"), min_free=args.min_free, max_util=args.max_util, exclude=args.exclude)


def _use(args: argparse.Namespace) -> Any:
    if not args.spec:
        raise UsageError("%gpu use: name the GPUs, e.g. %gpu use 0,2 (see %gpu use --help)")
    return selection.use(args.spec, force=args.force)


def _release(args: argparse.Namespace) -> Any:
    released = selection.release()
    if not released:
        return Help("This kernel held no GPU lease; CUDA_VISIBLE_DEVICES is as it was before gpumagic.")
    return Help(f"Released GPU {', '.join(map(str, released))}; CUDA_VISIBLE_DEVICES is as it was before gpumagic.")


def _seed(args: argparse.Namespace) -> Any:
    value = whole_number(args.value, "%gpu seed: the seed must be a whole number")
    return seed(value, deterministic=args.deterministic)


def _kill(args: argparse.Namespace) -> Any:
    pid = whole_number(args.pid, "%gpu kill: PID must be a whole number")
    timeout = parse_duration(args.timeout)
    return kill_gpu_process(pid, timeout)


def _watch(args: argparse.Namespace) -> Any:
    interval = parse_duration(args.interval)
    if interval < 0.05:
        raise UsageError("%gpu watch: --interval must be at least 50ms")
    if not 2 <= args.history <= 100_000:
        raise UsageError("%gpu watch: --history must be from 2 to 100000 samples")
    inventory = read_inventory()
    if not inventory.gpus:
        raise UsageError(f"No GPUs to watch: {inventory.problem}")
    if not in_kernel():
        return _watch_in_terminal(interval)
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
    sampler = GpuSampler()
    try:
        while True:
            inventory, samples = sampler.sample()
            print(text_view(samples, inventory.simulated), flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return Help("stopped watching")


def _help(args: argparse.Namespace) -> Any:
    if args.subcommand is None:
        return Help(_OVERVIEW)
    parser = _PARSERS.get(args.subcommand)
    if parser is None:
        raise UsageError(f"%gpu has no subcommand {args.subcommand!r}; use one of: {', '.join(_PARSERS)}")
    return Help(parser.format_help())


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
        # lazy: IPython's display, only when a pick waits
        from IPython.display import display

        if text == self._last:
            return
        self._last = text
        if self._handle is None:
            self._handle = display(Help(text), display_id=True)
        else:
            self._handle.update(Help(text))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.update(Help(""))

"""``%ddp`` and ``%%ddp``: a group of DDP ranks that lives across cells, over
``launch.kernel_side.group.RankGroup``."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any, ClassVar

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from gpumagic.errors import GpumagicError
from gpumagic.launch.kernel_side.group import CellFailed, CellInterrupted, RankGroup
from gpumagic.launch.kernel_side.output import cell_number, in_kernel
from gpumagic.launch.kernel_side.session import SESSION
from gpumagic.launch.option_table import default
from gpumagic.launch.options import LaunchOptions
from gpumagic.magics.parsing import Help, Parser, add_options, given_options, parse, parse_cell_line, subcommand
from gpumagic.units import MIB
from gpumagic.widgets.launch_dashboard import LaunchDashboard


def _parsers() -> dict[str, Parser]:
    start = Parser(
        "%ddp start",
        "Start N ranks with their process group ready; %%ddp cells then run on them, each rank keeping its\n"
        "namespace (rank, world_size, device, dist defined). Example: %ddp start -n 4 --gpus auto",
    )
    add_options(start, "group")
    start.add_argument("--no-dashboard", action="store_true", help="no live dashboard under this cell")
    simple = {
        "stop": "End the ranks and their processes, release the group's GPUs.",
        "restart": "Stop the group and start a fresh one with the same options (every namespace is lost).",
        "status": "Each rank: alive, the cell it runs and since when, the collective it is in, its memory.",
        "free": "Collect garbage and empty the CUDA cache on every rank (and drop a failed cell's frames kept for\n"
        "%ddp debug); says what was released.",
        "watch": "Show the group's live dashboard (loss curves across cells, each rank's resources) here.",
        "kept": "The names gpumagic.keep registered: what a replaced rank gets back.",
        "check": "Compare the replicas: DDP models, optimizers, schedulers, kept names, step counters.",
    }
    sync = Parser(
        "%ddp sync",
        "Make the replicas alike again: copy the named state (default: every DDP model, its optimizers and\n"
        "schedulers, the kept names, and what %ddp check found different) from one rank to every other.\n"
        "Example: %ddp sync --from 0",
    )
    sync.add_argument("names", nargs="*", metavar="NAME", help="only these names")
    sync.add_argument("--from", dest="source", type=int, default=0, metavar="RANK", help="the rank to copy (0)")
    debug = Parser(
        "%ddp debug",
        "A post-mortem debugger (pdb) on the rank whose last cell failed, at the failing line: p x, up, l, q.\n"
        "The other ranks wait. breakpoint() in a %%ddp cell stops one rank where you choose (c continues).\n"
        "Example: %ddp debug 1",
    )
    debug.add_argument("rank", type=int, metavar="RANK", help="the rank to debug")
    parsers = {"start": start, "sync": sync, "debug": debug}
    parsers.update({name: Parser(f"%ddp {name}", text) for name, text in simple.items()})
    return parsers


def _cell_parser() -> Parser:
    parser = Parser(
        "%%ddp",
        "Run the cell on the group's ranks (started with the defaults if none runs). Names the cell reads from\n"
        "the notebook are sent once and again only when they change; names the ranks made stay theirs.\n"
        "The interrupt button stops the cell on every rank, namespaces kept.",
    )
    add_options(parser, "cell")
    parser.add_argument("-o", metavar="VAR", help="store {rank: value of the last expression} in VAR")
    return parser


_PARSERS = _parsers()
_CELL_PARSER = _cell_parser()
_OVERVIEW = (
    "%ddp SUBCOMMAND — a DDP group that lives across cells.\n\n"
    "  %ddp start [-n N] [--gpus SPEC|auto] [--gpus-per-rank K] [--backend B] [--timeout D] [--grace D]\n"
    f"             [--hang-after D]     a collective waiting D ({default('group', 'hang_after')}) shows who is stuck "
    "where; 0: off\n"
    "  %%ddp [--ranks 0] [-o VAR] [--timeout D] [--hang-after D]   run the cell on every rank (or some)\n"
    "  %ddp check                          are the replicas alike (models, optimizers, step counters)?\n"
    "  %ddp sync [--from R] [NAME ...]     make them alike again, from rank R (0)\n"
    "  %ddp debug R                        pdb on rank R where its last cell failed (breakpoint(): in a cell)\n"
    "  %ddp status | free | watch | kept | restart | stop\n\n"
    "Python API: group = gpumagic.ranks(2); group.exec(code); group.run(fn); group.pull('model'); group.close()"
)


@magics_class
class DdpMagics(Magics):
    """``%ddp``/``%%ddp``: one persistent group of ranks per kernel."""

    # the group, its dashboard and how it was started are the kernel's session's (SESSION), which
    # gpumagic.ddp_group() reads too

    @line_cell_magic
    def ddp(self, line: str, cell: str | None = None) -> Any:
        if cell is not None:
            return self._cell(line, cell)
        name, rest = subcommand(line, "%ddp", "status", _PARSERS)
        if name is None:
            return Help(_OVERVIEW)
        parser = _PARSERS[name]
        args = parse(parser, rest)
        if args is None or args.help:
            return Help(parser.format_help())
        try:
            return self.SUBCOMMANDS[name](self, args)
        except GpumagicError as err:
            raise UsageError(f"{parser.prog}: {err}") from None

    # --- subcommands -------------------------------------------------------------------------------------

    def _start(self, args: argparse.Namespace) -> None:
        if self._running() is not None:
            raise UsageError("%ddp start: a group is running already; %ddp restart for a fresh one, or %ddp stop")
        options = given_options(args, "group")
        grace = options.pop("grace")
        self._start_group(LaunchOptions.for_group(**options), grace, dashboard=not args.no_dashboard)

    def _start_group(self, launch: LaunchOptions, grace: str | None = None, dashboard: bool = True) -> None:
        """Start the group ``launch`` asks for (``grace``: ``RankGroup``'s, ``None`` its default)."""
        started = time.monotonic()
        try:
            group = RankGroup(launch, **({} if grace is None else {"grace": grace}))
        except KeyboardInterrupt:
            raise UsageError("%ddp start interrupted; no group was started") from None
        SESSION.group = group
        SESSION.group_start = {"launch": launch, "grace": grace, "dashboard": dashboard}
        gpus = ", ".join(g[0][:12] for g in group.rank_gpus if g)
        where = "CPU" if not group.use_cuda else f"GPUs {gpus}" if gpus else "the GPUs Slurm gave each node"
        if group.nodes:
            where += (
                f"; {len(group.nodes)} nodes: {', '.join(group.nodes)}, {group.nprocs // len(group.nodes)} ranks each"
            )
        print(
            f"[gpumagic] {group.nprocs} ranks ready ({group.backend}, {where}) in {time.monotonic() - started:.1f}s; "
            "%%ddp cells run on them, %ddp stop ends them"
        )
        if dashboard and in_kernel():
            self._show_dashboard()

    def _stop(self, args: argparse.Namespace | None = None) -> None:
        group = self._running()
        if group is None:
            print("[gpumagic] no group is running")
            return
        pids = group.pids
        group.close()
        if SESSION.group_dashboard is not None:
            SESSION.group_dashboard.finish("finished")
            SESSION.group_dashboard.join(5)  # its thread gone when the cell returns
            SESSION.group_dashboard = None
        SESSION.group = None
        print(f"[gpumagic] stopped {len(pids)} ranks (pids {', '.join(map(str, pids))}) and what they started")

    def _restart(self, args: argparse.Namespace) -> None:
        options = dict(SESSION.group_start)
        if not options:
            raise UsageError("%ddp restart: no group was started in this kernel; %ddp start first")
        self._stop()
        self._start_group(**options)

    def _status(self, args: argparse.Namespace) -> Help:
        group = self._running()
        if group is None:
            return Help("[gpumagic] no group is running; %ddp start (or a %%ddp cell) starts one")
        rows = group.status()
        now = time.time()
        width = max((len(row["node"]) for row in rows if row.node), default=0)
        node_column = f"{'node':{width}}  " if width else ""
        lines = [
            f"{group.nprocs} ranks ({group.backend}); {group.cells} cells run, {group.replaced} ranks replaced, "
            f"process group re-formed {group.reformed} times",
            f"{'rank':>4}  {node_column}{'pid':>7}  {'alive':5}  {'busy with':28}  {'in collective':22}  "
            f"{'GPU alloc/reserved':18}  rss",
        ]
        for row in rows:
            busy = f"{row['cell']} for {now - row['since']:.1f}s" if row.get("cell") else "idle"
            collective = row.get("collective")
            inside = f"{collective[0]} for {now - collective[1]:.1f}s" if collective else "-"
            gpu = "-"
            if row.get("allocated") is not None:
                gpu = f"{row['allocated'] / MIB:.0f}/{row['reserved'] / MIB:.0f} MiB"
            rss = f"{row['rss'] / MIB:.0f} MiB" if row.get("rss") else "-"
            alive = "yes" if row["alive"] else "no"
            node = f"{row.node or '':{width}}  " if width else ""
            lines.append(f"{row['rank']:>4}  {node}{row['pid']:>7}  {alive:5}  {busy:28}  {inside:22}  {gpu:18}  {rss}")
        if group.hang_reports:
            report = group.hang_reports[-1]
            when = time.strftime("%H:%M:%S", time.localtime(report["time"]))
            lines += ["", f"the last hang report ({when}, {len(group.hang_reports)} in all):", report["text"]]
        return Help("\n".join(lines))

    def _debug(self, args: argparse.Namespace) -> None:
        self._require().debug(args.rank)

    def _free(self, args: argparse.Namespace) -> Help:
        group = self._require()
        rows = group.free()
        lines = []
        for row in rows:
            if row["cuda"]:
                released = (row["reserved_before"] - row["reserved_after"]) / MIB
                lines.append(
                    f"rank {row['rank']}: released {released:.0f} MiB of cached GPU memory "
                    f"({row['reserved_after'] / MIB:.0f} MiB still reserved); {row['collected']} objects collected"
                )
            else:
                lines.append(f"rank {row['rank']}: {row['collected']} objects collected (a CPU rank: no GPU cache)")
        return Help("\n".join(lines))

    def _watch(self, args: argparse.Namespace) -> None:
        self._require()
        if not in_kernel():
            raise UsageError("%ddp watch: the dashboard needs a notebook (a Jupyter kernel)")
        self._show_dashboard()

    def _kept(self, args: argparse.Namespace) -> Help:
        names = self._require().kept()
        if not names:
            return Help("nothing is kept: in a %%ddp cell, gpumagic.keep(model, optimizer) registers state")
        return Help("kept (restored on a replaced rank): " + ", ".join(names))

    def _check(self, args: argparse.Namespace) -> Help:
        group = self._require()
        divergence = group.check()
        unseen = "".join(f"\nnot compared: {name} ({why})" for name, why in sorted(divergence.uncomparable.items()))
        if divergence:
            return Help(
                f"the replicas differ: {divergence.describe()}\n%ddp sync makes every rank like rank 0 "
                "(%ddp sync --from R: like rank R)" + unseen
            )
        checked = ", ".join(divergence.checked) or "nothing to compare (no DDP model, optimizer or kept name)"
        return Help(f"the replicas are alike: {checked}" + unseen)

    def _sync(self, args: argparse.Namespace) -> Help:
        group = self._require()
        names = group.sync(args.source, args.names or None)
        if not names:
            return Help("nothing to sync: no DDP model, optimizer, kept name or difference found")
        return Help(f"every rank now has rank {args.source}'s {', '.join(names)}")

    SUBCOMMANDS: ClassVar[dict[str, Callable[[Any, argparse.Namespace], Any]]] = {  # one per parser in _PARSERS
        "start": _start,
        "stop": _stop,
        "restart": _restart,
        "status": _status,
        "debug": _debug,
        "free": _free,
        "watch": _watch,
        "kept": _kept,
        "check": _check,
        "sync": _sync,
    }

    # --- the cell ----------------------------------------------------------------------------------------

    def _cell(self, line: str, cell: str) -> Any:
        args = parse_cell_line(_CELL_PARSER, line)
        if args is None:
            return Help(_CELL_PARSER.format_help())
        ranks = _ranks(args.ranks)
        group = self._running()
        if group is None:
            print("[gpumagic] no group was running: starting one with the defaults (%ddp start -n N to choose)")
            try:
                self._start_group(LaunchOptions.for_group(), dashboard=in_kernel())
            except GpumagicError as err:
                raise UsageError(f"%%ddp: {err}") from None
            group = SESSION.group
        saved = group.output
        if args.output is not None:
            group.output = args.output
        if SESSION.group_dashboard is not None:
            SESSION.group_dashboard.mark(f"In[{cell_number(self.shell)}]")
        try:
            results = group.exec(
                self.shell.transform_cell(cell),
                self.shell.user_ns,
                ranks=ranks,
                timeout=args.timeout,
                filename=f"<%%ddp cell In[{cell_number(self.shell)}]>",
                hidden=set(self.shell.user_ns_hidden),
                hang_after=args.hang_after,
            )
        except GpumagicError as err:
            if isinstance(err, (CellFailed, CellInterrupted)):
                raise  # they render as the rank's traceback, and what was kept and lost
            raise UsageError(f"%%ddp: {err}") from None
        finally:
            group.output = saved
            if SESSION.group_dashboard is not None and not group.closed:
                SESSION.group_dashboard.follow(group.local_pids)  # a replaced rank is followed from now on
        if args.o is not None:
            self.shell.user_ns[args.o] = results
        return None

    # --- helpers -----------------------------------------------------------------------------------------

    def _running(self) -> Any:
        return SESSION.running_group()

    def _require(self) -> Any:
        group = self._running()
        if group is None:
            raise UsageError("no group is running; %ddp start (or a %%ddp cell) starts one")
        return group

    def _show_dashboard(self) -> None:
        group = self._require()
        if SESSION.group_dashboard is not None:  # it keeps its last picture; the group goes on in the new one
            SESSION.group_dashboard.finish("superseded")
            SESSION.group_dashboard.join(5)
        dashboard = LaunchDashboard(title="%ddp group")
        dashboard.attach(group.run_dir, group.local_pids, rank_gpus=group.rank_gpus, use_gpus=group.use_cuda)
        SESSION.group_dashboard = dashboard


def _ranks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"%%ddp: --ranks takes rank numbers such as 0 or 0,2, got {text!r}") from None

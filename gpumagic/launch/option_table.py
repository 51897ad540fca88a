"""Every option a user gives a launch, a group, a cell of a group or a background job, declared once: its name,
type, default, check, flag, help and the surfaces that take it. The magics' parsers (``magics.parsing``), the
defaults and checks of ``LaunchOptions`` and ``JobRequest``, the keyword-only parameters of ``launch_ddp``,
``spawn``, ``ranks`` and ``jobs_with``, and the option lists of docs/launch.md and docs/jobs.md are read from
this table, and tests hold each of them equal to it.

Surfaces: ``launch`` (``%%launch_ddp``, ``launch_ddp``, ``spawn``, ``LaunchOptions``), ``group`` (``%ddp start``,
``ranks``), ``cell`` (``%%ddp``) and ``job`` (``%%launch_bg``, ``jobs_with``, ``JobRequest``).
"""

from __future__ import annotations

import shlex
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumagic.errors import InvalidArgument
from gpumagic.launch.plan import check_backend, check_timeout
from gpumagic.units import parse_duration

SURFACES = ("launch", "group", "cell", "job")
MAX_RANKS = 256
START_METHODS = ("forkserver", "spawn")
OUTPUT_MODES = ("all", "rank0", "none")
MULTI_NODE = "multi-node and elastic (torch.distributed.elastic; docs/multi-node.md)"


def is_whole(value: object, lowest: int, highest: int | None) -> bool:
    """Whether ``value`` is an int (not a bool) from ``lowest`` to ``highest`` (``None``: no end)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return lowest <= value and (highest is None or value <= highest)


def check_nprocs(nprocs: object) -> None:
    """Raises InvalidArgument unless ``nprocs`` is a number of ranks gpumagic starts (1 to ``MAX_RANKS``)."""
    if not is_whole(nprocs, 1, MAX_RANKS):
        raise InvalidArgument(f"the number of ranks must be a whole number from 1 to {MAX_RANKS}, got {nprocs!r}")


def check_output(output: object) -> None:
    """Raises InvalidArgument unless ``output`` says whose output to show (``OUTPUT_MODES``)."""
    if output not in OUTPUT_MODES:
        raise InvalidArgument(f"output must be one of {', '.join(OUTPUT_MODES)}, got {output!r}")


def check_gpus_per_rank(gpus_per_rank: object) -> None:
    """Raises InvalidArgument unless ``gpus_per_rank`` is a whole number of at least 1."""
    if not is_whole(gpus_per_rank, 1, None):
        raise InvalidArgument(f"gpus_per_rank must be a whole number of at least 1, got {gpus_per_rank!r}")


def check_hang_after(value: str | float) -> float:
    """``--hang-after``: how long a collective may wait before the cell says who is stuck where (0: never).

    >>> check_hang_after("10s"), check_hang_after(0)
    (10.0, 0.0)
    """
    return parse_duration(value, at_most=7 * 86400, what="--hang-after")


def check_ddp(ddp: object) -> None:
    """Raises InvalidArgument unless ``ddp`` is ``None`` (one process) or a number of ranks."""
    if ddp is not None and not is_whole(ddp, 1, MAX_RANKS):
        raise InvalidArgument(f"ddp is the number of ranks, a whole number from 1 to {MAX_RANKS}, got {ddp!r}")


def check_memory_limit(memory_limit: object) -> None:
    """Raises InvalidArgument unless ``memory_limit`` is a bool."""
    if not isinstance(memory_limit, bool):
        raise InvalidArgument(f"memory_limit is True or False, got {memory_limit!r}")


def check_notify_wait(value: str | float) -> float:
    """``--notify-wait``: how long a job waits for GPUs before its targets hear of it (0: never).

    >>> check_notify_wait("1h")
    3600.0
    """
    return parse_duration(value, at_most=365 * 86400, what="--notify-wait")


def check_requeue_on_timeout(value: object) -> None:
    """Raises InvalidArgument unless ``value`` is a number of requeues from 0 to 1000."""
    if not is_whole(value, 0, 1000):
        raise InvalidArgument(f"requeue_on_timeout is a number of requeues from 0 to 1000, got {value!r}")


def check_notify(notify: object) -> None:
    """Raises InvalidArgument unless ``notify`` is None or targets (one or a list): each an ``http(s)://`` URL or
    ``cmd:COMMAND`` (``jobs.notify``)."""
    if notify is None:
        return
    for target in [notify] if isinstance(notify, str) else notify if isinstance(notify, (list, tuple)) else [notify]:
        if not isinstance(target, str) or not target.strip():
            raise InvalidArgument(f"notify takes an http(s) URL or cmd:COMMAND, got {target!r}")
        target = target.strip()
        if target.startswith("cmd:"):
            try:
                words = shlex.split(target[4:])
            except ValueError:
                words = []
            if not words:
                raise InvalidArgument(f"notify {target!r}: cmd: needs a command (cmd:mail -s done me@lab.org)")
            continue
        parsed = urllib.parse.urlsplit(target)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise InvalidArgument(
                f"notify {target!r} is neither an http(s) URL (https://hooks.example.org/...) nor cmd:COMMAND"
            )


def check_start_method(start_method: object) -> None:
    """Raises InvalidArgument unless ``start_method`` is one of ``START_METHODS``."""
    if start_method not in START_METHODS:
        raise InvalidArgument(f"start method must be one of {', '.join(START_METHODS)}, got {start_method!r}")


def check_port(port: object) -> None:
    """Raises InvalidArgument unless ``port`` is ``None`` (a free one) or a TCP port."""
    if port is not None and not is_whole(port, 1, 65535):
        raise InvalidArgument(f"port must be a whole number from 1 to 65535, got {port!r}")


def check_pdb(pdb: object) -> None:
    """Raises InvalidArgument unless ``pdb`` is a bool."""
    if not isinstance(pdb, bool):
        raise InvalidArgument(f"pdb is True or False, got {pdb!r}")


@dataclass(frozen=True)
class Option:
    """One option: ``name`` (the keyword and the parsed argument's name), ``annotation`` (its type as written in
    signatures), ``default`` (``defaults`` overrides it on some surfaces), ``help`` (``{default}`` is the
    surface's default), ``surfaces``, ``flags`` (none: the Python API alone takes it), and for the parser
    ``metavar``, ``parse`` (argparse's ``type``), ``choices``, ``switch`` (a flag without a value) and ``group``
    (the help's section). ``check`` raises ``InvalidArgument`` for a bad value (a value it returns, such as
    seconds, is what the option means)."""

    name: str
    annotation: str
    default: Any
    help: str
    surfaces: frozenset[str]
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False
    group: str | None = None
    check: Callable[[Any], Any] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def default_on(self, surface: str) -> Any:
        """The default on ``surface``."""
        return self.defaults.get(surface, self.default)

    def help_on(self, surface: str) -> str:
        """The help text on ``surface``, its default filled in."""
        return self.help.format(default=self.default_on(surface))


def _option(name: str, annotation: str, default: Any, help: str, surfaces: str, **more: Any) -> Option:
    """An option on the space-separated ``surfaces``; ``flag=True`` gives it ``--name-with-dashes``."""
    flags = more.pop("flags", None)
    if more.pop("flag", False):
        flags = ("--" + name.replace("_", "-"),)
    return Option(name, annotation, default, help, frozenset(surfaces.split()), tuple(flags or ()), **more)


_DURATION = {"flag": True, "metavar": "DURATION"}

OPTIONS: tuple[Option, ...] = (
    # background jobs (before the options they share with launches, where %%launch_bg shows them)
    _option(
        "name", "str | None", None, "the job's name (default: the function's, or job; made unique)", "job", flag=True
    ),
    _option(
        "gpus",
        "int | str | None",
        None,
        "how many GPUs (default 1, or one per rank; 0 = CPU), or a spec: GPU:1",
        "job",
        flag=True,
        metavar="N|SPEC",
    ),
    _option(
        "min_free",
        "str | int | None",
        None,
        "memory the job needs per GPU (20GB): reserved, may share a GPU with jobs",
        "job",
        flag=True,
        metavar="SIZE",
    ),
    _option(
        "memory_limit",
        "bool",
        False,
        "cap the job at its --min-free on each GPU (fails naming it)",
        "job",
        flag=True,
        switch=True,
        check=check_memory_limit,
    ),
    _option(
        "ddp",
        "int | None",
        None,
        "run as a DDP group of N ranks (process group ready)",
        "job",
        flag=True,
        metavar="N",
        check=check_ddp,
    ),
    _option(
        "after",
        "str | Job | Iterable[str | Job] | None",
        None,
        "start after these jobs finish (A or A,B; names or Jobs)",
        "job",
        flag=True,
        metavar="NAME",
    ),
    _option(
        "notify",
        "str | Sequence[str] | None",
        None,
        "tell TARGET when the job ends, is requeued or waits long: an http(s) URL (POST of JSON) or cmd:COMMAND "
        "(JSON on its stdin); default $GPUMAGIC_NOTIFY",
        "job",
        flag=True,
        metavar="TARGET",
        check=check_notify,
    ),
    _option(
        "notify_wait",
        "str | float",
        "1h",
        "with --notify: tell it once when the job has waited this long for GPUs ({default}; 0: never)",
        "job",
        check=check_notify_wait,
        **_DURATION,
    ),
    _option(
        "requeue_on_timeout",
        "int",
        0,
        "on Slurm: near the time limit the job's next gpumagic.checkpoint saves and requeues it, up to N times",
        "job",
        flag=True,
        metavar="N",
        parse=int,
        check=check_requeue_on_timeout,
    ),
    _option(
        "nprocs",
        "int | None",
        None,
        "ranks (default: one per GPU they get, else 2 on the CPU)",
        "launch group",
        flags=("-n", "--nprocs"),
        metavar="N",
        parse=int,
        check=lambda nprocs: nprocs is None or check_nprocs(nprocs),
    ),
    _option(
        "gpus",
        "str | None",
        None,
        "GPUs for the ranks: a %%gpu use spec (0,2, GPU:*), auto to pick and lease free ones, none for CPU ranks",
        "launch group",
        flag=True,
        metavar="SPEC",
    ),
    _option(
        "gpus_per_rank",
        "int",
        1,
        "GPUs per rank, model parallel: a rank sees them as cuda:0..K-1 ({default})",
        "launch group",
        flag=True,
        metavar="K",
        parse=int,
        check=check_gpus_per_rank,
    ),
    _option(
        "backend",
        "str | None",
        None,
        "process group backend: nccl, gloo, mpi, ucc (default nccl with GPUs, gloo without)",
        "launch group job",
        flag=True,
        check=check_backend,
    ),
    _option(
        "port",
        "int | None",
        None,
        "rendezvous port on 127.0.0.1 (default: a free one)",
        "launch",
        flag=True,
        parse=int,
        check=check_port,
    ),
    _option(
        "timeout",
        "str | float",
        "30m",
        "the process group's timeout ({default})",
        "launch group job",
        check=check_timeout,
        **_DURATION,
    ),
    _option(
        "start_method",
        "str",
        "forkserver",
        "how ranks start ({default})",
        "launch",
        flag=True,
        choices=START_METHODS,
        check=check_start_method,
    ),
    _option(
        "output",
        "str",
        "all",
        "whose output to show ({default})",
        "launch group",
        flag=True,
        choices=OUTPUT_MODES,
        check=check_output,
        defaults={"group": "rank0"},
    ),
    _option(
        "hang_after",
        "str | float",
        "10s",
        "a collective waiting this long shows who is stuck where ({default}; 0: off)",
        "launch group job",
        check=check_hang_after,
        **_DURATION,
    ),
    _option(
        "pdb",
        "bool",
        False,
        "a rank that raises waits for a post-mortem debugger here (p x, up, q)",
        "launch",
        flag=True,
        switch=True,
        check=check_pdb,
    ),
    _option(
        "grace",
        "str | float",
        "5s",
        "how long an interrupted rank may stay stuck ({default})",
        "group",
        **_DURATION,
    ),
    _option(
        "nnodes",
        "int",
        1,
        "nodes of the Slurm allocation, each running -n ranks ({default})",
        "launch group",
        flag=True,
        metavar="N",
        parse=int,
        group=MULTI_NODE,
    ),
    _option(
        "rdzv_endpoint",
        "str | None",
        None,
        "rendezvous on this machine's HOST:PORT (0: a free port)",
        "launch",
        flag=True,
        metavar="HOST:PORT",
        group=MULTI_NODE,
    ),
    _option(
        "node_rank",
        "int | None",
        None,
        "fixed node numbers: this node is R",
        "launch",
        flag=True,
        metavar="R",
        parse=int,
        group=MULTI_NODE,
    ),
    _option(
        "rdzv_id",
        "str | None",
        None,
        "c10d rendezvous id (default: the run's id)",
        "launch",
        flag=True,
        metavar="ID",
        group=MULTI_NODE,
    ),
    _option(
        "max_restarts",
        "int",
        0,
        "restart the whole group up to K times ({default})",
        "launch",
        flag=True,
        metavar="K",
        parse=int,
        group=MULTI_NODE,
    ),
    _option(
        "runs_dir",
        "str | None",
        None,
        "make the run directory here: a filesystem all nodes share",
        "launch",
        flag=True,
        metavar="DIR",
        group=MULTI_NODE,
    ),
    _option("write", "Callable[[str], None] | None", None, "where rank output goes (default stdout)", "launch group"),
    _option("dashboard", "Any", None, "a LaunchDashboard: attached as the ranks start, told when they end", "launch"),
    _option("on_note", "Callable[[str], None] | None", None, "where gpumagic's notes go (default write)", "group"),
    # %%ddp: one cell on a running group; None: the group's own setting
    _option("ranks", "str | None", None, "only these ranks: 0 or 0,2", "cell", flag=True, metavar="R"),
    _option("timeout", "str | None", None, "stop the cell after this long (as an interrupt)", "cell", **_DURATION),
    _option(
        "output",
        "str | None",
        None,
        "whose output to show (the group's default)",
        "cell",
        flag=True,
        choices=OUTPUT_MODES,
    ),
    _option(
        "hang_after", "str | None", None, "this cell's hang report threshold (the group's; 0: off)", "cell", **_DURATION
    ),
    _option("executor", "str", "local", "where the job runs: local (this machine's queue) or slurm", "job"),
    _option("slurm", "Mapping[str, Any] | None", None, "with executor slurm: partition, time, nodes, gres, ...", "job"),
)


def on(surface: str) -> tuple[Option, ...]:
    """The options ``surface`` takes, in the table's order.

    Raises:
        ValueError: no such surface.
    """
    if surface not in SURFACES:
        raise ValueError(f"no surface {surface!r}; one of {', '.join(SURFACES)}")
    return tuple(option for option in OPTIONS if surface in option.surfaces)


def option(surface: str, name: str) -> Option:
    """The option ``name`` of ``surface``. Raises KeyError if it takes none."""
    for found in on(surface):
        if found.name == name:
            return found
    raise KeyError(f"{surface} takes no option {name!r}")


def default(surface: str, name: str) -> Any:
    """The default of option ``name`` on ``surface``."""
    return option(surface, name).default_on(surface)


def markdown(surface: str) -> str:
    """The option list of ``surface`` as a Markdown table (docs/launch.md and docs/jobs.md hold it)."""
    rows = ["| option | Python | default | meaning |", "|---|---|---|---|"]
    for entry in on(surface):
        value = "|".join(entry.choices) if entry.choices else (entry.metavar or entry.name.upper())
        shown = f"`{'/'.join(entry.flags)}{'' if entry.switch else ' ' + value}`" if entry.flags else "(Python only)"
        meaning = entry.help_on(surface).replace("%%", "%")
        cells = (shown, f"`{entry.name}=`", f"`{entry.default_on(surface)!r}`", meaning)
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)

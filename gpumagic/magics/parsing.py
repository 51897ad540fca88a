"""The parser kit every magic shares: an argparse whose errors are one-line ``UsageError``s, help shown as plain
text, subcommand dispatch, the Slurm arguments of ``%%launch_ddp`` and ``%%launch_bg``, and errors cut to their
first line for a note under a dashboard.
"""

from __future__ import annotations

import argparse
import html
import shlex
from collections.abc import Collection, Mapping
from typing import Any

from IPython.core.error import UsageError

from gpumagic.launch.option_table import on

SLURM_FLAGS = (
    "partition", "time", "nodes", "tasks_per_node", "gres", "account", "qos", "constraint", "signal_delay"
)  # fmt: skip


class Parser(argparse.ArgumentParser):
    """argparse that raises ``UsageError`` instead of exiting, with ``-h``/``--help`` as a flag the magic reads."""

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


class Help(str):
    """Help text (or any text a magic returns) shown without quotes."""

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def subcommand(line: str, magic: str, default: str, parsers: Mapping[str, Parser]) -> tuple[str | None, str]:
    """(subcommand, the rest of the line) of a line magic with subcommands; ``None`` for ``-h``/``--help``.

    Raises:
        UsageError: no such subcommand (the message lists them).
    """
    words = line.strip().split(None, 1)
    name = words[0] if words else default
    rest = words[1] if len(words) > 1 else ""
    if name in ("-h", "--help") or (name == "help" and "help" not in parsers):  # the error below points to it
        return None, rest
    if name not in parsers:
        raise UsageError(f"{magic} has no subcommand {name!r}; use one of: {', '.join(parsers)} (see {magic} help)")
    return name, rest


def parse(parser: Parser, rest: str) -> argparse.Namespace | None:
    """A subcommand's arguments, or ``None`` when the line asks for help: checked before parsing, where a
    missing required argument would fail first."""
    words = split(rest, parser.prog)
    if "-h" in words or "--help" in words:
        return None
    return parser.parse_args(words)


def parse_cell_line(parser: Parser, line: str) -> argparse.Namespace | None:
    """A cell magic's arguments, or ``None`` when they ask for help; ``-o VAR`` (if the magic takes it) must
    name a variable.

    Raises:
        UsageError: bad arguments, or ``-o`` with no variable name.
    """
    args = parser.parse_args(split(line, parser.prog))
    if args.help:
        return None
    variable = getattr(args, "o", None)
    if variable is not None and not variable.isidentifier():
        raise UsageError(f"{parser.prog}: -o needs a variable name, got {variable!r}")
    return args


def split(rest: str, prog: str) -> list[str]:
    """The words of a magic's line, as a shell splits them. Raises UsageError for an unclosed quote."""
    try:
        return shlex.split(rest)
    except ValueError as err:
        raise UsageError(f"{prog}: {err} in {rest!r}") from None


def whole_number(text: str, what: str) -> int:
    """``text`` as an int, or a ``UsageError`` saying ``what`` it must be: ``"%gpu seed: the seed must be a whole
    number"`` becomes ``%gpu seed: the seed must be a whole number, got 'x'``."""
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{what}, got {text!r}") from None


def add_slurm_arguments(parser: argparse.ArgumentParser, shape: bool, executor: bool = True) -> None:
    """``--executor slurm`` (unless not ``executor``: a resume runs where the job ran) and the Slurm options
    (``shape``: --nodes and --tasks-per-node too)."""
    group = parser.add_argument_group("on Slurm (submitit; docs/multi-node.md)")
    if executor:
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
        "--signal-delay", metavar="DURATION", help="Slurm's signal this long before the time limit (90s): 5m"
    )
    group.add_argument(
        "--sbatch", action="append", metavar="KEY=VALUE", help="any other sbatch option, repeatable: exclusive=1"
    )


def slurm_options(args: argparse.Namespace, prog: str) -> dict[str, Any] | None:
    """The ``slurm=`` dict of the Slurm options given; None without --executor slurm (which then allows none)."""
    given = {key: getattr(args, key, None) for key in (*SLURM_FLAGS, "cpus_per_task", "mem")}
    given = {key: value for key, value in given.items() if value is not None}
    extra = {}
    for item in args.sbatch or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{prog}: --sbatch takes KEY=VALUE (exclusive=1, mail-type=END), got {item!r}")
        extra[key.strip()] = value.strip()
    if getattr(args, "executor", "slurm") != "slurm":
        if given or extra:
            flags = ", ".join("--" + key.replace("_", "-") for key in [*given, *(["sbatch"] if extra else [])])
            raise UsageError(f"{prog}: {flags} need --executor slurm")
        return None
    if extra:
        given["additional"] = extra
    return given


def add_options(parser: argparse.ArgumentParser, surface: str, only: Collection[str] = (),
                changes: bool = False) -> None:  # fmt: skip
    """The flags of every option of ``surface`` in the option table (``launch.option_table``), in its order, each
    in its section of the help; ``only``: these options alone. ``changes``: an option left out of the line is
    left out of the parsed arguments (``%jobs resume``: what is not given stays as it was)."""
    sections: dict[str, Any] = {}
    for entry in on(surface):
        if not entry.flags or (only and entry.name not in only):
            continue  # the Python API's alone
        target = parser
        if entry.group is not None:
            if entry.group not in sections:
                sections[entry.group] = parser.add_argument_group(entry.group)
            target = sections[entry.group]
        more: dict[str, Any] = {"dest": entry.name, "help": entry.help_on(surface)}
        if entry.switch:
            more["action"] = "store_true"
        else:
            more.update(default=entry.default_on(surface), type=entry.parse, choices=entry.choices)
            if entry.metavar is not None:
                more["metavar"] = entry.metavar
        if changes:
            more.update(default=argparse.SUPPRESS, help=entry.help.replace("{default}", "as before"))
        target.add_argument(*entry.flags, **more)


def given_options(args: argparse.Namespace, surface: str) -> dict[str, Any]:
    """``{name: value}`` of the option table's flags of ``surface`` that a magic's line was parsed with."""
    return {entry.name: getattr(args, entry.name) for entry in on(surface) if entry.flags}


def first_line(err: BaseException) -> str:
    """The first line of an error's message, HTML-escaped: for a note under a dashboard."""
    text = str(err)
    return html.escape(text.splitlines()[0] if text else "")

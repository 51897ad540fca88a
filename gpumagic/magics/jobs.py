"""``%%launch_bg`` and ``%jobs``: the IPython shell over ``gpumagic.jobs``.

As with ``%gpu``, every bad input is a one-line ``UsageError``; a job's own failure (``%jobs result``) shows
the job's traceback. Interrupting ``%jobs wait`` or ``%jobs logs -f`` stops the waiting, never the job.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from gpumagic.errors import GpumagicError
from gpumagic.jobs.api import RESUMABLE, STATES, JobRequest, job, list_jobs, select_jobs, submit_cell
from gpumagic.launch.kernel_side.output import cell_number, in_kernel
from gpumagic.magics.parsing import (
    Help,
    Parser,
    add_options,
    add_slurm_arguments,
    given_options,
    parse,
    parse_cell_line,
    slurm_options,
    subcommand,
    whole_number,
)
from gpumagic.telemetry.exporting import export
from gpumagic.telemetry.tracking import OPTION_HELP, track, trackers
from gpumagic.units import parse_duration
from gpumagic.widgets.compare import Comparison
from gpumagic.widgets.job_table import JobTable
from gpumagic.widgets.job_watch import JobWatch


def _launch_bg_parser() -> Parser:
    parser = Parser(
        "%%launch_bg",
        "Run the cell as a background job: detached from this kernel (it survives interrupts, restarts and\n"
        "closing the notebook), queued on this machine until its GPUs are free. The notebook names the cell\n"
        "uses are shipped by value; the value of its last expression is the job's result. %jobs follows it.\n"
        "Example: %%launch_bg --name A1 --gpus 1 --min-free 20GB",
    )
    add_options(parser, "job")
    add_slurm_arguments(parser, shape=True)
    return parser


WATCH_STATES = ", ".join(STATES)


def _jobs_parsers() -> dict[str, Parser]:
    listing = Parser("%jobs list", "Every job: name, status (and why it waits), GPUs, elapsed, latest metrics.")
    logs = Parser("%jobs logs", "A job's output (stdout and stderr); -f follows it until the job ends.")
    logs.add_argument("name")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    logs.add_argument("--tail", metavar="N", help="only the last N lines")
    kill = Parser("%jobs kill", "Stop jobs and their whole process trees: SIGTERM, then SIGKILL after 5s.")
    kill.add_argument("names", nargs="+", metavar="name")
    wait = Parser("%jobs wait", "Block until the jobs end (an interrupt stops the waiting, not the jobs).")
    wait.add_argument("names", nargs="+", metavar="name")
    wait.add_argument("--timeout", metavar="DURATION", help="give up waiting after this long (10m)")
    result = Parser("%jobs result", "A finished job's result (x = %jobs result A1); a failed job's traceback.")
    result.add_argument("name")
    remove = Parser("%jobs rm", "Delete ended jobs: their output, metrics and result.")
    remove.add_argument("names", nargs="+", metavar="name")
    watch = Parser(
        "%jobs watch",
        "A live table of jobs with Kill and Logs buttons (why each waits, in one line), and every job's curve in\n"
        "one plot, a colour per job. Closed (watch.close()) or re-run, it keeps its last picture.\n"
        "Example: %jobs watch A-* --state running,queued --metric loss",
    )
    watch.add_argument(
        "names", nargs="*", metavar="name", help="jobs by name or pattern (A-* matches A-1, A-2); default all"
    )
    watch.add_argument("--state", metavar="S[,S]", help=f"only jobs in these states: {WATCH_STATES}")
    watch.add_argument("--metric", default="loss", help="the metric to compare (default loss)")
    watch.add_argument("--interval", default="1s", metavar="DURATION", help="refresh period (1s)")
    compare = Parser(
        "%jobs compare",
        "Jobs side by side: a table (status, duration, GPUs, the configuration that differs, each metric's last\n"
        "and best value) and one figure per metric with a curve per job. Jobs that differ only by their seed are\n"
        "drawn as their mean with a band of ± one standard deviation. Read from disk: works in a new kernel.\n"
        "Example: %jobs compare A-* --metric loss --sort-by loss",
    )
    compare.add_argument(
        "names", nargs="*", metavar="name", help="jobs (A-* matches by pattern) or run ids; default all"
    )
    compare.add_argument(
        "--metric", action="append", metavar="M", help="a metric to show (repeat, or loss,acc; default every one)"
    )
    compare.add_argument("--x", default="step", help="x axis: step (default), elapsed or time")
    compare.add_argument("--sort-by", metavar="COL", help="a column (lr, duration, 'loss last') or a metric's best")
    direction = compare.add_mutually_exclusive_group()
    direction.add_argument("--descending", action="store_true", help="sort descending (default: best first)")
    direction.add_argument("--ascending", action="store_true", help="sort ascending")
    compare.add_argument(
        "--all-columns", action="store_true", help="every configuration key, not only those that differ"
    )
    compare.add_argument("--no-seed-groups", action="store_true", help="a curve per job, also for seeds")
    compare.add_argument(
        "--filter",
        action="append",
        metavar="COND",
        help="keep the runs that pass COND: lr<=0.001, opt=adam, name~A- (repeatable)",
    )
    resume = Parser(
        "%jobs resume",
        "Start a new attempt of an ended job (killed, failed, lost): it queues again, and its gpumagic.restore loads\n"
        "the last checkpoint any attempt saved. Options given replace the earlier attempt's; the rest stay.\n"
        "Example: %jobs resume A1 --gpus 2 --timeout 2h",
    )
    resume.add_argument("name")
    add_options(resume, "job", only=RESUMABLE, changes=True)
    add_slurm_arguments(resume, shape=True, executor=False)
    track = Parser(
        "%jobs track",
        "Send the metrics of every launch, %ddp group and job started from now on to TensorBoard, MLflow or\n"
        "W&B too (gpumagic.track): one run each there, a series per rank (loss/rank0, loss/rank1), the options\n"
        "as its parameters. Without KIND: the trackers chosen. Example: %jobs track mlflow --tracking-uri\n"
        "http://mlflow:5000; %jobs track wandb --stop; %jobs track none",
    )
    track.add_argument("kind", nargs="?", help="tensorboard, mlflow, wandb, or none (stop every one)")
    for option, (placeholder, meant) in OPTION_HELP.items():
        track.add_argument("--" + option.replace("_", "-"), metavar=placeholder, help=meant)
    track.add_argument("--stop", action="store_true", help="stop sending to this tracker")
    export = Parser(
        "%jobs export",
        "Send ended jobs' or runs' metrics to the trackers chosen, as new runs there (a run a tracker missed).",
    )
    export.add_argument("names", nargs="+", help="jobs' names or run ids")
    helper = Parser("%jobs help", "Help on a subcommand.")
    helper.add_argument("subcommand", nargs="?")
    return {
        "list": listing,
        "logs": logs,
        "kill": kill,
        "resume": resume,
        "wait": wait,
        "result": result,
        "rm": remove,
        "watch": watch,
        "compare": compare,
        "track": track,
        "export": export,
        "help": helper,
    }


_LAUNCH_BG = _launch_bg_parser()
_JOBS = _jobs_parsers()
_OVERVIEW = (
    "%jobs — background jobs (started with %%launch_bg or gpumagic.submit/sweep)\n\n"
    "  %jobs                      list them: status, why they wait, GPUs, elapsed, latest metrics\n"
    "  %jobs logs NAME [-f]       output so far; -f follows it\n"
    "  %jobs kill NAME...         stop them (SIGTERM, then SIGKILL)\n"
    "  %jobs resume NAME [opts]   a new attempt of an ended job, from its last checkpoint\n"
    "  %jobs wait NAME...         block until they end\n"
    "  %jobs result NAME          the result (x = %jobs result A1)\n"
    "  %jobs rm NAME...           delete ended jobs\n"
    "  %jobs watch [NAME...]      live table with actions and every job's curve (A-*; --state, --metric)\n"
    "  %jobs compare [NAME...]    table and curves side by side (A-* for a sweep; --metric, --x, --sort-by)\n"
    "  %jobs track [KIND] [opts]  metrics of launches, groups and jobs to tensorboard, mlflow or wandb too\n"
    "  %jobs export NAME...       an ended job's or run's metrics to the trackers, again\n"
    "  %jobs help SUBCOMMAND      details"
)


def _executor(args: argparse.Namespace, prog: str) -> dict[str, Any]:
    slurm = slurm_options(args, prog)
    return {} if slurm is None else {"executor": "slurm", "slurm": slurm}


def _job_request(args: argparse.Namespace) -> JobRequest:
    """What ``%%launch_bg``'s arguments ask of the job, checked.

    Raises:
        UsageError: --ddp is not a number. InvalidArgument: a bad option.
    """
    options = given_options(args, "job")
    del options["name"]  # the job's, not its request's
    if args.ddp is not None:
        options["ddp"] = whole_number(args.ddp, "%%launch_bg: --ddp needs a number of ranks")
    return JobRequest.of(**options, **_executor(args, _LAUNCH_BG.prog))


@magics_class
class JobMagics(Magics):
    """``%%launch_bg`` (a cell as a background job) and ``%jobs`` (list, follow, kill, ...)."""

    @cell_magic
    def launch_bg(self, line: str, cell: str) -> Any:
        args = parse_cell_line(_LAUNCH_BG, line)
        if args is None:
            return Help(_LAUNCH_BG.format_help())
        try:
            submitted = submit_cell(
                self.shell.transform_cell(cell),
                self.shell.user_ns,
                _job_request(args),
                filename=f"<%%launch_bg cell In[{cell_number(self.shell)}]>",
                hidden=set(self.shell.user_ns_hidden),
                name=args.name,
            )
        except GpumagicError as err:
            raise UsageError(f"%%launch_bg: {err}") from None
        name = submitted.name
        return Help(f"Submitted job {name} ({submitted.status}); %jobs lists it, %jobs logs {name} -f follows it")

    @line_magic
    def jobs(self, line: str) -> Any:
        name, rest = subcommand(line, "%jobs", "list", _JOBS)
        if name is None:
            return Help(_OVERVIEW)
        parser = _JOBS[name]
        args = parse(parser, rest)
        if args is None:
            return Help(parser.format_help())
        try:
            return _HANDLERS[name](args)
        except (GpumagicError, TimeoutError) as err:
            if type(err).__name__ == "JobFailed":
                raise  # renders as the job's own traceback
            raise UsageError(f"{parser.prog}: {err}") from None


def _list(args: argparse.Namespace) -> Any:
    return JobTable(list_jobs())


def _logs(args: argparse.Namespace) -> Any:
    tail = None
    if args.tail is not None:
        tail = whole_number(args.tail, "%jobs logs: --tail needs a number of lines")
        if tail < 0:
            raise UsageError("%jobs logs: --tail needs a number of lines of 0 or more")
    followed = job(args.name)
    if args.follow:
        return Help(f"[job {followed.name}: {followed.follow(tail=tail)}]")
    text = followed.logs(tail)
    print(text, end="" if text.endswith("\n") or not text else "\n", flush=True)
    return None


def _kill(args: argparse.Namespace) -> Any:
    names = list(dict.fromkeys(args.names))  # "kill A A" stops A once
    jobs = [job(name) for name in names]  # every name checked before anything is stopped
    lines = []
    for stopped in jobs:
        stopped.kill()
        lines.append(f"{stopped.name}: {stopped.status} ({stopped.reason})")
    return Help("\n".join(lines))


def _resume(args: argparse.Namespace) -> Any:
    changes = {name: value for name, value in vars(args).items() if name in RESUMABLE}
    if changes.get("ddp") is not None:
        changes["ddp"] = whole_number(changes["ddp"], "%jobs resume: --ddp needs a number of ranks")
    slurm = slurm_options(args, "%jobs resume")
    if slurm:
        changes["slurm"] = slurm
    resumed = job(args.name).resume(**changes)
    return Help(resumed.describe())


def _track(args: argparse.Namespace) -> Any:
    options = {option: getattr(args, option) for option in OPTION_HELP}
    if args.kind in (None, "none"):
        given = [option for option in (*OPTION_HELP, "stop") if getattr(args, option)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UsageError(f"%jobs track: {flag} needs a tracker first: tensorboard, mlflow or wandb")
        chosen = track(None) if args.kind == "none" else trackers()
    elif args.stop and any(options.values()):
        raise UsageError(f"%jobs track {args.kind} --stop takes no other option: it stops sending to {args.kind}")
    else:
        chosen = track(args.kind, stop=args.stop, **options)
    if not chosen:
        return Help("No tracker chosen: metrics stay in gpumagic's run directories (%jobs track KIND to add one).")
    return Help("Metrics of what starts from now on go to:\n" + "\n".join(f"  {t.where}" for t in chosen))


def _export(args: argparse.Namespace) -> Any:
    lines = []
    for name in args.names:
        failed = export(name)
        lines.extend(failed or [f"{name}: exported to {', '.join(t.kind for t in trackers())}"])
    return Help("\n".join(lines))


def _wait(args: argparse.Namespace) -> Any:
    jobs = [job(name) for name in args.names]
    limit = parse_duration(args.timeout) if args.timeout is not None else None
    started = time.monotonic()
    try:
        for waited in jobs:
            left = None if limit is None else max(0.0, limit - (time.monotonic() - started))
            waited.wait(left)
    except KeyboardInterrupt:
        return Help("Stopped waiting; the jobs go on:\n" + "\n".join(j.describe() for j in jobs))
    return Help("\n".join(j.describe() for j in jobs))


def _result(args: argparse.Namespace) -> Any:
    asked = job(args.name)
    status = asked.status
    if status in ("queued", "running"):
        raise UsageError(f"%jobs result: job {asked.name} is {status}; %jobs wait {asked.name} first")
    return asked.result()


def _remove(args: argparse.Namespace) -> Any:
    names = list(dict.fromkeys(args.names))  # "rm A A" removes A once
    jobs = [job(name) for name in names]
    active = [j.name for j in jobs if j.status in ("queued", "running")]
    if active:
        raise UsageError(f"%jobs rm: {', '.join(active)} still active; %jobs kill them first")
    for removed in jobs:
        removed.remove()
    return Help(f"Removed {', '.join(names)}")


def _watch(args: argparse.Namespace) -> Any:
    interval = parse_duration(args.interval)
    if interval < 0.1:
        raise UsageError("%jobs watch: --interval must be at least 100ms")
    if not args.metric.strip():
        raise UsageError("%jobs watch: --metric needs a metric name")
    if not in_kernel():
        return JobTable(select_jobs(args.names or None, args.state))
    watch = JobWatch(metric=args.metric, interval=interval, names=args.names or None, states=args.state)
    while _WATCHES:
        _WATCHES.pop().close()  # replaced: it keeps its last picture, as a static copy
    _WATCHES.append(watch)
    return watch


def _compare(args: argparse.Namespace) -> Any:
    metrics = None
    if args.metric:
        metrics = [m.strip() for text in args.metric for m in text.split(",") if m.strip()]
        if not metrics:
            raise UsageError("%jobs compare: --metric needs a metric name")
    descending = True if args.descending else False if args.ascending else None
    comparison = Comparison(
        args.names or None,
        metrics,
        args.x,
        sort_by=args.sort_by,
        descending=descending,
        all_columns=args.all_columns,
        group_seeds=not args.no_seed_groups,
    )
    return comparison.filter(*args.filter) if args.filter else comparison


def _help(args: argparse.Namespace) -> Any:
    if args.subcommand is None:
        return Help(_OVERVIEW)
    if args.subcommand in ("launch_bg", "%%launch_bg"):
        return Help(_LAUNCH_BG.format_help())
    parser = _JOBS.get(args.subcommand)
    if parser is None:
        raise UsageError(f"%jobs has no subcommand {args.subcommand!r}; use one of: {', '.join(_JOBS)}")
    return Help(parser.format_help())


_WATCHES: list[Any] = []
_HANDLERS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "list": _list,
    "logs": _logs,
    "kill": _kill,
    "resume": _resume,
    "wait": _wait,
    "result": _result,
    "rm": _remove,
    "watch": _watch,
    "compare": _compare,
    "track": _track,
    "export": _export,
    "help": _help,
}

JobMagics.launch_bg.__doc__ = _LAUNCH_BG.format_help()
JobMagics.jobs.__doc__ = _OVERVIEW + "\n\n" + "\n".join(p.format_help() for p in _JOBS.values())

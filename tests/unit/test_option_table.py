"""Each option is declared once, in ``gpumagic.launch.option_table``: every magic's parser, the keyword-only
parameters of ``launch_ddp``, ``spawn``, ``ranks`` and ``jobs_with``, the defaults of ``LaunchOptions`` and
``JobRequest``, and the option lists in docs/launch.md and docs/jobs.md are held equal to it here.

``python tests/unit/test_option_table.py`` rewrites the docs' lists from the table."""

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

import pytest

from gpumagic.jobs.api import JobRequest, jobs_with, sweep
from gpumagic.launch import option_table
from gpumagic.launch.kernel_side.ddp import launch_ddp, spawn
from gpumagic.launch.kernel_side.session import ranks
from gpumagic.launch.option_table import OPTIONS, SURFACES, on
from gpumagic.launch.options import LaunchOptions
from gpumagic.magics import ddp, jobs, launch
from gpumagic.magics.parsing import SLURM_FLAGS

ROOT = Path(__file__).resolve().parents[2]
SLURM = {*SLURM_FLAGS, "executor", "cpus_per_task", "mem", "sbatch"}
# each magic's parser: its surface, and the flags that are the magic's own (not options of the API)
PARSERS = {
    "%%launch_ddp": (launch._LAUNCH_PARSER, "launch", {"help", "o", "no_dashboard", "no_wait", *SLURM}),
    "%ddp start": (ddp._PARSERS["start"], "group", {"help", "no_dashboard"}),
    "%%ddp": (ddp._CELL_PARSER, "cell", {"help", "o"}),
    "%%launch_bg": (jobs._LAUNCH_BG, "job", {"help", *SLURM}),
}
# the docs' option lists: (file, surface), each between <!-- options: SURFACE --> and <!-- /options -->
DOCS = (("docs/launch.md", "launch"), ("docs/launch.md", "group"), ("docs/jobs.md", "job"))


@pytest.mark.parametrize("magic", PARSERS)
def test_every_magic_parser_has_exactly_the_tables_flags_and_defaults(magic):
    parser, surface, own = PARSERS[magic]
    actions = {a.dest: a for a in parser._actions}
    flagged = [o for o in on(surface) if o.flags]
    assert set(actions) - own == {o.name for o in flagged}, f"{magic}'s flags differ from the table's"
    for entry in flagged:
        action = actions[entry.name]
        assert tuple(action.option_strings) == entry.flags
        assert action.default == entry.default_on(surface)
        assert action.help == entry.help_on(surface)
        assert isinstance(action, argparse._StoreTrueAction) == entry.switch
        if not entry.switch:
            assert (action.type, action.choices, action.metavar) == (entry.parse, entry.choices, entry.metavar)


def test_help_shows_each_options_default_on_its_surface():
    assert "whose output to show (all)" in " ".join(launch._LAUNCH_PARSER.format_help().split())
    assert "whose output to show (rank0)" in " ".join(ddp._PARSERS["start"].format_help().split())
    assert launch.LaunchMagics.launch_ddp.__doc__ == launch._LAUNCH_PARSER.format_help()  # %%launch_ddp?


def keyword_only(function) -> list[tuple[str, object, str]]:
    return [
        (p.name, p.default, p.annotation)
        for p in inspect.signature(function).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]


def table(surface: str, leave_out: tuple[str, ...] = ()) -> list[tuple[str, object, str]]:
    return [(o.name, o.default_on(surface), o.annotation) for o in on(surface) if o.name not in leave_out]


def test_the_launch_functions_take_every_option_of_their_surface_as_a_keyword_only_parameter():
    """launch_ddp and spawn take more than 12 parameters (tests/unit/test_layering.py exempts them for it): this
    holds their signatures to the table, so neither can drift."""
    assert keyword_only(launch_ddp) == table("launch", ("nprocs",))
    assert keyword_only(spawn) == table("launch", ("nprocs",))
    assert keyword_only(jobs_with) == table("job")
    group = [(p.name, p.default, p.annotation) for p in inspect.signature(ranks).parameters.values()]
    assert group == table("group")


def test_sweep_takes_the_job_options_it_names_with_the_tables_defaults():
    job = {name: (default, annotation) for name, default, annotation in table("job")}
    taken = [(name, default) for name, default, _ in keyword_only(sweep)]
    assert taken and all(job[name][0] == default for name, default in taken)


def test_launch_options_and_job_requests_take_their_defaults_from_the_table():
    fields = {f.name: f.default for f in dataclasses.fields(LaunchOptions) if f.init and f.name != "process_group"}
    assert fields == {o.name: o.default_on("launch") for o in on("launch") if o.name not in ("write", "dashboard")}
    group = LaunchOptions.for_group()
    assert {name: getattr(group, name) for name in ("output", "timeout", "hang_after")} == {
        name: option_table.default("group", name) for name in ("output", "timeout", "hang_after")
    }
    request = {f.name: f.default for f in dataclasses.fields(JobRequest) if f.name != "launch"}
    assert request == {name: option_table.default("job", name) for name in request}
    made = {p.name: p.default for p in inspect.signature(JobRequest.of).parameters.values() if p.default is not p.empty}
    assert made == {name: option_table.default("job", name) for name in made}


def test_every_option_is_declared_once_per_surface_with_a_known_surface():
    for surface in SURFACES:
        names = [o.name for o in on(surface)]
        assert len(names) == len(set(names)), f"{surface} declares an option twice"
    assert all(o.surfaces and o.surfaces <= set(SURFACES) for o in OPTIONS)
    assert all(set(o.defaults) <= o.surfaces for o in OPTIONS)


def test_the_checks_of_the_table_refuse_what_launch_options_refuses():
    with pytest.raises(option_table.InvalidArgument, match="start method must be one of forkserver, spawn"):
        LaunchOptions(1, start_method="fork")
    with pytest.raises(option_table.InvalidArgument, match="pdb is True or False"):
        LaunchOptions(1, pdb="yes")


def docs_block(surface: str) -> str:
    return f"<!-- options: {surface} -->\n{option_table.markdown(surface)}\n<!-- /options -->"


def rewrite_docs() -> None:
    for name, surface in DOCS:
        path = ROOT / name
        text = path.read_text()
        pattern = re.compile(rf"<!-- options: {surface} -->\n.*?<!-- /options -->", re.S)
        block = docs_block(surface)
        path.write_text(pattern.sub(lambda _, block=block: block, text))


@pytest.mark.parametrize(("name", "surface"), DOCS)
def test_the_docs_option_lists_are_the_tables(name, surface):
    assert docs_block(surface) in (ROOT / name).read_text(), f"run python {Path(__file__).relative_to(ROOT)}"


if __name__ == "__main__":
    rewrite_docs()
    sys.exit(0)

"""Starting ranks on a machine: the one path a launch's ranks (``kernel_side.local``), a persistent group's
(``kernel_side.group_members``, and on other nodes ``rank_side.node_host``'s) and a background job's
(``jobs.runner``, through ``run_local``) take.

A rank is started from a context (the rank server's forkserver, held while the ranks live; or ``spawn``) as
``target(local_rank, plan, *args)``, where the target makes the process a rank (``runtime.become_rank``): it
leads its own process group, dies with its launcher, sends its output to its launcher's pipe, and takes its
whole environment from ``plan.environment(local_rank)`` (torchrun's variables, the store, its GPUs, its threads).
A ``spawn`` rank also starts with its GPUs in its initial environment (``initial_environment``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

from gpumagic.launch.plan import LaunchPlan
from gpumagic.launch.rank_side.rank_server import forkserver_context

INITIAL_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")  # what a spawn rank starts with


@contextlib.contextmanager
def starting_context(start_method: str) -> Iterator[Any]:
    """The multiprocessing context ranks start from, held until they ended: the rank server's (``forkserver``:
    not restarted under them), or ``spawn``'s."""
    if start_method == "forkserver":
        with forkserver_context() as context:
            yield context
        return
    resource_tracker.ensure_running()  # now, so it does not inherit a rank's GPUs (initial_environment)
    yield multiprocessing.get_context(start_method)


class RankStarter:
    """Starts the ranks of one plan on this machine, each as ``target(local_rank, plan, *args)`` in a process
    called ``name.format(local_rank)``, from ``context`` (``starting_context(start_method)``; in a kernel,
    ``kernel_side.rank_start.rank_context``).

    What differs between its users is said here: a launch's ranks run ``rank.run_local_rank`` (``"rank-{}"``),
    a group's ``group_rank.serve_group_rank`` (``"ddp-rank-{}"``), a job's are a launch's with ``spawn``.

    >>> starter = RankStarter(plan, context, target=run_local_rank, name="rank-{}")  # doctest: +SKIP
    >>> process = starter.start(0, writers, listener)  # doctest: +SKIP
    """

    def __init__(
        self,
        plan: LaunchPlan,
        context: Any,
        *,
        target: Callable[..., None],
        name: str,
        start_method: str = "forkserver",
    ) -> None:
        self.plan = plan
        self.context = context
        self.target = target
        self.name = name
        self.start_method = start_method

    def environment(self, local_rank: int) -> dict[str, str]:
        """The whole environment rank ``local_rank`` runs with (it sets it itself, first thing)."""
        return self.plan.environment(local_rank)

    def initial_environment(self, local_rank: int) -> dict[str, str]:
        """What of ``environment`` the process starts with: with ``spawn``, its GPUs (the environment ``/proc``
        shows, so the simulated inventory counts the rank on its GPU); nothing from the rank server, which
        forks every rank from its own."""
        gpus = self.plan.rank_gpus[local_rank] if self.plan.rank_gpus else ()
        if self.start_method != "spawn" or not gpus:
            return {}
        environment = self.environment(local_rank)
        return {name: environment[name] for name in INITIAL_VARIABLES}

    def start(self, local_rank: int, *args: Any) -> Any:
        """Start rank ``local_rank``: its started ``multiprocessing.Process``. ``args`` follow the plan."""
        process = self.context.Process(
            target=self.target, args=(local_rank, self.plan, *args), name=self.name.format(local_rank)
        )
        with _environment_while_starting(self.initial_environment(local_rank)):
            process.start()
        return process


@contextlib.contextmanager
def _environment_while_starting(variables: dict[str, str]) -> Iterator[None]:
    """This process's environment with ``variables`` while a ``spawn`` child starts (it copies it), then as
    it was."""
    if not variables:
        yield
        return
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass
class RankPipes:
    """A started rank of a persistent group, and its launcher's ends of its three pipes: the rank's output (read,
    non-blocking), its messages, its status channel."""

    process: Any
    output: Any
    connection: Any
    status: Any


def start_with_pipes(context: Any, start: Callable[[Any, Any, Any], Any]) -> RankPipes:
    """Make a group rank's three pipes from ``context`` and start it with ``start(output, connection, status)``
    (its ends, closed here once it holds them): the kernel's way for its own ranks, a node host's for its node's."""
    reader, writer = context.Pipe(duplex=False)
    ours, theirs = context.Pipe()
    status_ours, status_theirs = context.Pipe()
    try:
        process = start(writer, theirs, status_theirs)
    finally:
        writer.close()
        theirs.close()
        status_theirs.close()
    os.set_blocking(reader.fileno(), False)
    return RankPipes(process, reader, ours, status_ours)

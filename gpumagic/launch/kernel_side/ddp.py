"""The launch API: ``launch_ddp`` (a function on N ranks with the process group ready), ``spawn``
(``torch.multiprocessing.spawn``'s signature, for notebook-defined functions), ``prepare_cell`` with
``launch_prepared`` (``launch_cell`` does both) and ``check_launch``. Each turns its keywords into one
``LaunchOptions`` at once; ``launch_packed`` carries out a launch that value describes (what ``%%launch_ddp``
runs): on this machine (``local``) or, elastic or multi-node, through torch elastic (``elastic``)."""

from __future__ import annotations

import contextlib
import functools
import shutil
import sys
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from gpumagic.devices import selection
from gpumagic.devices.inventory import read_inventory, require_gpus
from gpumagic.devices.spec import parse_spec, resolve
from gpumagic.devices.visibility import current_visibility, hides_every_gpu
from gpumagic.errors import InvalidArgument
from gpumagic.launch.failures import LaunchInterrupted
from gpumagic.launch.hang_reports import HangFollower
from gpumagic.launch.kernel_side import tracked
from gpumagic.launch.kernel_side.elastic import launch_elastic, prepare_elastic
from gpumagic.launch.kernel_side.launch_handle import LaunchHandle
from gpumagic.launch.kernel_side.local import loopback_port, run_local, store_listener
from gpumagic.launch.kernel_side.output import RankOutput, progress_lines
from gpumagic.launch.kernel_side.post_mortem import PostMortems
from gpumagic.launch.option_table import check_nprocs, default
from gpumagic.launch.options import USER_OPTIONS, LaunchOptions
from gpumagic.launch.plan import LaunchPlan, Placement, choose_backend, place_on
from gpumagic.launch.shared_values import SharedBatch, shared_batch
from gpumagic.launch.shipping import pack, ship_cell, ship_function
from gpumagic.run_dirs import store
from gpumagic.run_dirs.launch_files import make_launch_directories, remove_launch_directories
from gpumagic.run_dirs.layout import RunFiles

DEFAULT_CPU_RANKS = 2
FOLLOWERS = ("write", "dashboard")  # keywords of the launch functions that say how to follow a launch


def launch_ddp(  # every option of the table's launch surface: tests/unit/test_option_table.py holds them equal
    fn: Callable[..., Any],
    nprocs: int | None = None,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    gpus: str | None = default("launch", "gpus"),
    gpus_per_rank: int = default("launch", "gpus_per_rank"),
    backend: str | None = default("launch", "backend"),
    port: int | None = default("launch", "port"),
    timeout: str | float = default("launch", "timeout"),
    start_method: str = default("launch", "start_method"),
    output: str = default("launch", "output"),
    hang_after: str | float = default("launch", "hang_after"),
    pdb: bool = default("launch", "pdb"),
    nnodes: int = default("launch", "nnodes"),
    rdzv_endpoint: str | None = default("launch", "rdzv_endpoint"),
    node_rank: int | None = default("launch", "node_rank"),
    rdzv_id: str | None = default("launch", "rdzv_id"),
    max_restarts: int = default("launch", "max_restarts"),
    runs_dir: str | None = default("launch", "runs_dir"),
    write: Callable[[str], None] | None = default("launch", "write"),
    dashboard: Any = default("launch", "dashboard"),
) -> dict[int, Any]:
    """Call ``fn(*args, **kwargs)`` on ``nprocs`` ranks with the process group initialized; ``{rank: value}``.

    ``fn`` may be defined in the notebook: it is shipped by value. Options (``LaunchOptions``, declared in
    ``launch.option_table``): ``gpus`` (a device spec or ``"auto"``), ``gpus_per_rank``, ``backend`` (default nccl
    with GPUs, gloo without), ``port``, ``timeout`` (of the process group), ``start_method``
    (``forkserver``/``spawn``), ``output`` (``all``/``rank0``/``none``), ``hang_after`` (a collective waiting this
    long is reported with where every rank is, 0: off), ``pdb`` (a rank that raises waits for a post-mortem
    debugger read with ``input()``); ``write``, where rank output goes (default stdout), and ``dashboard`` (a
    ``LaunchDashboard``, attached as the ranks start).

    Multi-node and elastic (torch.distributed.elastic, ``docs/multi-node.md``): ``nnodes`` with
    ``rdzv_endpoint`` (``"HOST:PORT"``, an address of this machine; the other nodes' agent command is printed),
    ``rdzv_id`` (c10d rendezvous, the default) or ``node_rank`` (fixed node numbers), ``max_restarts``
    (restart the whole group when a rank fails, this many times) and ``runs_dir`` (where the run directory
    goes: a filesystem every node shares). ``max_restarts`` alone runs an elastic group on this machine.

    Raises:
        LaunchError: a rank failed; it names the root cause with that rank's traceback.
        LaunchInterrupted: interrupted; every rank was stopped. ShippingError, InvalidArgument.
    """
    launch, follow = _options_of(locals())  # the parameters alone: nothing else is defined yet
    shared = shared_for(launch)
    packed = _packed(lambda: pack(ship_function(fn, tuple(args), dict(kwargs or {}), rank_first=False), shared), shared)
    return launch_sharing(packed, launch, shared, **follow)


def spawn(  # every option of the table's launch surface: tests/unit/test_option_table.py holds them equal
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 1,
    join: bool = True,
    *,
    gpus: str | None = default("launch", "gpus"),
    gpus_per_rank: int = default("launch", "gpus_per_rank"),
    backend: str | None = default("launch", "backend"),
    port: int | None = default("launch", "port"),
    timeout: str | float = default("launch", "timeout"),
    start_method: str = default("launch", "start_method"),
    output: str = default("launch", "output"),
    hang_after: str | float = default("launch", "hang_after"),
    pdb: bool = default("launch", "pdb"),
    nnodes: int = default("launch", "nnodes"),
    rdzv_endpoint: str | None = default("launch", "rdzv_endpoint"),
    node_rank: int | None = default("launch", "node_rank"),
    rdzv_id: str | None = default("launch", "rdzv_id"),
    max_restarts: int = default("launch", "max_restarts"),
    runs_dir: str | None = default("launch", "runs_dir"),
    write: Callable[[str], None] | None = default("launch", "write"),
    dashboard: Any = default("launch", "dashboard"),
) -> Any:
    """``torch.multiprocessing.spawn`` for notebooks: ``fn(rank, *args)`` on ``nprocs`` processes.

    Works with functions defined in the notebook. As with ``mp.spawn`` the code creates its own process
    group; ``MASTER_ADDR``/``MASTER_PORT`` (a free port) and the other torchrun variables are set. Returns
    ``{rank: value}``. ``join=False`` starts the ranks in a background thread and returns a ``LaunchHandle``
    whose ``join()`` gives that dict.
    """
    launch, follow = _options_of(locals(), process_group=False)  # the parameters alone
    if launch.pdb and not join:
        raise InvalidArgument("pdb=True needs join=True: the debugger's prompt is read while the call waits")
    shared = shared_for(launch)
    packed = _packed(lambda: pack(ship_function(fn, tuple(args), {}, rank_first=True), shared), shared)
    if join:
        return launch_sharing(packed, launch, shared, **follow)
    run = functools.partial(launch_sharing, packed, launch, shared, **follow)
    return LaunchHandle(run, name="gpumagic-spawn").start()


def launch_cell(
    source: str,
    namespace: Mapping[str, Any],
    *,
    filename: str,
    hidden: Collection[str] = (),
    nprocs: int | None = None,
    **options: Any,
) -> dict[int, Any]:
    """Run a cell's Python ``source`` on every rank, with ``rank``, ``local_rank``, ``world_size`` and
    ``device`` defined and the process group initialized; ``{rank: value of the last expression}``."""
    launch, follow = _split_options(nprocs, options)
    shared = shared_for(launch)
    packed = _packed(lambda: prepare_cell(source, namespace, filename=filename, hidden=hidden, shared=shared), shared)
    return launch_sharing(packed, launch, shared, **follow)


def prepare_cell(
    source: str,
    namespace: Mapping[str, Any],
    *,
    filename: str,
    hidden: Collection[str] = (),
    shared: SharedBatch | None = None,
) -> bytes:
    """What a cell's ranks receive: its code and the notebook names it uses, packed once; big tensors and arrays
    through ``shared``'s memory (``shared_for``: all ranks on this machine; release it when they end).

    Raises:
        ShippingError: not valid Python, IPython magics inside, or a name that cannot be pickled (named).
    """
    return pack(ship_cell(source, namespace, filename, hidden), shared)


def shared_for(launch: LaunchOptions) -> SharedBatch | None:
    """Shared memory for the big values of ``launch``, if all its ranks run on this machine (one node) and this
    machine offers it (``shared_values``); else None: every value travels by value."""
    return shared_batch() if launch.nnodes == 1 else None


def launch_sharing(packed: bytes, launch: LaunchOptions, shared: SharedBatch | None, **follow: Any) -> dict[int, Any]:
    """``launch_packed``, then ``shared`` released (the launch's ranks have ended)."""
    try:
        return launch_packed(packed, launch, **follow)
    finally:
        if shared is not None:
            shared.release()


def _packed(make: Callable[[], bytes], shared: SharedBatch | None) -> bytes:
    """``make()``; ``shared`` released if it raises (no launch will)."""
    try:
        return make()
    except BaseException:
        if shared is not None:
            shared.release()
        raise


def launch_prepared(packed: bytes, nprocs: int | None = None, **options: Any) -> dict[int, Any]:
    """Run a ``prepare_cell`` result on ``nprocs`` ranks with the process group initialized; ``{rank: value}``.

    Options as ``launch_ddp``'s, plus ``dashboard`` (a ``LaunchDashboard``: attached when the ranks start, told
    when they end; its Stop button stops them).
    """
    launch, follow = _split_options(nprocs, options)
    return launch_packed(packed, launch, **follow)


def check_launch(nprocs: int | None = None, **options: Any) -> None:
    """Check ``launch_prepared``'s arguments as it would, without reading or leasing any GPU state that changes:
    what ``--no-wait`` checks before it starts the launch on a thread, so bad input is an error at once.

    Raises:
        InvalidArgument: the first bad argument, as ``launch_prepared`` would say it.
    """
    launch, _ = _split_options(nprocs, options)
    check_named_gpus(launch)


def check_named_gpus(launch: LaunchOptions) -> None:
    """Raise InvalidArgument unless the GPUs ``launch.gpus`` names (a spec, not ``auto`` or ``none``) are enough
    for its ranks: read from the inventory, nothing leased."""
    if launch.gpus is not None and launch.gpus != "auto" and not parse_spec(launch.gpus).none:
        _check_enough(launch.gpus, launch.nprocs, launch.gpus_per_rank)


def _options_of(parameters: Mapping[str, Any], process_group: bool = True) -> tuple[LaunchOptions, dict[str, Any]]:
    """The launch (checked) and how to follow it, from a launch function's parameters (its ``locals()``)."""
    options = {name: parameters[name] for name in USER_OPTIONS}
    follow = {name: parameters[name] for name in FOLLOWERS}
    return LaunchOptions(parameters["nprocs"], process_group=process_group, **options), follow


def _split_options(
    nprocs: int | None, options: dict[str, Any], process_group: bool = True
) -> tuple[LaunchOptions, dict[str, Any]]:
    """A launch function's keywords: the launch's options (checked), and how to follow it (``write``,
    ``dashboard``), which ``launch_packed`` takes besides."""
    follow = {name: options.pop(name) for name in FOLLOWERS if name in options}
    return LaunchOptions.of(nprocs, options, process_group=process_group), follow


def launch_packed(
    packed: bytes,
    launch: LaunchOptions,
    *,
    write: Callable[[str], None] | None = None,
    dashboard: Any = None,
) -> dict[int, Any]:
    """Run a packed payload (``prepare_cell``, ``shipping.pack``) as ``launch`` says; ``{rank: value}``.

    ``write``: where rank output goes (default stdout, with progress bars one line per rank); ``dashboard``: a
    ``LaunchDashboard``, attached when the ranks start and told when they end (its Stop button stops them).
    The options were checked when ``launch`` was made; the GPUs are read or leased only after the port, the
    rendezvous and the run directory were taken, so a refusal leaves nothing behind.

    Raises:
        LaunchError, LaunchInterrupted, InvalidArgument: as ``launch_ddp``.
    """
    rendezvous = prepare_elastic(launch) if launch.elastic else None
    chosen_port = 0 if launch.elastic else loopback_port(launch.port)  # a taken --port is refused before any GPU
    run_dir = listener = None
    try:
        if not launch.elastic:  # a full disk or an unsafe runs directory is refused before any GPU is leased, too
            run_dir = store.new_run("ddp", ranks=0)
            files = RunFiles(run_dir)
            make_launch_directories(files)
            listener = store_listener(files)  # rank 0's from here on
        placement = place_ranks(launch)
    except BaseException:
        if listener is not None:
            listener.close()
        if rendezvous is not None:
            rendezvous.abandon()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if rendezvous is not None:
        return launch_elastic(
            packed,
            len(placement.rank_gpus),
            launch,
            backend=placement.backend or "gloo",
            use_cuda=placement.use_cuda,
            gpu_uuids=[g for gpus in placement.rank_gpus for g in gpus],
            write=write or stdout_writer(),
            dashboard=dashboard,
            rendezvous=rendezvous,
        )
    assert run_dir is not None
    plan = LaunchPlan.on_this_machine(
        run_dir,
        placement.rank_gpus,
        backend=placement.backend,
        use_cuda=placement.use_cuda,
        master_port=chosen_port,
        timeout_s=launch.timeout_s,
        hang_after_s=launch.hang_after_s,
        post_mortem=launch.pdb,
    )
    return _run_here(plan, packed, launch, listener, write, dashboard)


def _run_here(
    plan: LaunchPlan,
    packed: bytes,
    launch: LaunchOptions,
    listener: Any,
    write: Callable[[str], None] | None,
    dashboard: Any,
) -> dict[int, Any]:
    """Run ``plan``'s ranks on this machine, their output to ``write`` (``None``: stdout, with progress bars one
    line per rank), followed by the dashboard; the run's record and the ranks' files are settled at the end."""
    run_dir, files = Path(plan.run_dir), RunFiles(plan.run_dir)
    store.update_run(run_dir, ranks=plan.nprocs, backend=plan.backend, gpus=[list(g) for g in plan.rank_gpus])
    bars = progress_lines() if write is None else None  # one updating line per rank, in a notebook's output
    sink = RankOutput(write or stdout_writer(), launch.output, plan.nprocs, bars)
    writer = write or stdout_writer()
    hangs = HangFollower.of_run(run_dir, plan.world_size, plan.hang_after_s, lambda text: writer(text + "\n"))
    debuggers = PostMortems(files, plan.nprocs, writer, hangs) if plan.post_mortem else None

    def look() -> None:
        hangs.poll()
        if debuggers is not None:
            debuggers.poll()

    status = "failed"

    def started(plan: LaunchPlan, pids: list[int]) -> None:
        if dashboard is not None:
            dashboard.attach(run_dir, pids, rank_gpus=plan.rank_gpus, use_gpus=plan.use_cuda)

    exporting = tracked.follow(run_dir, "ddp", launch, nprocs=plan.nprocs, backend=plan.backend)
    try:
        results = run_local(
            plan,
            packed,
            start_method=launch.start_method,
            listener=listener,
            on_output=sink.feed,
            on_start=started,
            cancel=dashboard.cancel if dashboard is not None else None,
            on_poll=look,
        )
        status = "finished"
        return results
    except LaunchInterrupted:
        status = "interrupted"
        raise
    finally:
        sink.flush()
        remove_launch_directories(files)
        store.finish_run(run_dir, status)
        tracked.end(exporting, status, lambda line: writer(line + "\n"))
        if dashboard is not None:
            dashboard.finish(status)


def place_ranks(launch: LaunchOptions) -> Placement:
    """Read or lease the GPUs ``launch`` asks for and give each rank its share.

    Raises:
        InvalidArgument: too few GPUs, or a spec naming none (nothing is leased then).
    """
    if launch.allocation is not None and launch.allocation.here is None:
        return place_on_allocation(launch)
    available, simulated = gpus_for_ranks(launch.gpus, launch.nprocs, launch.gpus_per_rank)
    nprocs = launch.nprocs if launch.nprocs is not None else default_nprocs(available, launch.gpus_per_rank)
    check_nprocs(nprocs)
    return place_on(
        available,
        nprocs,
        launch.gpus_per_rank,
        simulated=simulated,
        backend=launch.backend,
        process_group=launch.process_group,
        every_rank_sees_all=not launch.process_group and launch.gpus is None,  # as under mp.spawn: the kernel's GPUs
    )


def place_on_allocation(launch: LaunchOptions) -> Placement:
    """From a login node, or for a %ddp group across the nodes, no rank runs on the kernel's GPUs: the ranks use
    the GPUs Slurm allocated on each node (``gpus_per_node`` of ``scontrol show job``), unless ``--gpus none``;
    this machine's GPUs are not theirs to lease.

    Raises:
        InvalidArgument: a device spec, which names this machine's GPUs.
    """
    assert launch.allocation is not None
    gpus = launch.allocation.gpus_per_node
    if launch.gpus is not None and not parse_spec(launch.gpus).none:
        raise InvalidArgument(
            f"--gpus {launch.gpus} names this machine's GPUs, and no rank runs here: the ranks use the GPUs Slurm "
            f"allocated on each node ({gpus} per node); leave out --gpus, or give --gpus none for CPU ranks"
        )
    use_cuda = gpus > 0 and launch.gpus is None
    nprocs = launch.nprocs if launch.nprocs is not None else max(1, gpus // launch.gpus_per_rank) if use_cuda else 2
    check_nprocs(nprocs)
    return Placement(tuple(() for _ in range(nprocs)), use_cuda, choose_backend(launch.backend, use_cuda=use_cuda))


def gpus_for_ranks(spec: str | None, nprocs: int | None, per_rank: int) -> tuple[list[str], bool]:
    """The GPU UUIDs available to the ranks (cuda order) and whether they are simulated.

    ``None``: the GPUs this kernel sees; ``"none"``: no GPU, leaving the kernel's own choice as it is;
    ``"auto"``: pick and lease free ones; any other spec: lease those (``use``).
    """
    if spec is None:
        if hides_every_gpu():
            return [], False
        inventory = read_inventory()
        if not inventory.gpus:
            return [], False
        visible = current_visibility(inventory).nvml_indices
        return [inventory[i].uuid for i in visible], inventory.simulated
    if spec == "auto":
        if nprocs is None:
            raise InvalidArgument("with --gpus auto, say how many ranks with -n")
        chosen = selection.pick(nprocs * per_rank)
    elif parse_spec(spec).none:
        return [], False
    else:
        _check_enough(spec, nprocs, per_rank)  # before use() leases them and changes CUDA_VISIBLE_DEVICES
        chosen = selection.use(spec)
    return list(chosen.uuids), chosen.simulated


def _check_enough(spec: str, nprocs: int | None, per_rank: int) -> None:
    """Raise InvalidArgument unless the GPUs ``spec`` names are enough for ``nprocs`` ranks of ``per_rank``."""
    named = len(resolve(parse_spec(spec), require_gpus(read_inventory())))
    needed = (nprocs or 1) * per_rank
    if named < needed:
        raise InvalidArgument(
            f"--gpus {spec} names {named} GPU(s), too few for {nprocs or 1} rank(s) × {per_rank} GPU(s) = {needed}; "
            "name more, lower -n or --gpus-per-rank, or run the ranks on the CPU with --gpus none"
        )


def default_nprocs(available: list[str], gpus_per_rank: int) -> int:
    """How many ranks run when none is asked for: one per ``gpus_per_rank`` GPUs, or 2 CPU ranks without GPUs.

    Raises:
        InvalidArgument: fewer GPUs than one rank needs.
    """
    if not available:
        return DEFAULT_CPU_RANKS
    if len(available) < gpus_per_rank:
        raise InvalidArgument(
            f"one rank with {gpus_per_rank} GPUs needs {gpus_per_rank} but {len(available)} are available to this "
            f"kernel; lower --gpus-per-rank to at most {len(available)}, or pick more GPUs with %gpu pick"
        )
    return len(available) // gpus_per_rank


def stdout_writer() -> Callable[[str], None]:
    """Where rank output goes by default: this kernel's stdout as it is now (a cell's output)."""
    stream = sys.stdout

    def write(text: str) -> None:
        with contextlib.suppress(ValueError):
            stream.write(text)
            stream.flush()

    return write

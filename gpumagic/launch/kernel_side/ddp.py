"""The launch API: ``launch_ddp`` (a function on N ranks with the process group ready), ``spawn``
(``torch.multiprocessing.spawn``'s signature, for notebook-defined functions), and ``prepare_cell`` with
``launch_prepared`` (what ``%%launch_ddp`` runs; ``launch_cell`` does both)."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

from gpumagic.errors import InvalidArgument
from gpumagic.launch.failures import LaunchInterrupted
from gpumagic.launch.kernel_side.local import loopback_port, store_listener
from gpumagic.launch.kernel_side.output import OUTPUT_MODES, RankOutput, progress_lines
from gpumagic.launch.plan import LaunchPlan, assign_gpus, check_backend, check_timeout, threads_per_rank
from gpumagic.launch.shipping import pack, ship_cell, ship_function
from gpumagic.run_dirs import store
from gpumagic.run_dirs.launch_files import make_launch_directories, remove_launch_directories
from gpumagic.run_dirs.layout import RunFiles

DEFAULT_CPU_RANKS = 2
MAX_RANKS = 256


def launch_ddp(
    fn: Callable[..., Any],
    nprocs: int | None = None,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> dict[int, Any]:
    """Call ``fn(*args, **kwargs)`` on ``nprocs`` ranks with the process group initialized; ``{rank: value}``.

    ``fn`` may be defined in the notebook: it is shipped by value. Options: ``gpus`` (a device spec or
    ``"auto"``), ``gpus_per_rank``, ``backend`` (default nccl with GPUs, gloo without), ``port``,
    ``timeout`` (of the process group, default ``"30m"``), ``start_method`` (``forkserver``/``spawn``),
    ``output`` (``all``/``rank0``/``none``).

    Multi-node and elastic (torch.distributed.elastic, ``docs/multi-node.md``): ``nnodes`` with
    ``rdzv_endpoint`` (``"HOST:PORT"``, an address of this machine; the other nodes' agent command is printed),
    ``rdzv_id`` (c10d rendezvous, the default) or ``node_rank`` (fixed node numbers), ``max_restarts``
    (restart the whole group when a rank fails, this many times) and ``runs_dir`` (where the run directory
    goes: a filesystem every node shares). ``max_restarts`` alone runs an elastic group on this machine.

    Raises:
        LaunchError: a rank failed; it names the root cause with that rank's traceback.
        LaunchInterrupted: interrupted; every rank was stopped. ShippingError, InvalidArgument.
    """
    packed = pack(ship_function(fn, tuple(args), dict(kwargs or {}), rank_first=False))
    return _launch(packed, nprocs, process_group=True, **options)


def spawn(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1, join: bool = True, **options: Any) -> Any:
    """``torch.multiprocessing.spawn`` for notebooks: ``fn(rank, *args)`` on ``nprocs`` processes.

    Works with functions defined in the notebook. As with ``mp.spawn`` the code creates its own process
    group; ``MASTER_ADDR``/``MASTER_PORT`` (a free port) and the other torchrun variables are set. Returns
    ``{rank: value}``. ``join=False`` starts the ranks in a background thread and returns a handle whose
    ``join()`` gives that dict.
    """
    packed = pack(ship_function(fn, tuple(args), {}, rank_first=True))
    if join:
        return _launch(packed, nprocs, process_group=False, **options)
    return SpawnHandle(lambda: _launch(packed, nprocs, process_group=False, **options))


class SpawnHandle:
    """Ranks running in the background (``spawn(..., join=False)``)."""

    def __init__(self, run: Callable[[], dict[int, Any]]) -> None:
        import threading

        self._result: dict[int, Any] | None = None
        self._error: BaseException | None = None

        def target() -> None:
            try:
                self._result = run()
            except BaseException as err:  # noqa: BLE001 - handed to join()
                self._error = err

        self._thread = threading.Thread(target=target, name="gpumagic-spawn", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> dict[int, Any] | None:
        """Wait for the ranks; ``None`` if ``timeout`` passed first. Raises the launch's error, if any."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        if self._error is not None:
            raise self._error
        return self._result


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
    return launch_prepared(prepare_cell(source, namespace, filename=filename, hidden=hidden), nprocs, **options)


def prepare_cell(source: str, namespace: Mapping[str, Any], *, filename: str, hidden: Collection[str] = ()) -> bytes:
    """What a cell's ranks receive: its code and the notebook names it uses, packed once.

    Raises:
        ShippingError: not valid Python, IPython magics inside, or a name that cannot be pickled (named).
    """
    return pack(ship_cell(source, namespace, filename, hidden))


def launch_prepared(packed: bytes, nprocs: int | None = None, **options: Any) -> dict[int, Any]:
    """Run a ``prepare_cell`` result on ``nprocs`` ranks with the process group initialized; ``{rank: value}``.

    Options as ``launch_ddp``'s, plus ``dashboard`` (a ``LaunchDashboard``: attached when the ranks start, told
    when they end; its Stop button stops them) and ``write`` (where rank output goes, default stdout).
    """
    return _launch(packed, nprocs, process_group=True, **options)


def check_launch(nprocs: int | None = None, *, gpus: str | None = None, **options: Any) -> None:
    """Check ``launch_prepared``'s arguments as it would, without reading or leasing any GPU state that changes:
    what ``--no-wait`` checks before it starts the launch on a thread, so bad input is an error at once.

    Raises:
        InvalidArgument: the first bad argument, as ``launch_prepared`` would say it.
    """
    options.pop("dashboard", None)
    options.pop("write", None)
    names = (
        "gpus_per_rank",
        "backend",
        "port",
        "timeout",
        "start_method",
        "output",
        "nnodes",
        "rdzv_endpoint",
        "node_rank",
        "rdzv_id",
        "max_restarts",
        "runs_dir",
    )
    unknown = set(options) - set(names)
    if unknown:
        raise InvalidArgument(f"unknown launch option(s): {', '.join(sorted(unknown))}")
    defaults = {
        "gpus_per_rank": 1,
        "timeout": "30m",
        "start_method": "forkserver",
        "output": "all",
        "nnodes": 1,
        "max_restarts": 0,
    }
    values = {**dict.fromkeys(names), **defaults, **options}
    _check_arguments(nprocs, True, *(values[name] for name in names))
    from gpumagic.devices.spec import parse_spec

    if gpus is not None and gpus != "auto" and not parse_spec(gpus).none:
        _check_enough(gpus, nprocs, values["gpus_per_rank"])


def _check_arguments(
    nprocs: int | None,
    process_group: bool,
    gpus_per_rank: Any,
    backend: str | None,
    port: int | None,
    timeout: str | float,
    start_method: str,
    output: str,
    nnodes: int,
    rdzv_endpoint: str | None,
    node_rank: int | None,
    rdzv_id: str | None,
    max_restarts: int,
    runs_dir: str | None,
) -> tuple[float, bool, str | None]:
    """Check a launch's arguments; returns the timeout in seconds, whether it is elastic, and its endpoint."""
    from gpumagic.launch.kernel_side.local import START_METHODS

    if start_method not in START_METHODS:
        raise InvalidArgument(f"start method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
    if output not in OUTPUT_MODES:
        raise InvalidArgument(f"output must be one of {', '.join(OUTPUT_MODES)}, got {output!r}")
    if isinstance(gpus_per_rank, bool) or not isinstance(gpus_per_rank, int) or gpus_per_rank < 1:
        raise InvalidArgument(f"gpus_per_rank must be a whole number of at least 1, got {gpus_per_rank!r}")
    check_backend(backend)
    timeout_s = check_timeout(timeout)
    _check_port(port)  # every argument is checked before GPUs are read or leased
    if nprocs is not None:
        _check_nprocs(nprocs)
    elastic = (nnodes, rdzv_endpoint, node_rank, rdzv_id, max_restarts, runs_dir) != (1, None, None, None, 0, None)
    if elastic:
        from gpumagic.launch.kernel_side.elastic import check_options

        if not process_group:
            raise InvalidArgument("spawn runs on this machine only; use launch_ddp for a multi-node or elastic run")
        if port is not None:
            raise InvalidArgument("with an elastic launch the port is --rdzv-endpoint's; leave out --port")
        rdzv_endpoint = rdzv_endpoint or ("127.0.0.1:0" if nnodes == 1 else None)
        check_options(nnodes, rdzv_endpoint, node_rank, rdzv_id, max_restarts)
    return timeout_s, elastic, rdzv_endpoint


def _launch(
    packed: bytes,
    nprocs: int | None,
    *,
    process_group: bool,
    gpus: str | None = None,
    gpus_per_rank: int = 1,
    backend: str | None = None,
    port: int | None = None,
    timeout: str | float = "30m",
    start_method: str = "forkserver",
    output: str = "all",
    write: Callable[[str], None] | None = None,
    dashboard: Any = None,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    node_rank: int | None = None,
    rdzv_id: str | None = None,
    max_restarts: int = 0,
    runs_dir: str | None = None,
) -> dict[int, Any]:
    from gpumagic.launch.kernel_side.local import run_local

    timeout_s, elastic, rdzv_endpoint = _check_arguments(
        nprocs,
        process_group,
        gpus_per_rank,
        backend,
        port,
        timeout,
        start_method,
        output,
        nnodes,
        rdzv_endpoint,
        node_rank,
        rdzv_id,
        max_restarts,
        runs_dir,
    )  # every argument is checked before GPUs are read or leased
    rendezvous = None
    if elastic:
        from gpumagic.launch.kernel_side.elastic import launch_elastic, prepare_elastic

        rendezvous = prepare_elastic(nnodes, rdzv_endpoint, node_rank, rdzv_id, max_restarts, runs_dir)
    chosen_port = 0 if elastic else loopback_port(port)  # a taken --port is refused before any GPU is leased
    run_dir = listener = None
    try:
        if not elastic:  # a full disk or an unsafe runs directory is refused before any GPU is leased, too
            run_dir = store.new_run("ddp", ranks=0)
            files = RunFiles(run_dir)
            make_launch_directories(files)
            listener = store_listener(files)  # rank 0's from here on
        available, simulated = _rank_gpus(gpus, nprocs, gpus_per_rank)
        if nprocs is None:
            nprocs = default_nprocs(available, gpus_per_rank)
        _check_nprocs(nprocs)
        if not process_group and gpus is None:  # as under mp.spawn, every process sees the kernel's GPUs
            rank_gpus = tuple(tuple(available) for _ in range(nprocs))
        else:
            rank_gpus = assign_gpus(available, nprocs, gpus_per_rank)
    except BaseException:
        if listener is not None:
            listener.close()
        if rendezvous is not None:
            rendezvous.abandon()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    use_cuda = bool(available) and not simulated
    if process_group and backend is None:
        backend = "nccl" if use_cuda else "gloo"
    if elastic:
        return launch_elastic(
            packed,
            nprocs,
            nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint,
            node_rank=node_rank,
            rdzv_id=rdzv_id,
            max_restarts=max_restarts,
            backend=backend or "gloo",
            use_cuda=use_cuda,
            gpu_uuids=[g for gpus in rank_gpus for g in gpus],
            threads_per_rank=threads_per_rank(nprocs),
            timeout_s=timeout_s,
            runs_dir=runs_dir,
            output=output,
            write=write or _stdout_writer(),
            dashboard=dashboard,
            rendezvous=rendezvous,
        )
    assert run_dir is not None
    store.update_run(run_dir, ranks=nprocs, backend=backend, gpus=[list(g) for g in rank_gpus])
    plan = LaunchPlan.on_this_machine(
        run_dir,
        rank_gpus,
        backend=backend if process_group else None,
        use_cuda=use_cuda,
        master_port=chosen_port,
        timeout_s=timeout_s,
    )
    sink = RankOutput(write or _stdout_writer(), output, nprocs, progress_lines() if write is None else None)
    status = "failed"

    def started(plan: LaunchPlan, pids: list[int]) -> None:
        if dashboard is not None:
            dashboard.attach(run_dir, pids, rank_gpus=plan.rank_gpus, use_gpus=plan.use_cuda)

    try:
        results = run_local(
            plan,
            packed,
            start_method=start_method,
            listener=listener,
            on_output=sink.feed,
            on_start=started,
            cancel=dashboard.cancel if dashboard is not None else None,
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
        if dashboard is not None:
            dashboard.finish(status)


def _rank_gpus(spec: str | None, nprocs: int | None, per_rank: int) -> tuple[list[str], bool]:
    """The GPU UUIDs available to the ranks (cuda order) and whether they are simulated.

    ``None``: the GPUs this kernel sees; ``"none"``: no GPU, leaving the kernel's own choice as it is;
    ``"auto"``: pick and lease free ones; any other spec: lease those (``use``).
    """
    from gpumagic.devices import selection
    from gpumagic.devices.inventory import read_inventory
    from gpumagic.devices.spec import parse_spec
    from gpumagic.devices.visibility import current_visibility, hides_every_gpu

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
    from gpumagic.devices.inventory import read_inventory, require_gpus
    from gpumagic.devices.spec import parse_spec, resolve

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


def _check_nprocs(nprocs: object) -> None:
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or not 1 <= nprocs <= MAX_RANKS:
        raise InvalidArgument(f"the number of ranks must be a whole number from 1 to {MAX_RANKS}, got {nprocs!r}")


def _check_port(port: int | None) -> None:
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise InvalidArgument(f"port must be a whole number from 1 to 65535, got {port!r}")


def _stdout_writer() -> Callable[[str], None]:
    stream = sys.stdout

    def write(text: str) -> None:
        with contextlib.suppress(ValueError):
            stream.write(text)
            stream.flush()

    return write

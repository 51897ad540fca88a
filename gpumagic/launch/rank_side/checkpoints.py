"""``gpumagic.checkpoint(step, **state)`` and ``gpumagic.restore(**state)``: a run's state saved into its own
directory (``run_dirs.checkpoint_files``) and loaded back in place, the same call in a launch's ranks, a
``%ddp`` group's, a background job's and a plain script given ``GPUMAGIC_RUN_DIR``.

In a process group of several ranks every rank calls both: the ranks first agree on the step (a mismatch is named
on every rank, never a hang), rank 0 writes, and every rank hears whether it could; on restore rank 0 chooses the
checkpoint, every rank reads and checks it, and only when all could does any load it; a rank that cannot (another
model's shapes) fails all of them with one line. Every failure on one rank is told to the others before the next
collective. Because checkpoints live in the run's directory, whatever runs the code again in that directory
resumes from them: a Slurm requeue, ``%jobs resume``, a ``--max-restarts`` restart. A Slurm job with
``requeue_on_timeout`` hears the time limit's signal (``jobs.slurm_task``); its next ``checkpoint`` saves, seals
and asks Slurm to requeue it.

State values with ``state_dict()`` (models, optimizers, schedulers, ``GradScaler``) are saved by their state
dict: a DDP-wrapped or ``torch.compile``-d model as the module inside it, so a checkpoint fits the model wrapped
or not; an FSDP model (``fully_shard``, or FSDP1 where it can gather) and its optimizer as their full state dicts,
gathered on rank 0 and given back to every rank's shards. Other values are pickled and restored into the same
dict, list or set in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpumagic.errors import GpumagicError, InvalidArgument
from gpumagic.launch.rank_side.output_routing import flush
from gpumagic.run_dirs import checkpoint_files, store
from gpumagic.run_dirs.checkpoint_files import Checkpoint
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.store import RUN_DIR_VARIABLE

_log = logging.getLogger(__name__)

ATTEMPT_VARIABLE = "GPUMAGIC_ATTEMPT"  # a background job's attempt (1 first; %jobs resume adds one)
REQUEUE_VARIABLE = "GPUMAGIC_REQUEUE_ON_TIME_LIMIT"  # "k/N": a Slurm job that may requeue itself, the k-th time
REQUEUE_WAIT_S = 120.0  # for Slurm to end a rank whose job it requeues
FORMAT = 1  # the layout of what torch.save writes: {"gpumagic": {...}, "state": {name: value}}


class CheckpointError(GpumagicError):
    """A checkpoint could not be saved or restored; the message names the file, the rank and what to do."""


def checkpoint(step: int, /, *, every: int = 1, **state: Any) -> Path | None:
    """Save ``state`` as the checkpoint of ``step`` (the steps done: ``restore`` returns it as the step to go on
    from) into this run's directory, atomically and sealed; the last two are kept. With ``every``, only a step that
    is a multiple of it is saved (call it each step), and, in a Slurm job with ``requeue_on_timeout``, the first
    call after Slurm's signal ahead of the time limit: it saves, and the job requeues itself.

    Every rank of a process group calls it with the same step; rank 0 writes. Costs about what ``torch.save``
    of the same state costs (the seal is hashed by a thread afterwards).

    Example: ``gpumagic.checkpoint(step + 1, every=500, model=model, optimizer=optimizer)`` in the training loop.

    Returns:
        The checkpoint's file, or None where ``every`` skipped the step.
    Raises:
        InvalidArgument: no state, a step that is not a whole number >= 0, ranks that disagree on the step, or no
            run to save into. CheckpointError: rank 0 could not write it (every rank raises). DiskFull.
    """
    _check_step(step)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InvalidArgument(f"every is a whole number of steps >= 1, got {every!r}")
    if not state:
        raise InvalidArgument("gpumagic.checkpoint(step, model=model, optimizer=optimizer): name the state to save")
    run_dir = _run_dir("checkpoint")
    group = _process_group()
    near_limit = _time_limit_heard(group)
    if step % every and not near_limit:
        return None
    if group is not None:
        _agree_on_step(group, step)
    kinds = {name: _kind(value, state) for name, value in state.items()}
    gathered = {name: _state_of(value, *kinds[name]) for name, value in state.items() if kinds[name][1] is not None}
    rank = group.get_rank() if group is not None else 0
    written: Path | None = None
    failure: BaseException | None = None
    if rank == 0:
        # lazy: torch is imported by the rank's code before it saves anything
        import torch

        try:  # whatever fails here is told to every rank below (state_dict(), pickling, the disk)
            saved = {name: gathered[name] if name in gathered else _state_of(value, *kinds[name])
                     for name, value in state.items()}  # fmt: skip
            labels = {name: kind for name, (kind, _) in kinds.items()}
            document = {"gpumagic": {"format": FORMAT, "step": step, "kinds": labels}, "state": saved}
            written = checkpoint_files.write(run_dir, step, tuple(state), lambda path: torch.save(document, path))
        except Exception as err:  # noqa: BLE001 - told to every rank below, then raised here as it was
            _log.debug("rank 0 could not save the checkpoint; every rank is told", exc_info=True)
            failure = err
    if group is not None:
        told = [None if failure is None else f"{type(failure).__name__}: {failure}", str(written or "")]
        group.broadcast_object_list(told, src=0)
        if rank != 0 and told[0] is not None:
            raise CheckpointError(f"rank 0 could not save the checkpoint of step {step}: {told[0]}")
        written = Path(told[1])
    if failure is not None:
        raise failure
    if near_limit:
        _requeue(run_dir, group, step)
    return written


def time_limit_near(signum: int, frame: Any) -> None:
    """Slurm's signal ahead of the time limit (a job with ``requeue_on_timeout``): the next ``checkpoint`` saves
    and requeues. A signal handler: it only takes note."""
    global _near_limit
    _near_limit = True


_near_limit = False


def _time_limit_heard(group: Any) -> bool:
    """Whether any rank heard the time limit's signal (each hears it at its own step: they agree here, a small
    collective in each ``checkpoint`` call of a job that can requeue, none elsewhere)."""
    if not os.environ.get(REQUEUE_VARIABLE):
        return False
    if group is None:
        return _near_limit
    # lazy: torch is imported by the rank's code before it checkpoints
    import torch

    on_gpu = "nccl" in str(group.get_backend()).lower() and torch.cuda.is_available()  # NCCL reduces CUDA tensors
    heard = torch.tensor([1 if _near_limit else 0], device=f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu")
    group.all_reduce(heard, op=group.ReduceOp.MAX)
    return bool(heard.item())


def _requeue(run_dir: Path, group: Any, step: int) -> None:
    """After the checkpoint of ``step``: rank 0 asks Slurm to requeue the job (``scontrol requeue``), and every rank
    waits for Slurm to end it; if Slurm refuses, every rank says why once and trains on to the limit."""
    global _near_limit
    rank = group.get_rank() if group is not None else 0
    refused = [""]
    if rank == 0:
        checkpoint_files.settle()  # sealed before Slurm's SIGTERM can end the rank: else the next attempt skips it
        # said before asking: once Slurm grants the requeue, its SIGTERM can end the rank before another line
        sys.stderr.write(f"[gpumagic] rank 0: time limit near; saved step {step}; asking Slurm to requeue the job\n")
        flush()
        refused[0] = _ask_slurm_to_requeue(run_dir, step)
    if group is not None:
        group.broadcast_object_list(refused, src=0)
    _near_limit = False
    if refused[0]:
        os.environ.pop(REQUEUE_VARIABLE, None)
        sys.stderr.write(f"[gpumagic] rank {rank}: saved step {step}, but {refused[0]}; it runs on to the limit\n")
        return
    sys.stderr.write(f"[gpumagic] rank {rank}: time limit near; saved step {step}; Slurm requeues the job\n")
    flush()
    time.sleep(REQUEUE_WAIT_S)  # Slurm's SIGTERM ends the rank (the task's handler) as it requeues
    os._exit(128 + signal.SIGTERM)


def _ask_slurm_to_requeue(run_dir: Path, step: int) -> str:
    """Count the requeue in the job's record and ask Slurm for it; why not, or empty."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id:
        return "this is not a Slurm job"
    try:  # counted first: Slurm's SIGTERM may end this rank the moment the requeue is granted
        used = int(os.environ.get(REQUEUE_VARIABLE, "1/1").split("/")[0])
        store.update_run(run_dir, timeout_requeues=used, reason=f"requeued before its time limit at step {step}")
    except (OSError, ValueError) as err:
        _log.debug("the requeue could not be counted in the job's record", exc_info=True)
        return f"the requeue could not be recorded ({err})"
    why = ""
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
        if done.returncode:
            why = f"Slurm refused the requeue: {(done.stderr or done.stdout).strip()[:200]}"
    except (OSError, subprocess.TimeoutExpired) as err:
        _log.debug("scontrol requeue failed; the job runs on to its limit", exc_info=True)
        why = f"scontrol requeue failed ({err})"
    if why:  # not requeued after all: the count and the reason go back
        with contextlib.suppress(OSError):
            store.update_run(run_dir, timeout_requeues=used - 1, reason="")
    return why


def restore(**state: Any) -> int:
    """Load this run's latest checkpoint (of any earlier attempt: a requeue, a resume, a restart) into ``state``'s
    objects in place, and return its step: the step to go on from; 0 when there is none (nothing is changed).

    Every rank of a process group calls it and gets the same step. A half-written or damaged checkpoint is never
    loaded (the one before it is).

    Example: ``start = gpumagic.restore(model=model, optimizer=optimizer)``, then ``for step in range(start,
    total_steps)``.

    Raises:
        InvalidArgument: no state, or no run to restore from. CheckpointError: the checkpoint does not fit
            (a missing name, other shapes: one line naming the file and what differs), on every rank.
    """
    if not state:
        raise InvalidArgument("gpumagic.restore(model=model, optimizer=optimizer): name the state to load into")
    run_dir = _run_dir("restore")
    group = _process_group()
    rank = group.get_rank() if group is not None else 0
    entry: Checkpoint | None = None
    document: Mapping[str, Any] = {}
    problem: str | None = None
    chosen = ["", None]  # the seal of the checkpoint rank 0 chose (empty: none), or why it could not choose
    if rank == 0:
        try:
            entry, document, problem = _newest_sound(run_dir, state)
            chosen[0] = str(entry.seal) if entry is not None else ""
        except OSError as err:
            _log.debug("the checkpoints could not be listed", exc_info=True)
            chosen[1] = f"the checkpoints in {RunFiles(run_dir).checkpoints} cannot be read: {err}"
    if group is not None:
        group.broadcast_object_list(chosen, src=0)
    if chosen[1]:
        raise CheckpointError(chosen[1])
    if not chosen[0]:
        return 0
    if entry is None:  # another rank: it reads and checks the file rank 0 chose, before any rank loads it
        try:
            entry = _entry_at(Path(chosen[0]), run_dir)
            document = _read(entry, state)
        except (CheckpointError, checkpoint_files.CheckpointDamaged) as err:
            problem = str(err)
        except Exception as err:  # noqa: BLE001 - told to every rank: one rank raising alone leaves the rest waiting
            _log.debug("the checkpoint could not be read", exc_info=True)
            problem = f"checkpoint {Path(chosen[0]).name} could not be read: {type(err).__name__}: {err}"
    _agree(group, rank, problem)
    assert entry is not None
    try:
        problem = _load_all(document, state, entry.path.name)
    except Exception as err:  # noqa: BLE001 - as above
        _log.debug("the checkpoint could not be loaded", exc_info=True)
        problem = f"checkpoint {entry.path.name} could not be loaded: {type(err).__name__}: {err}"
    _agree(group, rank, problem)
    if rank == 0:
        try:
            checkpoint_files.record_restored(run_dir, entry.step, _attempt())
        except OSError:  # only what %jobs shows ("resumed from step N") is lost
            _log.debug("the restored step could not be recorded", exc_info=True)
    return entry.step


def _agree(group: Any, rank: int, problem: str | None) -> None:
    """Raise CheckpointError on every rank when any rank has a ``problem`` (named, unless every rank has it)."""
    if group is None:
        if problem:
            raise CheckpointError(problem)
        return
    problems: list[Any] = [None] * group.get_world_size()
    group.all_gather_object(problems, problem)
    failed = [(r, p) for r, p in enumerate(problems) if p]
    if failed:
        who, what = failed[0]
        alike = len(failed) == len(problems) and len({p for _, p in failed}) == 1  # every rank, the same way
        raise CheckpointError(what if alike else f"rank {who}: {what}")


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        if hasattr(step, "item") and getattr(step, "ndim", 1) == 0:  # a tensor or numpy scalar
            raise InvalidArgument(f"the checkpoint's step is a whole number >= 0; pass int(step), got {step!r}")
        raise InvalidArgument(f"the checkpoint's step is a whole number >= 0 (the steps done), got {step!r}")


def _run_dir(what: str) -> Path:
    """The run directory of this process (every rank of a launch, group or job has one)."""
    value = os.environ.get(RUN_DIR_VARIABLE)
    if not value:
        raise InvalidArgument(
            f"gpumagic.{what} works in a run's code: %%launch_ddp, %%ddp, a background job (%%launch_bg, "
            f"gpumagic.submit) or a script given {RUN_DIR_VARIABLE}=DIR; this process has no run directory"
        )
    return Path(value)


def _attempt() -> int:
    """This run's attempt: the job's (1 first, one more for each ``%jobs resume``) plus Slurm's requeues."""
    return int(os.environ.get(ATTEMPT_VARIABLE) or 1) + int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def _process_group() -> Any:
    """``torch.distributed`` when its default process group is initialized with more than one rank, else None."""
    dist = sys.modules.get("torch.distributed")  # never imports torch: a run that never joined has no group
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist


def _agree_on_step(group: Any, step: int) -> None:
    steps: list[Any] = [None] * group.get_world_size()
    group.all_gather_object(steps, step)
    if len(set(steps)) > 1:
        by_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
        raise InvalidArgument(f"every rank checkpoints the same step, got {by_rank}; nothing was saved")


def _inner(value: Any) -> Any:
    """The module inside a DDP wrapper or a ``torch.compile``-d module (its state dict without their prefixes)."""
    while True:
        kind = type(value).__name__
        if kind == "DistributedDataParallel" and hasattr(value, "module"):
            value = value.module
        elif kind == "OptimizedModule" and hasattr(value, "_orig_mod"):
            value = value._orig_mod
        else:
            return value


def _is_fsdp(value: Any) -> bool:
    """An FSDP1 wrapper or a module ``fully_shard`` has sharded (FSDP2)."""
    return any(cls.__name__ in ("FullyShardedDataParallel", "FSDPModule") for cls in type(value).__mro__)


def _full_options() -> Any:
    # lazy: torch.distributed.checkpoint, only for FSDP models
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _kind(value: Any, state: Mapping[str, Any]) -> tuple[str, Any]:
    """How ``value`` is saved and loaded, and the FSDP model it goes through (None: none): ``fsdp model`` and
    ``fsdp optimizer`` by their full state dicts (collectives: every rank gathers and loads them together),
    ``state_dict`` (models, optimizers, schedulers: the module inside a DDP or ``torch.compile`` wrapper), or
    ``value``, pickled."""
    inner = _inner(value)
    if _is_fsdp(inner):
        return "fsdp model", inner
    model = _fsdp_model_of(inner, state)
    if model is not None:
        return "fsdp optimizer", model
    if callable(getattr(inner, "state_dict", None)) and callable(getattr(inner, "load_state_dict", None)):
        return "state_dict", None
    return "value", None


def _state_of(value: Any, kind: str, model: Any) -> Any:
    """What is saved of ``value`` of ``kind`` (``_kind``): an FSDP model's or optimizer's full state dict (rank 0
    gets it), a state dict, or the value itself."""
    if kind == "fsdp model":
        # lazy: torch.distributed.checkpoint, only for FSDP models
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_full_options())
    if kind == "fsdp optimizer":
        # lazy: torch.distributed.checkpoint, only for FSDP models
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, _inner(value), options=_full_options())
    return _inner(value).state_dict() if kind == "state_dict" else value


def _fsdp_model_of(optimizer: Any, state: Mapping[str, Any]) -> Any:
    """The FSDP model among ``state``'s values whose parameters ``optimizer`` steps, if it steps one (its state
    is sharded like the model's, and saved and loaded through the model)."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not groups or not groups[0].get("params"):
        return None
    first = id(groups[0]["params"][0])
    for value in state.values():
        model = _inner(value)
        if _is_fsdp(model) and any(id(p) == first for p in model.parameters()):
            return model
    return None


def _entry_at(seal: Path, run_dir: Path) -> Checkpoint:
    """The checkpoint rank 0 chose, read and checked again by this rank (its seal and its file)."""
    for entry in checkpoint_files.sealed(run_dir):
        if entry.seal == seal:
            return entry
    raise CheckpointError(f"checkpoint {seal} is gone or no longer sealed; it was removed while being restored")


def _newest_sound(run_dir: Path, state: Mapping[str, Any]) -> tuple[Checkpoint | None, Mapping[str, Any], str | None]:
    """The newest checkpoint whose file matches its seal, read (a damaged newer one is skipped with a warning),
    and why it does not fit ``state`` (None: it does); ``(None, {}, None)`` when there is none."""
    for entry in checkpoint_files.sealed(run_dir):
        try:
            return entry, _read(entry, state), None
        except checkpoint_files.CheckpointDamaged as err:
            _log.warning("gpumagic: %s; the checkpoint before it is used", err)
        except CheckpointError as err:
            return entry, {}, str(err)
        except Exception as err:  # noqa: BLE001 - told to every rank, as a misfit is
            _log.debug("the checkpoint could not be read", exc_info=True)
            return entry, {}, f"checkpoint {entry.path.name} could not be read: {type(err).__name__}: {err}"
    return None, {}, None


def _read(entry: Checkpoint, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The state ``entry`` holds, read from the file ``open_verified`` checked (the same open file: nothing swapped in
    between); CheckpointError if it is not gpumagic's or lacks a name of ``state``."""
    # lazy: torch is imported by the rank's code before it restores anything
    import torch

    with checkpoint_files.open_verified(entry) as file:
        same_file = f"/proc/self/fd/{file.fileno()}"  # the inode checked, by path: torch's faster reader
        document = torch.load(same_file if os.path.exists(same_file) else file, map_location="cpu", weights_only=False)
    saved = document.get("state") if isinstance(document, dict) else None
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {entry.path.name} is not one gpumagic.checkpoint wrote")
    missing = [name for name in state if name not in saved]
    if missing:
        held = ", ".join(saved) or "nothing"
        absent = ", ".join(map(repr, missing))
        raise CheckpointError(f"checkpoint {entry.path.name} (step {entry.step}) has no {absent}; it holds {held}")
    return saved


def _load_all(saved: Mapping[str, Any], state: Mapping[str, Any], file: str) -> str | None:
    """Load ``saved`` into ``state``; the first reason it does not fit, or None. An FSDP model and its optimizer
    are loaded through ``set_*_state_dict``: collectives, made in the same order on every rank, each rank giving
    the full state dict it read."""
    problem = None
    for name, value in state.items():
        target = _inner(value)
        kind, model = _kind(value, state)
        if model is not None:
            # lazy: torch.distributed.checkpoint, only for FSDP models
            from torch.distributed.checkpoint import state_dict as dcp

            try:
                if kind == "fsdp model":
                    dcp.set_model_state_dict(model, saved[name], options=_full_options())
                else:
                    dcp.set_optimizer_state_dict(model, target, saved[name], options=_full_options())
            except (RuntimeError, ValueError, KeyError) as err:
                problem = problem or _misfit(file, name, err)
            continue
        if problem is not None:
            continue
        try:
            _load_one(target, saved[name])
        except (RuntimeError, ValueError, KeyError, TypeError) as err:
            problem = _misfit(file, name, err)
    return problem


def _load_one(target: Any, value: Any) -> None:
    if callable(getattr(target, "load_state_dict", None)):
        target.load_state_dict(value)
    elif isinstance(target, dict) and isinstance(value, Mapping):
        target.clear()
        target.update(value)
    elif isinstance(target, list) and isinstance(value, list):
        target[:] = value
    elif isinstance(target, set) and isinstance(value, (set, frozenset)):
        target.clear()
        target.update(value)
    else:
        raise TypeError(
            f"restore loads in place, and this {type(target).__name__} cannot be changed in place; keep such values "
            "in a dict: gpumagic.checkpoint(step, extra={'epoch': epoch}), then gpumagic.restore(extra=extra)"
        )


def _misfit(file: str, name: str, err: BaseException) -> str:
    """One line: the file, the name, and what differs (load_state_dict's report is several lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    lines = lines[1:] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines
    detail = "; ".join(line.rstrip(".") for line in lines)
    return f"checkpoint {file} does not fit {name!r}: {detail or type(err).__name__}"

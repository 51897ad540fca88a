"""Are the replicas of a persistent group alike, and making them alike again.

After an interrupt, a failure or ``%ddp check``, every rank describes the state that data-parallel training
keeps the same on every rank: its DistributedDataParallel models, their optimizers and learning-rate
schedulers, what ``gpumagic.keep`` registered, and the plain numbers (``steps``, ``epoch``) that were equal on
every rank when the cell started. Each is a fingerprint: float64 sums of every tensor (computed where the
tensor lives), the numbers themselves. The kernel compares them and names what differs and where;
``%ddp sync`` (``RankGroup.sync``) then copies those names from one rank to the others over the process group.

``describe``, ``plan_kinds`` and ``sync_from`` run on the ranks; ``compare`` and ``Divergence`` in the kernel.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumagic.launch.shipping import dumps

_log = logging.getLogger(__name__)

COUNTERS = (int,)  # the plain numbers compared: step and epoch counters (a float like a running loss is per rank)


# --- the ranks' side ----------------------------------------------------------------------------------------


def scalars_of(namespace: Mapping[str, Any], skip: Iterable[str]) -> dict[str, Any]:
    """The whole numbers among the user's public names (taken at a cell's start, to compare with its end)."""
    left_out = set(skip)
    return {
        n: v
        for n, v in namespace.items()
        if type(v) in COUNTERS and n not in left_out and not n.startswith("_")  # not private names, nor _ of a loop
    }


def kind_of(value: Any) -> str:
    """How a value is compared and synced: ``ddp``, ``module``, ``optimizer``, ``scheduler``, ``tensor``,
    ``value``."""
    # lazy: torch takes seconds to import; only rank processes need it
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(value, DistributedDataParallel):
        return "ddp"
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        return "scheduler"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "value"


def replicated(namespace: Mapping[str, Any], kept: Iterable[str]) -> dict[str, str]:
    """The names training keeps alike on every rank, with their kinds: DistributedDataParallel models, the
    optimizers of their parameters and those optimizers' schedulers, and the kept names."""
    found: dict[str, str] = {}
    kinds = {n: kind_of(v) for n, v in namespace.items() if not n.startswith("_")}
    ddp_parameters = {
        id(p) for n, k in kinds.items() if k == "ddp" for p in namespace[n].parameters()
    }  # the same tensors as the module's
    optimizers = set()
    for name, kind in kinds.items():
        value = namespace[name]
        if kind == "ddp":
            found[name] = kind
        elif kind == "optimizer" and any(id(p) in ddp_parameters for g in value.param_groups for p in g["params"]):
            found[name] = kind
            optimizers.add(id(value))
    for name, kind in kinds.items():
        if kind == "scheduler" and id(getattr(namespace[name], "optimizer", None)) in optimizers:
            found[name] = kind
    for name in kept:
        if name in namespace and name not in found:
            found[name] = kinds.get(name) or kind_of(namespace[name])
    return found


def describe(namespace: Mapping[str, Any], kept: Iterable[str], before: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's fingerprints: ``state`` (name -> digest of the replicated state), ``shapes`` (tensors'
    shapes, to sync them in place), ``scalars`` (name -> (at the cell's start, now))."""
    state = {}
    for name, kind in replicated(namespace, kept).items():
        try:
            state[name] = _digest(_fingerprint(namespace[name], kind))
        except Exception as err:  # noqa: BLE001 - a value that cannot be described is told, not fatal
            _log.debug("the value %s cannot be fingerprinted; told as not comparable", name, exc_info=True)
            state[name] = f"cannot be compared: {type(err).__name__}"
    now = scalars_of(namespace, ())
    scalars = {n: (before.get(n), now.get(n)) for n in set(before) | set(now)}
    return {"state": state, "scalars": scalars}


def plan_kinds(namespace: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """How this rank would take each of ``names`` in a sync: its kind, and a tensor's shape and dtype (a
    tensor synced in place must be alike on every rank); ``None`` where the rank lacks the name."""
    plan: dict[str, Any] = {}
    for name in names:
        if name not in namespace:
            plan[name] = None
            continue
        value = namespace[name]
        kind = kind_of(value)
        plan[name] = (kind, tuple(value.shape), str(value.dtype)) if kind == "tensor" else (kind,)
    return plan


def sync_from(namespace: dict[str, Any], source: int, plan: list[tuple[str, str]]) -> list[str]:
    """Make ``plan``'s names (name, kind) on this rank equal to rank ``source``'s, over the process group: a
    collective every rank makes with the same plan. Models and tensors are copied in place (whatever refers to
    them sees the copy); optimizers and schedulers load the source's state; other values are replaced."""
    # lazy: torch takes seconds to import; only rank processes need it
    import torch.distributed as dist

    me = dist.get_rank()
    for name, kind in plan:
        value = namespace.get(name)
        if kind in ("ddp", "module"):
            module = value.module if kind == "ddp" else value
            for tensor in (*module.parameters(), *module.buffers()):
                dist.broadcast(tensor.data, src=source)
        elif kind == "tensor":
            dist.broadcast(value.data, src=source)
        elif kind in ("optimizer", "scheduler"):
            carried = [value.state_dict() if me == source else None]
            dist.broadcast_object_list(carried, src=source)
            if me != source:
                value.load_state_dict(carried[0])
        else:
            carried = [value if me == source else None]
            dist.broadcast_object_list(carried, src=source)
            namespace[name] = carried[0]
    return [name for name, _ in plan]


def _fingerprint(value: Any, kind: str) -> Any:
    """A comparable description of ``value``: every tensor as its shape, dtype and float64 sums."""
    if kind in ("ddp", "module"):
        module = value.module if kind == "ddp" else value
        named = [*module.named_parameters(), *module.named_buffers()]
        return [(name, *_tensors([t])) for name, t in named]
    if kind in ("optimizer", "scheduler"):
        return _nested(value.state_dict())
    if kind == "tensor":
        return _tensors([value])
    return _nested(value)


def _nested(value: Any) -> Any:
    # lazy: torch takes seconds to import; only rank processes need it
    import torch

    if isinstance(value, torch.Tensor):
        return _tensors([value])
    if isinstance(value, Mapping):
        return sorted((repr(k), _nested(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_nested(v) for v in value]
    if isinstance(value, (int, float, bool, str, bytes, type(None))):
        return value

    return hashlib.blake2b(dumps(value), digest_size=16).hexdigest()


def _tensors(tensors: list[Any]) -> list[Any]:
    """Shape, dtype and the float64 sum and sum of magnitudes of each tensor, computed where it lives, read
    together (one copy from a GPU)."""
    # lazy: torch takes seconds to import; only rank processes need it
    import torch

    sums = []
    for tensor in tensors:
        t = tensor.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        total = t.sum(dtype=torch.float64)
        size = t.abs().sum(dtype=torch.float64) if t.dtype != torch.bool else total
        sums.append(torch.stack([total, size]))
    read = torch.stack(sums).cpu().tolist() if sums else []
    return [(tuple(t.shape), str(t.dtype), *pair) for t, pair in zip(tensors, read, strict=True)]


def _digest(description: Any) -> str:
    return hashlib.blake2b(repr(description).encode(), digest_size=12).hexdigest()


# --- the kernel's side --------------------------------------------------------------------------------------


@dataclass
class Divergence:
    """What differs between the ranks: ``state`` (name -> the ranks whose state differs from the lowest rank's),
    ``missing`` (name -> the ranks that lack it), ``scalars`` (name -> each rank's value), ``uncomparable``
    (name -> why), and ``checked``: the names found alike."""

    state: dict[str, list[int]] = field(default_factory=dict)
    missing: dict[str, list[int]] = field(default_factory=dict)
    scalars: dict[str, dict[int, Any]] = field(default_factory=dict)
    uncomparable: dict[str, str] = field(default_factory=dict)
    checked: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return sorted({*self.state, *self.missing, *self.scalars})

    def __bool__(self) -> bool:
        return bool(self.state or self.missing or self.scalars)

    def describe(self) -> str:
        """One line: what differs where (empty when nothing does)."""
        parts = []
        for name in self.names:
            if name in self.missing:
                parts.append(f"{name} (missing on {_ranks(self.missing[name])})")
            elif name in self.state:
                many = len(self.state[name]) > 1
                parts.append(f"{name} ({_ranks(self.state[name])} differ{'' if many else 's'})")
            else:
                told = ", ".join(f"rank {r}: {v!r}" for r, v in sorted(self.scalars[name].items()))
                parts.append(f"{name} ({told})")
        return "; ".join(parts)


def compare(descriptions: Mapping[int, Mapping[str, Any]]) -> Divergence:
    """Compare the ranks' ``describe`` answers: state that differs from the lowest rank's or that some ranks
    lack, whole numbers that were equal on every rank at the cell's start and differ now."""
    found = Divergence()
    ranks = sorted(descriptions)
    names = sorted(set().union(*(d["state"] for d in descriptions.values()))) if ranks else []
    for name in names:
        digests = {r: descriptions[r]["state"].get(name) for r in ranks}
        lacking = [r for r, d in digests.items() if d is None]
        why = next((d for d in digests.values() if d is not None and d.startswith("cannot be compared")), None)
        if lacking:
            found.missing[name] = lacking
        elif why is not None:
            found.uncomparable[name] = why
        elif len(set(digests.values())) > 1:
            found.state[name] = [r for r in ranks[1:] if digests[r] != digests[ranks[0]]]
        else:
            found.checked.append(name)
    scalar_names = sorted(set().union(*(d["scalars"] for d in descriptions.values()))) if ranks else []
    for name in scalar_names:
        values = {r: descriptions[r]["scalars"].get(name, (None, None)) for r in ranks}
        before = [v[0] for v in values.values()]
        if None in before or len({repr(b) for b in before}) > 1:
            continue  # not alike when the cell started: a rank's own number
        now = {r: v[1] for r, v in values.items()}
        if len({repr(v) for v in now.values()}) > 1:
            found.scalars[name] = now
        else:
            found.checked.append(name)
    return found


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def sync_plan(names: Iterable[str], kinds: Mapping[int, Mapping[str, Any]], source: int) -> list[tuple[str, str]]:
    """The plan every rank follows in ``sync_from``: each name with how it travels. In place where every rank
    holds it alike (a model, an optimizer, a tensor of one shape); other values are replaced by the source's.

    Raises:
        KeyError: the source rank lacks a name (named in the message).
        ValueError: a rank lacks a model, optimizer or scheduler, or holds another kind of thing under its
            name: a copy would not be wired to that rank's own model (the message says what to do).
    """
    plan = []
    for name in names:
        own = kinds[source].get(name)
        if own is None:
            raise KeyError(name)
        unlike = sorted(r for r in kinds if kinds[r].get(name) != own)
        if (
            unlike
            and own[0] in ("ddp", "module", "optimizer", "scheduler")
            and any(kinds[r].get(name) is None or kinds[r][name][0] != own[0] for r in unlike)
        ):
            held = kinds[unlike[0]].get(name)
            raise ValueError(
                f"rank {unlike[0]} {'lacks ' + name if held is None else f'holds a {held[0]} as {name}'}, rank "
                f"{source} a {own[0]}: make it there in a cell (its own copy, on its device), then sync"
            )
        plan.append((name, own[0] if not unlike or own[0] != "tensor" else "value"))
    return plan

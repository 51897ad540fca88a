"""What a persistent group's cells send each rank (``group.RankGroup``): the notebook's names a rank lacks or
that changed since they were sent (known by a digest of their pickle, computed again only when a value's cheap
change key, ``value_keys``, changed), never the names the ranks made themselves; and the notebook's names a rank
that replaces a dead one is sent again."""

from __future__ import annotations

import hashlib
import types
from collections.abc import Collection, Mapping
from typing import Any

from gpumagic.launch.kernel_side.group_members import Member
from gpumagic.launch.messages import CellResult, Done, ToKernel
from gpumagic.launch.shared_values import SharedBatch
from gpumagic.launch.shipping import CellPayload, ShippingError, dumps, pack
from gpumagic.launch.value_keys import change_key, has_cheap_key


class NameShipper:
    """The notebook's names as the last cell saw them, and what each of their values' digests was."""

    def __init__(self) -> None:
        self.namespace: Mapping[str, Any] = {}  # the notebook's names, as the last cell saw them
        self.hidden: set[str] = set()
        self._fingerprints: dict[str, tuple[Any, list[Any], str]] = {}  # name -> (change key, its objects, digest)

    def pack_for(
        self,
        payload: CellPayload,
        targets: list[Member],
        namespace: Mapping[str, Any],
        hidden: Collection[str],
        shared: SharedBatch | None = None,
    ) -> tuple[dict[int, bytes], dict[str, str]]:
        """Each rank's packed cell: only the kernel's names it lacks or that changed since sent, and the digests
        of the names sent. Names sent before are checked too, used by the cell or not: a function the ranks
        defined may read them (``lr``). Each target's ``sending`` says what it is sent. ``shared``: big tensors
        and arrays travel through its memory (release it once the ranks replied)."""
        self.namespace, self.hidden = namespace, set(hidden)  # what a replaced rank is sent again
        for name in [n for n in self._fingerprints if n not in namespace]:  # deleted: hold none of it
            del self._fingerprints[name]
        for member in targets:
            for name in member.shipped:
                if name in namespace and name not in member.own and name not in hidden and name not in payload.names:
                    value = namespace[name]
                    if not isinstance(value, types.ModuleType):
                        payload.names[name] = value
        wanted = [name for name in payload.names if any(name not in m.own for m in targets)]  # not held by all
        digests = {name: self.digest(name, payload.names[name], shared) for name in wanted}
        packed: dict[int, bytes] = {}
        by_names: dict[frozenset[str], bytes] = {}
        for member in targets:
            send = frozenset(
                name
                for name in wanted
                if name not in member.own and not (member.shipped.get(name) == digests[name] and name in member.present)
            )
            if send not in by_names:
                part = CellPayload(
                    payload.source,
                    payload.filename,
                    {n: payload.names[n] for n in sorted(send)},
                    payload.modules,
                    payload.sources,
                )
                by_names[send] = pack(part, shared)
            packed[member.rank] = by_names[send]
            member.sending = send
        return packed, digests

    def received(self, targets: list[Member], replies: dict[int, ToKernel], digests: dict[str, str]) -> None:
        """After a cell: what each rank that finished it holds now (its own names, every name present) and
        the digests of what it was sent."""
        for member in targets:
            reply = replies.get(member.rank)
            if isinstance(reply, Done) and isinstance(reply.value, CellResult):
                member.own, member.present = set(reply.value.own), set(reply.value.present)
                for name in member.sending:
                    if name in digests:  # a function's call sends no names
                        member.shipped[name] = digests[name]
            member.sending = frozenset()

    def digest(self, name: str, value: Any, shared: SharedBatch | None = None) -> str:
        """``_digest``, pickled again only when the value's change key (``value_keys``) is not the one it had: a
        notebook class or function a cell uses costs microseconds a cell, not a pickle."""
        if not has_cheap_key(value):
            return _digest(name, value, shared)
        try:
            key, held = change_key(value, lambda part: _digest(name, part, shared))
        except ShippingError:  # a part cannot travel alone (the value's own pickle may manage): no cheap key
            return _digest(name, value, shared)
        known = self._fingerprints.get(name)
        if known is not None and known[0] == key:
            return known[2]
        digest = _digest(name, value, shared)
        self._fingerprints[name] = (key, held, digest)
        return digest

    def notebook_names(self, names: Collection[str], shared: SharedBatch | None = None) -> tuple[bytes, dict[str, str]]:
        """The notebook's current values of ``names`` (those it still has and that can travel), pickled
        together (big tensors and arrays through ``shared``), and their digests."""
        values = {}
        for name in sorted(names):
            value = self.namespace.get(name)
            if name in self.namespace and not isinstance(value, types.ModuleType) and name not in self.hidden:
                values[name] = value
        digests = {}
        for name, value in list(values.items()):
            try:
                digests[name] = self.digest(name, value, shared)
            except ShippingError:
                del values[name]  # it cannot travel any more: lost, and said so
        return dumps(values, shared), digests


def _digest(name: str, value: Any, shared: SharedBatch | None = None) -> str:
    """A digest of the value as it would travel: equal digests, the ranks have it already. Through ``shared`` a
    big tensor or array is its shared file (written once per change), not its bytes."""
    try:
        data = dumps(value, shared)
    except Exception:  # noqa: BLE001 - pack() names the culprit
        pack(CellPayload("", "", {name: value}), shared)  # big parts through ``shared`` again, not by value
        raise ShippingError(f"cannot send {name!r} to the ranks") from None
    return hashlib.blake2b(data, digest_size=16).hexdigest()

"""Device specs: the ways users name GPUs today, parsed and resolved against an inventory.

Accepted: ``0,2`` · ``GPU:1`` (also ``/gpu:1``, ``/device:GPU:1``) · ``['GPU:0', 'GPU:1']`` · ``GPU:*`` /
``all`` · a regular expression over names (``A100``, ``RTX.*4090``) · a UUID or a prefix of one
(``GPU-5e0f``) · ``none`` / ``cpu``.
"""

from __future__ import annotations

import ast
import re
import warnings
from dataclasses import dataclass
from typing import Any

try:
    import re._parser as regex_parser  # Python 3.11+
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as regex_parser  # type: ignore[no-redef]

from gpumagic.devices.model import GpuInfo, Inventory
from gpumagic.errors import InvalidArgument

ACCEPTED_FORMS = (
    "accepted: 0,2 | GPU:1 | ['GPU:0','GPU:1'] | GPU:* or all | a name pattern such as A100 | "
    "a UUID or its prefix such as GPU-5e0f | none or cpu"
)
_MAX_LENGTH = 2000
_INDEX_RE = re.compile(r"^(?:/?(?:device:)?gpu:)?(\d{1,4})$", re.IGNORECASE)
_ALL_RE = re.compile(r"^(?:\*|all|(?:/?(?:device:)?gpu:)\*)$", re.IGNORECASE)
_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9a-f][0-9a-f-]{3,}$", re.IGNORECASE)


class SpecError(InvalidArgument):
    """A device spec that is malformed or names no GPU here. The message lists the accepted forms."""


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed spec: ``none`` (CPU only), ``all``, or selectors (``index``/``uuid``/``pattern``, value)."""

    text: str
    none: bool = False
    all: bool = False
    selectors: tuple[tuple[str, str | int], ...] = ()


def parse_spec(text: object) -> DeviceSpec:
    """Parse what a user typed to name GPUs.

    >>> parse_spec("0,2").selectors
    (('index', 0), ('index', 2))
    >>> parse_spec("GPU:*").all
    True

    Raises:
        SpecError: the text is not a spec; the message shows the accepted forms.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    elif isinstance(text, (list, tuple)):
        return _from_items(str(list(text)), list(text))
    if not isinstance(text, str):
        raise SpecError(f"a device spec is text, not {type(text).__name__}; {ACCEPTED_FORMS}")
    raw = text.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        raw = raw[1:-1].strip()
    if not raw:
        raise SpecError(f"empty device spec; {ACCEPTED_FORMS}")
    if len(raw) > _MAX_LENGTH:
        raise SpecError(f"device spec longer than {_MAX_LENGTH} characters; {ACCEPTED_FORMS}")
    if raw.lower() in ("none", "cpu", "[]", "()"):
        return DeviceSpec(raw, none=True)
    if raw[0] in "[(":
        try:
            items = ast.literal_eval(raw)
        except Exception:  # noqa: BLE001 - any literal_eval failure means "not a list literal"
            raise SpecError(f"{raw!r} is not a valid list; {ACCEPTED_FORMS}") from None
        if not isinstance(items, (list, tuple)):
            raise SpecError(f"{raw!r} is not a list of GPUs; {ACCEPTED_FORMS}")
        return _from_items(raw, list(items))
    tokens = [t for t in re.split(r"[,\s]+", raw) if t]
    selectors = [_token(t) for t in tokens]
    if all(s is not None for s in selectors):
        return _combine(raw, selectors)  # type: ignore[arg-type]
    return DeviceSpec(raw, selectors=(("pattern", _pattern(raw)),))


def _from_items(raw: str, items: list[object]) -> DeviceSpec:
    if not items:
        return DeviceSpec(raw, none=True)
    selectors = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise SpecError(f"{item!r} in {raw!r} is not a GPU; {ACCEPTED_FORMS}")
        selector = _token(str(item).strip())
        if selector is None:
            raise SpecError(f"{item!r} in {raw!r} is not a GPU index, GPU:N or UUID; {ACCEPTED_FORMS}")
        selectors.append(selector)
    return _combine(raw, selectors)


def _combine(raw: str, selectors: list[tuple[str, str | int]]) -> DeviceSpec:
    if any(kind == "all" for kind, _ in selectors):
        return DeviceSpec(raw, all=True)
    unique = tuple(dict.fromkeys(selectors))
    return DeviceSpec(raw, selectors=unique)


def _token(token: str) -> tuple[str, str | int] | None:
    if _ALL_RE.match(token):
        return ("all", "*")
    match = _INDEX_RE.match(token)
    if match:
        return ("index", int(match.group(1)))
    if _UUID_RE.match(token):
        return ("uuid", token)
    return None


def _pattern(raw: str) -> str:
    try:
        pattern = _compile(raw)
    except (re.error, RecursionError, OverflowError) as err:
        raise SpecError(f"{raw!r} is neither a GPU list nor a valid name pattern ({err}); {ACCEPTED_FORMS}") from None
    too_slow = _backtracking_risk(raw)
    if too_slow:
        raise SpecError(f"{raw!r} {too_slow}, which can take minutes to match; write a simpler pattern (like A100)")
    if pattern.search(""):  # "| cat /etc/passwd" or "x?" would name every GPU by accident
        raise SpecError(
            f"{raw!r} matches an empty name, so it would name every GPU; write GPU:* or all for every GPU; "
            f"{ACCEPTED_FORMS}"
        )
    return raw


MAX_OPEN_REPEATS = 4  # x*, x+, x{2,} in a name pattern; with names of ~40 characters more can take minutes


def _backtracking_risk(raw: str) -> str | None:
    """Why matching ``raw`` could take exponential time (Python's regex engine cannot be interrupted), or None:
    a repeat inside a repeat (``(a+)+``), alternatives inside a repeat (``(.|\\w)*``), or more than
    ``MAX_OPEN_REPEATS`` open-ended repeats (``.*.*.*.*.*x``)."""
    try:
        tree = regex_parser.parse(raw, re.IGNORECASE)
    except (re.error, RecursionError, OverflowError):
        return None
    repeats = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}
    count = 0

    def walk(items: Any, inside_repeat: bool) -> str | None:
        nonlocal count
        for op, argument in items:
            name = str(op)
            if name in repeats:
                _, high, body = argument
                if high > 1:
                    if inside_repeat:
                        return "repeats a repeat"
                    if high > 1000:
                        count += 1
                found = walk(body, inside_repeat or high > 1)
            elif name == "SUBPATTERN":
                found = walk(argument[-1], inside_repeat)
            elif name == "BRANCH":
                if inside_repeat:  # (.|\w)* matches one text in exponentially many ways
                    return "repeats a choice of alternatives"
                found = next((w for w in (walk(b, inside_repeat) for b in argument[1]) if w), None)
            else:
                found = None
            if found:
                return found
        return None

    why = walk(tree, False)
    if why is None and count > MAX_OPEN_REPEATS:
        why = f"has {count} open-ended repeats (*, +, {{n,}}), more than {MAX_OPEN_REPEATS}"
    return why


def _compile(pattern: str) -> re.Pattern[str]:
    with warnings.catch_warnings():  # FutureWarnings about odd patterns would only confuse here
        warnings.simplefilter("ignore")
        return re.compile(pattern, re.IGNORECASE)


def resolve(spec: DeviceSpec, inventory: Inventory) -> tuple[GpuInfo, ...]:
    """The GPUs ``spec`` names, in NVML index order.

    Raises:
        SpecError: a selector names no GPU here, or a UUID prefix is ambiguous.
    """
    if spec.none:
        return ()
    if spec.all:
        return tuple(inventory.gpus)
    chosen: dict[int, GpuInfo] = {}
    for kind, value in spec.selectors:
        for gpu in _match(kind, value, inventory):
            chosen[gpu.nvml_index] = gpu
    return tuple(chosen[i] for i in sorted(chosen))


def _match(kind: str, value: str | int, inventory: Inventory) -> list[GpuInfo]:
    if kind == "index":
        found = [g for g in inventory.gpus if g.nvml_index == value]
        if not found:
            raise SpecError(f"there is no GPU {value}: this machine has {inventory.describe_indices()}")
        return found
    if kind == "uuid":
        prefix = str(value).lower()
        if prefix.startswith("mig-"):
            raise SpecError(
                f"{value} is a MIG instance; gpumagic chooses whole GPUs for now. "
                "Set CUDA_VISIBLE_DEVICES to the MIG UUID yourself, before CUDA starts."
            )
        found = [g for g in inventory.gpus if g.uuid.lower().startswith(prefix)]
        if not found:
            raise SpecError(f"no GPU has a UUID starting with {value}; see the UUIDs with gpumagic.gpus()")
        if len(found) > 1:
            indices = ", ".join(str(g.nvml_index) for g in found)
            raise SpecError(f"{value} is the start of several GPUs' UUIDs (GPUs {indices}); give more of it")
        return found
    pattern = _compile(str(value))
    found = [g for g in inventory.gpus if pattern.search(g.name)]
    if not found:
        names = sorted({g.name for g in inventory.gpus}) or ["none"]
        raise SpecError(f"{value!r} matches no GPU name (names here: {', '.join(names)}); {ACCEPTED_FORMS}")
    return found

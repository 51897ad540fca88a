"""Which experiment trackers a run's metrics also go to (``gpumagic.track``): TensorBoard, MLflow, Weights & Biases.

Choosing a tracker imports nothing of it: the exporter (``telemetry.exporting``) imports the tracker's package in
its own thread, when a run that is tracked starts. The choice is this process's; ``GPUMAGIC_TRACK`` carries one
to processes started elsewhere (a script, a job runner started by hand), and a background job carries the choice
made when it was submitted, sealed with the rest of its description.

What a run was exported as is kept in its ``run.json`` (``tracking``: per tracker, its run id or directory, or
the problem that stopped it), which ``%jobs``, the dashboards and ``compare`` show.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from gpumagic.errors import InvalidArgument

TRACK_VARIABLE = "GPUMAGIC_TRACK"
KINDS = ("tensorboard", "mlflow", "wandb")
OPTIONS = {  # the options each tracker takes (all optional)
    "tensorboard": ("logdir",),
    "mlflow": ("tracking_uri", "experiment"),
    "wandb": ("project", "entity", "mode", "dir"),
}
OPTION_HELP = {  # each option's placeholder and help, for %jobs track's flags
    "logdir": ("DIR", "tensorboard: a subdirectory per run in DIR (./runs)"),
    "tracking_uri": ("URI", "mlflow: http(s)://host:port, or a path for a file store (MLFLOW_TRACKING_URI, ./mlruns)"),
    "experiment": ("NAME", "mlflow: the experiment (gpumagic)"),
    "project": ("NAME", "wandb: the project (gpumagic)"),
    "entity": ("NAME", "wandb: the team or user"),
    "mode": ("MODE", "wandb: online, offline or disabled (WANDB_MODE, online)"),
    "dir": ("DIR", "wandb: where its files go (WANDB_DIR, the working directory)"),
}
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # what each imports
WANDB_MODES = ("online", "offline", "disabled")
MLFLOW_NAMED_URIS = ("databricks", "databricks-uc")  # URIs of MLflow's without a scheme: not paths
DEFAULT_EXPERIMENT = "gpumagic"
DEFAULT_PROJECT = "gpumagic"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tracker:
    """One tracker a run's metrics go to, with its options made whole (absolute paths, defaults filled in).

    >>> Tracker.of("mlflow", tracking_uri="http://mlflow:5000").where
    'mlflow at http://mlflow:5000 (experiment gpumagic)'
    """

    kind: str
    logdir: str | None = None  # tensorboard: one subdirectory per run
    tracking_uri: str | None = None  # mlflow: http(s)://host:port, or file:///path (a bare path means file:)
    experiment: str | None = None  # mlflow
    project: str | None = None  # wandb
    entity: str | None = None  # wandb
    mode: str | None = None  # wandb: online, offline or disabled (None: wandb's own, WANDB_MODE or online)
    dir: str | None = None  # wandb: where its files go (None: wandb's own, WANDB_DIR or the working directory)

    @classmethod
    def of(cls, kind: str, **options: Any) -> Tracker:
        """Check ``kind`` and its ``options`` (``None``: the default) and fill in the defaults.

        Raises:
            InvalidArgument: an unknown tracker or option, a value of the wrong kind.
        """
        if kind not in KINDS:
            raise InvalidArgument(f"gpumagic.track takes one of {', '.join(KINDS)} (or None to stop), got {kind!r}")
        given = {name: value for name, value in options.items() if value is not None}
        wrong = sorted(set(given) - set(OPTIONS[kind]))
        if wrong:
            raise InvalidArgument(
                f"track({kind!r}) takes {', '.join(OPTIONS[kind])}, not {', '.join(wrong)} ({_owner(wrong[0])})"
            )
        for name, value in given.items():
            if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
                raise InvalidArgument(f"track({kind!r}, {name}=...) needs a non-empty string, got {value!r}")
        values = {name: os.fspath(value) for name, value in given.items()}
        if kind == "tensorboard":
            values["logdir"] = _absolute(values.get("logdir") or "runs")  # torch's SummaryWriter's default
        elif kind == "mlflow":
            uri = values.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or "mlruns"
            named = uri in MLFLOW_NAMED_URIS or (_SCHEME.match(uri) and not os.path.isabs(uri))
            values["tracking_uri"] = uri if named else _file_uri(uri)
            values.setdefault("experiment", DEFAULT_EXPERIMENT)
        else:
            if values.get("mode") not in (None, *WANDB_MODES):
                raise InvalidArgument(
                    f"track('wandb', mode=...) is one of {', '.join(WANDB_MODES)}, got {values['mode']!r}"
                )
            values.setdefault("project", DEFAULT_PROJECT)
            if "dir" in values:
                values["dir"] = _absolute(values["dir"])
        return cls(kind, **values)

    @property
    def where(self) -> str:
        """Where its runs go, in a few words."""
        if self.kind == "tensorboard":
            return f"tensorboard at {self.logdir}"
        if self.kind == "mlflow":
            return f"mlflow at {self.tracking_uri} (experiment {self.experiment})"
        mode = f", {self.mode}" if self.mode else ""
        entity = f"{self.entity}/" if self.entity else ""
        return f"wandb project {entity}{self.project}{mode}"

    def __repr__(self) -> str:
        """``Tracker('mlflow', tracking_uri='http://mlflow:5000', experiment='gpumagic')``: its options alone."""
        options = "".join(f", {name}={value!r}" for name, value in self.to_json().items() if name != "kind")
        return f"Tracker({self.kind!r}{options})"

    def to_json(self) -> dict[str, str]:
        return {name: value for name, value in asdict(self).items() if value is not None}

    @classmethod
    def from_json(cls, data: Any) -> Tracker:
        """A tracker as ``to_json`` wrote it, or a kind's name alone (its defaults).

        Raises:
            InvalidArgument: not a tracker.
        """
        if isinstance(data, str):
            return cls.of(data.strip())
        if not isinstance(data, Mapping) or not isinstance(data.get("kind"), str):
            raise InvalidArgument(f"a tracker is a kind's name or {{'kind': ..., options}}, got {data!r:.80}")
        return cls.of(data["kind"], **{k: v for k, v in data.items() if k != "kind"})


def _owner(option: str) -> str:
    owners = [kind for kind, names in OPTIONS.items() if option in names]
    return f"{option} is {owners[0]}'s" if owners else f"{option} is no tracker's option"


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _file_uri(path: str) -> str:
    return "file://" + _absolute(path.removeprefix("file://"))


_chosen: tuple[Tracker, ...] | None = None  # None: nothing chosen in this process, GPUMAGIC_TRACK decides


def track(
    kind: str | None,
    /,
    *,
    logdir: str | None = None,
    tracking_uri: str | None = None,
    experiment: str | None = None,
    project: str | None = None,
    entity: str | None = None,
    mode: str | None = None,
    dir: str | None = None,
    stop: bool = False,
) -> tuple[Tracker, ...]:
    """Send the metrics of every launch, background job and ``%ddp`` group started from now on to a tracker too:
    each is one run there, with each rank's series of each metric (``loss/rank0``, ``loss/rank1``), and the
    launch's options and a sweep's values as its parameters. Returns the trackers now chosen.

    - ``track("tensorboard", logdir="runs")``: a subdirectory of ``logdir`` per run.
    - ``track("mlflow", tracking_uri="http://host:5000", experiment="gpumagic")``: a bare path is a file store.
    - ``track("wandb", project="gpumagic", entity=None, mode="offline", dir=None)``.

    Choosing a tracker again replaces its options; ``track("wandb", stop=True)`` stops that one, ``track(None)``
    every one. The exporting happens off the ranks, from the run's files: ``gpumagic.log`` costs what it did, and
    a tracker that is slow or unreachable is named once, at most a few seconds after the run's end.

    Raises:
        InvalidArgument: an unknown tracker or option, or a tracker whose package is not installed (the message
            says which extra installs it: ``pip install 'gpumagic[mlflow]'``).
    """
    global _chosen
    current = list(trackers())
    if kind is None:
        _chosen = ()
        return _chosen
    if stop:
        if kind not in KINDS:
            raise InvalidArgument(f"gpumagic.track takes one of {', '.join(KINDS)}, got {kind!r}")
        _chosen = tuple(t for t in current if t.kind != kind)
        return _chosen
    options = {"logdir": logdir, "tracking_uri": tracking_uri, "experiment": experiment, "project": project}
    options.update(entity=entity, mode=mode, dir=dir)
    chosen = Tracker.of(kind, **{name: value for name, value in options.items() if value is not None})
    check_installed(kind)
    _chosen = (*(t for t in current if t.kind != kind), chosen)
    return _chosen


def check_installed(kind: str) -> None:
    """Raises InvalidArgument naming the extra to install when ``kind``'s package is missing (nothing imported)."""
    if importlib.util.find_spec(PACKAGES[kind]) is None:
        raise InvalidArgument(f"tracking to {kind} needs its package: pip install 'gpumagic[{kind}]'")


def trackers() -> tuple[Tracker, ...]:
    """The trackers chosen in this process (``track``), else those ``GPUMAGIC_TRACK`` names."""
    return _chosen if _chosen is not None else from_environment()


def from_environment(value: str | None = None) -> tuple[Tracker, ...]:
    """The trackers ``GPUMAGIC_TRACK`` names: a JSON list of ``{"kind": ..., options}`` (or of kinds' names), or
    kinds' names with commas (``tensorboard,wandb``: their defaults). A value that names no tracker is said once
    in the log and tracks nothing: a typo must not stop the run it was meant for."""
    text = os.environ.get(TRACK_VARIABLE, "") if value is None else value
    if not text.strip():
        return ()
    try:
        items = json.loads(text) if text.lstrip().startswith("[") else [p for p in text.split(",") if p.strip()]
        if not isinstance(items, list):
            raise InvalidArgument("not a list")
        return tuple(Tracker.from_json(item) for item in items)
    except (ValueError, InvalidArgument) as err:
        _log.warning("gpumagic: %s=%r tracks nothing: %s", TRACK_VARIABLE, text[:200], err)
        return ()


def to_environment(chosen: tuple[Tracker, ...]) -> str:
    """``GPUMAGIC_TRACK``'s value for ``chosen`` (``from_environment`` reads it back)."""
    return json.dumps([t.to_json() for t in chosen])


def tracked_summary(info: Mapping[str, Any]) -> str:
    """What a run was exported as, from its ``run.json``, in a few words: ``mlflow 3f9c1a2b · wandb
    gpumagic/ab12 · tensorboard runs/20261129-ddp-ab12``; a tracker that failed says so (``mlflow: unreachable``).
    Empty for a run that was not tracked.

    >>> tracked_summary({"tracking": {"mlflow": {"run_id": "3f9c1a2b77"}, "wandb": {"problem": "timed out"}}})
    'mlflow 3f9c1a2b · wandb: timed out'
    """
    tracking = info.get("tracking")
    if not isinstance(tracking, Mapping):
        return ""
    parts = []
    for kind in KINDS:
        entry = tracking.get(kind)
        if isinstance(entry, Mapping):
            parts.append(_entry_words(kind, entry))
    return " · ".join(parts)


def _entry_words(kind: str, entry: Mapping[str, Any]) -> str:
    if entry.get("problem"):
        return f"{kind}: {entry['problem']}"
    if kind == "mlflow":
        return f"mlflow {str(entry.get('run_id', '?'))[:8]}"
    if kind == "wandb":
        return f"wandb {entry.get('path') or entry.get('id', '?')}"
    logdir = str(entry.get("logdir", "?"))
    return f"tensorboard {_last_parts(logdir)}"


def _last_parts(path: str, count: int = 2) -> str:
    return "/".join(path.rstrip("/").split("/")[-count:])

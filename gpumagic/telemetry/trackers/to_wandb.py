"""A run as Weights & Biases sees it: one W&B run (its id the gpumagic run's, named after the job, grouped by
sweep), each rank's series of a metric as ``loss/rank0``, ``loss/rank1``, each against its rank's own step
(``rank0/step``: ranks log their steps at their own pace, and W&B drops a row whose global step goes back), the
run's parameters as its config, its end as its exit code. A resumed job goes on in the same W&B run.

Each run is its own ``Run`` object (``reinit="create_new"``): the notebook's own runs are never touched, and
neither is W&B's service process, which W&B itself ends when the process exits (a notebook's may hold runs of the
user's own; a job's exporter is a process of its own).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumagic.telemetry.trackers.to_tensorboard import parameter_value, series_name
from gpumagic.telemetry.tracking import Tracker

INIT_TIMEOUT_S = 10  # wandb.init waits 90 s for an unreachable server by default
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class WandbRun:
    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.run: Any = None
        self.wandb: Any = None  # the package, once loaded
        self.defined: set[str] = set()

    def load(self) -> None:
        # lazy: wandb takes half a second to import; only for a run tracked to it
        import wandb

        self.wandb = wandb

    def open(self, run: Any) -> dict[str, Any]:
        wandb = self.wandb
        earlier = run.earlier.get("wandb") or {}
        tracker = self.tracker
        settings = wandb.Settings(
            silent=True, console="off", x_disable_stats=True, x_disable_meta=True, save_code=False, disable_git=True,
            init_timeout=INIT_TIMEOUT_S,
        )  # fmt: skip
        self.run = wandb.init(
            project=tracker.project,
            entity=tracker.entity,
            mode=tracker.mode,
            dir=tracker.dir,
            id=earlier.get("id") or _run_id(run),
            name=run.name,
            group=run.group,
            job_type=run.kind,
            config={str(k): parameter_value(v) for k, v in run.params.items()},
            reinit="create_new",
            resume="allow" if earlier.get("id") else None,
            settings=settings,
        )
        return {"id": self.run.id, "path": "/".join(p for p in (self.run.entity, self.run.project, self.run.id) if p),
                "dir": str(Path(self.run.dir).parent)}  # fmt: skip

    def write(self, points: Sequence[tuple[int, str, float, float, float]]) -> None:
        """One ``run.log`` row per step that ranks reached together (a row costs W&B about 0.13 ms, whatever it
        holds): each rank's values with its own step key, so a row never mixes two steps of one series."""
        row: dict[str, Any] = {}
        row_step = None
        for rank, metric, step, value, when in points:
            name, step_name = series_name(metric, rank), f"rank{rank}/step"
            if name not in self.defined:
                self._define(name, step_name)
            if row and (step != row_step or name in row):
                self.run.log(row)  # never step=: ranks go at their own pace
                row = {}
            row_step = step
            row.update({name: value, step_name: step, "_timestamp": when})
        if row:
            self.run.log(row)

    def _define(self, name: str, step_name: str) -> None:
        if step_name not in self.defined:
            self.run.define_metric(step_name, hidden=True)
            self.defined.add(step_name)
        self.run.define_metric(name, step_metric=step_name)
        self.defined.add(name)

    def close(self, status: str) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=0 if status == "finished" else 1)


def _run_id(run: Any) -> str:
    """The W&B id of a gpumagic run (its own id; ``gpumagic.export`` again: another beside it)."""
    base = _UNSAFE.sub("-", run.run_id)[:56]
    return f"{base}-{secrets.token_hex(3)}" if run.again else base

"""A run as MLflow sees it: one MLflow run (named after the job, else the run's id, tagged ``gpumagic.run_id``) in
the tracker's experiment, each rank's series of a metric as ``loss/rank0``, ``loss/rank1``, the run's parameters
as its params, its end as its status. A resumed job goes on in the same MLflow run.

Only ``MlflowClient`` is used, in the exporter's thread. A server is first reached with a plain connection (2 s):
an unreachable one is named at once, where MLflow's own retries would hold the exporter four minutes. A file
store (``file://``) is allowed while MLflow makes it (``MLFLOW_ALLOW_FILE_STORE``, which MLflow 3 asks for),
then the variable is as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from gpumagic.telemetry.trackers.to_tensorboard import parameter_value, series_name
from gpumagic.telemetry.tracking import Tracker

CONNECT_TIMEOUT_S = 2.0
MAX_METRICS = 1000  # MLflow's log_batch takes at most 1000 metrics, 100 params a call
MAX_PARAMS = 100
MAX_PARAM_CHARS = 6000
STATUSES = {"finished": "FINISHED", "failed": "FAILED"}  # anything else ended it early: KILLED
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"
_environment_lock = threading.Lock()
_log = logging.getLogger(__name__)
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")  # MLflow's metric and param names take these only


class Unreachable(OSError):
    """The tracking server did not take a connection."""


class MlflowRun:
    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.client: Any = None
        self.run_id = ""
        self.metric: Any = None  # mlflow's classes, once loaded
        self.param: Any = None
        self.client_class: Any = None

    def load(self) -> None:
        # lazy: mlflow takes a second to import; only for a run tracked to it
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.metric, self.param, self.client_class = Metric, Param, MlflowClient

    def open(self, run: Any) -> dict[str, Any]:
        uri = str(self.tracker.tracking_uri)
        reach(uri)
        Param = self.param
        with file_store_allowed(uri):
            self.client = self.client_class(tracking_uri=uri)
            self.client.search_experiments(max_results=1)  # MLflow makes the store, and keeps it for the URI
        earlier = run.earlier.get("mlflow") or {}
        if earlier.get("run_id"):  # a resumed job: its MLflow run goes on (an earlier problem may have passed)
            self.run_id, experiment_id = earlier["run_id"], earlier.get("experiment_id")
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment_id = self._experiment(str(self.tracker.experiment))
            tags = {"gpumagic.run_id": run.run_id, "gpumagic.kind": run.kind}
            if run.group:
                tags["gpumagic.sweep"] = run.group
            self.run_id = self.client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
            params = [Param(_safe(str(k)), str(parameter_value(v))[:MAX_PARAM_CHARS]) for k, v in run.params.items()]
            for start in range(0, len(params), MAX_PARAMS):
                self.client.log_batch(self.run_id, params=params[start : start + MAX_PARAMS])
        return {"run_id": self.run_id, "experiment_id": experiment_id, "uri": uri}

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except Exception:  # another run created it meanwhile: use that one, or raise the first error
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            _log.debug("experiment %s was created meanwhile; this run joins it", name, exc_info=True)
            return str(found.experiment_id)

    def write(self, points: Sequence[tuple[int, str, float, float, float]]) -> None:
        Metric = self.metric
        metrics = [
            Metric(_safe(series_name(metric, rank)), value, int(when * 1000), int(step))
            for rank, metric, step, value, when in points
        ]
        for start in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS])

    def close(self, status: str) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id, STATUSES.get(status, "KILLED"))


@contextlib.contextmanager
def file_store_allowed(uri: str) -> Iterator[None]:
    """While MLflow makes a ``file:`` store: ``MLFLOW_ALLOW_FILE_STORE=true`` (MLflow 3 refuses one without it),
    then as it was: the notebook's own use of MLflow is its own."""
    if not uri.startswith("file:"):
        yield
        return
    with _environment_lock:
        before = os.environ.get(ALLOW_FILE_STORE)
        os.environ[ALLOW_FILE_STORE] = "true"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(ALLOW_FILE_STORE, None)
            else:
                os.environ[ALLOW_FILE_STORE] = before


def reach(uri: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raises ``Unreachable`` unless an ``http(s)`` server at ``uri`` takes a connection within ``timeout_s``."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        reason = err.strerror or type(err).__name__ if not isinstance(err, socket.timeout) else "no answer"
        raise Unreachable(f"unreachable ({reason} within {timeout_s:g} s)") from None


def _safe(name: str) -> str:
    return _UNSAFE.sub("_", name)

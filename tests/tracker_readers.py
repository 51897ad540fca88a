"""Each tracker's run read back with the tracker's own reader (TensorBoard's ``EventAccumulator``, MLflow's client
on a file store), and W&B's offline ``.wandb`` file with W&B's own protobuf records: no stand-ins."""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from pathlib import Path


def as_float32(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``points`` as TensorBoard keeps them: its scalars are float32."""
    return [(step, struct.unpack("f", struct.pack("f", value))[0]) for step, value in points]


# --- the trackers' own readers -------------------------------------------------------------------------------


def tensorboard_series(directory: str) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    accumulator = EventAccumulator(directory, size_guidance={"scalars": 0})
    accumulator.Reload()
    series = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    hparams = {}
    try:
        written = accumulator.PluginTagToContent("hparams")
    except KeyError:  # none written
        written = {}
    for content in written.values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        for name, value in data.session_start_info.hparams.items():
            hparams[name] = value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
    return series, hparams


def mlflow_client(tmp_path: Path):
    """MLflow's client of the file store under ``tmp_path``, made as gpumagic's exporter makes one (MLflow keeps
    the store for the URI): ``MLFLOW_ALLOW_FILE_STORE`` only meanwhile, so a test sees whether it was left set."""
    from mlflow.tracking import MlflowClient

    from gpumagic.telemetry.trackers.to_mlflow import file_store_allowed

    uri = f"file://{tmp_path / 'mlruns'}"
    with file_store_allowed(uri):
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
    return client


def mlflow_runs(tmp_path: Path) -> list:
    client = mlflow_client(tmp_path)
    experiment = client.get_experiment_by_name("exp")
    return client.search_runs([experiment.experiment_id]) if experiment else []


def mlflow_series(tmp_path: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in mlflow_client(tmp_path).get_metric_history(run_id, key)]


def wandb_records(path: str):
    """The records of a W&B ``.wandb`` file (LevelDB's log format: a 7-byte header, 32 KiB blocks, 7-byte record
    headers, a record split FIRST/MIDDLE/LAST across blocks), as W&B's own protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending = Path(path).read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", "a W&B data file"
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header: padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += chunk


def wandb_history(directory: str, timeout: float = 60.0) -> tuple[dict, dict, list[dict]]:
    """One offline W&B run directory: its run record's config, its exit record and its history rows, once W&B's
    service wrote the exit record (``finish`` returns before its writer has flushed the file; the exit comes last)."""
    deadline = time.monotonic() + timeout
    while True:
        (path,) = glob.glob(f"{directory}/run-*.wandb")
        config, ended, rows = {}, {}, []
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config = {_key(item): json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "exit":
                ended = {"exit_code": record.exit.exit_code}
            elif kind == "history":
                rows.append({_key(item): json.loads(item.value_json) for item in record.history.item})
        if ended or time.monotonic() > deadline:
            return config, ended, rows
        time.sleep(0.1)


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_run(directory: str) -> tuple[dict, dict, dict[str, list[tuple[int, float]]]]:
    """One offline W&B run directory: its config, its exit record and each rank's series (``loss/rank0``: [(step,
    value), ...], against the rank's own step)."""
    config, ended, rows = wandb_history(directory)
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if "/rank" in key:
                rank = key.rsplit("rank", 1)[1]
                series.setdefault(key, []).append((row[f"rank{rank}/step"], value))
    return config, ended, series


def offline_trackers(monkeypatch, tmp_path: Path) -> None:
    """The environment of a test of trackers: no ``WANDB_`` or ``MLFLOW_TRACKING`` variable of the machine's (a
    blank ``WANDB_`` one breaks ``wandb.Settings``: removed, never emptied), W&B's own files under ``tmp_path``,
    no ``GPUMAGIC_TRACK`` and no tracker chosen (``monkeypatch`` puts back what was)."""
    from gpumagic.telemetry import tracking

    for name in list(os.environ):
        if name.startswith(("WANDB_", "MLFLOW_TRACKING")):
            monkeypatch.delenv(name)
    monkeypatch.delenv(tracking.TRACK_VARIABLE, raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for name in ("CACHE", "CONFIG", "DATA"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))
    monkeypatch.setattr(tracking, "_chosen", None)

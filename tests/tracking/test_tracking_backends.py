"""Each offline-capable backend writes a run that is then read back with that tool's own reader."""

from __future__ import annotations

import glob
import json
import struct
import time
from pathlib import Path

import pytest

from hybridflow.tracking import build_tracker

CONFIG = {"actor": {"optim": {"lr": 1e-6}}, "trainer": {"logger": ["console", "jsonl"]}}
STEPS = {1: {"actor/pg_loss": 0.5, "timing/gen": 1.25}, 2: {"actor/pg_loss": 0.25, "timing/gen": 1.0},
         3: {"actor/pg_loss": 0.125, "timing/gen": 0.75}}


def log_run(name: str, run_dir: Path) -> None:
    tr = build_tracker([name], run_dir, project="hf-test", experiment="exp-1", config_dict=CONFIG)
    for step, m in STEPS.items():
        tr.log(m, step)
    tr.event("gen_time", "slow generation", 2, level="warning")
    tr.close()


def test_tensorboard_roundtrip(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_run("tensorboard", tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"actor/pg_loss", "timing/gen"} <= set(acc.Tags()["scalars"])
    got = [(e.step, e.value) for e in acc.Scalars("actor/pg_loss")]
    assert got == [(s, m["actor/pg_loss"]) for s, m in STEPS.items()]
    assert "events/gen_time" in acc.Tags()["tensors"] or "events/gen_time/text_summary" in acc.Tags()["tensors"]


def test_mlflow_file_store_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    log_run("mlflow", tmp_path)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    exp = client.get_experiment_by_name("hf-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "exp-1" and run.info.status == "FINISHED"
    hist = client.get_metric_history(run.info.run_id, "actor/pg_loss")
    assert sorted((m.step, m.value) for m in hist) == [(s, m["actor/pg_loss"]) for s, m in STEPS.items()]
    assert run.data.params["actor.optim.lr"] == "1e-06"
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "events.jsonl"} <= arts


def _read_leveldb_log(path: str) -> list[bytes]:
    """Records of a W&B transaction log (LevelDB log format: 32 KiB blocks, 7-byte record headers)."""
    raw = Path(path).read_bytes()
    assert raw[:4] == b":W&B", raw[:8]
    block, pos, out, buf = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pos += 7
        data, pos = raw[pos:pos + length], pos + length
        if kind == 1:
            out.append(data)
        elif kind == 2:
            buf = data
        elif kind == 3:
            buf += data
        elif kind == 4:
            out.append(buf + data)
    return out


def test_wandb_offline_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_run("wandb", tmp_path)
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    records: list = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wandb-core writes the file asynchronously after finish() returns
        records = [pb.Record.FromString(d) for d in _read_leveldb_log(run_file)]
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.2)
    history, config = {}, {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            # keys with "/" may be stored as nested_key parts
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            if "actor/pg_loss" in items:
                history[items["_step"]] = items["actor/pg_loss"]
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    assert history == {s: m["actor/pg_loss"] for s, m in STEPS.items()}
    assert config["actor"]["optim"]["lr"] == 1e-6


def test_swanlab_offline_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("swanlab")
    try:
        from swanlab.proto.swanlab.record.v1 import record_pb2
        from swanlab.sdk.internal.core_python.store import DataStoreReader
    except ImportError as err:  # internal reader layout differs in other swanlab versions
        pytest.skip(f"swanlab's offline-file reader is not available: {err}")
    for var in ("SWANLAB_MODE", "SWANLAB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    log_run("swanlab", tmp_path)
    (run_file,) = glob.glob(str(tmp_path / "swanlog" / "run-*" / "run-*.swanlab"))
    reader = DataStoreReader()
    reader.open(run_file)
    got = {}
    for data in reader:
        rec = record_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "scalar" and rec.scalar.key == "actor/pg_loss":
            got[rec.scalar.step] = rec.scalar.value.number
    reader.close()
    assert got == {s: m["actor/pg_loss"] for s, m in STEPS.items()}

"""Experiment tracking: train.wandb logs what metrics.jsonl, eval.jsonl and TensorBoard log, read back from the
offline W&B run's transaction log (OUT_DIR/wandb/offline-run-*/run-*.wandb) and TensorBoard's event files.

No network: without WANDB_API_KEY the trainer runs W&B offline.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest
import test_train
import yaml
from test_train import read_metrics, steps_of, tiny_config, tiny_raw

from fullband.config import build_config
from fullband.errors import ConfigError
from fullband.train import train
from fullband.train.tracking import RunLog

parity_data = test_train.parity_data

# The .wandb file is a LevelDB-style log: a 7-byte file header (":W&B", magic, version), then 32 KiB blocks of
# chunks, each a 7-byte header (crc32c, length, type) and a piece of one protobuf Record.
WANDB_HEADER = b":W&B"
BLOCK, CHUNK_HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """Every wandb.proto Record of a run's .wandb file, in the order written."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == WANDB_HEADER, f"{path} is not a W&B transaction log"
    pos, pending = 7, b""
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        if kind == 0:
            break  # zeros past the last chunk
        pending += data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def finished_log(out_dir: Path, timeout_s: float = 60.0) -> list:
    """The records of the run's log once it ends in the exit record: W&B's service writes the last records just
    after ``run.finish()`` returns."""
    [log] = sorted(out_dir.glob("wandb/offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(wandb_records(log))
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"{log} has no exit record {timeout_s} s after the run finished"
        time.sleep(0.1)


def read_offline_run(out_dir: Path) -> tuple[dict, dict[int, dict]]:
    """(the run record's project, name, tags and config; the logged history rows by step)."""
    run, history = {}, {}
    for record in finished_log(out_dir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"project": record.run.project, "name": record.run.display_name, "tags": list(record.run.tags),
                   "config": {item.key: json.loads(item.value_json) for item in record.run.config.update}}
        elif kind == "history":
            # A key holding "/" is stored split into its parts or whole in nested_key, depending on the writer.
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    return run, history


def tensorboard_scalars(out_dir: Path) -> dict[int, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    rows: dict[int, dict] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            rows.setdefault(event.step, {})[tag] = event.value
    return rows


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """No key and no mode (the trainer must choose offline itself); W&B's own settings and caches in tmp_path."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'fullband[track]')")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_NAME", "WANDB_TAGS", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_offline_run_holds_every_metric_and_the_config(tmp_path, parity_data, offline_wandb, capsys):
    schedule = [{"until": 0.5, "passes": {1: 1.0}}, {"until": 1.0, "passes": {2: 0.5, 3: 0.5}}]
    cfg = tiny_config(train={"tokens": steps_of(4), "schedule": schedule, "eval_every": 2, "tensorboard": True,
                             "wandb": {"project": "fullband-test", "tags": ["tiny", "parity"]}},
                      eval={"at_start": True, "sequential": True}, model={"vocab_size": 512})
    out = tmp_path / "my-run"
    train(cfg, out, data_dir=parity_data)

    run, history = read_offline_run(out)
    assert run["project"] == "fullband-test" and run["name"] == "my-run" and run["tags"] == ["tiny", "parity"]
    # The resolved config, as the run saved it: the vocabulary comes from the byte tokenizer, not the config.
    logged = {section: run["config"][section] for section in ("model", "data", "train", "eval")}
    assert logged == json.loads(json.dumps(yaml.safe_load((out / "config.yaml").read_text())))
    assert logged["model"]["vocab_size"] == 259

    # Every step's record, field by field, as metrics.jsonl has it; every evaluation as eval.jsonl has it.
    metrics = read_metrics(out)
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    assert sorted(history) == [0, 1, 2, 3, 4]
    for record in metrics:
        row = history[record["step"]]
        for key in ("tokens", "compute_tokens", "loss", "passes", "lr", "grad_norm", "elapsed_s", "tokens_per_s"):
            assert row[f"train/{key}"] == pytest.approx(record[key], rel=1e-12), key
        assert row["train/skipped"] == float(record["skipped"])
        assert [row[f"train/pass_loss/{k}"] for k in range(1, record["passes"] + 1)] == record["pass_losses"]
        assert f"train/pass_loss/{record['passes'] + 1}" not in row
    assert {r["passes"] for r in metrics} != {1}  # so the pass losses of a K-pass step were checked
    for record in evals:
        row = history[record["step"]]
        assert {k: row[f"val/{k}"] for k in record["loss"]} == record["loss"]
        for group in ("jacobi_delta", "sequential_gap"):
            assert {k: row[f"val/{group}/{k}"] for k in record[group]} == record[group]
    assert "sequential" in evals[-1]["loss"] and evals[-1]["jacobi_delta"]

    # TensorBoard got the same scalars at the same steps (as float32).
    tensorboard = tensorboard_scalars(out)
    assert sorted(tensorboard) == sorted(history)
    for step, row in history.items():
        assert tensorboard[step] == pytest.approx(row, rel=1e-6), step
    assert "wandb sync" in capsys.readouterr().err


def test_only_rank_zero_logs(tmp_path, offline_wandb):
    cfg = tiny_config(train={"tensorboard": True, "wandb": {"project": "fullband-test"}})
    run_log = RunLog.open(tmp_path, cfg.train, cfg.to_dict(), is_main=False, log=print)
    run_log.log_train({"step": 1, "loss": 1.0, "pass_losses": [1.0]})
    run_log.close()
    assert run_log.sinks == [] and list(tmp_path.iterdir()) == []


def test_missing_wandb_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb then raises ImportError
    cfg = tiny_config(train={"wandb": {"project": "fullband-test"}})
    with pytest.raises(ConfigError, match=r"pip install 'fullband\[track\]'"):
        RunLog.open(tmp_path, cfg.train, cfg.to_dict(), is_main=True, log=print)


def test_wandb_option_from_the_command_line():
    cfg = build_config(tiny_raw(), {"train.wandb": "{project: fb, name: run-1, tags: [a, b]}"})
    assert cfg.train.wandb == {"project": "fb", "name": "run-1", "tags": ["a", "b"]}
    assert build_config(tiny_raw(), {"train.wandb": '{"project": "fb"}'}).train.wandb == {"project": "fb"}
    assert build_config(tiny_raw()).train.wandb == {}


@pytest.mark.parametrize("option, message", [
    ({"name": "x"}, "needs a project"),
    ({"project": ""}, "needs a project"),
    ({"project": "p", "team": "t"}, "unknown key"),
    ({"project": "p", "tags": "a,b"}, "tags must be a list"),
    ({"project": "p", "tags": ["a", 3]}, "tags must be a list"),
    ({"project": "p", "name": 5}, "name must be a string"),
])
def test_bad_wandb_option_is_refused(option, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(train={"wandb": option})


def test_wandb_option_not_a_mapping_is_refused():
    with pytest.raises(ConfigError, match="train.wandb expects a mapping"):
        build_config(tiny_raw(), {"train.wandb": "fullband"})

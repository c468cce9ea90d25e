"""Checkpoints: atomic layout, verification, skipping corrupt ones on resume, no pickle; the
same for DCP checkpoints (one process here; resharding across world sizes in test_train_distributed.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import test_train
import torch
from test_train import read_metrics, steps_of, tiny_config

from fullband.cli import main
from fullband.errors import CheckpointError, ConfigError
from fullband.hf import export_hf
from fullband.loading import load_model, load_model_and_data
from fullband.storage import (
    ModelDir,
    latest_valid_checkpoint,
    list_checkpoints,
    load_pretrained,
    verify_checkpoint,
)
from fullband.train import train
from fullband.train.checkpoint import read_checkpoint

STEPS = 6

parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)


def _cfg():
    # K = 1 for the first third, then 2 or 3 passes: the resumed part includes fused passes.
    schedule = [{"until": 0.34, "passes": {1: 1.0}}, {"until": 1.0, "passes": {2: 0.5, 3: 0.5}}]
    return tiny_config(train={"tokens": steps_of(STEPS), "ckpt_every": 2, "keep_checkpoints": 3,
                              "schedule": schedule})


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, parity_data) -> Path:
    run = tmp_path_factory.mktemp("ckpt") / "run"
    train(_cfg(), run, data_dir=parity_data)
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _rewrite_manifest(checkpoint: Path) -> None:
    """Make the manifest agree with the files again (what an attacker who edits a checkpoint would do)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_layout_retention_and_verification(finished_run):
    names = [p.name for p in list_checkpoints(finished_run)]
    assert names == ["step_00000002", "step_00000004", "step_00000006"]
    newest = list_checkpoints(finished_run)[-1]
    for name in ("manifest.json", "optimizer.pt", "rng.pt", "trainer_state.json", "model/config.json",
                 "model/model.safetensors", "model/tokenizer"):
        assert (newest / name).exists(), name
    for checkpoint in list_checkpoints(finished_run):
        verify_checkpoint(checkpoint)
    state = json.loads((newest / "trainer_state.json").read_text())
    assert state["step"] == STEPS and state["tokens"] == steps_of(STEPS)
    assert not list((finished_run / "checkpoints").glob(".tmp-*"))
    # the checkpoint's model directory loads on its own, with its tokenizer
    model = load_pretrained(newest / "model")
    assert model.config.d_model == 32
    assert ModelDir.open(newest / "model").tokenizer == newest / "model" / "tokenizer"


@pytest.mark.parametrize("damage", ["flip_optimizer", "truncate_model"])
def test_corrupt_newest_checkpoint_is_reported_and_skipped_on_resume(finished_run, tmp_path, capfd, damage,
                                                                     parity_data):
    run = _copy(finished_run, tmp_path)
    newest = list_checkpoints(run)[-1]
    if damage == "flip_optimizer":
        path = newest / "optimizer.pt"
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 8):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))
        expected = "optimizer.pt does not match its sha256"
    else:
        path = newest / "model" / "model.safetensors"
        path.write_bytes(path.read_bytes()[:100])
        expected = "model/model.safetensors has 100 bytes"
    with pytest.raises(CheckpointError, match=expected):
        verify_checkpoint(newest)
    capfd.readouterr()
    assert latest_valid_checkpoint(run) == list_checkpoints(run)[1]
    assert "skipping" in capfd.readouterr().err

    orig = read_metrics(run)
    result = train(_cfg(), run, data_dir=parity_data, resume=True)
    err = capfd.readouterr().err
    assert "skipping" in err and expected in err
    assert f"resumed from {list_checkpoints(run)[1]} at step 4" in err
    assert result.finished and result.steps == STEPS
    # steps 5 and 6 were redone from step 4's checkpoint and agree exactly with the first time
    again = read_metrics(run)
    assert [r["step"] for r in again] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["pass_losses"]) for r in again] == [(r["loss"], r["pass_losses"]) for r in orig]
    verify_checkpoint(list_checkpoints(run)[-1])  # the damaged checkpoint was replaced by a good one


def test_interrupted_write_is_ignored(finished_run, tmp_path, capfd, parity_data):
    run = _copy(finished_run, tmp_path)
    # a write that died before the rename: a .tmp- directory with some files and no manifest
    tmp = run / "checkpoints" / ".tmp-step_00000008"
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "model.safetensors").write_bytes(b"partial")
    # and a step directory without a manifest (copied by hand, incomplete)
    (run / "checkpoints" / "step_00000010" / "model").mkdir(parents=True)
    assert [p.name for p in list_checkpoints(run)][-1] == "step_00000010"
    with pytest.raises(CheckpointError, match="no manifest.json"):
        verify_checkpoint(run / "checkpoints" / "step_00000010")
    assert latest_valid_checkpoint(run).name == "step_00000006"
    assert ModelDir.open(run).path == run / "checkpoints" / "step_00000006" / "model"
    result = train(_cfg(), run, data_dir=parity_data, resume=True)
    assert result.steps == STEPS and result.finished
    assert "is already complete" in capfd.readouterr().err and read_metrics(run)[-1]["step"] == STEPS


def test_model_dir_resolves_every_path(finished_run, tmp_path):
    newest = list_checkpoints(finished_run)[-1]
    assert ModelDir.open(finished_run).path == newest / "model"
    assert ModelDir.open(str(newest)).path == newest / "model"
    assert ModelDir.open(newest / "model").path == newest / "model"
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelDir.open(tmp_path / "nope")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="neither a model directory"):
        ModelDir.open(garbage)
    with pytest.raises(CheckpointError):
        ModelDir.open(garbage / "notes.txt")
    # a run whose only checkpoints are all damaged
    run = _copy(finished_run, tmp_path)
    for checkpoint in list_checkpoints(run):
        (checkpoint / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ModelDir.open(run)
    # a damaged checkpoint named directly is refused, not loaded
    with pytest.raises(CheckpointError, match="manifest"):
        ModelDir.open(list_checkpoints(run)[-1])


class _Evil:
    """Unpickling this object would create a file: a stand-in for arbitrary code execution."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickled_objects_in_a_checkpoint_are_refused(finished_run, tmp_path, parity_data):
    run = _copy(finished_run, tmp_path)
    newest = list_checkpoints(run)[-1]
    marker = tmp_path / "pwned"
    good = torch.load(newest / "optimizer.pt", weights_only=True)
    torch.save({**good, "payload": _Evil(marker)}, newest / "optimizer.pt")
    _rewrite_manifest(newest)
    verify_checkpoint(newest)  # the manifest agrees, so only the loader can refuse it
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        read_checkpoint(newest)
    (run / "eval.jsonl").write_text("")  # no final evaluation: the run is not complete, resuming loads the state
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        train(_cfg(), run, data_dir=parity_data, resume=True)
    assert not marker.exists()


# ---- DCP checkpoints (train.checkpoint_format dcp) -----------------------------------------------


def _dcp_cfg(**train_fields):
    cfg = _cfg()
    cfg.train.checkpoint_format = "dcp"
    for name, value in train_fields.items():
        setattr(cfg.train, name, value)
    return cfg


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory, parity_data) -> Path:
    """The run of ``finished_run`` in DCP format, stopped after 2 steps and resumed (same world size)."""
    run = tmp_path_factory.mktemp("dcp") / "run"
    train(_dcp_cfg(stop_after_steps=2), run, data_dir=parity_data)
    train(_dcp_cfg(), run, data_dir=parity_data, resume=True)
    return run


def test_dcp_layout_and_bitwise_resume(dcp_run, finished_run):
    newest = list_checkpoints(dcp_run)[-1]
    assert [p.name for p in list_checkpoints(dcp_run)] == ["step_00000002", "step_00000004", "step_00000006"]
    for name in ("dcp/.metadata", "dcp/__0_0.distcp", "rng.pt", "trainer_state.json", "model/config.json",
                 "model/generation_config.json", "model/tokenizer"):
        assert (newest / name).exists(), name
    assert not (newest / "optimizer.pt").exists() and not (newest / "model" / "model.safetensors").exists()
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and {"dcp/.metadata", "dcp/__0_0.distcp"} <= set(manifest["files"])
    verify_checkpoint(newest)
    # Resumed from step 2, the run is the full-format uninterrupted run bit for bit: losses and weights.
    assert [(r["loss"], r["pass_losses"]) for r in read_metrics(dcp_run)] == [
        (r["loss"], r["pass_losses"]) for r in read_metrics(finished_run)]
    full = ModelDir.open(list_checkpoints(finished_run)[-1] / "model").read_weights()
    sharded = ModelDir.open(newest / "model").read_weights()
    assert sharded.keys() == full.keys() and all(torch.equal(sharded[k], full[k]) for k in full)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_dcp_shard_is_reported_and_skipped(dcp_run, finished_run, tmp_path, capfd, parity_data, damage):
    run = _copy(dcp_run, tmp_path)
    shard = list_checkpoints(run)[-1] / "dcp" / "__0_0.distcp"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
        expected = "dcp/__0_0.distcp has 100 bytes"
    else:
        shard.unlink()
        expected = "dcp/__0_0.distcp is missing"
    with pytest.raises(CheckpointError, match=expected):
        verify_checkpoint(list_checkpoints(run)[-1])
    (run / "eval.jsonl").write_text("")  # not finished: resuming loads the newest checkpoint that verifies
    result = train(_dcp_cfg(), run, data_dir=parity_data, resume=True)
    err = capfd.readouterr().err
    assert "skipping" in err and expected in err and f"resumed from {list_checkpoints(run)[1]} at step 4" in err
    assert result.finished
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(finished_run)]
    verify_checkpoint(list_checkpoints(run)[-1])


def test_front_doors_and_consolidate_read_a_dcp_checkpoint(dcp_run, tmp_path, capsys):
    newest = list_checkpoints(dcp_run)[-1]
    assert ModelDir.open(dcp_run).path == ModelDir.open(newest).path == ModelDir.open(newest / "model").path
    expected = ModelDir.open(newest / "model").read_weights()
    # generate / chat / serve / bench load through load_model, eval through load_model_and_data
    model, tokenizer = load_model(dcp_run, device="cpu")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert model.decode_settings.to_dict() == json.loads((newest / "model" / "generation_config.json").read_text())
    model, dataset, model_dir, _ = load_model_and_data(newest, device="cpu")
    assert model_dir == newest / "model" and torch.equal(model.embed.weight, expected["embed.weight"])

    exported = export_hf(dcp_run, tmp_path / "hf")
    assert all(torch.equal(load_model(exported, device="cpu")[0].state_dict()[k], v) for k, v in expected.items())

    out = tmp_path / "consolidated"
    assert main(["consolidate", str(dcp_run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer"]
    plain = load_pretrained(out)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in expected.items())
    assert ModelDir.open(out).path == out and ModelDir.open(out).tokenizer == out / "tokenizer"
    # a non-empty --out is refused, not overwritten
    assert main(["consolidate", str(dcp_run), "--out", str(out)]) == 2
    assert "already exists and is not an empty directory" in capsys.readouterr().err


def test_init_from_a_dcp_checkpoint(dcp_run, tmp_path, capfd, parity_data):
    newest = list_checkpoints(dcp_run)[-1]
    cfg = tiny_config(train={"tokens": steps_of(1), "init_fusion": "keep", "schedule": "fixed:2"})
    assert train(cfg, tmp_path / "mid", data_dir=parity_data, init_from=newest).finished
    assert f"initialised from {newest / 'model'}, fusion weights included" in capfd.readouterr().err


def test_checkpoint_format_is_validated():
    with pytest.raises(ConfigError, match="train.checkpoint_format='zip': allowed values are auto, dcp, full"):
        tiny_config(train={"checkpoint_format": "zip"})

"""Opening a model for inference is cheap and still refuses damaged files: a run's checkpoint is checked against
its manifest by sizes (no file is hashed, the optimizer state is never read), a truncated safetensors file is caught
by its header, the model is built around its weights (no random initialisation), and ``fullband verify`` hashes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_train
import torch
from conftest import make_model
from test_train import steps_of, tiny_config

from fullband import files
from fullband.cli import main
from fullband.errors import CheckpointError
from fullband.generation import generate
from fullband.loading import load_model
from fullband.storage import list_checkpoints, load_pretrained, read_safetensors
from fullband.train import train

parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)


@pytest.fixture(scope="module")
def run(tmp_path_factory, parity_data) -> Path:
    out = tmp_path_factory.mktemp("open") / "run"
    train(tiny_config(train={"tokens": steps_of(4), "ckpt_every": 2, "schedule": "fixed:2"}), out,
          data_dir=parity_data)
    return out


@pytest.fixture
def no_hashing(monkeypatch):
    """Any sha256 taken while this is active fails the test."""
    def refuse(path):
        raise AssertionError(f"{path} was hashed")
    monkeypatch.setattr(files, "sha256_of", refuse)


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def test_loading_a_run_hashes_nothing_and_equals_the_checkpoint(run, no_hashing):
    newest = list_checkpoints(run)[-1]
    rng = torch.get_rng_state()
    model, _ = load_model(run, device="cpu")
    # Built around its weights: no parameter was drawn at random first (the generator did not move).
    assert torch.equal(torch.get_rng_state(), rng)
    saved = read_safetensors(newest / "model" / "model.safetensors")
    assert set(saved) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    assert model.inv_freq.device.type == "cpu" and model.inv_freq.dtype == torch.float32
    # The settings stored with the run (fixed:2 trains Jacobi passes: soft) come with it.
    assert model.decode_settings.mode == "soft"
    prompts = [[1, 2, 3], [4, 5]]
    assert generate(model, prompts, 4).shape == (2, 4)


def test_a_corrupt_optimizer_state_does_not_stop_inference_but_verify_names_it(run, tmp_path, capsys):
    run = _copy(run, tmp_path)
    newest = list_checkpoints(run)[-1]
    raw = bytearray((newest / "optimizer.pt").read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, different bytes: only a hash sees it
    (newest / "optimizer.pt").write_bytes(bytes(raw))
    load_model(run, device="cpu")
    assert main(["verify", str(run)]) == 2
    err = capsys.readouterr().err
    assert "optimizer.pt does not match its sha256" in err and newest.name in err
    assert main(["verify", str(list_checkpoints(run)[0])]) == 0
    assert f"ok {list_checkpoints(run)[0]}" in capsys.readouterr().out


def test_size_mismatch_truncation_and_missing_manifest_are_clear_errors_without_hashing(run, tmp_path, no_hashing):
    run = _copy(run, tmp_path)
    newest = list_checkpoints(run)[-1]
    weights = newest / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"model/model.safetensors has \d+ bytes, the manifest says"):
        load_model(newest, device="cpu")
    # A run directory falls back to the newest checkpoint whose files have their sizes.
    model, _ = load_model(run, device="cpu")
    assert torch.equal(model.embed.weight,
                       read_safetensors(list_checkpoints(run)[-2] / "model" / "model.safetensors")["embed.weight"])
    (newest / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json: it was not completely written"):
        load_model(newest, device="cpu")


@pytest.mark.parametrize("damage", ["truncated", "header", "empty"])
def test_a_damaged_safetensors_file_is_refused_by_its_header(tmp_path, damage):
    model = make_model()
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    raw = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(raw[: len(raw) - 4])
        expected = "incomplete metadata, file not fully covered"  # safetensors' own checks
    elif damage == "header":
        length = int.from_bytes(raw[:8], "little")
        weights.write_bytes(raw[:8] + b"{" * length + raw[8 + length:])
        expected = "invalid JSON in header"
    else:
        weights.write_bytes(b"")
        expected = "header too small"
    with pytest.raises(CheckpointError, match=f"model.safetensors is unreadable or truncated: .*{expected}"):
        load_pretrained(tmp_path)


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    make_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layers": config["n_layers"] + 1}))
    with pytest.raises(ValueError, match="does not match its config: missing"):
        load_pretrained(tmp_path)


def test_a_model_loads_in_the_dtype_it_is_stored_in_unless_told(tmp_path):
    model = make_model().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path)
    assert loaded.embed.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.embed.weight, model.embed.weight)
    assert load_pretrained(tmp_path, dtype=torch.float64).embed.weight.dtype == torch.float64

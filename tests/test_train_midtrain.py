"""Mid-training: --init-from a standard checkpoint with the paper schedule; tokenizer mismatches."""

from __future__ import annotations

import json

import pytest
import test_train
import torch
from safetensors.torch import load_file
from test_train import read_metrics, steps_of, tiny_config

from fullband.data import prepare_dataset
from fullband.errors import DataError
from fullband.storage import list_checkpoints, load_pretrained
from fullband.train import train
from fullband.train.trainer import Trainer

parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)


@pytest.fixture(scope="module")
def standard_run(tmp_path_factory, parity_data):
    run = tmp_path_factory.mktemp("standard") / "run"
    train(tiny_config(train={"tokens": steps_of(3), "schedule": "standard"}), run, data_dir=parity_data)
    return run


def test_init_from_keeps_the_trunk_and_starts_fresh_fusion(standard_run, tmp_path, parity_data):
    source = load_file(str(list_checkpoints(standard_run)[-1] / "model" / "model.safetensors"))
    # The user's model section says d_model 64: the checkpoint's architecture wins (only feedback fields apply).
    cfg = tiny_config(train={"tokens": steps_of(4), "schedule": "paper", "seed": 5},
                      model={"d_model": 64, "feedback_jitter": 0.05})
    trainer = Trainer(cfg, tmp_path / "mid", data_dir=parity_data, init_from=standard_run)
    model = trainer._build_model(trainer._prepare_data())
    assert model.config.d_model == 32 and model.config.feedback_jitter == 0.05
    state = model.state_dict()
    assert state.keys() == source.keys()
    fusion = [k for k in state if k.startswith("fusion.")]
    trunk = [k for k in state if not k.startswith("fusion.")]
    assert fusion and trunk
    for k in trunk:
        assert torch.equal(state[k], source[k]), k
    # fresh fusion matrices: not the source's (which a standard run never trained but did initialise)
    for k in fusion:
        if state[k].ndim == 2:
            assert not torch.equal(state[k], source[k]), k

    # and training runs: 75% one pass, then fused passes, finite losses
    result = train(cfg, tmp_path / "mid2", data_dir=parity_data, init_from=standard_run)
    rows = read_metrics(tmp_path / "mid2")
    assert result.finished and [r["passes"] for r in rows][:3] == [1, 1, 1] and rows[3]["passes"] in (2, 3)
    assert all(r["loss"] == r["loss"] and not r["skipped"] for r in rows)
    mid = load_pretrained(list_checkpoints(tmp_path / "mid2")[-1] / "model")
    assert mid.config.d_model == 32 and mid.config.feedback_jitter == 0.05
    saved = (tmp_path / "mid2" / "config.yaml").read_text()
    assert "d_model: 32" in saved  # the run records the architecture it really trained


def test_init_from_lr0_checkpoint_holds_the_initial_weights(standard_run, tmp_path, parity_data):
    """Black-box: with lr 0 one step changes nothing, so the checkpoint holds the initial weights."""
    cfg = tiny_config(train={"tokens": steps_of(1), "schedule": "fixed:2", "lr": 0.0})
    train(cfg, tmp_path / "mid", data_dir=parity_data, init_from=standard_run)
    source = load_file(str(list_checkpoints(standard_run)[-1] / "model" / "model.safetensors"))
    start = load_file(str(list_checkpoints(tmp_path / "mid")[-1] / "model" / "model.safetensors"))
    for k in source:
        if k.startswith("fusion.") and source[k].ndim == 2:
            assert not torch.equal(start[k], source[k]), k
        elif not k.startswith("fusion."):
            assert torch.equal(start[k], source[k]), k


def test_init_from_with_another_tokenizer_is_a_clear_error(standard_run, tmp_path):
    bpe_cfg = tiny_config(data={"tokenizer": "bpe", "bpe_vocab_size": 300}, train={"schedule": "paper"})
    bpe_data = tmp_path / "bpe-data"
    prepare_dataset(bpe_cfg.data, bpe_data)
    with pytest.raises(DataError, match="tokenizer mismatch") as info:
        train(bpe_cfg, tmp_path / "mid", data_dir=bpe_data, init_from=standard_run)
    assert "--data.tokenizer" in str(info.value)
    assert not (tmp_path / "mid" / "checkpoints").exists()


def test_init_from_a_model_dir_with_a_smaller_vocabulary(standard_run, tmp_path):
    """A bare model directory (no tokenizer saved with it) whose vocabulary cannot hold the data's ids."""
    model = load_pretrained(list_checkpoints(standard_run)[-1] / "model")
    bare = tmp_path / "bare"
    model.save_pretrained(bare)
    bpe_cfg = tiny_config(data={"tokenizer": "bpe", "bpe_vocab_size": 300})
    prepare_dataset(bpe_cfg.data, tmp_path / "bpe-data")
    with pytest.raises(DataError, match="300 tokens but the model's vocabulary has 259"):
        train(bpe_cfg, tmp_path / "mid", data_dir=tmp_path / "bpe-data", init_from=bare)


def _evals(run) -> list[dict]:
    return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines() if line]


def test_init_from_with_an_identity_fusion_starts_at_the_source_model_in_every_mode(standard_run, tmp_path,
                                                                                      parity_data):
    """--model.fusion add --model.fusion_init identity with --init-from, and eval.at_start: the step-0
    evaluation (before any update) gives every decode mode the source's standard loss; the paper's fresh gate
    does not (its standard loss is the source's too: the trunk is the same). Training then moves the zero
    projection."""
    runs = {}
    for fusion, init in (("add", "identity"), ("gate", "random")):
        cfg = tiny_config(train={"tokens": steps_of(2), "schedule": "fixed:2"}, eval={"at_start": True},
                          model={"fusion": fusion, "fusion_init": init})
        runs[fusion] = tmp_path / fusion
        train(cfg, runs[fusion], data_dir=parity_data, init_from=standard_run)
    start, end = _evals(runs["add"])
    assert start["step"] == 0 and end["step"] == 2
    gate = _evals(runs["gate"])[0]["loss"]
    assert start["loss"]["standard"] == gate["standard"]
    for name, loss in start["loss"].items():
        assert loss == pytest.approx(gate["standard"], abs=1e-6), name
    assert abs(gate["fused(1)"] - gate["standard"]) > 1e-3
    mid = load_pretrained(list_checkpoints(runs["add"])[-1] / "model")
    assert mid.config.fusion_init == "identity" and mid.fusion.proj.weight.abs().sum() > 0

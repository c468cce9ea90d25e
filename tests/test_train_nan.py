"""Non-finite losses: a NaN/inf step is skipped and counted, too many in a row stop the run cleanly."""

from __future__ import annotations

import pytest
import test_train
import torch
from safetensors.torch import load_file
from test_train import read_metrics, steps_of, tiny_config

from fullband.storage import latest_valid_checkpoint, list_checkpoints, verify_checkpoint
from fullband.train import TrainingDiverged, objective, train
from fullband.train.checkpoint import read_checkpoint

parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)


@pytest.fixture
def poison(monkeypatch):
    """poison({3: nan, 5: inf}): the training loss of the n-th training forward (1-based) becomes nan/inf."""
    bad: dict[int, float] = {}
    calls = {"n": 0}
    original = objective.multipass_loss

    def multipass_loss(model, *args, **kwargs):
        out = original(model, *args, **kwargs)
        if model.training:
            calls["n"] += 1
            if calls["n"] in bad:
                out.loss = out.loss * bad[calls["n"]]
        return out

    monkeypatch.setattr(objective, "multipass_loss", multipass_loss)
    return bad.update


def _weights(run, step):
    return load_file(str(run / "checkpoints" / f"step_{step:08d}" / "model" / "model.safetensors"))


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_steps_are_skipped_and_counted(tmp_path, parity_data, poison):
    poison({2: float("nan"), 4: float("inf")})  # not consecutive: max_bad_steps=2 is never reached
    cfg = tiny_config(train={"tokens": steps_of(5), "ckpt_every": 1, "keep_checkpoints": 10, "max_bad_steps": 2,
                             "schedule": "fixed:2", "lr_schedule": "constant"})
    result = train(cfg, tmp_path / "run", data_dir=parity_data)
    assert result.finished and result.steps == 5 and result.skipped_steps == 2
    rows = read_metrics(tmp_path / "run")
    assert [r["skipped"] for r in rows] == [False, True, False, True, False]
    assert all(r["loss"] is None for r in rows if r["skipped"])  # strict JSON: null, not NaN
    assert all(r["loss"] == r["loss"] for r in rows if not r["skipped"])  # finite where not skipped
    run = tmp_path / "run"
    # a skipped step leaves the weights and the optimizer state exactly as they were
    for bad in (2, 4):
        assert _same(_weights(run, bad), _weights(run, bad - 1))
        before = read_checkpoint(run / "checkpoints" / f"step_{bad - 1:08d}")["optimizer"]["state"]
        after = read_checkpoint(run / "checkpoints" / f"step_{bad:08d}")["optimizer"]["state"]
        assert before.keys() == after.keys()
        for name in before:
            assert all(torch.equal(before[name][k], after[name][k]) for k in before[name]), name
    # and the good steps do change them
    for good in (1, 3, 5):
        if good > 1:
            assert not _same(_weights(run, good), _weights(run, good - 1))
    state = read_checkpoint(latest_valid_checkpoint(run))["trainer_state"]
    assert state["skipped_steps"] == 2 and state["consecutive_bad_steps"] == 0


def test_consecutive_bad_steps_stop_the_run(tmp_path, parity_data, poison):
    poison({3: float("nan"), 4: float("nan"), 5: float("nan")})
    cfg = tiny_config(train={"tokens": steps_of(6), "ckpt_every": 2, "max_bad_steps": 3})
    with pytest.raises(TrainingDiverged) as info:
        train(cfg, tmp_path / "run", data_dir=parity_data)
    message = str(info.value)
    assert "3 consecutive steps" in message and "non-finite" in message and "step 5" in message
    assert str(tmp_path / "run" / "checkpoints") in message
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["skipped"] for r in rows] == [False, False, True, True, True]
    # checkpoints: step 2 (good) and step 4 (written after a skipped step, same weights); none at 5
    checkpoints = list_checkpoints(tmp_path / "run")
    assert [p.name for p in checkpoints] == ["step_00000002", "step_00000004"]
    for checkpoint in checkpoints:
        verify_checkpoint(checkpoint)
    assert _same(_weights(tmp_path / "run", 2), _weights(tmp_path / "run", 4))
    # after the cause is gone, --resume continues from the last checkpoint and finishes
    poison({})
    result = train(cfg, tmp_path / "run", data_dir=parity_data, resume=True)
    assert result.finished and result.steps == 6


def test_diverged_is_a_clear_cli_error(tmp_path, parity_data, poison, capsys):
    from fullband.cli import main

    poison({1: float("nan"), 2: float("nan")})
    args = ["train", "--out-dir", str(tmp_path / "run"), "--data-dir", str(parity_data)]
    for section, body in tiny_config(train={"tokens": steps_of(3), "max_bad_steps": 2}).to_dict().items():
        for key, value in body.items():
            if value is not None and not isinstance(value, (list, dict)):
                args += [f"--{section}.{key}", str(value)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error: 2 consecutive steps had a non-finite loss" in err and "Traceback" not in err

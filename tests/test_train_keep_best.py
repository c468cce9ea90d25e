"""train.keep_best: OUT_DIR/best holds the model of the lowest validation loss, survives an interrupted run,
loads like any model, and bad settings are refused with a message."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import test_train
from safetensors.torch import load_file
from test_train import steps_of, tiny_config

from fullband.errors import ConfigError
from fullband.loading import load_model, load_model_and_data
from fullband.storage import ModelDir, list_checkpoints, read_best
from fullband.train import train

parity_data = test_train.parity_data

STEPS = 8
# A learning rate large enough that the validation loss goes down and up again within 8 steps, so the best
# evaluation is not the last one; a checkpoint at every step to compare the kept weights with.
SECTIONS = {"train": {"tokens": steps_of(STEPS), "lr": 0.05, "warmup_steps": 1, "eval_every": 1, "ckpt_every": 1,
                      "keep_checkpoints": STEPS, "keep_best": "standard"}}


def _evals(run: Path) -> dict[int, float]:
    lines = (run / "eval.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"]["standard"] for r in map(json.loads, lines)}


def _weights(path: Path) -> dict:
    return load_file(str(path / "model" / "model.safetensors"))


def test_best_is_the_lowest_validation_loss_and_loads(tmp_path, parity_data):
    run = tmp_path / "run"
    result = train(tiny_config(**SECTIONS), run, data_dir=parity_data)
    losses = _evals(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    best_step = max(s for s, v in losses.items() if v == min(losses.values()))
    assert best_step < STEPS, losses  # the test needs a run whose last evaluation is not its best
    assert result.best == read_best(run) == {"step": best_step, "loss_name": "standard", "loss": losses[best_step],
                                             "data_dir": str(parity_data.resolve())}
    checkpoint = next(p for p in list_checkpoints(run) if p.name.endswith(f"{best_step:08d}"))
    kept, at_step = _weights(run / "best"), _weights(checkpoint)
    assert kept.keys() == at_step.keys() and all(bool((kept[k] == at_step[k]).all()) for k in kept)
    model, tokenizer = load_model(run / "best", device="cpu")  # a model directory with its tokenizer
    assert tokenizer.encode("01") and model.config.d_model == 32
    # the commands that read the run's config (fused:auto's cap) and data (fullband eval) find them
    assert ModelDir.open(run / "best").run.path == run
    assert load_model_and_data(run / "best", device="cpu")[3] == parity_data.resolve()


def test_an_interrupted_run_keeps_the_same_best(tmp_path, parity_data):
    straight = tmp_path / "straight"
    train(tiny_config(**SECTIONS), straight, data_dir=parity_data)
    split = tmp_path / "split"
    stopped = test_train.merge(SECTIONS, {"train": {"stop_after_steps": 3}})
    train(tiny_config(**stopped), split, data_dir=parity_data)
    # what a run that died after a later evaluation but before its checkpoint leaves behind: a whole best/
    # (its manifest agrees) from beyond the checkpoint the run resumes from
    (split / "best" / "best.json").write_text(json.dumps({"step": 5, "loss_name": "standard", "loss": -1.0}))
    manifest = json.loads((split / "best" / "manifest.json").read_text())
    data = (split / "best" / "best.json").read_bytes()
    manifest["files"]["best.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (split / "best" / "manifest.json").write_text(json.dumps(manifest))
    assert read_best(split)["step"] == 5
    train(tiny_config(**SECTIONS), split, data_dir=parity_data, resume=True)
    assert read_best(split) is not None and read_best(split) == read_best(straight)
    a, b = _weights(straight / "best"), _weights(split / "best")
    assert all(bool((a[k] == b[k]).all()) for k in a)


def test_a_half_written_best_is_not_read(tmp_path, parity_data):
    run = tmp_path / "run"
    train(tiny_config(**SECTIONS), run, data_dir=parity_data)
    (run / "best" / "model" / "model.safetensors").write_bytes(b"truncated")
    assert read_best(run) is None


@pytest.mark.parametrize("train_section, message", [
    ({"keep_best": "fused(5)", "eval_every": 1}, "not a validation loss this config reports"),
    ({"keep_best": "sequential", "eval_every": 1}, "choose from standard, fused(1)"),
    ({"keep_best": "standard", "eval_every": 0}, "needs train.eval_every"),
])
def test_bad_keep_best_is_refused(train_section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny_config(train=train_section)


def test_state_tracking_preset_keeps_its_best_model_and_bench_grades_it(tmp_path, capsys):
    """`fullband train --config state-tracking` on exported records, then `fullband bench RUN/best`: the preset's
    kept model is graded with fused:auto run to the exact recurrence (the run's schedule sets the cap)."""
    from fullband.cli import main
    from fullband.data.synthetic import export_jsonl, state_tracking_task

    train_file = export_jsonl(state_tracking_task("parity", 1, 4), tmp_path / "train.jsonl", 300, seed=0)
    val_file = export_jsonl(state_tracking_task("parity", 4, 4), tmp_path / "val.jsonl", 6, seed=1)
    run = tmp_path / "run"
    assert main(["train", "--config", "state-tracking", "--data.source", str(train_file), "--out-dir", str(run),
                 "--train.tokens", str(6 * 32 * 32), "--train.eval_every", "2", "--train.progress", "false",
                 "--train.device", "cpu", "--train.compile_recurrence", "0"]) == 0  # no cold compile (~150 s)
    best = read_best(run)
    assert best["loss_name"] == "sequential" and best["step"] in (2, 4, 6)
    evals = {r["step"]: r["loss"]["sequential"] for r in map(json.loads, (run / "eval.jsonl").read_text().splitlines())}
    assert best["loss"] == min(evals.values())
    capsys.readouterr()
    assert main(["bench", str(run / "best"), "--task", f"jsonl:{val_file}", "--modes", "standard,fused:auto",
                 "--out", str(tmp_path / "bench"), "--no-progress", "--no-plots"]) == 0
    results = json.loads((tmp_path / "bench" / "results.json").read_text())["results"][f"jsonl:{val_file}"]
    auto = results["fused:auto"]["0.0"]
    assert auto["problems"] == 6 and 0 <= auto["accuracy"] <= 1
    # prompts of 4 moves are 14 tokens: run to the exact recurrence, not stopped at the default cap of 8
    assert auto["mean_fused_passes"] > 8

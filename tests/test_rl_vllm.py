"""``fullband rl --rl.rollout_engine vllm``: rollouts sampled by vLLM in the trainer's process (fullband.vllm.rollouts).

A tiny FBT trained with a feedback schedule (head size 32, float32), served by vLLM's CPU build: its greedy rollouts
equal ``fullband.generate``'s and its sampled tokens' log-probabilities equal ``rollout_logprobs`` in standard,
soft, fused:2 and fused:exact; after an optimizer step the engine samples from the new weights, and refuses to
sample from weights it did not take; a run stopped and resumed equals the uninterrupted one. The importance-sampling
weights and the weighted loss against TRL's own code; the config errors.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import math
import textwrap
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import test_train
import torch
from test_train import steps_of, tiny_config
from vllm_helpers import in_process_vllm, ragged_prompts

from fullband import FullBandConfig, FullBandLM
from fullband.data.tokenizers import ByteTokenizer
from fullband.decoding import DecodeSettings
from fullband.errors import ConfigError, FullbandError
from fullband.generation import generate
from fullband.loading import load_model
from fullband.rl import group_advantages, grpo_loss, rollout_logprobs
from fullband.rl.grpo import IS_CORRECTIONS, importance_weights, pad_rows
from fullband.rl.trainer import SAMPLING_METRICS, VLLM_EXPORT_DIR, build_rl_config, cut_at_end, run_rl
from fullband.train import train
from tests.conftest import make_model
from tests.test_rl import ByteSumParity, checkpoint_state, ragged_rows, read_metrics, same_state, trl_loss

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (EXTRAS=vllm bash scripts/setup.sh, or pip install vllm)")
MAX_LEN = 96
NEW = 12
LENGTHS = (1, 3, 7, 12, 40)
MODES = ("standard", "soft", "fused:2", "fused:exact")

parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)


@pytest.fixture(scope="module")
def in_process_engines():
    """vLLM engines in this process, one at a time (tests/vllm_helpers.py)."""
    with in_process_vllm(_close_engine):
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, parity_data):
    """(fullband model, its run directory): trained with a feedback schedule (fixed:2; stored decode mode soft) on
    parity records, byte tokenizer. Head size 32: the CPU build's attention takes 32, 64, 80, ..."""
    root = tmp_path_factory.mktemp("rl_vllm_tiny")
    config = tiny_config(model={"d_model": 64, "n_heads": 2, "n_kv_heads": 1, "d_ff": 128, "max_seq_len": MAX_LEN},
                         train={"schedule": "fixed:2", "tokens": steps_of(8)})
    train(config, root / "run", data_dir=parity_data)
    model, _ = load_model(root / "run", device="cpu")
    assert DecodeSettings.of(model).label == "soft" and model.embed.weight.dtype == torch.float32
    return model, root / "run"


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(LENGTHS)


_ENGINE: dict = {}


def _close_engine() -> None:
    if _ENGINE:
        _ENGINE.pop("engine").close()
        _ENGINE.clear()


def rollout_engine(tiny, mode: str, tmp_path_factory):
    """The rollout engine of ``mode`` (one per mode: building another closes it), holding the tiny model's weights
    as policy version 0."""
    from fullband.vllm.rollouts import VLLMRollouts

    model, run = tiny
    if _ENGINE.get("mode") != mode:
        _close_engine()
        engine = VLLMRollouts(model, run, tmp_path_factory.mktemp("export") / VLLM_EXPORT_DIR,
                              DecodeSettings.of(model).with_label(mode))
        _ENGINE.update(mode=mode, engine=engine)
    _ENGINE["engine"].load_policy(model, 0)
    return _ENGINE["engine"]


def reference(model, prompts, mode: str, stop: list[int], new: int = NEW) -> list[list[int]]:
    rows = generate(model, prompts, new, decode=DecodeSettings.of(model).with_label(mode), stop_token_ids=stop)
    return [cut_at_end(row, set(stop)) for row in rows.tolist()]


# ---- sampling ------------------------------------------------------------------------------------------------------


@needs_vllm
@pytest.mark.parametrize("mode", MODES)
def test_rollouts_equal_fullband_greedy_and_logprobs(in_process_engines, tiny, prompts, mode, tmp_path_factory):
    """Greedy rollouts, with a stop token that ends some of them early, are fullband.generate's cut at the stop;
    the sampled tokens' log-probabilities at temperatures 1 and 0.7 are rollout_logprobs' (vLLM's processed
    log-probabilities: after the temperature), and a seed gives the same tokens again."""
    model, _ = tiny
    engine = rollout_engine(tiny, mode, tmp_path_factory)
    full = reference(model, prompts, mode, [])
    stop = [full[2][0]]  # the third row's first greedy token: that row, at least, stops early
    expected = reference(model, prompts, mode, stop)
    assert expected != full and expected[2] == full[2][:1]
    rows, _ = engine.sample(prompts, NEW, 0.0, stop, [0] * len(prompts))
    assert rows == expected
    for temperature in (1.0, 0.7):
        seeds = list(range(7, 7 + len(prompts)))
        rows, logprobs = engine.sample(prompts, NEW, temperature, [], seeds)
        assert [len(r) for r in rows] == [NEW] * len(prompts)
        ours = rollout_logprobs(model, prompts, rows, DecodeSettings.of(model).with_label(mode), temperature)
        assert all(torch.allclose(lp, o.detach(), atol=1e-4, rtol=0) for lp, o in zip(logprobs, ours))
        assert engine.sample(prompts, NEW, temperature, [], seeds)[0] == rows


@needs_vllm
def test_the_engine_samples_the_synced_weights_and_refuses_stale_ones(in_process_engines, tiny, prompts,
                                                                      tmp_path_factory):
    """After an optimizer step and load_policy, vLLM's greedy tokens and log-probabilities are those of the new
    weights (which differ from the old ones'); weights changed behind the sync are refused before sampling."""
    from vllm.v1.worker.gpu_worker import Worker

    model, _ = tiny
    engine = rollout_engine(tiny, "soft", tmp_path_factory)
    decode = DecodeSettings.of(model)
    before, _ = engine.sample(prompts, NEW, 0.0, [], [0] * len(prompts))
    moved = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(moved.parameters(), lr=3e-2)
    (-torch.cat(rollout_logprobs(moved, prompts, before, decode)).sum()).backward()
    optimizer.step()
    engine.load_policy(moved, 1)
    after, _ = engine.sample(prompts, NEW, 0.0, [], [0] * len(prompts))
    assert before == reference(model, prompts, "soft", []) != after
    assert after == reference(moved, prompts, "soft", [])
    rows, logprobs = engine.sample(prompts, NEW, 1.0, [], list(range(len(prompts))))
    ours = rollout_logprobs(moved, prompts, rows, decode)
    old = rollout_logprobs(model, prompts, rows, decode)
    assert all(torch.allclose(lp, o.detach(), atol=1e-4, rtol=0) for lp, o in zip(logprobs, ours))
    assert max(float((lp - o.detach()).abs().max()) for lp, o in zip(logprobs, old)) > 1e-3
    with mock.patch.object(Worker, "reload_weights", lambda *args, **kwargs: None):  # a reload that did nothing
        engine.load_policy(model, 2)
    with pytest.raises(RuntimeError, match="vLLM did not take the policy weights"):
        engine.sample(prompts, NEW, 1.0, [], list(range(len(prompts))))


# ---- the trainer ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rl_vllm_records") / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"parity {b:04b} :", "answer": f" {bin(b).count('1') % 2}"}) + "\n"
                            for b in range(16)))
    return path


def rl_config(run: Path, records: Path, **overrides):
    values = dict(model=str(run), data=str(records), steps=3, prompts_per_step=2, group_size=4, max_new_tokens=6,
                  lr=3e-3, progress=False, seed=1, truncated_reward=None, rollout_engine="vllm",
                  is_correction="token_truncate", updates_per_step=2)
    values.update(overrides)
    return build_rl_config({"rl": values})


@needs_vllm
def test_a_vllm_run_resumed_equals_the_uninterrupted_run(in_process_engines, tiny, records, tmp_path):
    """Stopped after 2 of 3 steps and resumed: the same weights and optimizer state, bit for bit, and the same
    metrics. Every step's rollouts come from the step's weights: vLLM's log-probabilities are the trainer's within
    float32 rounding (a step on stale weights would differ by far more), the weights near 1; the export is removed
    at the end."""
    _close_engine()
    _, run = tiny
    run_rl(rl_config(run, records), tmp_path / "whole", reward=ByteSumParity())
    run_rl(rl_config(run, records, stop_after_steps=2), tmp_path / "parts", reward=ByteSumParity())
    run_rl(rl_config(run, records), tmp_path / "parts", resume=True, reward=ByteSumParity())
    whole, whole_optimizer = checkpoint_state(tmp_path / "whole", 3)
    parts, parts_optimizer = checkpoint_state(tmp_path / "parts", 3)
    assert same_state(whole, parts) and same_state(whole_optimizer, parts_optimizer)
    metrics = read_metrics(tmp_path / "whole")
    assert metrics == read_metrics(tmp_path / "parts")
    assert all(not m["skipped"] for m in metrics)
    assert all(0 <= m["sampling/sampling_logp_difference/mean"] <= m["sampling/sampling_logp_difference/max"] < 1e-4
               for m in metrics), metrics
    assert all(abs(m[f"sampling/importance_sampling_ratio/{k}"] - 1) < 1e-3 for m in metrics for k in
               ("min", "mean", "max"))
    assert not (tmp_path / "whole" / VLLM_EXPORT_DIR).exists()


def test_the_fullband_engine_logs_no_sampling_metrics(tmp_path, records):
    """The default engine computes what it computed before: no vLLM, no mismatch metrics."""
    torch.manual_seed(0)
    FullBandLM(FullBandConfig(vocab_size=ByteTokenizer().vocab_size, d_model=16, n_layers=1, n_heads=2, d_ff=32,
                              max_seq_len=40)).save_pretrained(tmp_path / "model")
    ByteTokenizer().save(tmp_path / "model" / "tokenizer")
    cfg = build_rl_config({"rl": dict(model=str(tmp_path / "model"), data=str(records), steps=1, prompts_per_step=2,
                                      group_size=4, max_new_tokens=3, progress=False, truncated_reward=None)})
    assert cfg.rollout_engine == "fullband" and cfg.is_correction == "none"
    run_rl(cfg, tmp_path / "run", reward=ByteSumParity())
    (metrics,) = read_metrics(tmp_path / "run")
    assert not set(SAMPLING_METRICS) & metrics.keys()


# ---- importance sampling against TRL --------------------------------------------------------------------------------


def trl_importance_weights(old, sampling, mask, mode, cap):
    """The importance-sampling ratio of TRL's GRPOTrainer._generate_and_score_completions: its own block of code,
    cut out of its source and run on these log-probabilities."""
    from trl import GRPOTrainer

    source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    # The `if self.use_vllm and self.vllm_importance_sampling_correction:` block that computes the ratio, from the
    # start of its line to the comment that follows it.
    ratio_start = source.index("per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps)")
    start = source.rindex("\n", 0, source.rindex("if self.use_vllm and self.vllm_importance_sampling_correction:",
                                                  0, ratio_start)) + 1
    end = source.index("# Compute the per-token log probabilities for the reference model", start)
    trainer = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                              vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=cap,
                              vllm_importance_sampling_clip_min=None)
    scope = {"self": trainer, "torch": torch, "math": math, "completion_mask": mask.long(), "tool_mask": None,
             "old_per_token_logps": old, "sampling_per_token_logps": sampling}
    exec(textwrap.dedent(source[start:end]), scope)  # noqa: S102 - TRL's own code, the reference
    return scope["vllm_importance_sampling_ratio"]


@pytest.mark.parametrize("mode", IS_CORRECTIONS[1:])
def test_importance_weights_and_loss_equal_trl(mode):
    """The weights of every correction equal TRL's, and the weighted loss and its gradient TRL's loss with them, in
    float64 at 1e-12; the mismatches are large enough that the cap truncates or masks some weights."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install 'fullband[rl]'); nothing to compare with")
    torch.manual_seed(0)
    model = make_model(seed=8, dtype=torch.float64)
    prompts, completions = ragged_rows(seed=3)
    rows = rollout_logprobs(model, prompts, completions)
    old = [r.detach() for r in rows]
    # Noise, and a shift per row that puts some rows' sequence ratios far above 1 and others below.
    sampling = [o + 0.8 * torch.randn_like(o) + shift for o, shift in zip(old, (-0.3, 0.3, -0.3, 0.3))]
    cap = 1.5
    ours = importance_weights(old, sampling, mode, cap)
    padded_old, mask = pad_rows(old)
    theirs = trl_importance_weights(padded_old, pad_rows(sampling)[0], mask, mode, cap)
    assert ours.shape == theirs.shape and torch.allclose(ours, theirs, atol=1e-12, rtol=0)
    raw = importance_weights(old, sampling, "sequence_truncate" if mode.startswith("sequence") else "token_truncate",
                             1e9)
    assert ((raw > cap) & (mask if raw.shape[1] > 1 else True)).any(), "no weight above the cap: nothing is tested"
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), 2)
    loss = grpo_loss(rows, old, advantages, clip_low=0.2, clip_high=0.28, is_weights=ours)
    (grad,) = torch.autograd.grad(loss.loss, model.embed.weight)
    rows = rollout_logprobs(model, prompts, completions)
    new, _ = pad_rows(rows)
    reference = trl_loss(new, padded_old, None, mask, advantages, "grpo", 0.0, 0.2, 0.28, is_ratio=theirs)
    (reference_grad,) = torch.autograd.grad(reference, model.embed.weight)
    assert float(loss.loss) == pytest.approx(float(reference), abs=1e-12)
    assert torch.allclose(grad, reference_grad, atol=1e-12, rtol=0)
    unweighted = grpo_loss(rollout_logprobs(model, prompts, completions), old, advantages, clip_low=0.2,
                           clip_high=0.28)
    assert abs(float(unweighted.loss) - float(loss.loss)) > 1e-6


# ---- bad input ----------------------------------------------------------------------------------------------------


def test_bad_options_are_config_errors(records):
    base = dict(model="m", data=str(records))
    with pytest.raises(ConfigError, match="rl.rollout_engine must be one of fullband, vllm, got 'sglang'"):
        build_rl_config({"rl": {**base, "rollout_engine": "sglang"}})
    with pytest.raises(ConfigError, match="rl.is_correction must be one of none, token_truncate.*got 'token'"):
        build_rl_config({"rl": {**base, "rollout_engine": "vllm", "is_correction": "token"}})
    with pytest.raises(ConfigError, match="set rl.rollout_engine vllm or leave rl.is_correction none"):
        build_rl_config({"rl": {**base, "is_correction": "token_mask"}})
    with pytest.raises(ConfigError, match="rl.is_clip_max must be > 0"):
        build_rl_config({"rl": {**base, "rollout_engine": "vllm", "is_clip_max": 0}})


def test_what_vllm_cannot_sample_is_refused(tmp_path, monkeypatch):
    """fused:auto (with the modes that work), a model that is not a FullBandLM, and vLLM missing: one clear error
    each, before any export or engine."""
    from fullband.vllm.rollouts import VLLMRollouts

    model = make_model(seed=0)
    if importlib.util.find_spec("vllm") is not None:
        with pytest.raises(ConfigError, match="fused:auto.*standard, soft, fused:N .* and fused:exact"):
            VLLMRollouts(model, tmp_path, tmp_path / "export", DecodeSettings().with_label("fused:auto"))
        with pytest.raises(FullbandError, match="serves the transformer.*this model is a Linear"):
            VLLMRollouts(torch.nn.Linear(2, 2), tmp_path, tmp_path / "export", DecodeSettings())
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "vllm" else
                        real_find_spec(name, *args))
    with pytest.raises(FullbandError, match=r"EXTRAS=vllm bash scripts/setup.sh.*pip install vllm"):
        VLLMRollouts(model, tmp_path, tmp_path / "export", DecodeSettings())
    assert not (tmp_path / "export").exists()

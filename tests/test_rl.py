"""fullband.rl: rollout log-probabilities in the mode that sampled them, rewards, the GRPO loss (against TRL's),
the trainer's checkpoints and resume, the command line."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fullband import FullBandConfig, FullBandLM
from fullband.bench.sandbox import bubblewrap_problem
from fullband.cli import main
from fullband.data.tokenizers import ByteTokenizer
from fullband.decoding import DecodeSettings
from fullband.errors import ConfigError, FullbandError
from fullband.generation import generate, score_continuations
from fullband.model import prompt_plain
from fullband.rl import (
    CodeTestReward,
    ExactMatchReward,
    RegexReward,
    completion_logits,
    group_advantages,
    grpo_loss,
    informative_groups,
    make_reward,
    rollout_logprobs,
)
from fullband.rl.grpo import pad_rows
from fullband.rl.trainer import build_rl_config, run_rl
from fullband.sampling import SamplingParams, sample_rows
from fullband.storage import read_safetensors
from tests.conftest import FEATURES, float32_case, make_model

FEEDBACK_MODES = ("soft", "fused:2", "fused:exact", "fused:auto")
MODES = ("standard", *FEEDBACK_MODES)
# The gate at std 1: at the default 0.02 the fused input barely depends on the token, and the feedback modes'
# log-probabilities would differ from the plain pass's by little.
STRONG_GATE = dict(gate_init_std=1.0, max_seq_len=48)


def replay_sampler(logits: torch.Tensor, temperature: float, seed: int) -> torch.Tensor:
    """The tokens generate's sampler draws from (B, T, V) ``logits``: row i from its own generator seeded seed + i,
    one draw a step (``fullband.sampling.sample_rows``, as the engine calls it)."""
    rows = logits.shape[0]
    params = [SamplingParams(temperature=temperature)] * rows
    generators = [torch.Generator().manual_seed(seed + i) for i in range(rows)]
    return torch.stack([sample_rows(logits[:, t].detach(), params, generators) for t in range(logits.shape[1])], 1)


def ragged_rows(seed: int = 1, vocab: int = 64) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 9, 1, 6)]
    completions = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 2, 10, 1)]
    return prompts, completions


def worst(ours, reference) -> float:
    return max(float((a.detach().to(b.dtype) - b).abs().max()) for a, b in zip(ours, reference))


# ---- rollout_logprobs: the acceptance core ---------------------------------------------------------


@pytest.mark.parametrize("label", MODES)
@pytest.mark.parametrize("features", ["plain", "gate_window"])
def test_rollout_logprobs_equal_decode_scoring_float64(label, features):
    """What generate computed when it sampled (score_continuations, scoring="decode") to 1e-10, for ragged rows."""
    model = make_model(seed=3, dtype=torch.float64, **STRONG_GATE, **FEATURES.get(features, {}))
    prompts, completions = ragged_rows()
    decode = DecodeSettings().with_label(label)
    ours = rollout_logprobs(model, prompts, completions, decode=decode)
    reference = [lp for lp, _ in score_continuations(model, prompts, completions, decode=decode, scoring="decode")]
    assert [o.dtype for o in ours] == [torch.float64] * len(ours)
    assert [len(o) for o in ours] == [len(c) for c in completions]
    assert worst(ours, reference) < 1e-10
    if label != "standard":
        # The plain teacher-forced pass is another policy: a trainer scoring with it would be off by this much.
        plain = rollout_logprobs(model, prompts, completions, decode=DecodeSettings("standard"))
        assert worst(plain, reference) > 1e-2


@pytest.mark.parametrize("label", MODES)
def test_rollout_logprobs_equal_decode_scoring_float32(label):
    """float32: the same to 1e-5 (two orders of summation of the same products)."""
    dtype, atol = float32_case(1e-5)
    model = make_model(seed=3, dtype=dtype, **STRONG_GATE)
    prompts, completions = ragged_rows()
    decode = DecodeSettings().with_label(label)
    ours = rollout_logprobs(model, prompts, completions, decode=decode)
    reference = [lp for lp, _ in score_continuations(model, prompts, completions, decode=decode, scoring="decode")]
    assert worst(ours, reference) < atol


@pytest.mark.parametrize("label", MODES)
def test_a_row_does_not_depend_on_its_batch(label):
    model = make_model(seed=4, dtype=torch.float64, **STRONG_GATE)
    prompts, completions = ragged_rows(seed=2)
    decode = DecodeSettings().with_label(label)
    batched = rollout_logprobs(model, prompts, completions, decode=decode)
    for prompt, completion, row in zip(prompts, completions, batched):
        (alone,) = rollout_logprobs(model, [prompt], [completion], decode=decode)
        assert float((alone - row).detach().abs().max()) < 1e-12


def test_soft_logprobs_and_gradients_equal_the_recurrence_over_the_whole_text():
    """An independent reference: model.recurrence over prompt + completion with the prompt positions plain (its
    autograd-safe StepKeys path, no cache), as docs/method.md §6 defines soft decoding. Values and every
    parameter's gradient agree, and the gradient reaches the fusion."""
    model = make_model(seed=5, dtype=torch.float64, **STRONG_GATE)
    prompt, completion = [3, 17, 40, 2, 9], [11, 5, 60, 7, 7, 1]
    (ours,) = rollout_logprobs(model, [prompt], [completion], decode=DecodeSettings("soft"))
    weights = torch.linspace(0.5, 2.0, len(completion), dtype=torch.float64)
    (ours * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    ids = torch.tensor([prompt + completion[:-1]])
    plain = torch.zeros_like(ids, dtype=torch.bool)
    plain[:, : len(prompt)] = True
    logits = model.recurrence(ids, plain).logits[0, len(prompt) - 1 :]
    reference = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
    (reference * weights).sum().backward()
    assert float((ours - reference).detach().abs().max()) < 1e-10
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-8, atol=1e-10), name
    for name in ("fusion.value_proj.weight", "fusion.gate_proj.weight"):
        assert float(grads[name].abs().sum()) > 1e-3, f"no gradient reaches {name}"


def test_exact_logprobs_equal_the_recurrence_with_only_the_first_token_plain():
    """fused:exact is the exact recurrence over prompt and completion alike: one plain position (each row's
    first real token), every other fused with the state before it."""
    model = make_model(seed=6, dtype=torch.float64, **STRONG_GATE)
    prompts, completions = [[5, 9, 13], [7, 2, 2, 30, 8]], [[4, 4, 19], [6]]
    ours = rollout_logprobs(model, prompts, completions, decode=DecodeSettings("fused", "exact"))
    for prompt, completion, row in zip(prompts, completions, ours):
        ids = torch.tensor([prompt + completion[:-1]])
        logits = model.recurrence(ids, prompt_plain(ids, None, None)).logits[0, len(prompt) - 1 :]
        reference = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert float((row - reference).detach().abs().max()) < 1e-10


@pytest.mark.parametrize("label", ["soft", "fused:exact"])
def test_sampled_rollouts_are_scored_as_they_were_sampled(label):
    """Rollouts sampled by generate (temperature 0.8, a seed): replaying generate's sampler on completion_logits'
    logits, with a generator seeded alike, draws the very same tokens; their log-probabilities equal
    score_continuations'; the plain pass's logits would not replay them."""
    model = make_model(seed=7, dtype=torch.float64, **STRONG_GATE)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4]]
    decode = DecodeSettings().with_label(label)
    rows = generate(model, prompts, 12, decode=decode, temperature=0.8, seed=123).tolist()
    logits, targets, _ = completion_logits(model, prompts, rows, decode)
    assert replay_sampler(logits, 0.8, 123).tolist() == rows
    ours = rollout_logprobs(model, prompts, rows, decode=decode, temperature=0.8)
    scaled = [(lp / 1.0) for lp in ours]
    reference = score_continuations(model, prompts, rows, decode=decode)
    # score_continuations scores at temperature 1: compare at 1, and check the 0.8 scaling on its own.
    at_one = rollout_logprobs(model, prompts, rows, decode=decode)
    assert worst(at_one, [lp for lp, _ in reference]) < 1e-10
    expected = (logits.detach() / 0.8).log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    assert worst(scaled, list(expected)) < 1e-12
    plain_logits, _, _ = completion_logits(model, prompts, rows, DecodeSettings("standard"))
    assert replay_sampler(plain_logits, 0.8, 123).tolist() != rows


def test_bad_rows_are_refused_with_what_to_do():
    model = make_model(seed=0)
    with pytest.raises(ValueError, match="one completion per prompt"):
        rollout_logprobs(model, [[1], [2]], [[3]])
    with pytest.raises(ValueError, match="at least one token each"):
        rollout_logprobs(model, [[1]], [[]])
    with pytest.raises(ValueError, match="max_seq_len"):
        rollout_logprobs(model, [[1] * 30], [[2] * 10])
    with pytest.raises(ValueError, match="vocab_size"):
        rollout_logprobs(model, [[1]], [[64]])
    with pytest.raises(ValueError, match="vocab_size"):
        rollout_logprobs(model, [[1]], [[2.0]])
    numpy = pytest.importorskip("numpy")
    (from_numpy,) = rollout_logprobs(model, [numpy.array([1, 2])], [numpy.array([3])])
    (from_lists,) = rollout_logprobs(model, [[1, 2]], [[3]])
    assert torch.equal(from_numpy, from_lists)
    with pytest.raises(ValueError, match="temperature"):
        rollout_logprobs(model, [[1]], [[2]], temperature=0.0)


# ---- rewards ---------------------------------------------------------------------------------------


def test_exact_and_regex_rewards():
    assert ExactMatchReward()([" 1", " 0\nmore", "1 0 => 1", ""], [" 1", " 1", " 1", " 1"]) == [1.0, 0.0, 1.0, 0.0]
    reward = RegexReward(r"answer: (?P<answer>-?\d+)")
    assert reward(["so answer: 42.", "answer: 41", "no"], ["42", "42", "42"]) == [1.0, 0.0, 0.0]
    assert make_reward("regex:=(\\d)")(["x=7"], ["7"]) == [1.0]
    with pytest.raises(ConfigError, match="rewards are"):
        make_reward("fuzzy")
    with pytest.raises(ConfigError, match="does not compile"):
        make_reward("regex:(")
    with pytest.raises(ValueError, match="one answer per completion"):
        ExactMatchReward()(["a"], [])


def test_math_reward():
    pytest.importorskip("math_verify", reason="the math reward needs math-verify (fullband[eval])")
    reward = make_reward("math")
    assert reward(["The answer is $\\frac{1}{2}$", "so 0.3"], ["$0.5$", "$1/2$"]) == [1.0, 0.0]


def test_code_reward_runs_the_tests_in_the_sandbox():
    problem = bubblewrap_problem()
    if problem is not None:
        pytest.skip(f"bubblewrap cannot run here: {problem}")
    reward = CodeTestReward()
    good, bad = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"
    tests = "assert add(2, 3) == 5"
    escape = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)"
    assert reward([good, bad, escape], [tests, tests, ""]) == [1.0, 0.0, 0.0]


# ---- the GRPO loss -------------------------------------------------------------------------------


def test_group_advantages_and_informative_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4)
    std = torch.tensor([1.0, 0, 0, 0]).std()
    assert torch.allclose(adv[:4], (torch.tensor([1.0, 0, 0, 0]) - 0.25) / (std + 1e-4))
    assert adv[4:].abs().max() == 0
    assert torch.allclose(group_advantages(rewards, 4, scale="none")[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert informative_groups(rewards, 4).tolist() == [True, False]
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def test_first_update_is_the_policy_gradient():
    """With ratio 1 (old = new, detached), GRPO's gradient is -mean_i A_i mean_t ∇log π(o_i,t)."""
    logits = torch.randn(3, 5, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (3, 5))
    lengths = [5, 2, 4]
    lp = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    rows = [lp[i, :n] for i, n in enumerate(lengths)]
    advantages = torch.tensor([1.0, -0.5, 2.0])
    out = grpo_loss(rows, [r.detach() for r in rows], advantages)
    (grad,) = torch.autograd.grad(out.loss, logits, retain_graph=True)
    expected = -sum(advantages[i] * rows[i].mean() for i in range(3)) / 3
    (want,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(grad, want, atol=1e-7)
    assert out.ratio_mean == pytest.approx(1.0) and out.clip_fraction == 0.0 and out.kl is None


class _OneProcess:
    """What TRL's loss asks of accelerate in a single process."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(new, old, ref, mask, advantages, loss_type, beta, clip_low, clip_high):
    """TRL's own GRPOTrainer._compute_loss on these per-token log-probabilities (its log-probability method replaced
    by one that returns them)."""
    from trl import GRPOTrainer

    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, aux_loss_enabled=False, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=clip_low,
        epsilon_high=clip_high, args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        use_vllm=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)}, accelerator=_OneProcess(),
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (new, torch.zeros_like(new), None),
    )
    B, L = new.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, L, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    return GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("aggregation,loss_type", [("sequence", "grpo"), ("token", "dapo")])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_equals_trl(aggregation, loss_type, beta):
    """The loss and its gradient equal TRL's GRPOTrainer loss on the same rollouts, old and reference
    log-probabilities and advantages (asymmetric clip, ratios far enough from 1 that both clips bite)."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install 'fullband[rl]'); nothing to compare with")
    from trl.trainer.utils import nanstd

    torch.manual_seed(0)
    model = make_model(seed=8, dtype=torch.float64)
    prompts, completions = ragged_rows(seed=3)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    advantages = group_advantages(rewards, 2)
    grouped = rewards.view(-1, 2)
    trl_advantages = (rewards - grouped.mean(1).repeat_interleave(2)) / (nanstd(grouped, dim=1).repeat_interleave(2)
                                                                         + 1e-4)
    assert torch.allclose(advantages, trl_advantages, atol=1e-12)
    rows = rollout_logprobs(model, prompts, completions)
    old = [r.detach() + 0.3 * torch.randn_like(r) for r in rows]
    ref = [r.detach() + 0.2 * torch.randn_like(r) for r in rows]
    ours = grpo_loss(rows, old, advantages, ref, clip_low=0.2, clip_high=0.28, kl_coef=beta, aggregation=aggregation)
    (ours_grad,) = torch.autograd.grad(ours.loss, model.embed.weight)
    rows = rollout_logprobs(model, prompts, completions)
    new, mask = pad_rows(rows)
    theirs = trl_loss(new, pad_rows(old)[0], pad_rows(ref)[0], mask, advantages, loss_type, beta, 0.2, 0.28)
    (theirs_grad,) = torch.autograd.grad(theirs, model.embed.weight)
    assert ours.clip_fraction > 0
    assert float(ours.loss) == pytest.approx(float(theirs), abs=1e-12)
    assert torch.allclose(ours_grad, theirs_grad, atol=1e-12)


# ---- the trainer and the command line ---------------------------------------------------------------


@pytest.fixture(scope="module")
def soft_model_dir(tmp_path_factory) -> Path:
    """A tiny byte-level FBT that decodes in soft mode (as a run of the paper's schedule stores)."""
    torch.manual_seed(0)
    model = FullBandLM(FullBandConfig(vocab_size=ByteTokenizer().vocab_size, d_model=16, n_layers=1, n_heads=2,
                                      d_ff=32, max_seq_len=40, gate_init_std=0.5))
    model.decode_settings = DecodeSettings("soft")
    path = tmp_path_factory.mktemp("rl") / "model"
    model.save_pretrained(path)
    ByteTokenizer().save(path / "tokenizer")
    return path


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("records")
    rows = [{"prompt": f"parity {b:04b} :", "answer": f" {bin(b).count('1') % 2}"} for b in range(16)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:12]))
    (root / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[12:]))
    return root / "train.jsonl", root / "val.jsonl"


def rl_config(model_dir, records, **overrides):
    train, val = records
    values = dict(model=str(model_dir), data=str(train), val_data=str(val), steps=4, prompts_per_step=2,
                  group_size=4, max_new_tokens=3, lr=3e-3, progress=False, seed=1)
    values.update(overrides)
    return build_rl_config({"rl": values})


def test_a_run_writes_metrics_checkpoints_and_the_decode_mode(soft_model_dir, records, tmp_path):
    cfg = rl_config(soft_model_dir, records, kl_coef=0.1, updates_per_step=2, eval_every=2, ckpt_every=2)
    result = run_rl(cfg, tmp_path)
    assert result.steps == 4 and 0.0 <= result.final_accuracy <= 1.0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for key in ("reward", "accuracy", "loss", "kl", "rollout_s", "scoring_s", "update_s", "step_s", "clip_fraction"):
        assert all(key in m for m in metrics), key
    assert all(m["scoring_s"] > 0 for m in metrics)  # the reference and old log-probabilities
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4] and evals[0]["decode"] == "soft"
    stored = json.loads((tmp_path / "checkpoints").glob("step_*").__next__().joinpath(
        "model", "generation_config.json").read_text())
    assert stored["decode_mode"] == "soft"


class ByteSumParity:
    """A reward an untrained model earns about half the time, so every group has a signal and every step updates."""

    correct_at = 1.0

    def __call__(self, completions, answers):
        return [float(sum(map(ord, c)) % 2) for c in completions]


def test_resume_after_a_stop_equals_the_uninterrupted_run(soft_model_dir, records, tmp_path):
    """Stopped after 2 of 5 steps and resumed: the same weights, bit for bit, and the same metrics."""
    settings = dict(steps=5, dynamic_sampling=True, clip_high=0.28, updates_per_step=2, kl_coef=0.05)
    run_rl(rl_config(soft_model_dir, records, **settings), tmp_path / "whole", reward=ByteSumParity())
    run_rl(rl_config(soft_model_dir, records, stop_after_steps=2, **settings), tmp_path / "parts",
           reward=ByteSumParity())
    assert [p.name for p in (tmp_path / "parts" / "checkpoints").glob("step_*")] == ["step_00000002"]
    run_rl(rl_config(soft_model_dir, records, **settings), tmp_path / "parts", resume=True, reward=ByteSumParity())

    def weights(run):
        newest = sorted((run / "checkpoints").glob("step_*"))[-1]
        assert newest.name == "step_00000005"
        return read_safetensors(newest / "model" / "model.safetensors")

    whole, parts = weights(tmp_path / "whole"), weights(tmp_path / "parts")
    start = read_safetensors(soft_model_dir / "model.safetensors")
    assert whole.keys() == parts.keys()
    assert all(torch.equal(whole[k], parts[k]) for k in whole)
    assert not torch.equal(whole["fusion.gate_proj.weight"], start["fusion.gate_proj.weight"])
    strip = ("rollout_s", "scoring_s", "update_s", "step_s")

    def metrics(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in m.items() if k not in strip} for m in rows]

    assert metrics(tmp_path / "whole") == metrics(tmp_path / "parts")
    assert all(m["groups_kept"] > 0 and m["loss"] is not None for m in metrics(tmp_path / "whole"))


def test_progress_bar_and_tensorboard(soft_model_dir, records, tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="rl.tensorboard needs tensorboard (fullband[tensorboard])")
    run_rl(rl_config(soft_model_dir, records, steps=2, progress=True, tensorboard=True), tmp_path)
    err = capsys.readouterr().err
    assert "reward=" in err and "acc=" in err
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_the_score_mode_ablation_changes_the_update_not_the_rollouts(soft_model_dir, records, tmp_path):
    """rl.score_mode standard (the plain pass, what a trainer ignoring the mode computes) samples the same first
    rollouts as the default, but its update differs: the soft rollouts' plain-pass gradient is another one."""
    for name, mode in (("right", ""), ("plain", "standard")):
        run_rl(rl_config(soft_model_dir, records, steps=1, score_mode=mode), tmp_path / name, reward=ByteSumParity())
    right, plain = (read_safetensors(tmp_path / n / "checkpoints" / "step_00000001" / "model" / "model.safetensors")
                    for n in ("right", "plain"))
    assert not torch.equal(right["fusion.gate_proj.weight"], plain["fusion.gate_proj.weight"])
    first = [json.loads((tmp_path / n / "metrics.jsonl").read_text().splitlines()[0]) for n in ("right", "plain")]
    assert first[0]["reward"] == first[1]["reward"] and first[0]["completion_tokens"] == first[1]["completion_tokens"]


def test_the_command_line(soft_model_dir, records, tmp_path, capsys):
    train, val = records
    config = tmp_path / "rl.yaml"
    config.write_text(f"rl:\n  data: {train}\n  steps: 2\n  prompts_per_step: 2\n  group_size: 2\n"
                      "  max_new_tokens: 2\n  progress: false\n")
    assert main(["rl", str(soft_model_dir), "--config", str(config), "--out-dir", str(tmp_path / "run"),
                 "--rl.val_data", str(val), "--rl.decode_mode", "fused:exact"]) == 0
    assert "held-out greedy accuracy" in capsys.readouterr().out
    assert (tmp_path / "run" / "config.yaml").is_file()
    # Resumed with more steps (pacing may change): it continues from step 2.
    assert main(["rl", "--out-dir", str(tmp_path / "run"), "--resume", "--rl.steps", "3"]) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    # A resumed run may not change what it computes: refused with the option named, exit status 2.
    assert main(["rl", "--out-dir", str(tmp_path / "run"), "--resume", "--rl.lr", "0.5"]) == 2
    assert "cannot change rl.lr" in capsys.readouterr().err


def test_a_model_without_its_tokenizer_is_refused(records, tmp_path):
    FullBandLM(FullBandConfig(vocab_size=ByteTokenizer().vocab_size, d_model=16, n_layers=1, n_heads=2, d_ff=32,
                              max_seq_len=40)).save_pretrained(tmp_path / "bare")
    with pytest.raises(FullbandError, match="no tokenizer directory"):
        run_rl(rl_config(tmp_path / "bare", records), tmp_path / "run")


def test_config_errors_say_what_to_do(soft_model_dir, records):
    with pytest.raises(ConfigError, match="unknown option"):
        build_rl_config({"rl": {"model": "m", "data": "d", "learning_rate": 1}})
    with pytest.raises(ConfigError, match="--rl.data"):
        build_rl_config({"rl": {"model": "m"}})
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        rl_config(soft_model_dir, records, group_size=1)
    with pytest.raises(ConfigError, match="unknown decode mode"):
        rl_config(soft_model_dir, records, decode_mode="fast")
    with pytest.raises(ConfigError, match="loss_aggregation"):
        rl_config(soft_model_dir, records, loss_aggregation="mean")

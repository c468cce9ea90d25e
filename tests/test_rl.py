"""fullband.rl: rollout log-probabilities in the mode that sampled them, rewards, the GRPO loss (against TRL's),
the trainer's checkpoints and resume, the command line."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from fullband import FullBandConfig, FullBandLM
from fullband.bench.sandbox import bubblewrap_problem
from fullband.cli import main
from fullband.config import read_sections
from fullband.data.chat import apply_chat_template
from fullband.data.tokenizers import ByteTokenizer
from fullband.decoding import DecodeSettings
from fullband.errors import ConfigError, FullbandError
from fullband.generation import generate, score_continuations
from fullband.loading import encode_prompt
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
from fullband.rl.cli import config_path
from fullband.rl.grpo import AGGREGATIONS, importance_weights, pad_rows
from fullband.rl.trainer import (
    SAMPLING_METRICS,
    RLTrainer,
    build_rl_config,
    lr_multiplier,
    micro_batches,
    resumed_config,
    run_rl,
    save_config,
)
from fullband.sampling import SamplingParams, sample_rows
from fullband.storage import read_safetensors
from fullband.train.checkpoint import read_checkpoint
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


def trl_loss(new, old, ref, mask, advantages, loss_type, beta, clip_low, clip_high, is_ratio=None):
    """TRL's own GRPOTrainer._compute_loss on these per-token log-probabilities (its log-probability method replaced
    by one that returns them); with ``is_ratio``, its vLLM importance-sampling correction by those weights."""
    from trl import GRPOTrainer

    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, aux_loss_enabled=False, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=clip_low,
        epsilon_high=clip_high, args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)}, accelerator=_OneProcess(),
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (new, torch.zeros_like(new), None),
    )
    B, L = new.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, L, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
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


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("correction", ["none", "token_truncate", "sequence_mask"])
def test_micro_batch_losses_add_up_to_the_batch_loss(aggregation, correction):
    """grpo_loss's normalizer (rl.micro_batch): 8 ragged rollouts in micro-batches of 3, each loss its share of the
    batch's, backpropagated one after the other, give the whole batch's loss and gradient to 1e-12 (float64), and
    the token-weighted means of their metrics the batch's; with the KL term, both clips and importance weights."""
    torch.manual_seed(0)
    model = make_model(seed=8, dtype=torch.float64)
    (prompts, completions), more = ragged_rows(seed=1), ragged_rows(seed=2)
    prompts, completions = prompts + more[0], completions + more[1]
    rows = rollout_logprobs(model, prompts, completions)
    old = [r.detach() + 0.3 * torch.randn_like(r) for r in rows]
    ref = [r.detach() + 0.2 * torch.randn_like(r) for r in rows]
    sampling = [o + 0.3 * torch.randn_like(o) for o in old]
    advantages = torch.randn(len(rows), dtype=torch.float64)
    settings = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1, aggregation=aggregation)

    def weights(part: slice) -> torch.Tensor | None:
        return None if correction == "none" else importance_weights(old[part], sampling[part], correction)

    whole = grpo_loss(rows, old, advantages, ref, is_weights=weights(slice(None)), **settings)
    whole.loss.backward()
    whole_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    tokens = sum(map(len, completions))
    normalizer = len(rows) if aggregation == "sequence" else tokens
    loss = kl = clipped = ratio = 0.0
    for part in micro_batches(len(rows), 3):
        chunk = grpo_loss(rollout_logprobs(model, prompts[part], completions[part]), old[part], advantages[part],
                          ref[part], is_weights=weights(part), normalizer=normalizer, **settings)
        chunk.loss.backward()
        share = sum(map(len, completions[part])) / tokens
        loss, kl = loss + float(chunk.loss.detach()), kl + chunk.kl * share
        clipped, ratio = clipped + chunk.clip_fraction * share, ratio + chunk.ratio_mean * share
    assert [len(completions[part]) for part in micro_batches(len(rows), 3)] == [3, 3, 2]
    assert whole.clip_fraction > 0 and whole.kl > 0
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == whole_grads.keys()
    assert max(float((grads[name] - g).abs().max()) for name, g in whole_grads.items()) < 1e-12
    assert max(float(g.abs().max()) for g in whole_grads.values()) > 1e-3
    assert loss == pytest.approx(float(whole.loss.detach()), abs=1e-12) and kl == pytest.approx(whole.kl, abs=1e-12)
    assert clipped == pytest.approx(whole.clip_fraction, abs=1e-12)
    assert ratio == pytest.approx(whole.ratio_mean, abs=1e-12)
    # Without a normalizer the loss is the batch's own: a micro-batch of all the rollouts is the batch.
    alone = grpo_loss(rows, old, advantages, ref, is_weights=weights(slice(None)), normalizer=normalizer, **settings)
    assert float(alone.loss.detach()) == pytest.approx(float(whole.loss.detach()), abs=1e-12)


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
    """A tiny run's config. Its rollouts are graded as they are (truncated_reward null): the random model almost
    never ends a rollout, and a truncated reward would leave every step without a signal."""
    train, val = records
    values = dict(model=str(model_dir), data=str(train), val_data=str(val), steps=4, prompts_per_step=2,
                  group_size=4, max_new_tokens=3, lr=3e-3, progress=False, seed=1, truncated_reward=None)
    values.update(overrides)
    return build_rl_config({"rl": values})


class ByteSumParity:
    """A reward an untrained model earns about half the time, so every group has a signal and every step updates."""

    correct_at = 1.0

    def __call__(self, completions, answers):
        return [float(sum(map(ord, c)) % 2) for c in completions]


class SignalOnOnes(ByteSumParity):
    """ByteSumParity for the records whose answer is " 1", 0 for the others: half the groups have no signal, so
    dynamic sampling has groups to drop and to refill."""

    def __call__(self, completions, answers):
        return [r if a == " 1" else 0.0 for r, a in zip(super().__call__(completions, answers), answers)]


class SignalOnce(ByteSumParity):
    """ByteSumParity on its first call, then 0 for every rollout: a first step with a signal, then none."""

    calls = 0

    def __call__(self, completions, answers):
        self.calls += 1
        return super().__call__(completions, answers) if self.calls == 1 else [0.0] * len(completions)


TIMES = ("rollout_s", "scoring_s", "backward_s", "optimizer_s", "step_s")


def read_metrics(run: Path) -> list[dict]:
    """metrics.jsonl without its timings (which differ between equal runs)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if k not in TIMES} for m in rows]


def checkpoint_state(run: Path, step: int) -> tuple[dict, dict]:
    """(the weights, the optimizer state) of a run's checkpoint."""
    path = run / "checkpoints" / f"step_{step:08d}"
    return read_safetensors(path / "model" / "model.safetensors"), read_checkpoint(path)["optimizer"]


def same_state(a, b) -> bool:
    """Nested dicts and lists of tensors and numbers equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def test_a_run_writes_metrics_checkpoints_and_the_decode_mode(soft_model_dir, records, tmp_path):
    cfg = rl_config(soft_model_dir, records, kl_coef=0.1, updates_per_step=2, eval_every=2, ckpt_every=2)
    result = run_rl(cfg, tmp_path, reward=ByteSumParity())
    assert result.steps == 4 and 0.0 <= result.final_accuracy <= 1.0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    keys = ("reward", "accuracy", "loss", "kl", "entropy", "clip_fraction", "grad_norm", "lr", "truncated_fraction",
            "frac_reward_zero_std", "completion_tokens", "draws", "groups_kept", "skipped", *TIMES)
    assert all(set(keys) <= m.keys() for m in metrics), [set(keys) - m.keys() for m in metrics]
    assert all(not m["skipped"] and m["scoring_s"] > 0 and m["backward_s"] > 0 for m in metrics)
    # A random byte model: its next-token entropy is near log(259), and it rarely ends in 3 tokens.
    assert all(3.0 < m["entropy"] < math.log(259) + 1e-6 for m in metrics)
    assert all(m["completion_tokens"] <= 3 and 0 <= m["truncated_fraction"] <= 1 for m in metrics)
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4] and evals[0]["decode"] == "soft"
    stored = json.loads((tmp_path / "checkpoints").glob("step_*").__next__().joinpath(
        "model", "generation_config.json").read_text())
    assert stored["decode_mode"] == "soft"


def test_resume_after_a_stop_equals_the_uninterrupted_run(soft_model_dir, records, tmp_path):
    """Stopped after 2 of 5 steps and resumed: the same weights, bit for bit, and the same metrics, with the state
    a step depends on beyond the weights: the learning-rate schedule (warm-up, cosine), dynamic sampling's refill
    draws, AdamW's moments, the KL reference."""
    settings = dict(steps=5, dynamic_sampling=True, refill_rounds=2, clip_high=0.28, updates_per_step=2,
                    kl_coef=0.05, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    run_rl(rl_config(soft_model_dir, records, **settings), tmp_path / "whole", reward=SignalOnOnes())
    run_rl(rl_config(soft_model_dir, records, stop_after_steps=2, **settings), tmp_path / "parts",
           reward=SignalOnOnes())
    assert [p.name for p in (tmp_path / "parts" / "checkpoints").glob("step_*")] == ["step_00000002"]
    run_rl(rl_config(soft_model_dir, records, **settings), tmp_path / "parts", resume=True, reward=SignalOnOnes())

    whole, whole_optimizer = checkpoint_state(tmp_path / "whole", 5)
    parts, parts_optimizer = checkpoint_state(tmp_path / "parts", 5)
    start = read_safetensors(soft_model_dir / "model.safetensors")
    assert same_state(whole, parts) and same_state(whole_optimizer, parts_optimizer)
    assert not torch.equal(whole["fusion.gate_proj.weight"], start["fusion.gate_proj.weight"])
    metrics = read_metrics(tmp_path / "whole")
    assert metrics == read_metrics(tmp_path / "parts")
    assert any(m["draws"] > 1 for m in metrics[2:]), "no refill after the resume: the test would not cover it"
    cfg = rl_config(soft_model_dir, records, **settings)
    assert [m["lr"] for m in metrics] == [3e-3 * lr_multiplier(step, cfg) for step in range(5)]
    assert [m["lr"] for m in metrics][1] == 3e-3 and metrics[-1]["lr"] == pytest.approx(3e-4)


def test_a_zero_signal_batch_leaves_weights_and_optimizer_state_unchanged(soft_model_dir, records, tmp_path):
    """Step 1 has a signal and moves the weights and AdamW's state; step 2's rewards are all 0, so its advantages
    are: no optimizer step, not even one on a zero gradient (AdamW would move the weights by its momentum and
    change its moments and step count). With the KL term on, whose gradient alone is not 0."""
    run_rl(rl_config(soft_model_dir, records, steps=2, ckpt_every=1, kl_coef=0.1), tmp_path, reward=SignalOnce())
    first, first_optimizer = checkpoint_state(tmp_path, 1)
    second, second_optimizer = checkpoint_state(tmp_path, 2)
    assert not same_state(first, read_safetensors(soft_model_dir / "model.safetensors"))
    assert first_optimizer["state"], "step 1 made no optimizer step: the test would not cover a state change"
    assert same_state(first, second) and same_state(first_optimizer, second_optimizer)
    metrics = read_metrics(tmp_path)
    assert [m["skipped"] for m in metrics] == [False, True]
    assert metrics[1]["frac_reward_zero_std"] == 1.0 and metrics[1]["loss"] is None


def fixed_rollouts(monkeypatch, trainer, texts: list[str | None]) -> None:
    """Make ``trainer``'s generate return these rollouts: a text ends with the end token, None is 3 tokens that do
    not end (cut at max_new_tokens 3)."""
    tok = trainer.tokenizer
    rows = [list(tok.encode(t)) + [tok.eos_id] * (3 - len(tok.encode(t))) if t is not None else list(tok.encode("x1y"))
            for t in texts]
    calls = []

    def fake_generate(model, prompts, max_new_tokens, **kwargs):
        calls.append(kwargs)
        assert len(prompts) == len(rows) and max_new_tokens == 3
        return torch.tensor(rows)

    monkeypatch.setattr("fullband.rl.trainer.generate", fake_generate)
    return calls


class AlwaysRight:
    correct_at = 1.0

    def __call__(self, completions, answers):
        return [1.0] * len(completions)


class Recorder(AlwaysRight):
    """Keeps the texts it was asked to grade."""

    def __init__(self):
        self.seen = []

    def __call__(self, completions, answers):
        self.seen += completions
        return super().__call__(completions, answers)


def test_a_truncated_rollout_gets_the_truncated_reward(soft_model_dir, records, tmp_path, monkeypatch):
    """A rollout that reaches max_new_tokens without the end token or the stop gets rl.truncated_reward, whatever
    the reward says of its text; one that ends is graded on its text up to the end (the newline stop cut off)."""
    cfg = rl_config(soft_model_dir, records, group_size=2, truncated_reward=-0.5, stop="newline")
    trainer = RLTrainer(cfg, tmp_path, reward=AlwaysRight())
    calls = fixed_rollouts(monkeypatch, trainer, ["1", None, " 1\n", None])
    batch = trainer.rollouts(0, 0)
    assert batch.rewards.tolist() == [1.0, -0.5, 1.0, -0.5]
    assert batch.ended.tolist() == [True, False, True, False]
    assert batch.correct.tolist() == [True, False, True, False]
    newline = trainer.tokenizer.encode("\n")[0]
    assert [len(c) for c in batch.completions] == [2, 3, 3, 3] and batch.completions[2][-1] == newline
    assert newline in calls[0]["stop_token_ids"] and trainer.tokenizer.eos_id in calls[0]["stop_token_ids"]
    # The text graded is the completion before its end: the newline and what follows it are not the answer's.
    trainer.reward = Recorder()
    trainer.rollouts(0, 0)
    assert trainer.reward.seen == ["1", "x1y", " 1", "x1y"]
    # null: graded like any other rollout.
    trainer = RLTrainer(rl_config(soft_model_dir, records, group_size=2, stop="newline"), tmp_path / "asis",
                        reward=AlwaysRight())
    fixed_rollouts(monkeypatch, trainer, ["1", None, " 1\n", None])
    assert trainer.rollouts(0, 0).rewards.tolist() == [1.0] * 4


def test_masked_truncated_rollouts_leave_the_loss(soft_model_dir, records, tmp_path, monkeypatch):
    """mask_truncated_completions: rollouts cut at max_new_tokens are out of the loss; a batch of only those makes
    no step even where their rewards differ."""
    rows = torch.tensor([list(ByteTokenizer().encode(t)) for t in ("ab1", "ab2", "cd1", "cd2")])  # no end
    monkeypatch.setattr("fullband.rl.trainer.generate", lambda *args, **kwargs: rows)
    for mask, skipped in ((True, True), (False, False)):
        cfg = rl_config(soft_model_dir, records, group_size=2, mask_truncated_completions=mask)
        trainer = RLTrainer(cfg, tmp_path / str(mask), reward=ByteSumParity())  # the byte sums differ
        record = trainer.train_step(0)
        assert record["truncated_fraction"] == 1.0 and record["skipped"] is skipped


@pytest.fixture(scope="module")
def float64_model_dir(tmp_path_factory) -> Path:
    """A tiny byte-level FBT in float64 with a strong gate, for the trainer's exactness tests."""
    torch.manual_seed(0)
    model = FullBandLM(FullBandConfig(vocab_size=ByteTokenizer().vocab_size, d_model=16, n_layers=1, n_heads=2,
                                      d_ff=32, max_seq_len=40, gate_init_std=1.0)).to(torch.float64)
    path = tmp_path_factory.mktemp("rl64") / "model"
    model.save_pretrained(path)
    ByteTokenizer().save(path / "tokenizer")
    return path


# 8 rollouts of 1 to 3 tokens: "" is the end token alone, None 3 tokens cut at the cap. Both groups have a signal
# under ByteSumParity (rewards 1, 0, 0, 1 and 0, 1, 0, 1).
RAGGED_TEXTS = ["1", None, "", "ab", None, "7", "", "xy"]


class ReplayedSampler:
    """A stand-in for rl.rollout_engine vllm's engine: RAGGED_TEXTS, with sampler log-probabilities that are the
    trainer's own plus seeded noise, so that the importance weights are not 1 (and some are capped)."""

    def __init__(self, trainer: RLTrainer):
        self.trainer = trainer

    def load_policy(self, model, step):
        pass

    def sample(self, prompts, max_new_tokens, temperature, stop, seeds):
        tok = self.trainer.tokenizer
        rows = [list(tok.encode(t)) + [tok.eos_id] if t is not None else list(tok.encode("x1y")) for t in RAGGED_TEXTS]
        with torch.no_grad():
            scored = rollout_logprobs(self.trainer.model, prompts, rows, self.trainer.decode, temperature)
        noise = torch.Generator().manual_seed(seeds[0] % 2**31)
        return rows, [s + 0.4 * torch.randn(len(s), generator=noise, dtype=s.dtype) for s in scored]


@pytest.mark.parametrize("mode,aggregation,correction", [("standard", "sequence", "none"), ("fused:2", "token", "none"),
                                                         ("soft", "token", "token_truncate"),
                                                         ("fused:2", "sequence", "sequence_mask")])
def test_micro_batches_train_as_the_whole_batch(float64_model_dir, records, tmp_path, monkeypatch, mode, aggregation,
                                                correction):
    """rl.micro_batch 3 against 0 (all 8 ragged rollouts at once), float64: after two steps of two updates each (old
    log-probabilities, the KL reference, AdamW's moments, the grad clip all in play) the same weights and the same
    metrics to 1e-10, importance weights and the sampler's mismatch metrics included."""
    engine = dict(rollout_engine="vllm", is_correction=correction) if correction != "none" else {}
    runs = []
    for micro_batch in (0, 3):
        cfg = rl_config(float64_model_dir, records, decode_mode=mode, loss_aggregation=aggregation, kl_coef=0.1,
                        updates_per_step=2, clip_high=0.28, lr=0.05, micro_batch=micro_batch, **engine)
        trainer = RLTrainer(cfg, tmp_path / str(micro_batch), reward=ByteSumParity())
        if engine:
            trainer.vllm = ReplayedSampler(trainer)
        else:
            fixed_rollouts(monkeypatch, trainer, RAGGED_TEXTS)
        records_ = [trainer.train_step(step) for step in range(2)]
        runs.append((records_, {k: v.clone() for k, v in trainer.model.state_dict().items()}))
    (whole, whole_weights), (micro, micro_weights) = runs
    assert next(iter(whole_weights.values())).dtype == torch.float64
    assert max(float((whole_weights[k] - micro_weights[k]).abs().max()) for k in whole_weights) < 1e-10
    start = read_safetensors(float64_model_dir / "model.safetensors")
    assert max(float((whole_weights[k] - start[k]).abs().max()) for k in start) > 1e-3
    for a, b in zip(whole, micro):
        assert not a["skipped"] and a["clip_fraction"] > 0, "the second update clipped nothing: not covered"
        assert a.keys() == b.keys() and (SAMPLING_METRICS[0] in a) == bool(engine)
        for key in a.keys() - set(TIMES):
            if isinstance(a[key], float):
                assert math.isclose(a[key], b[key], rel_tol=1e-10, abs_tol=1e-10), (key, a[key], b[key])
            else:
                assert a[key] == b[key], key


def test_refilling_is_deterministic_by_seed(soft_model_dir, records, tmp_path):
    """Dynamic sampling drops the groups without a signal and refills the batch from more draws: the draws of a
    step are disjoint and fixed by (seed, step); two runs with one seed are equal, another seed draws others."""
    cfg = rl_config(soft_model_dir, records, steps=3, prompts_per_step=3, dynamic_sampling=True, refill_rounds=2)
    trainer = RLTrainer(cfg, tmp_path / "draws")
    draws = [[r["prompt"] for r in trainer.draw_records(1, d)] for d in range(3)]
    assert len({p for d in draws for p in d}) == 9
    assert draws == [[r["prompt"] for r in RLTrainer(cfg, tmp_path / "again").draw_records(1, d)] for d in range(3)]
    assert draws[0] != [r["prompt"] for r in trainer.draw_records(2, 0)]

    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        run_rl(rl_config(soft_model_dir, records, steps=3, prompts_per_step=3, dynamic_sampling=True,
                         refill_rounds=2, seed=seed), tmp_path / name, reward=SignalOnOnes())
        runs[name] = read_metrics(tmp_path / name)
    assert runs["a"] == runs["b"] and runs["a"] != runs["c"]
    assert same_state(checkpoint_state(tmp_path / "a", 3), checkpoint_state(tmp_path / "b", 3))
    assert all(m["groups_kept"] <= 3 and 1 <= m["draws"] <= 3 for m in runs["a"])
    assert any(m["draws"] > 1 for m in runs["a"]) and any(m["frac_reward_zero_std"] > 0 for m in runs["a"])


def test_the_learning_rate_schedule():
    cfg = SimpleNamespace(steps=10, warmup_steps=2, min_lr_ratio=0.1, lr_schedule="cosine")
    assert [lr_multiplier(s, cfg) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_multiplier(9, cfg) == pytest.approx(0.1) and lr_multiplier(5, cfg) < lr_multiplier(4, cfg)
    assert lr_multiplier(5.5, SimpleNamespace(**{**vars(cfg), "lr_schedule": "linear"})) == pytest.approx(0.55)
    assert lr_multiplier(9, SimpleNamespace(**{**vars(cfg), "lr_schedule": "constant"})) == 1.0


def test_the_kl_term_is_zero_at_the_start_and_grows(soft_model_dir, records, tmp_path):
    """rl.kl_coef: the KL to the starting model is 0 on the first step (the policy is the reference) and positive
    once the policy has moved; without it there is no reference and no KL figure."""
    run_rl(rl_config(soft_model_dir, records, steps=3, kl_coef=0.5), tmp_path / "kl", reward=ByteSumParity())
    kl = [m["kl"] for m in read_metrics(tmp_path / "kl")]
    assert kl[0] == 0.0 and all(k > 0 for k in kl[1:])
    run_rl(rl_config(soft_model_dir, records, steps=2), tmp_path / "none", reward=ByteSumParity())
    assert [m["kl"] for m in read_metrics(tmp_path / "none")] == [None, None]


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
    # A decaying learning rate is a function of rl.steps: then more steps would change the steps already run.
    assert main(["rl", str(soft_model_dir), "--config", str(config), "--out-dir", str(tmp_path / "cosine"),
                 "--rl.lr_schedule", "cosine"]) == 0
    assert main(["rl", "--out-dir", str(tmp_path / "cosine"), "--resume", "--rl.steps", "3"]) == 2
    assert "cannot change rl.steps" in capsys.readouterr().err


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
    with pytest.raises(ConfigError, match="lr_schedule must be one of constant, cosine, linear"):
        rl_config(soft_model_dir, records, lr_schedule="wsd")
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        rl_config(soft_model_dir, records, min_lr_ratio=1.5)
    with pytest.raises(ConfigError, match="rl.stop must be one of auto, newline, eos"):
        rl_config(soft_model_dir, records, stop="\\n")
    with pytest.raises(ConfigError, match="refill_rounds must be >= 0"):
        rl_config(soft_model_dir, records, refill_rounds=-1)
    with pytest.raises(ConfigError, match="rl.micro_batch must be >= 0, got -2"):
        rl_config(soft_model_dir, records, micro_batch=-2)


def test_a_resumed_run_cannot_change_the_micro_batch(soft_model_dir, records, tmp_path):
    """rl.micro_batch changes the float rounding of the loss: a resumed run would not compute what the
    uninterrupted one computes bit for bit."""
    save_config(rl_config(soft_model_dir, records), tmp_path)
    with pytest.raises(ConfigError, match="cannot change rl.micro_batch"):
        resumed_config(tmp_path, {"rl.micro_batch": "4"})


def test_the_bundled_recipe_is_a_config_name(soft_model_dir, records, tmp_path):
    """--config state-tracking: the recipe of experiments/rl, bundled; a file path still wins."""
    train, _ = records
    raw = read_sections(config_path("state-tracking"))
    cfg = build_rl_config(raw, {"rl.model": str(soft_model_dir), "rl.data": str(train)})
    assert (cfg.lr_schedule, cfg.dynamic_sampling, cfg.max_new_tokens, cfg.truncated_reward) == ("cosine", True, 16, 0)
    mine = tmp_path / "state-tracking"
    mine.write_text("rl:\n  lr: 0.5\n")
    assert config_path(str(mine)) == mine


# ---- chat prompts (rl.chat) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """A tiny FBT with the byte tokenizer's chat extension (the built-in template, <|im_end|> ending a turn)."""
    tok = ByteTokenizer(chat=True)
    torch.manual_seed(0)
    model = FullBandLM(FullBandConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, d_ff=32,
                                      max_seq_len=64))
    path = tmp_path_factory.mktemp("rl_chat") / "model"
    model.save_pretrained(path)
    tok.save(path / "tokenizer")
    return path


def test_chat_prompts_are_the_chat_template_and_replies_end_at_the_end_of_turn(chat_model_dir, records, tmp_path,
                                                                                monkeypatch):
    """rl.chat: the rollouts' and the evaluation's prompts are apply_chat_template's one-user-message conversation;
    the end-of-turn token ends a rollout (not a newline, with the exact reward's auto stop), and the reward grades
    the reply before it. Without rl.chat the same prompts are plain text and the same rows do not end."""
    tok = ByteTokenizer(chat=True)
    end_of_turn = tok.token_to_id("<|im_end|>")
    rows = [tok.encode("85") + [end_of_turn] + tok.encode("x"), tok.encode("8\n5") + [end_of_turn],
            tok.encode("1234")]
    calls = []

    def fake_generate(model, prompts, max_new_tokens, **kwargs):
        calls.append(dict(prompts=prompts, **kwargs))
        return torch.tensor(rows[: len(prompts)] if len(prompts) <= len(rows) else [rows[0]] * len(prompts))

    monkeypatch.setattr("fullband.rl.trainer.generate", fake_generate)
    for chat in (True, False):
        cfg = rl_config(chat_model_dir, records, chat=chat, prompts_per_step=1, group_size=3, max_new_tokens=4,
                        stop="auto" if chat else "newline")
        trainer = RLTrainer(cfg, tmp_path / str(chat), reward=Recorder())
        record = trainer.draw_records(0, 0)[0]
        batch = trainer.rollouts(0, 0)
        trainer.evaluate()
        rollout_call, eval_call = calls[-2:]
        def encoded(text, chat=chat):
            return apply_chat_template(tok, [{"role": "user", "content": text}]) if chat else encode_prompt(tok, text)

        assert rollout_call["prompts"] == [encoded(record["prompt"])] * 3
        assert eval_call["prompts"] == [encoded(r["prompt"]) for r in trainer.val_records]
        if chat:
            assert trainer.stop == "eos" and end_of_turn in rollout_call["stop_token_ids"]
            assert eval_call["stop_token_ids"] == rollout_call["stop_token_ids"]
            assert tok.encode("\n")[0] not in rollout_call["stop_token_ids"]
            assert batch.ended.tolist() == [True, True, False]
            assert batch.completions[:2] == [rows[0][:3], rows[1]]
            assert trainer.reward.seen[:3] == ["85", "8\n5", "1234"]
        else:  # plain prompts, the exact reward's newline stop: <|im_end|> is just another token
            assert trainer.stop == "newline" and end_of_turn not in rollout_call["stop_token_ids"]
            assert batch.ended.tolist() == [False, True, False]
            assert trainer.reward.seen[:3] == ["85x", "8", "1234"]


def test_a_chat_run_trains_and_evaluates(chat_model_dir, records, tmp_path):
    cfg = rl_config(chat_model_dir, records, chat=True, steps=2, eval_every=1, max_new_tokens=4)
    result = run_rl(cfg, tmp_path, reward=ByteSumParity())
    assert result.steps == 2 and 0.0 <= result.final_accuracy <= 1.0
    assert [json.loads(line)["step"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["rl"]["chat"] is True


def test_chat_without_a_chat_template_is_refused(soft_model_dir, records, tmp_path):
    """The plain byte tokenizer has neither a template nor the chat tokens: refused before any rollout, saying what
    to do."""
    with pytest.raises(ConfigError, match="rl.chat true needs a chat template.*fullband train --data.format chat"
                       ".*leave rl.chat false"):
        run_rl(rl_config(soft_model_dir, records, chat=True), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()

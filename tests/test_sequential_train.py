"""train.exact_mode sequential: the exact recurrence trained token by token (FullBandLM.recurrence) has the
loss and gradients of the K-pass Jacobi path with pass_loss last (float64, 1e-10), with packed isolated
documents, sliding windows and the model's attention variants; a run through the trainer matches the Jacobi
mode's run step by step; the options it cannot honour are refused."""

from __future__ import annotations

import pytest
import test_train_curriculum
import torch
from conftest import FEATURES, make_model
from test_train import read_metrics, steps_of, tiny_config

from fullband.errors import ConfigError
from fullband.generation import sequential_forward
from fullband.model import plain_positions
from fullband.train import train
from fullband.train.objective import multipass_loss, sequential_loss

B, T = 3, 12
# Row 0: two documents; row 1: one; row 2: four, one of a single token (its own first and last position).
SEGMENTS = torch.tensor([[0] * 5 + [1] * 7, [0] * 12, [0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3]])
VARIANTS = {"full": {}, "window4": dict(sliding_window=4), **FEATURES,
            "concat_window": dict(fusion="concat", sliding_window=4)}


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (B, T), generator=g)
    labels = torch.randint(0, 64, (B, T), generator=g)
    labels[:, :2] = -100
    return ids, labels


def _loss_and_grads(model, out) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _generators(seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + row) for row in range(B)]


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_and_every_gradient_equal_the_jacobi_path(single_thread, variant, packed):
    ids, labels = _batch()
    # train mode with jitter 0: what a sequential run trains (the config refuses jitter)
    model = make_model(dtype=torch.float64, feedback_jitter=0.0, **VARIANTS[variant]).train()
    segments = SEGMENTS if packed else None
    plain_mask = torch.zeros(B, T, dtype=torch.bool)
    plain_mask[1, 7] = True  # a position plain in every pass (e.g. a chat turn's start)
    recurrence = dict(segment_ids=segments, plain_mask=plain_mask, prefix_mixin=0.5)
    jacobi_loss, jacobi = _loss_and_grads(model, multipass_loss(model, ids, labels, T, pass_loss="last",
                                                                 generator=_generators(1), **recurrence))
    loss, grads = _loss_and_grads(model, sequential_loss(model, ids, labels, generator=_generators(1),
                                                          **recurrence))
    torch.testing.assert_close(loss, jacobi_loss, rtol=0, atol=1e-10)
    assert grads.keys() == jacobi.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in jacobi.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-10, msg=name)


def test_packed_documents_need_only_the_longest_document_in_passes(single_thread):
    """The trainer's exact K is the longest document (here 7 < T), not T: the same loss and gradients."""
    ids, labels = _batch(1)
    segments = SEGMENTS.clone()
    segments[1, 6:] = 1  # row 1 as two documents of 6: the longest of the batch is row 0's second, 7 tokens
    model = make_model(dtype=torch.float64, feedback_jitter=0.0, sliding_window=4).train()
    jacobi_loss, jacobi = _loss_and_grads(model, multipass_loss(model, ids, labels, 7, pass_loss="last",
                                                                 segment_ids=segments))
    loss, grads = _loss_and_grads(model, sequential_loss(model, ids, labels, segment_ids=segments))
    torch.testing.assert_close(loss, jacobi_loss, rtol=0, atol=1e-10)
    for name, grad in jacobi.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("variant", ["full", "gate_window"])
def test_states_equal_the_cached_decoding_recurrence(single_thread, variant):
    """With gradients (keys kept per step, StepKeys) against fullband.generation.sequential_forward (the KV cache,
    no gradients)."""
    ids, _ = _batch(2)
    model = make_model(dtype=torch.float64, **VARIANTS[variant])
    plain = plain_positions(ids, segment_ids=SEGMENTS)
    out = model.recurrence(ids, plain, segment_ids=SEGMENTS)
    assert out.hidden.requires_grad  # the path that backpropagates
    logits, hidden = out.logits, out.hidden
    want_logits, want_hidden = sequential_forward(model, ids, plain_mask=plain, segment_ids=SEGMENTS)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=1e-10)


# Parity records of 1..8 moves (14..21 tokens, one or two per window of 33), prepared once per module.
packed_records = test_train_curriculum.mixed_lengths


def test_a_sequential_run_matches_the_jacobi_run(tmp_path, packed_records):
    """Float32 through the trainer (it has no float64): a few steps with grad accumulation, prefix mixin and a
    window. The two paths sum in different orders, so the metrics agree to float32 rounding, compounded over
    the steps' updates."""
    data, data_dir = packed_records
    steps, grad_accum = 3, 2
    runs = {}
    for mode in ("jacobi", "sequential"):
        cfg = tiny_config(data=data, model={"feedback_jitter": 0.0, "sliding_window": 4},
                          train={"schedule": "exact", "exact_mode": mode, "pass_loss": "last", "prefix_mixin": 1.0,
                                 "grad_accum": grad_accum, "tokens": steps_of(steps, grad_accum), "dtype": "float32"})
        result = train(cfg, tmp_path / mode, data_dir=data_dir)
        runs[mode] = (result, read_metrics(tmp_path / mode))
    (jacobi, a), (sequential, b) = runs["jacobi"], runs["sequential"]
    assert [r["passes"] for r in a] == [r["passes"] for r in b] and min(r["passes"] for r in a) > 1
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["pass_losses"] == pytest.approx(x["pass_losses"][-1:], rel=1e-5)  # the exact pass alone
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    # compute: one pass per step instead of K
    assert sequential.compute_tokens == jacobi.tokens
    assert jacobi.compute_tokens == sum(steps_of(1, grad_accum) * r["passes"] for r in a)
    assert sequential.final_eval.loss == pytest.approx(jacobi.final_eval.loss, rel=1e-4)  # the trained weights


@pytest.mark.parametrize("train_options, model_options, message", [
    ({"pass_loss": "paper"}, {}, "train.pass_loss='paper' scores the plain and intermediate"),
    ({"pass_loss": "paper+last"}, {}, "train.pass_loss='paper\\+last'"),
    ({}, {"feedback_jitter": 0.02}, "model.feedback_jitter=0.02"),
    ({"grad_passes": 2}, {}, "train.grad_passes=2"),
    ({"detach_passes": True}, {}, "train.detach_passes"),
    ({"compile": True}, {}, "train.compile"),
    ({"parallel": "fsdp"}, {}, "train.parallel fsdp"),
    ({"exact_mode": "tokenwise"}, {}, "train.exact_mode='tokenwise': allowed values are jacobi, sequential"),
])
def test_what_the_token_steps_cannot_do_is_refused(train_options, model_options, message):
    train_section = {"schedule": "exact", "exact_mode": "sequential", "pass_loss": "last", **train_options}
    model_section = {"feedback_jitter": 0.0, **model_options}
    with pytest.raises(ConfigError, match=message):
        tiny_config(data={"format": "prompt_answer"}, model=model_section, train=train_section)
    ok = tiny_config(data={"format": "prompt_answer"}, model={"feedback_jitter": 0.0},
                     train={"schedule": "exact", "exact_mode": "sequential", "pass_loss": "last"})
    assert ok.train.exact_mode == "sequential"


def test_other_schedules_have_no_exact_pass_to_compute(tmp_path, packed_records):
    """A preset's baseline overrides train.schedule alone (experiments/sweeps.py, the demo): with schedule
    standard, exact_mode sequential and the Jacobi-only options are accepted, and the run is the plain one."""
    data, data_dir = packed_records
    metrics = {}
    for mode in ("jacobi", "sequential"):
        cfg = tiny_config(data=data, model={"feedback_jitter": 0.02},
                          train={"schedule": "standard", "exact_mode": mode, "pass_loss": "paper",
                                 "tokens": steps_of(1)})
        train(cfg, tmp_path / mode, data_dir=data_dir)
        metrics[mode] = read_metrics(tmp_path / mode)
    assert metrics["sequential"] == [{**r, **{k: metrics["sequential"][0][k] for k in ("elapsed_s", "tokens_per_s")}}
                                     for r in metrics["jacobi"]]

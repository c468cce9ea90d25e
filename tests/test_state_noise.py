"""Noise on the carried state in sequential training (model.feedback_jitter with train.exact_mode sequential):
the perturbed state is what position t is fused with, the state carried on stays exact, the compiled chunks add
the same noise, and sequential_loss draws it from the rows' generators."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from test_sequential_train import SEGMENTS, B, T, _batch, _generators, _loss_and_grads

from fullband.train.objective import sequential_loss


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_noise_perturbs_the_fed_state_only(single_thread):
    ids, _ = _batch()
    model = make_model(dtype=torch.float64, feedback_jitter=0.0, sliding_window=4).eval()
    D = model.config.d_model
    at = 5
    noise = torch.zeros(B, T, D, dtype=torch.float64)
    noise[:, at] = torch.randn(B, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plain = model.recurrence(ids).hidden
    noisy = model.recurrence(ids, state_noise=noise).hidden
    torch.testing.assert_close(noisy[:, :at], plain[:, :at], rtol=0, atol=0)
    assert (noisy[:, at] - plain[:, at]).abs().max() > 1e-3
    # The same as running the prefix, then the rest from the perturbed state over the prefix's keys: the state
    # carried past position `at` is that position's own top state, not a perturbed one.
    cache = model.new_cache(B, T)
    prefix = model.recurrence(ids[:, :at], past_key_values=cache).hidden
    rest = model.recurrence(ids[:, at:], past_key_values=cache, state=prefix[:, -1:] + noise[:, at : at + 1]).hidden
    torch.testing.assert_close(noisy[:, at:], rest, rtol=0, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
def test_compiled_chunks_add_the_same_noise(single_thread, packed):
    ids, labels = _batch()
    model = make_model(dtype=torch.float64, feedback_jitter=0.0, sliding_window=4).train()
    options = dict(segment_ids=SEGMENTS if packed else None, jitter=0.3)
    steps = _loss_and_grads(model, sequential_loss(model, ids, labels, generator=_generators(1), **options))
    model.compile_recurrence(5, backend="aot_eager")
    chunks = _loss_and_grads(model, sequential_loss(model, ids, labels, generator=_generators(1), **options))
    torch.testing.assert_close(chunks[0], steps[0], rtol=0, atol=1e-10)
    for name, grad in steps[1].items():
        torch.testing.assert_close(chunks[1][name], grad, rtol=0, atol=1e-10, msg=name)
    exact = _loss_and_grads(model, sequential_loss(model, ids, labels, generator=_generators(1),
                                                   segment_ids=options["segment_ids"]))
    assert abs(float(exact[0] - steps[0])) > 1e-6  # the noise changed the loss

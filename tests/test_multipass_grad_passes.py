"""grad_passes=g: the first K - g passes run without a graph (T2MLR-style truncation)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model, reference_recurrence, shift

from fullband.train.objective import multipass_loss

K, T = 6, 7


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (3, T), generator=g)
    labels = torch.randint(0, 64, (3, T), generator=g)
    labels[:, :2] = -100
    return ids, labels


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_all_passes_with_gradient_is_the_default(single_thread):
    ids, labels = _batch()
    model = make_model(dtype=torch.float64)
    multipass_loss(model, ids, labels, K).loss.backward()
    full = _grads(model)
    model.zero_grad()
    multipass_loss(model, ids, labels, K, grad_passes=K).loss.backward()
    assert _grads(model).keys() == full.keys()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, full[name], rtol=0, atol=0)


@pytest.mark.parametrize("grad_passes", [1, 2, 4])
def test_loss_value_unchanged_gradient_only_through_the_last_passes(single_thread, grad_passes):
    ids, labels = _batch(1)
    model = make_model(dtype=torch.float64)
    full = multipass_loss(model, ids, labels, K)
    out = multipass_loss(model, ids, labels, K, grad_passes=grad_passes)
    torch.testing.assert_close(out.loss, full.loss, rtol=1e-12, atol=0)
    out.loss.backward()
    got = _grads(model)

    # Reference, written independently: constant states for the first K - g passes, then the last g
    # passes by hand from model.forward, each weighted as in Eq. 12 (λ = 1).
    model.zero_grad()
    plain = torch.zeros(ids.shape, dtype=torch.bool)
    plain[:, 0] = True
    with torch.no_grad():
        hidden = model(ids).hidden
        for _ in range(K - grad_passes - 1):
            hidden = model(ids, feedback=shift(hidden), plain_mask=plain).hidden
    first = K - grad_passes  # 0-based index of the first pass with a graph
    loss = 0.0
    for k in range(first, K):
        step = model(ids, feedback=shift(hidden), plain_mask=plain) if k > 0 else model(ids)
        ce = F.cross_entropy(step.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss = loss + ce * (1.0 if k == 0 else 1.0 / (K - 1))
        hidden = step.hidden
    loss.backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12)


def test_enough_passes_still_reach_the_exact_recurrence(single_thread):
    """K = T passes with a graph through the last 2 only: the last pass is the token-by-token recurrence."""
    ids, _ = _batch(2)
    model = make_model(dtype=torch.float64)
    out = model.multipass(ids, T, grad_passes=2)
    ref_logits, _ = reference_recurrence(model, ids)
    torch.testing.assert_close(out.logits[-1], ref_logits, rtol=1e-10, atol=1e-10)


def test_bad_grad_passes_is_a_clear_error():
    ids, _ = _batch()
    with pytest.raises(ValueError, match="grad_passes must be None"):
        make_model().multipass(ids, 3, grad_passes=0)

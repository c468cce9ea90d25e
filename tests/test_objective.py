"""The training loss over the passes (fullband.train.objective) against Eq. 12 written by hand in float64 from
``model.forward`` (docs/method.md §4): loss, per-pass losses and gradients; the per-pass backward; masked
targets; the DDP-facing module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model, shift

from fullband.train.objective import LossOptions, MultipassObjective, multipass_loss, pass_weight

pytestmark = pytest.mark.usefixtures("single_thread")

K, LAMBDA = 3, 0.5
# Eq. 12 with K = 3 and λ = 0.5: L1 + λ·mean(L2, L3); "last": L3 alone; "paper+last": Eq. 12 + L3.
WEIGHTS = {"paper": [1.0, 0.25, 0.25], "last": [0.0, 0.0, 1.0], "paper+last": [1.0, 0.25, 1.25]}


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (3, 9), generator=g)
    labels = torch.randint(0, 64, (3, 9), generator=g)
    labels[0, :4] = -100  # an untrained prompt
    labels[2, -1] = -100
    return ids, labels


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reference(model, ids, labels, weights, z_loss=0.0, detach=False):
    """The loss by hand: pass 1 plain, pass k fed pass k-1's top states shifted by one (position 0 plain), each
    pass's mean cross-entropy over the trained targets, weighted, plus z_loss / K · mean(logsumexp²) per pass."""
    valid = labels != -100
    plain = torch.zeros(ids.shape, dtype=torch.bool)
    plain[:, 0] = True
    total, losses, hidden = 0.0, [], None
    for k, weight in enumerate(weights):
        out = model(ids) if k == 0 else model(ids, feedback=shift(hidden.detach() if detach else hidden),
                                              plain_mask=plain)
        ce = F.cross_entropy(out.logits[valid], labels[valid])
        total = total + weight * ce + z_loss / len(weights) * out.logits[valid].logsumexp(-1).pow(2).mean()
        losses.append(ce)
        hidden = out.hidden
    return total, losses


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("pass_loss", list(WEIGHTS))
def test_loss_and_gradients_equal_eq_12_by_hand_in_float64(pass_loss, z_loss):
    ids, labels = _batch(1)
    model = make_model(dtype=torch.float64)
    out = multipass_loss(model, ids, labels, K, later_pass_weight=LAMBDA, pass_loss=pass_loss, z_loss=z_loss)
    out.loss.backward()
    got = _grads(model)

    model.zero_grad(set_to_none=True)
    want_loss, want_losses = reference(model, ids, labels, WEIGHTS[pass_loss], z_loss)
    want_loss.backward()
    want = _grads(model)
    torch.testing.assert_close(out.loss, want_loss.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.stack(out.pass_losses), torch.stack(want_losses).detach(), rtol=1e-12, atol=0)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_pass_weight_is_eq_12():
    for name, weights in WEIGHTS.items():
        assert [pass_weight(k, K, name, LAMBDA) for k in range(K)] == pytest.approx(weights, abs=1e-15)
    assert pass_weight(0, 1, "paper") == 1.0  # one pass: L1 alone, no division by K - 1 = 0
    with pytest.raises(ValueError, match="pass_loss must be one of paper, last, paper\\+last"):
        pass_weight(0, 2, "first+last")


@pytest.mark.parametrize("passes", [2, 3])
def test_per_pass_backward_equals_one_backward_when_detached(passes):
    """backward_scale backpropagates each pass as it finishes (memory of one pass, not K): the gradients and
    losses must equal one backward of the whole detached objective, and both the detached reference by hand."""
    ids, labels = _batch(2)
    model = make_model(dtype=torch.float64)
    kwargs = dict(detach=True, later_pass_weight=0.7, z_loss=1e-3)
    out = multipass_loss(model, ids, labels, passes, **kwargs)
    out.loss.backward()
    once = _grads(model)
    model.zero_grad(set_to_none=True)

    now = multipass_loss(model, ids, labels, passes, backward_scale=0.5, **kwargs)
    assert not now.loss.requires_grad
    torch.testing.assert_close(now.loss, out.loss.detach(), atol=1e-12, rtol=0)
    assert _grads(model).keys() == once.keys()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, 0.5 * once[name], atol=1e-12, rtol=1e-10)

    model.zero_grad(set_to_none=True)
    weights = [1.0] + [0.7 / (passes - 1)] * (passes - 1)
    want_loss, _ = reference(model, ids, labels, weights, z_loss=1e-3, detach=True)
    want_loss.backward()
    torch.testing.assert_close(out.loss, want_loss.detach(), rtol=1e-12, atol=0)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(once[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_per_pass_backward_with_prefix_mixin_and_jitter_matches_one_backward():
    """In training mode (jitter) with prefix mixin, both paths draw the same random numbers from the same
    per-row generators, so the per-pass backward still equals one backward."""
    ids, labels = _batch(3)
    model = make_model(dtype=torch.float64).train()
    grads, losses = [], []
    for scale in (None, 1.0):
        model.zero_grad(set_to_none=True)
        generators = [torch.Generator().manual_seed(10 + row) for row in range(ids.shape[0])]
        out = multipass_loss(model, ids, labels, 3, detach=True, prefix_mixin=1.0, generator=generators,
                             backward_scale=scale)
        if scale is None:
            out.loss.backward()
        grads.append(_grads(model))
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[1], losses[0], atol=1e-12, rtol=0)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-12, rtol=1e-10)


def test_masked_targets_are_skipped_and_a_batch_without_any_is_zero_not_nan():
    ids, labels = _batch(4)
    model = make_model(dtype=torch.float64)
    masked = labels.clone()
    masked[:, :6] = -100
    out = multipass_loss(model, ids, masked, 2)
    logits = model.multipass(ids, 2).logits
    for k in range(2):
        want = F.cross_entropy(logits[k][:, 6:].flatten(0, 1), labels[:, 6:].flatten())
        torch.testing.assert_close(out.pass_losses[k], want, rtol=1e-12, atol=0)
    nothing = multipass_loss(model, ids, torch.full_like(ids, -100), 2, z_loss=1e-4)
    assert float(nothing.loss.detach()) == 0.0
    nothing.loss.backward()  # a zero loss still backpropagates (a rank whose window is all prompt)


def test_bf16_logits_are_scored_in_float32():
    ids, labels = _batch(5)
    model = make_model(dtype=torch.bfloat16)
    out = multipass_loss(model, ids, labels, 2)
    assert out.loss.dtype == torch.float32 and all(loss.dtype == torch.float32 for loss in out.pass_losses)


def test_objective_module_is_multipass_loss_and_rejects_bad_arguments():
    ids, labels = _batch(6)
    model = make_model(dtype=torch.float64)
    objective = MultipassObjective(model, LossOptions(later_pass_weight=LAMBDA, grad_passes=2))
    assert list(objective.parameters()) == list(model.parameters())  # DDP/FSDP see the model's weights
    a = objective(ids, labels, 3)
    b = multipass_loss(model, ids, labels, 3, later_pass_weight=LAMBDA, grad_passes=2)
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="backward_scale needs detach=True"):
        multipass_loss(model, ids, labels, 2, backward_scale=1.0)
    with pytest.raises(ValueError, match="pass_loss must be one of"):
        multipass_loss(model, ids, labels, 2, pass_loss="first+last")
    with pytest.raises(ValueError, match="passes must be >= 1"):
        multipass_loss(model, ids, labels, 0)

"""The training-recipe options beyond the paper that presets use (docs/method.md, "options beyond the paper"):
model.gate_init_std, train.pass_loss and train.adam_eps."""

from __future__ import annotations

import pytest
import test_train
import torch
import torch.nn.functional as F
from conftest import make_model, shift
from conftest import tiny_config as tiny_model_config
from test_train import read_metrics, steps_of, tiny_config

from fullband import FullBandLM
from fullband.config import ConfigError, TrainConfig
from fullband.train import train
from fullband.train.objective import multipass_loss
from fullband.train.optim import build_optimizers

pytestmark = pytest.mark.usefixtures("single_thread")
parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)


# ---- model.gate_init_std -------------------------------------------------------------------------


def test_gate_init_std_scales_w_g_alone_and_leaves_every_other_draw_unchanged():
    def build(**overrides):
        torch.manual_seed(0)
        return FullBandLM(tiny_model_config(fusion="gate", init_std=0.02, **overrides))

    plain, wide = build(), build(gate_init_std=0.5)
    for (name, a), (_, b) in zip(plain.named_parameters(), wide.named_parameters(), strict=True):
        if name == "fusion.gate_proj.weight":
            torch.testing.assert_close(b, a * 25, rtol=1e-6, atol=0)  # the same draws, 0.5 / 0.02 times larger
        else:
            assert torch.equal(a, b), name
    # Mid-training re-initialises the fusion with the same std.
    torch.manual_seed(1)
    wide.reset_fusion_parameters()
    assert 0.4 < wide.fusion.gate_proj.weight.std().item() < 0.6
    assert 0.01 < wide.fusion.value_proj.weight.std().item() < 0.03


# ---- train.pass_loss -----------------------------------------------------------------------------


def _grads(model: FullBandLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _passes_by_hand(model: FullBandLM, ids: torch.Tensor, passes: int, detach: bool = False) -> list:
    """The K passes written from model.forward: pass 1 plain, pass k fed pass k-1's top states shifted by one
    position (detached if asked), position 0 plain."""
    plain = torch.zeros(ids.shape, dtype=torch.bool)
    plain[:, 0] = True
    outs = [model(ids)]
    for _ in range(passes - 1):
        hidden = outs[-1].hidden
        outs.append(model(ids, feedback=shift(hidden.detach() if detach else hidden), plain_mask=plain))
    return outs


@pytest.mark.parametrize("detach", [False, True])
def test_last_pass_only_backpropagates_pass_k_alone(detach):
    """The loss is pass K's cross-entropy; the gradient is that of pass K's loss through the passes that fed
    it (only pass K's own graph when the states are detached), by hand from model.forward."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (3, 7), generator=g)
    labels = torch.randint(0, 64, (3, 7), generator=g)
    labels[:, :3] = -100
    K = 4
    model = make_model(dtype=torch.float64)
    kwargs = {"backward_scale": 1.0} if detach else {}
    out = multipass_loss(model, ids, labels, K, pass_loss="last", detach=detach, **kwargs)
    assert len(out.pass_losses) == K
    torch.testing.assert_close(out.loss, out.pass_losses[-1].detach(), rtol=1e-12, atol=0)
    if not detach:
        out.loss.backward()
    got = _grads(model)

    model.zero_grad()
    step = _passes_by_hand(model, ids, K, detach)[-1]
    F.cross_entropy(step.logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12)


def test_training_with_pass_loss_last_reports_the_last_pass_loss(tmp_path, parity_data):
    cfg = tiny_config(train={"tokens": steps_of(4), "schedule": "fixed:3", "pass_loss": "last"})
    train(cfg, tmp_path / "run", data_dir=parity_data)
    for row in read_metrics(tmp_path / "run"):
        assert len(row["pass_losses"]) == 3
        assert row["loss"] == pytest.approx(row["pass_losses"][-1], rel=1e-6)


def test_unknown_pass_loss_is_a_clear_error():
    for unknown in ("first", "first+last"):
        with pytest.raises(ConfigError, match="pass_loss='first.*': allowed values are paper, last, paper\\+last"):
            tiny_config(train={"pass_loss": unknown})


def test_paper_plus_last_adds_the_last_pass_to_eq_12():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (2, 6), generator=g)
    labels = torch.randint(0, 64, (2, 6), generator=g)
    model = make_model(dtype=torch.float64)
    paper = multipass_loss(model, ids, labels, 4, later_pass_weight=0.5)
    both = multipass_loss(model, ids, labels, 4, later_pass_weight=0.5, pass_loss="paper+last")
    torch.testing.assert_close(both.loss, paper.loss + paper.pass_losses[-1], rtol=1e-12, atol=0)
    first, *later = paper.pass_losses
    torch.testing.assert_close(paper.loss, first + 0.5 * sum(later) / 3, rtol=1e-12, atol=0)


# ---- train.adam_eps ------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_adam_eps_damps_steps_on_gradients_below_it(optimizer):
    """A gradient of 1e-7 everywhere (a loss near 0): the default epsilon still takes a step of about lr,
    epsilon 1e-5 one about 100 times smaller, on every parameter AdamW updates."""
    moves = {}
    for eps in (1e-8, 1e-5):
        model = make_model()
        cfg = TrainConfig(optimizer=optimizer, adam_eps=eps, weight_decay=0.0)
        optimizers = build_optimizers(model, cfg)
        adam_params = [p for o in optimizers if isinstance(o, torch.optim.AdamW) for g in o.param_groups
                       for p in g["params"]]
        before = [p.detach().clone() for p in adam_params]
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-7)
        for opt in optimizers:
            opt.step()
        moved = torch.cat([(p - b).abs().flatten() for p, b in zip(adam_params, before, strict=True)])
        moves[eps] = (moved.min().item(), moved.max().item())
    for eps, (smallest, largest) in moves.items():
        want = cfg.lr * 1e-7 / (1e-7 + eps)
        assert smallest == pytest.approx(want, rel=1e-3) and largest == pytest.approx(want, rel=1e-3)

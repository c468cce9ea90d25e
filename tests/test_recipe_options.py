"""The training-recipe options beyond the paper (docs/method.md, "options beyond the paper"): model.embed_norm,
model.gate_init_std, the gate_token fusion, train.later_pass_weight_ramp, train.fusion_lr_multiplier,
train.fusion_warmup_steps and train.pass_loss."""

from __future__ import annotations

import pytest
import test_train
import torch
import torch.nn.functional as F
from conftest import FUSIONS, make_model, reference_decode, shift
from conftest import tiny_config as tiny_model_config
from safetensors.torch import load_file
from test_generation import generate_with_logits
from test_train import read_metrics, steps_of, tiny_config

from fullband import FullBandLM
from fullband.config import ConfigError, TrainConfig
from fullband.train import PassSchedule, train
from fullband.train.checkpoint import list_checkpoints
from fullband.train.feedback import feedback_start_step, fusion_warming_up, later_pass_weight_at, pass_loss_at
from fullband.train.optim import build_optimizers, set_lr

pytestmark = pytest.mark.usefixtures("single_thread")
parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)

# K = 1 for the first half of the run, then K = 2: the feedback phase is the second half.
HALF_SCHEDULE = [{"until": 0.5, "passes": {1: 1.0}}, {"until": 1.0, "passes": {2: 1.0}}]


def _stack_input(model: FullBandLM, **kwargs) -> torch.Tensor:
    """What the first block receives: the (plain or fused) input of every position."""
    seen = []
    handle = model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(**kwargs)
    finally:
        handle.remove()
    return seen[0]


# ---- model.gate_init_std, fusion gate_token -------------------------------------------------------


@pytest.mark.parametrize("fusion", ["gate", "gate_token"])
def test_gate_init_std_scales_w_g_alone_and_leaves_every_other_draw_unchanged(fusion):
    def build(**overrides):
        torch.manual_seed(0)
        return FullBandLM(tiny_model_config(fusion=fusion, init_std=0.02, **overrides))

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


def test_gate_token_adds_the_normalised_embedding_to_the_gated_state():
    gate, gate_token = make_model(fusion="gate"), make_model(fusion="gate_token")
    gate_token.load_state_dict(gate.state_dict())  # the two fusions have the same weights
    ids = torch.randint(0, 64, (2, 7))
    feedback = torch.randn(2, 7, 32)
    plain = torch.zeros(2, 7, dtype=torch.bool)
    token = gate.fusion.embed_norm(gate.embed(ids))
    got = _stack_input(gate_token, input_ids=ids, feedback=feedback, plain_mask=plain)
    torch.testing.assert_close(got, _stack_input(gate, input_ids=ids, feedback=feedback, plain_mask=plain) + token)
    # The token reaches the stack even when the fed-back state carries nothing.
    zero = _stack_input(gate_token, input_ids=ids, feedback=torch.zeros(2, 7, 32), plain_mask=plain)
    torch.testing.assert_close(zero, token)


# ---- model.embed_norm ----------------------------------------------------------------------------


@pytest.mark.parametrize("fusion", FUSIONS)
def test_embed_norm_gives_plain_inputs_unit_rms_and_feeds_the_normalised_embedding_to_the_fusion(fusion):
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (2, 9))
    feedback = torch.randn(2, 9, 32, dtype=torch.float64)
    plain = torch.rand(2, 9) < 0.5
    plain[:, 0] = True
    off = make_model(dtype=torch.float64, fusion=fusion, norm_eps=1e-12)
    on = make_model(dtype=torch.float64, fusion=fusion, norm_eps=1e-12, embed_norm=True)
    rms_off = _stack_input(off, input_ids=ids).pow(2).mean(-1).sqrt()
    rms_on = _stack_input(on, input_ids=ids).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms_on, torch.ones_like(rms_on), atol=1e-9, rtol=0)
    assert (rms_off - 1).abs().min() > 0.1  # the paper's plain input is not unit RMS: the option changes it

    x = _stack_input(on, input_ids=ids, feedback=feedback, plain_mask=plain)
    torch.testing.assert_close(x[plain].pow(2).mean(-1).sqrt(), torch.ones(int(plain.sum()), dtype=torch.float64),
                               atol=1e-9, rtol=0)
    # The fusion sees the normalised embedding, not the raw one.
    e = on.embed(ids)
    e_normed = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-12)
    with torch.no_grad():
        expected = on.fusion(e_normed, feedback)
        raw = on.fusion(e, feedback)
    torch.testing.assert_close(x[~plain], expected[~plain], atol=1e-9, rtol=0)
    if fusion not in ("gate", "gate_token"):  # gate fusions normalise e themselves: raw and normalised agree
        assert (x[~plain] - raw[~plain]).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["soft", "fused"])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_embed_norm_cached_decoding_matches_uncached_reference(fusion, mode):
    model = make_model(dtype=torch.float64, fusion=fusion, embed_norm=True, sliding_window=4)
    torch.manual_seed(21)
    prompt = torch.randint(0, 64, (1, 5))
    n = 8
    kwargs = {"fused_passes": 2} if mode == "fused" else {}
    tokens, logits = generate_with_logits(model, prompt, n, mode=mode, **kwargs)
    _, ref_logits = reference_decode(model, prompt, n, mode, forced=tokens[0], **kwargs)
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-10, rtol=0)


# ---- the λ ramp and the fusion warm-up: pure functions of the step --------------------------------


def test_later_pass_weight_ramps_from_the_feedback_phase_start():
    schedule = PassSchedule.parse("paper")  # feedback from 75% of the steps
    cfg = TrainConfig(later_pass_weight=0.5, later_pass_weight_ramp=0.5)
    assert feedback_start_step(schedule, 100) == 75
    # 25 feedback steps, ramp over 12.5 of them: λ = 0.5 · (step - 75) / 12.5, capped at 0.5
    expected = {0: 0.0, 74: 0.0, 75: 0.0, 76: 0.04, 80: 0.2, 87: 0.48, 88: 0.5, 99: 0.5}
    assert {s: later_pass_weight_at(s, 100, schedule, cfg) for s in expected} == pytest.approx(expected, abs=1e-12)
    assert later_pass_weight_at(80, 100, schedule, TrainConfig(later_pass_weight=0.5)) == 0.5  # no ramp: constant
    # A schedule with feedback from step 0, and one with no feedback at all.
    assert feedback_start_step(PassSchedule.parse("fixed:2"), 10) == 0
    assert feedback_start_step(PassSchedule.parse("standard"), 10) is None
    assert later_pass_weight_at(3, 10, PassSchedule.parse("standard"), cfg) == 0.5
    # The phase boundary is the step phase_at places first in the feedback phase, also for awkward fractions.
    odd = PassSchedule.parse([{"until": 0.3, "passes": {1: 1.0}}, {"until": 1.0, "passes": {1: 0.5, 3: 0.5}}])
    for total in (7, 10, 33, 1000):
        start = feedback_start_step(odd, total)
        assert odd.phase_at(start / total).until == 1.0 and odd.phase_at((start - 1) / total).until == 0.3


def test_fusion_warmup_covers_the_first_steps_of_the_feedback_phase():
    schedule = PassSchedule.parse(HALF_SCHEDULE)
    cfg = TrainConfig(fusion_warmup_steps=3)
    assert [fusion_warming_up(s, 10, schedule, cfg) for s in range(10)] == [False] * 5 + [True] * 3 + [False] * 2
    assert not any(fusion_warming_up(s, 10, schedule, TrainConfig()) for s in range(10))


def test_training_uses_the_ramped_weight_and_detaches_during_the_warmup(tmp_path, parity_data, monkeypatch):
    calls = []
    original = FullBandLM.multipass

    def spy(self, *args, **kwargs):
        if "later_pass_weight" in kwargs:  # a training step (the evaluation calls multipass too)
            calls.append((kwargs["passes"], kwargs["later_pass_weight"], kwargs["detach"]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FullBandLM, "multipass", spy)
    cfg = tiny_config(train={"tokens": steps_of(8), "schedule": HALF_SCHEDULE, "later_pass_weight": 0.8,
                             "later_pass_weight_ramp": 0.5, "fusion_warmup_steps": 1})
    train(cfg, tmp_path / "run", data_dir=parity_data)
    # Steps 4..7 have K = 2; λ ramps over 0.5 × 4 = 2 steps: 0, 0.4, 0.8, 0.8 (0 before: unused with K = 1);
    # step 4 alone is detached.
    assert [(k, pytest.approx(w), d) for k, w, d in calls] == (
        [(1, 0.0, False)] * 4 + [(2, 0.0, True), (2, 0.4, False), (2, 0.8, False), (2, 0.8, False)])
    rows = read_metrics(tmp_path / "run")
    for row, weight in zip(rows[4:], (0.0, 0.4, 0.8, 0.8), strict=True):
        first, later = row["pass_losses"]
        assert row["loss"] == pytest.approx(first + weight * later, rel=1e-6)


# ---- train.fusion_lr_multiplier ------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fusion_lr_multiplier_scales_the_fusion_groups(optimizer):
    model = make_model()
    fusion = {id(p) for p in model.fusion.parameters()}
    cfg = TrainConfig(optimizer=optimizer, fusion_lr_multiplier=0.25)
    optimizers = build_optimizers(model, cfg)
    seen = set()
    for opt in optimizers:
        peak = cfg.muon_lr if isinstance(opt, torch.optim.Muon) else cfg.lr
        for group in opt.param_groups:
            kinds = {id(p) in fusion for p in group["params"]}
            assert len(kinds) == 1  # no group mixes fusion and trunk parameters
            assert group["initial_lr"] == pytest.approx(peak * (0.25 if kinds == {True} else 1.0))
            seen |= {id(p) for p in group["params"]}
    assert seen == {id(p) for p in model.parameters()}
    set_lr(optimizers, 0.5)  # the schedule keeps the ratio
    for opt in optimizers:
        for group in opt.param_groups:
            assert group["lr"] == pytest.approx(0.5 * group["initial_lr"])
    # The default keeps today's groups (so existing checkpoints' optimizer states still load).
    assert [len(o.param_groups) for o in build_optimizers(model, TrainConfig(optimizer=optimizer))] == (
        [1, 1] if optimizer == "muon" else [2])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fusion_lr_multiplier_zero_freezes_the_fusion(optimizer):
    model = make_model().train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizers = build_optimizers(model, TrainConfig(optimizer=optimizer, fusion_lr_multiplier=0.0))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    model.multipass(ids[:, :-1], passes=2, labels=ids[:, 1:]).loss.backward()
    assert model.fusion.value_proj.weight.grad.abs().max() > 0  # the fusion had something to learn
    for opt in optimizers:
        opt.step()
    for name, p in model.named_parameters():
        moved = not torch.equal(p, before[name])
        assert moved != name.startswith("fusion."), name


def test_recipe_options_reject_bad_values():
    with pytest.raises(ConfigError, match="later_pass_weight_ramp"):
        tiny_config(train={"later_pass_weight_ramp": 1.5})
    with pytest.raises(ConfigError, match="fusion_lr_multiplier"):
        tiny_config(train={"fusion_lr_multiplier": -1.0})
    with pytest.raises(ConfigError, match="fusion_warmup_steps"):
        tiny_config(train={"fusion_warmup_steps": -2})


# ---- train.pass_loss: "last" ---------------------------------------------------------------------


def _grads(model: FullBandLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _passes_by_hand(model: FullBandLM, ids: torch.Tensor, passes: int, detach: bool = False) -> list:
    """The K passes of multipass written from model.forward: pass 1 plain, pass k fed pass k-1's top states
    shifted by one position (detached if asked), position 0 plain."""
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
    out = model.multipass(ids, K, labels=labels, pass_loss="last", detach=detach, **kwargs)
    assert len(out.pass_losses) == K
    torch.testing.assert_close(out.loss, out.pass_losses[-1].to(out.loss.dtype), rtol=1e-12, atol=0)
    if not detach:
        out.loss.backward()
    got = _grads(model)

    model.zero_grad()
    step = _passes_by_hand(model, ids, K, detach)[-1]
    F.cross_entropy(step.logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)


def test_training_with_pass_loss_last_reports_the_last_pass_loss(tmp_path, parity_data):
    cfg = tiny_config(train={"tokens": steps_of(4), "schedule": "fixed:3", "pass_loss": "last"})
    train(cfg, tmp_path / "run", data_dir=parity_data)
    for row in read_metrics(tmp_path / "run"):
        assert len(row["pass_losses"]) == 3
        assert row["loss"] == pytest.approx(row["pass_losses"][-1], rel=1e-6)


def test_last_pass_loss_from_switches_the_loss_at_its_fraction_of_the_steps(tmp_path, parity_data):
    assert [pass_loss_at(s, 10, TrainConfig()) for s in range(10)] == ["paper"] * 10  # the default never switches
    cfg = TrainConfig(pass_loss="paper+last", last_pass_loss_from=0.5)
    assert [pass_loss_at(s, 10, cfg) for s in range(10)] == ["paper+last"] * 5 + ["last"] * 5

    cfg = tiny_config(train={"tokens": steps_of(4), "schedule": "fixed:3", "last_pass_loss_from": 0.5})
    train(cfg, tmp_path / "run", data_dir=parity_data)
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        first, *later = row["pass_losses"]
        want = later[-1] if row["step"] > 2 else first + sum(later) / len(later)  # Eq. 12 with λ = 1
        assert row["loss"] == pytest.approx(want, rel=1e-6)


def test_resume_across_the_loss_switch_equals_the_uninterrupted_run(tmp_path, parity_data):
    sections = {"train": {"tokens": steps_of(4), "schedule": "fixed:3", "pass_loss": "first+last",
                          "last_pass_loss_from": 0.5}}
    train(tiny_config(**sections), tmp_path / "straight", data_dir=parity_data)
    stopped = test_train.merge(sections, {"train": {"stop_after_steps": 2}})  # stops right at the switch
    assert not train(tiny_config(**stopped), tmp_path / "split", data_dir=parity_data).finished
    assert train(tiny_config(**sections), tmp_path / "split", data_dir=parity_data, resume=True).finished
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert b[3]["loss"] == pytest.approx(b[3]["pass_losses"][-1], rel=1e-6)  # after the switch: LK alone
    assert b[0]["loss"] == pytest.approx(b[0]["pass_losses"][0] + b[0]["pass_losses"][-1], rel=1e-6)
    wa, wb = (load_file(str(list_checkpoints(tmp_path / run)[-1] / "model" / "model.safetensors"))
              for run in ("straight", "split"))
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)


def test_unknown_pass_loss_is_a_clear_error():
    with pytest.raises(ConfigError, match="train.pass_loss='first'"):
        tiny_config(train={"pass_loss": "first"}).validate()
    with pytest.raises(ConfigError, match="train.last_pass_loss_from=1.5 must lie in"):
        tiny_config(train={"last_pass_loss_from": 1.5}).validate()
    with pytest.raises(ValueError, match="pass_loss must be"):
        make_model().multipass(torch.zeros(1, 3, dtype=torch.long), 2, pass_loss="first")


def test_paper_plus_last_adds_the_last_pass_to_eq_12():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (2, 6), generator=g)
    labels = torch.randint(0, 64, (2, 6), generator=g)
    model = make_model(dtype=torch.float64)
    paper = model.multipass(ids, 4, labels=labels, later_pass_weight=0.5)
    both = model.multipass(ids, 4, labels=labels, later_pass_weight=0.5, pass_loss="paper+last")
    torch.testing.assert_close(both.loss, paper.loss + paper.pass_losses[-1].to(paper.loss.dtype), rtol=1e-6, atol=0)
    first, *later = paper.pass_losses
    torch.testing.assert_close(paper.loss, (first + 0.5 * sum(later) / 3).to(paper.loss.dtype), rtol=1e-6, atol=0)
    ends = model.multipass(ids, 4, labels=labels, later_pass_weight=0.5, pass_loss="first+last")
    torch.testing.assert_close(ends.loss, (first + later[-1]).to(ends.loss.dtype), rtol=1e-6, atol=0)


def test_first_plus_last_backpropagates_the_plain_and_the_last_pass_alone():
    """L1 + LK: the gradient equals that of the plain pass's and pass K's cross-entropies written by hand from
    model.forward; passes 2..K-1 add no loss term, only the path from pass 1 to pass K."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (2, 6), generator=g)
    labels = torch.randint(0, 64, (2, 6), generator=g)
    K = 4
    model = make_model(dtype=torch.float64)
    model.multipass(ids, K, labels=labels, pass_loss="first+last").loss.backward()
    got = _grads(model)

    model.zero_grad()
    first, *_, last = _passes_by_hand(model, ids, K)
    sum(F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()) for out in (first, last)).backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)


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

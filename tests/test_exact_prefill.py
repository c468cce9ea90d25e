"""The exact prefill (fused_passes="exact", decode mode fused:exact): the prompt through the exact recurrence one
token at a time, against the Jacobi fixed point (fused:auto at tol 0) and sequential_forward in float64, with left
padding (batched == one by one), a cache that already holds a prefix, generation, scoring and the settings."""

from __future__ import annotations

import pytest
import torch
from conftest import FEATURES, make_model

from fullband.decoding import DecodeSettings, DecodeSettingsError
from fullband.generation import generate, left_pad, score_continuations, sequential_forward

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 33, 2, 40, 9, 1, 22], [9, 1, 22, 61, 3, 3, 50, 12, 7, 8, 30], [44], [30, 31, 32]]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_exact_prefill_is_the_sequential_recurrence_and_the_jacobi_fixed_point(feature):
    model = make_model(dtype=torch.float64, **FEATURES[feature])
    ids = torch.tensor([PROMPTS[1]])
    exact = model.prefill(ids, "exact")
    seq_logits, seq_hidden = sequential_forward(model, ids)
    torch.testing.assert_close(exact.hidden, seq_hidden, atol=1e-12, rtol=0)
    torch.testing.assert_close(exact.logits, seq_logits, atol=1e-12, rtol=0)
    jacobi = model.prefill(ids, "auto", fused_tol=0.0, fused_max_passes=ids.shape[1] + 2)
    torch.testing.assert_close(exact.hidden, jacobi.hidden, atol=1e-10, rtol=0)
    assert exact.fused_passes.tolist() == [ids.shape[1] - 1]  # the Jacobi passes it stands for
    # Not vacuous: a few Jacobi passes are still away from it.
    assert (model.prefill(ids, 3).hidden - exact.hidden).abs().max() > 1e-6
    # logits_to_keep keeps the last positions only, with the same values.
    last = model.prefill(ids, "exact", logits_to_keep=1)
    assert last.logits.shape[1] == 1
    torch.testing.assert_close(last.logits[:, -1], exact.logits[:, -1], atol=1e-12, rtol=0)


@pytest.mark.parametrize("feature", ["mha_bias", "gate_window"])
def test_left_padded_batch_equals_one_by_one(feature):
    model = make_model(dtype=torch.float64, **FEATURES[feature])
    ids, mask = left_pad(PROMPTS)
    batched = model.prefill(ids, "exact", attention_mask=mask, logits_to_keep=1)
    assert batched.fused_passes.tolist() == [len(p) - 1 for p in PROMPTS]
    for row, prompt in enumerate(PROMPTS):
        alone = model.prefill(torch.tensor([prompt]), "exact", logits_to_keep=1)
        torch.testing.assert_close(batched.logits[row, -1], alone.logits[0, -1], atol=1e-12, rtol=0)
        torch.testing.assert_close(batched.hidden[row, -len(prompt):], alone.hidden[0], atol=1e-12, rtol=0)
    # The tokens a batch generates are each row's own, and those of fused:auto at its fixed point.
    kw = dict(mode="fused", fused_passes="exact")
    together = generate(model, PROMPTS, 6, **kw)
    for row, prompt in enumerate(PROMPTS):
        assert torch.equal(together[row], generate(model, [prompt], 6, **kw)[0])
    fixed_point = generate(model, PROMPTS, 6, mode="fused", fused_passes="auto", fused_tol=0.0, fused_max_passes=16)
    assert torch.equal(together, fixed_point)


def test_cache_is_left_as_the_recurrence_leaves_it():
    """Prefill into a cache, then decode: the next step equals the exact recurrence over prompt + token, and a
    prefill that continues a cache treats its first token as a fused pass does (plain)."""
    model = make_model(dtype=torch.float64, **FEATURES["gate_window"])
    prompt = torch.tensor([PROMPTS[0]])
    cache = model.new_cache(1, 12)
    out = model.prefill(prompt, "exact", past_key_values=cache, use_cache=True)
    assert cache.length == prompt.shape[1]
    step = model(torch.tensor([[11]]), feedback=out.hidden[:, -1:], past_key_values=cache, use_cache=True)
    whole_logits, whole_hidden = sequential_forward(model, torch.cat([prompt, torch.tensor([[11]])], dim=1))
    torch.testing.assert_close(step.logits[:, -1], whole_logits[:, -1], atol=1e-12, rtol=0)
    # Continuing a cached prefix: the continuation's first token is plain in both the Jacobi and exact prefill.
    for passes in ("exact", "auto"):
        cache = model.new_cache(1, 12)
        model.prefill(prompt[:, :5], passes, past_key_values=cache, use_cache=True, fused_tol=0.0,
                      fused_max_passes=8)
        rest = model.prefill(prompt[:, 5:], passes, past_key_values=cache, use_cache=True, fused_tol=0.0,
                             fused_max_passes=8)
        if passes == "exact":
            want = rest.hidden
        else:
            torch.testing.assert_close(rest.hidden, want, atol=1e-10, rtol=0)


def test_scoring_and_settings():
    model = make_model(dtype=torch.float64, **FEATURES["mha_bias"])
    contexts, continuations = [[5, 17, 33, 2], [9, 1]], [[40, 9], [22, 61, 3]]
    for scoring in ("decode", "prefill"):
        exact = score_continuations(model, contexts, continuations, mode="fused", fused_passes="exact",
                                    scoring=scoring)
        auto = score_continuations(model, contexts, continuations, mode="fused", fused_passes="auto", fused_tol=0.0,
                                   fused_max_passes=16, scoring=scoring)
        for (e_logprob, e_greedy), (a_logprob, a_greedy) in zip(exact, auto, strict=True):
            torch.testing.assert_close(e_logprob, a_logprob, atol=1e-6, rtol=0)
            assert torch.equal(e_greedy, a_greedy)

    settings = DecodeSettings().with_label("fused:exact")
    assert (settings.mode, settings.fused_passes, settings.prefill_passes) == ("fused", "exact", "exact")
    assert settings.label == "fused:exact" and "token by token" in settings.describe()
    assert DecodeSettings.from_dict(settings.to_dict()) == settings
    settings.check_within(1)  # no Jacobi passes to bound
    with pytest.raises(DecodeSettingsError, match="an integer >= 1, 'auto' or 'exact'"):
        DecodeSettings().with_label("fused:exactly")


def test_the_recurrence_continues_a_filled_cache_from_a_carried_state():
    """``FullBandLM.recurrence`` after a prefix in the cache, its first token fused with the prefix's last top state
    (as the Hugging Face model's soft decoding feeds several tokens), computes what it computes over the whole
    sequence; packed documents, which restart at position 0, are refused after a prefix."""
    model = make_model(dtype=torch.float64, **FEATURES["gate_window"])
    ids = torch.tensor([PROMPTS[1]])
    whole = model.recurrence(ids)
    cache = model.new_cache(1, ids.shape[1])
    head = model.recurrence(ids[:, :4], past_key_values=cache)
    rest = model.recurrence(ids[:, 4:], past_key_values=cache, state=head.hidden[:, -1:])
    assert cache.length == ids.shape[1]
    torch.testing.assert_close(torch.cat([head.hidden, rest.hidden], dim=1), whole.hidden, atol=1e-12, rtol=0)
    torch.testing.assert_close(rest.logits, whole.logits[:, 4:], atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="segment_ids .* start at position 0"):
        model.recurrence(ids[:, :2], past_key_values=cache, segment_ids=torch.zeros(1, 2, dtype=torch.long))

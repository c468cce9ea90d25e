"""Cached decoding in the three modes vs uncached references, batching, sampling, streaming, errors."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import FEATURES, FUSIONS, TEST_BF16, float32_case, make_model, reference_decode

import fullband.engine as engine
from fullband.generation import generate, generate_stream
from fullband.sampling import SamplingParams, sample_rows


def sample_next(logits, temperature=0.0, top_k=None, top_p=None, generator=None):
    """Every row of ``logits`` sampled with the same fields and one generator, drawn from in row order."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    return sample_rows(logits, [params] * logits.shape[0], [generator] * logits.shape[0])


@contextlib.contextmanager
def recorded_logits():
    """Record the logits the engine hands to the sampler at each step (the real cached decode path)."""
    seen: list[torch.Tensor] = []
    real = engine.sample_rows

    def spy(logits, *args, **kwargs):
        seen.append(logits.detach().clone())
        return real(logits, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "sample_rows", spy)
        yield seen


def generate_with_logits(model, prompt, n, **kwargs):
    with recorded_logits() as seen:
        tokens = generate(model, prompt, n, **kwargs)
    return tokens, torch.stack(seen, dim=1)  # (B, N), (B, N, V)


pytestmark = pytest.mark.usefixtures("single_thread")

# --------------------------------------------------------------------------------------------------
# 2. Soft decoding with the KV cache == uncached recomputation of the recurrence


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("feature", FEATURES)
def test_soft_decoding_matches_uncached_reference(feature, fusion, device):
    dtype, atol = float32_case(1e-5)
    model = make_model(dtype=dtype, fusion=fusion, **FEATURES[feature]).to(device)
    torch.manual_seed(20)
    prompt = torch.randint(0, 64, (1, 5)).to(device)
    n = 8  # prompt + generated = 13 > sliding window 4
    tokens, logits = generate_with_logits(model, prompt, n, mode="soft")
    assert tokens.shape == (1, n)
    ref_tokens, ref_logits = reference_decode(model, prompt, n, "soft", forced=tokens[0])
    torch.testing.assert_close(logits[0], ref_logits, atol=atol, rtol=0)
    if not TEST_BF16:  # in bf16, rounding may flip a near-tie between two greedy choices
        greedy_tokens, _ = reference_decode(model, prompt, n, "soft")
        assert torch.equal(tokens[0], greedy_tokens)

    # The test is not vacuous: standard decoding of the same tokens agrees at step 0 (plain prefill)
    # and differs afterwards (the fed-back state matters).
    _, std_logits = reference_decode(model, prompt, n, "standard", forced=tokens[0])
    torch.testing.assert_close(logits[0, 0], std_logits[0], atol=atol, rtol=0)
    assert (logits[0, 1:] - std_logits[1:]).abs().amax(-1).min() > 1e-4


@pytest.mark.parametrize("feature", FEATURES)
def test_standard_decoding_matches_uncached_reference_and_ignores_fusion(feature, device):
    dtype, atol = float32_case(1e-5)
    model = make_model(dtype=dtype, **FEATURES[feature]).to(device)
    torch.manual_seed(21)
    prompt = torch.randint(0, 64, (1, 5)).to(device)
    tokens, logits = generate_with_logits(model, prompt, 8, mode="standard")
    ref_tokens, ref_logits = reference_decode(model, prompt, 8, "standard", forced=tokens[0])
    if not TEST_BF16:  # in bf16, rounding may flip a near-tie between two greedy choices
        assert torch.equal(tokens[0], reference_decode(model, prompt, 8, "standard")[0])
    torch.testing.assert_close(logits[0], ref_logits, atol=atol, rtol=0)
    with torch.no_grad():
        for p in model.fusion.parameters():
            p.fill_(float("nan"))
    again, again_logits = generate_with_logits(model, prompt, 8, mode="standard")
    assert torch.equal(again, tokens) and torch.equal(again_logits, logits)


# --------------------------------------------------------------------------------------------------
# 4. fused(n): prefill == n+1 multipass passes, continuation == the uncached reference on those states


@pytest.mark.parametrize("n_passes", [1, 2])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_fused_decoding_matches_multipass_and_reference(fusion, n_passes, device):
    dtype, atol = float32_case(1e-5)
    model = make_model(dtype=dtype, fusion=fusion, **FEATURES["gate_window"]).to(device)
    torch.manual_seed(22)
    prompt = torch.randint(0, 64, (1, 7)).to(device)
    n = 6
    tokens, logits = generate_with_logits(model, prompt, n, mode="fused", fused_passes=n_passes)
    with torch.no_grad():
        passes = model.multipass(prompt, passes=n_passes + 1)
    # The first generated token is read from pass n+1's last position.
    torch.testing.assert_close(logits[0, 0], passes.logits[-1][0, -1], atol=atol, rtol=0)
    ref_tokens, ref_logits = reference_decode(model, prompt, n, "fused", fused_passes=n_passes, forced=tokens[0])
    torch.testing.assert_close(logits[0], ref_logits, atol=atol, rtol=0)
    if not TEST_BF16:  # in bf16, rounding may flip a near-tie between two greedy choices
        greedy_tokens, _ = reference_decode(model, prompt, n, "fused", fused_passes=n_passes)
        assert torch.equal(tokens[0], greedy_tokens)
    # Not vacuous: the extra passes change the prompt's last state, hence the first logits.
    _, soft_logits = generate_with_logits(model, prompt, 1, mode="soft")
    assert (soft_logits[0, 0] - logits[0, 0]).abs().max() > 1e-4
    if n_passes == 2:
        _, one_pass = generate_with_logits(model, prompt, 1, mode="fused", fused_passes=1)
        assert (one_pass[0, 0] - logits[0, 0]).abs().max() > 1e-4


# --------------------------------------------------------------------------------------------------
# 5. Batched generation with ragged prompts == one-by-one generation

PROMPTS = [[5, 17, 33, 2, 40], [9, 1, 22, 61, 3, 3, 50, 12, 7], [44], [30, 31, 32]]
MODES = [("standard", 1), ("soft", 1), ("fused", 2)]


def _right_padded(prompts, pad=63):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    return ids, mask


@pytest.mark.parametrize("mode,fused_passes", MODES)
@pytest.mark.parametrize("feature", ["mha_bias", "gate_window"])
def test_batched_ragged_generation_matches_one_by_one(feature, mode, fused_passes, device):
    model = make_model(dtype=torch.float64, **FEATURES[feature]).to(device)
    n = 7
    kw = dict(mode=mode, fused_passes=fused_passes)
    singles = [generate(model, torch.tensor([p]), n, **kw)[0] for p in PROMPTS]
    assert all(s.shape == (n,) for s in singles)
    batched = generate(model, PROMPTS, n, **kw)
    ids, mask = _right_padded(PROMPTS)
    from_tensor = generate(model, ids, n, attention_mask=mask, **kw)
    # Left padding given explicitly is handled the same way.
    left = torch.stack([torch.cat([torch.full((9 - len(p),), 63), torch.tensor(p)]) for p in PROMPTS])
    left_mask = left.new_tensor([[0] * (9 - len(p)) + [1] * len(p) for p in PROMPTS])
    from_left = generate(model, left, n, attention_mask=left_mask, **kw)
    for i, single in enumerate(singles):
        assert torch.equal(batched[i], single), (i, batched[i], single)
        assert torch.equal(from_tensor[i], single)
        assert torch.equal(from_left[i], single)

    # With an end-of-sequence token: pick one that row 0 emits mid-way.
    eos = int(singles[0][2])
    singles_eos = [generate(model, torch.tensor([p]), n, eos_token_id=eos, **kw)[0] for p in PROMPTS]
    batched_eos = generate(model, PROMPTS, n, eos_token_id=eos, **kw)
    assert singles_eos[0].shape[0] <= 3 and int(singles_eos[0][-1]) == eos
    lengths = []
    for i, single in enumerate(singles_eos):
        k = single.shape[0]
        lengths.append(k)
        assert torch.equal(batched_eos[i, :k], single)
        assert torch.equal(single, singles[i][:k])  # eos only truncates
        if k < n:
            assert int(single[-1]) == eos and eos not in single[:-1].tolist()
            assert bool((batched_eos[i, k:] == eos).all())  # finished rows are filled with eos
    assert batched_eos.shape[1] == max(lengths)


# --------------------------------------------------------------------------------------------------
# 7. Sampling


def test_seeded_sampling_is_reproducible():
    model = make_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    kw = dict(mode="soft", temperature=1.0)
    a = generate(model, prompts, 12, seed=123, **kw)
    b = generate(model, prompts, 12, seed=123, **kw)
    c = generate(model, prompts, 12, seed=124, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, generate(model, prompts, 12, mode="soft"))  # not greedy


def _draws(logits, n, **kw):
    g = torch.Generator().manual_seed(0)
    rows = logits.repeat_interleave(n, dim=0)
    return sample_next(rows, generator=g, **kw).view(logits.shape[0], n)


def test_sample_next_greedy_and_temperature():
    torch.manual_seed(30)
    logits = torch.randn(3, 10) * 2
    assert torch.equal(sample_next(logits), logits.argmax(-1))
    # With temperature 0.7 and no filter the empirical frequencies match softmax(logits / 0.7).
    draws = _draws(logits, 20000, temperature=0.7)
    freq = torch.stack([torch.bincount(r, minlength=10).double() / r.numel() for r in draws])
    torch.testing.assert_close(freq, (logits.double() / 0.7).softmax(-1), atol=0.015, rtol=0)


def test_sample_next_top_k_never_leaves_the_top_k():
    torch.manual_seed(31)
    logits = torch.randn(6, 20)
    draws = _draws(logits, 2000, temperature=1.5, top_k=3)
    top3 = logits.topk(3, dim=-1).indices
    for row, allowed in zip(draws, top3):
        assert set(row.tolist()) == set(allowed.tolist())  # inside the top 3, and all 3 reachable
    assert bool((_draws(logits, 50, temperature=1.0, top_k=1) == logits.argmax(-1, keepdim=True)).all())


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_sample_next_top_p_keeps_the_smallest_prefix_reaching_p(top_p):
    torch.manual_seed(32)
    logits = torch.randn(6, 12) * 1.5
    temperature = 1.3
    draws = _draws(logits, 3000, temperature=temperature, top_p=top_p)
    probs = (logits.double() / temperature).softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    cum = sorted_probs.cumsum(-1)
    for r in range(logits.shape[0]):
        # nucleus: the smallest prefix of the sorted tokens whose mass reaches top_p
        size = int((cum[r] < top_p).sum()) + 1
        assert (cum[r] - top_p).abs().min() > 1e-4  # no boundary case within float error
        allowed = set(order[r, :size].tolist())
        assert set(draws[r].tolist()) == allowed, (r, size)


def test_sample_next_top_p_one_keeps_everything():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0]])
    draws = _draws(logits, 4000, temperature=1.0, top_p=1.0)
    assert set(draws[0].tolist()) == set(range(5))
    tiny = _draws(logits, 200, temperature=1.0, top_p=1e-3)
    assert set(tiny[0].tolist()) == {0}


def test_top_k_top_p_in_generate_stay_inside_the_allowed_set():
    model = make_model()
    prompt = [[3, 4, 5]]
    with recorded_logits() as seen:
        tokens = generate(model, prompt, 10, mode="soft", temperature=1.0, top_k=2, seed=7)
    for step, logits in enumerate(seen):
        assert int(tokens[0, step]) in logits[0].topk(2).indices.tolist()


# --------------------------------------------------------------------------------------------------
# 8. Errors


@pytest.mark.parametrize(
    "prompt,kwargs,match",
    [
        ([[]], {}, "empty"),
        (torch.zeros(1, 0, dtype=torch.long), {}, "empty"),
        ([[1, 64]], {}, "outside the vocabulary"),
        ([[1, -1]], {}, "outside the vocabulary"),
        ([[1] * 30], dict(max_new_tokens=3), "max_seq_len"),
        ([[1]], dict(mode="beam"), "mode"),
        ([[1]], dict(mode="fused", fused_passes=0), "fused_passes"),
        ([[1]], dict(temperature=-0.5), "temperature"),
        ([[1]], dict(top_p=0.0), "top_p"),
        ([[1]], dict(top_p=1.5), "top_p"),
    ],
)
def test_generate_rejects_bad_arguments(prompt, kwargs, match):
    model = make_model()
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, prompt, **kwargs)


def test_generate_limits_are_inclusive():
    model = make_model()
    assert generate(model, [[1] * 29], 3).shape == (1, 3)  # exactly max_seq_len = 32 is allowed
    assert generate(model, [[63]], 1, top_p=1.0).shape == (1, 1)
    assert generate(model, [[1, 2], [3]], 0).shape == (2, 0)


# --------------------------------------------------------------------------------------------------
# 10. Streaming


@pytest.mark.parametrize("mode,fused_passes", MODES)
def test_stream_yields_one_row_per_step_and_matches_generate(mode, fused_passes):
    model = make_model(**FEATURES["gate_window"])
    kw = dict(mode=mode, fused_passes=fused_passes)
    steps = list(generate_stream(model, PROMPTS, 6, **kw))
    assert len(steps) == 6
    assert all(s.shape == (len(PROMPTS),) and s.dtype == torch.long for s in steps)
    full = generate(model, PROMPTS, 6, **kw)
    assert torch.equal(torch.stack(steps, dim=1), full)
    # With eos the stream stops once every row has finished.
    row = full[0].tolist()
    j = next(j for j in range(1, 6) if row[j] not in row[:j])  # first step emitting a new token
    stopped = list(generate_stream(model, [PROMPTS[0]], 6, eos_token_id=row[j], **kw))
    assert len(stopped) == j + 1 and int(stopped[-1][0]) == row[j]
    sampled = list(generate_stream(model, PROMPTS, 6, temperature=1.0, seed=3, **kw))
    assert torch.equal(torch.stack(sampled, 1), generate(model, PROMPTS, 6, temperature=1.0, seed=3, **kw))


def test_a_mode_given_where_a_decode_settings_goes_is_refused_by_name():
    from fullband.generation import score_continuations

    model = make_model()
    with pytest.raises(TypeError, match="decode must be a DecodeSettings"):
        score_continuations(model, [[1, 2]], [[3]], "soft")  # the old positional order: mode third
    with pytest.raises(TypeError, match="unknown generate\\(\\) argument\\(s\\) beam_width"):
        generate(model, [[1, 2]], 2, beam_width=4)

"""Core equivalence tests of the model: plain path vs independent references, multi-pass (Jacobi) vs the
exact recurrence, and storage (the training loss over the passes: test_objective.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FEATURES, FUSIONS, make_model, reference_recurrence, shift, tiny_config

from fullband import FullBandConfig, FullBandLM, KVCache, sequential_forward
from fullband.errors import CheckpointError
from fullband.model import RMSNorm
from fullband.storage import load_pretrained

pytestmark = pytest.mark.usefixtures("single_thread")

# --------------------------------------------------------------------------------------------------
# An independent, straightforward reference transformer (float64, no SDPA, explicit masks)


def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def ref_rope(cfg: FullBandConfig, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, 1, head_dim). Like Hugging Face models, the library computes the RoPE angles
    and their cos/sin in float32 whatever the weights' dtype (so bf16 positions do not round); mirrored
    here. Plain RoPE only: rope_scaling is checked against Hugging Face below."""
    hd = cfg.resolved_head_dim
    inv = (1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)).float()
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)[:, None, :]
    return ang.cos().double(), ang.sin().double()


def ref_fusion(sd, cfg, e, h):
    eps = cfg.norm_eps
    if cfg.fusion == "gate":
        gate = torch.sigmoid(ref_rmsnorm(e, sd["fusion.embed_norm.weight"], eps) @ sd["fusion.gate_proj.weight"].T)
        return ref_rmsnorm((h @ sd["fusion.value_proj.weight"].T) * gate, sd["fusion.out_norm.weight"], eps)
    if cfg.fusion == "concat":
        return ref_rmsnorm(torch.cat([e, h], -1) @ sd["fusion.proj.weight"].T, sd["fusion.out_norm.weight"], eps)
    return e + h @ sd["fusion.proj.weight"].T


def ref_forward(sd, cfg: FullBandConfig, ids: torch.Tensor, feedback=None, plain=None):
    """One sequence (1-D ids) through the stack, written from docs/method.md §2-3 and the config's documentation."""
    eps, H, KV, hd = cfg.norm_eps, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    T = ids.shape[0]
    x = sd["embed.weight"][ids]
    if feedback is not None:
        x = torch.where(plain.unsqueeze(-1), x, ref_fusion(sd, cfg, x, feedback))
    cos, sin = ref_rope(cfg, T)
    t_idx = torch.arange(T)[:, None]
    s_idx = torch.arange(T)[None, :]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."

        def lin(name, inp, p=p):
            out = inp @ sd[p + name + ".weight"].T
            bias = sd.get(p + name + ".bias")
            return out if bias is None else out + bias

        a = ref_rmsnorm(x, sd[p + "attn_norm.weight"], eps)
        q = lin("attn.q_proj", a).view(T, H, hd)
        k = lin("attn.k_proj", a).view(T, KV, hd)
        v = lin("attn.v_proj", a).view(T, KV, hd)
        if cfg.qk_norm:
            q = ref_rmsnorm(q, sd[p + "attn.q_norm.weight"], eps)
            k = ref_rmsnorm(k, sd[p + "attn.k_norm.weight"], eps)
        q = q * cos + ref_rotate_half(q) * sin
        k = k * cos + ref_rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        allowed = s_idx <= t_idx
        sliding = cfg.sliding_window is not None and not (
            cfg.full_attention_every > 0 and (i + 1) % cfg.full_attention_every == 0
        )
        if sliding:
            allowed = allowed & (s_idx > t_idx - cfg.sliding_window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        y = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
        if cfg.attn_output_gate:
            y = y * torch.sigmoid(a @ sd[p + "attn.gate_proj.weight"].T)[..., None]
        x = x + y.reshape(T, H * hd) @ sd[p + "attn.o_proj.weight"].T
        m = ref_rmsnorm(x, sd[p + "mlp_norm.weight"], eps)
        ff = F.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)
        x = x + ff @ sd[p + "mlp.down_proj.weight"].T
    normed = ref_rmsnorm(x, sd["norm.weight"], eps)
    head = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["embed.weight"]
    return normed @ head.T, normed


# --------------------------------------------------------------------------------------------------
# 1. The plain path


def _poison_fusion(model: FullBandLM) -> None:
    with torch.no_grad():
        for p in model.fusion.parameters():
            p.fill_(float("nan"))


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("feature", FEATURES)
def test_plain_forward_never_touches_fusion(fusion, feature):
    model = make_model(fusion=fusion, **FEATURES[feature])
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 10))
    before = model(ids)
    before_mp = model.multipass(ids, passes=1)
    _poison_fusion(model)
    after = model(ids)
    assert torch.isfinite(after.logits).all() and torch.isfinite(after.hidden).all()
    assert torch.equal(after.logits, before.logits)
    assert torch.equal(after.hidden, before.hidden)
    assert torch.equal(model.multipass(ids, passes=1).logits[0], before_mp.logits[0])
    # Positions marked plain ignore the feedback even when it is passed; fused positions do see the
    # poison (so the checks above would catch a plain path that went through the fusion).
    fb = torch.randn(2, 10, model.config.d_model)
    all_plain = model(ids, feedback=fb, plain_mask=torch.ones(2, 10, dtype=torch.bool))
    assert torch.equal(all_plain.logits, before.logits)
    plain = torch.zeros(2, 10, dtype=torch.bool)
    plain[:, 0] = True
    assert torch.isnan(model(ids, feedback=fb, plain_mask=plain).logits[:, 1:]).all()


def test_rmsnorm_keeps_float64_precision():
    """A float64 model must normalise in float64 (exactness tests rely on it); bf16 still goes via float32."""
    norm = RMSNorm(16, 1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 16, dtype=torch.float64)
    expected = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), expected, atol=1e-14, rtol=0)
    norm_bf16 = RMSNorm(16, 1e-6).to(torch.bfloat16)
    xb = (x * 100).to(torch.bfloat16)
    xf = xb.float()
    expected_bf16 = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert norm_bf16(xb).dtype == torch.bfloat16
    assert torch.equal(norm_bf16(xb), expected_bf16)


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("feature", FEATURES)
def test_forward_matches_reference_transformer(feature, fusion):
    """float64: the plain pass and a fused pass equal an explicit reference implementation."""
    model = make_model(dtype=torch.float64, fusion=fusion, **FEATURES[feature])
    cfg = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    torch.manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    fb = torch.randn(2, 12, cfg.d_model, dtype=torch.float64)
    plain = torch.rand(2, 12) < 0.3
    plain[:, 0] = True
    with torch.no_grad():
        out = model(ids)
        fused = model(ids, feedback=fb, plain_mask=plain)
    for b in range(2):
        ref_logits, ref_hidden = ref_forward(sd, cfg, ids[b])
        torch.testing.assert_close(out.logits[b], ref_logits, atol=1e-10, rtol=0)
        torch.testing.assert_close(out.hidden[b], ref_hidden, atol=1e-10, rtol=0)
        ref_logits, ref_hidden = ref_forward(sd, cfg, ids[b], fb[b], plain[b])
        torch.testing.assert_close(fused.logits[b], ref_logits, atol=1e-10, rtol=0)
        torch.testing.assert_close(fused.hidden[b], ref_hidden, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "tied,rope_scaling",
    [
        (True, None),
        (False, None),
        (
            True,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
    ],
)
def test_plain_forward_matches_hf_llama(tied, rope_scaling):
    transformers = pytest.importorskip("transformers")
    model = make_model(n_kv_heads=2, tie_embeddings=tied, rope_scaling=rope_scaling)
    cfg = model.config
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if rope_scaling is not None:
        rope = {**rope_scaling, "rope_theta": cfg.rope_theta}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=tied,
        attention_bias=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not tied:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"layers.{i}.attn.{proj}.weight"] = f"model.layers.{i}.self_attn.{proj}.weight"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"layers.{i}.mlp.{proj}.weight"] = f"model.layers.{i}.mlp.{proj}.weight"
        names[f"layers.{i}.attn_norm.weight"] = f"model.layers.{i}.input_layernorm.weight"
        names[f"layers.{i}.mlp_norm.weight"] = f"model.layers.{i}.post_attention_layernorm.weight"
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith("fusion.")}
    assert set(ours) == set(names)
    hf_state = {names[k]: v for k, v in ours.items()}
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing)
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    torch.manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, 14))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------------
# 3. Multi-pass (Jacobi) iteration vs the exact recurrence

# float64 tolerance for comparing two computations of the same quantity by different routes (cached vs
# uncached, parallel vs sequential). Structural errors show up at 1e-3 and above; the library's RMSNorm
# rounds float64 inputs through float32 (see test_rmsnorm_keeps_float64_precision), which alone costs ~1e-7.
ATOL64 = 1e-9


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("feature", FEATURES)
def test_multipass_converges_to_sequential_recurrence(feature, fusion, device):
    model = make_model(dtype=torch.float64, fusion=fusion, **FEATURES[feature]).to(device)
    T = 10
    torch.manual_seed(4)
    ids = torch.randint(0, 64, (2, T)).to(device)
    seq_logits, seq_hidden = sequential_forward(model, ids)
    ref_logits, ref_hidden = reference_recurrence(model, ids)
    torch.testing.assert_close(seq_logits, ref_logits, atol=ATOL64, rtol=0)
    torch.testing.assert_close(seq_hidden, ref_hidden, atol=ATOL64, rtol=0)

    with torch.no_grad():
        full = model.multipass(ids, passes=T)
    torch.testing.assert_close(full.logits[-1], ref_logits, atol=ATOL64, rtol=0)
    torch.testing.assert_close(full.hidden[-1], ref_hidden, atol=ATOL64, rtol=0)

    # Train mode with jitter=0 is the same computation.
    model.train()
    with torch.no_grad():
        full_train = model.multipass(ids, passes=T, jitter=0.0)
    model.eval()
    torch.testing.assert_close(full_train.hidden[-1], ref_hidden, atol=ATOL64, rtol=0)

    # k passes: the first k positions are exact, later ones are not (yet).
    k = 3
    with torch.no_grad():
        part = model.multipass(ids, passes=k)
    torch.testing.assert_close(part.hidden[-1][:, :k], ref_hidden[:, :k], atol=ATOL64, rtol=0)
    torch.testing.assert_close(part.logits[-1][:, :k], ref_logits[:, :k], atol=ATOL64, rtol=0)
    later_gap = (part.hidden[-1][:, k:] - ref_hidden[:, k:]).abs().amax(dim=-1)  # (B, T-k)
    assert bool((later_gap > 1e-4).all()), later_gap
    # Each pass makes exactly one more position exact (position k-1 is exact after k passes, not k-1).
    gap_prev = (part.hidden[-2][:, k - 1] - ref_hidden[:, k - 1]).abs().max()
    assert gap_prev > 1e-4


@pytest.mark.parametrize("fusion", FUSIONS)
def test_document_starts_and_plain_mask_stay_plain(fusion):
    model = make_model(dtype=torch.float64, fusion=fusion, n_kv_heads=2, sliding_window=4, full_attention_every=2)
    T, bos = 10, 1
    torch.manual_seed(5)
    ids = torch.randint(2, 64, (2, T))
    ids[:, 0] = bos
    ids[0, 4] = bos
    ids[1, 6] = bos
    doc_start = ids == bos
    ref_logits, ref_hidden = reference_recurrence(model, ids, plain=doc_start)
    seq_logits, seq_hidden = sequential_forward(model, ids, plain_mask=doc_start)
    torch.testing.assert_close(seq_hidden, ref_hidden, atol=ATOL64, rtol=0)
    torch.testing.assert_close(seq_logits, ref_logits, atol=ATOL64, rtol=0)
    with torch.no_grad():
        by_bos = model.multipass(ids, passes=T, bos_token_id=bos)
        by_mask = model.multipass(ids, passes=T, plain_mask=doc_start)
        no_docs = model.multipass(ids, passes=T)
    torch.testing.assert_close(by_bos.hidden[-1], ref_hidden, atol=ATOL64, rtol=0)
    torch.testing.assert_close(by_mask.hidden[-1], ref_hidden, atol=ATOL64, rtol=0)
    torch.testing.assert_close(by_bos.logits[-1], ref_logits, atol=ATOL64, rtol=0)
    # The document start changes the result from that position on, and only from there.
    torch.testing.assert_close(no_docs.hidden[-1][0, :4], ref_hidden[0, :4], atol=ATOL64, rtol=0)
    torch.testing.assert_close(no_docs.hidden[-1][1, :6], ref_hidden[1, :6], atol=ATOL64, rtol=0)
    assert (no_docs.hidden[-1][0, 4] - ref_hidden[0, 4]).abs().max() > 1e-4
    assert (no_docs.hidden[-1][1, 6] - ref_hidden[1, 6]).abs().max() > 1e-4
    # A doc-start position's input is its plain embedding: with no earlier context (row's own first doc)
    # its state equals the plain pass's state.
    torch.testing.assert_close(by_bos.hidden[-1][:, 0], by_bos.hidden[0][:, 0], atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------
# 6. The training objective


def _manual_pass2_loss(model, ids, labels, detach):
    h1 = model(ids).hidden
    if detach:
        h1 = h1.detach()
    plain = torch.zeros_like(ids, dtype=torch.bool)
    plain[:, 0] = True
    logits = model(ids, feedback=shift(h1), plain_mask=plain).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("fusion", FUSIONS)
def test_gradient_flows_between_passes_unless_detached(fusion):
    model = make_model(fusion=fusion)
    torch.manual_seed(6)
    ids = torch.randint(0, 64, (2, 8))
    labels = torch.randint(0, 64, (2, 8))
    params = [p for _, p in model.named_parameters()]

    def pass2_loss(out):
        return F.cross_entropy(out.logits[1].flatten(0, 1), labels.flatten())

    out = model.multipass(ids, passes=2)
    (g_h1,) = torch.autograd.grad(pass2_loss(out), out.hidden[0], retain_graph=True)
    assert g_h1.abs().max() > 1e-6  # pass 2's loss reaches pass 1's states by default
    grads = torch.autograd.grad(pass2_loss(out), params)

    out_det = model.multipass(ids, passes=2, detach=True)
    (g_h1_det,) = torch.autograd.grad(pass2_loss(out_det), out_det.hidden[0], allow_unused=True, retain_graph=True)
    assert g_h1_det is None or g_h1_det.abs().max() == 0
    grads_det = torch.autograd.grad(pass2_loss(out_det), params)

    manual = torch.autograd.grad(_manual_pass2_loss(model, ids, labels, detach=False), params)
    manual_det = torch.autograd.grad(_manual_pass2_loss(model, ids, labels, detach=True), params)
    for g, g_ref in zip(grads, manual):
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-4)
    for g, g_ref in zip(grads_det, manual_det):
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-4)
    # The through-pass-1 contribution is real: e.g. the final norm's gain gradient differs.
    i = next(i for i, p in enumerate(params) if p is model.norm.weight)
    assert (grads[i] - grads_det[i]).abs().max() > 1e-6


def test_iterate_passes_runs_a_pass_only_when_asked_and_checks_arguments_at_once():
    model = make_model(fusion="add")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(9))
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(len(calls)))
    try:
        passes = model.iterate_passes(ids, 3)
        assert calls == []
        first = next(passes)
        assert len(calls) == 1
        rest = list(passes)
        assert len(calls) == 3 and len(rest) == 2
    finally:
        handle.remove()
    with torch.no_grad():
        whole = model.multipass(ids, 3)
    for got, want in zip([first, *rest], zip(whole.logits, whole.hidden, strict=True), strict=True):
        torch.testing.assert_close(got.logits, want[0], atol=0, rtol=0)
        torch.testing.assert_close(got.hidden, want[1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="passes"):
        model.iterate_passes(ids, passes=0)
    with pytest.raises(ValueError, match="grad_passes"):
        model.iterate_passes(ids, passes=2, grad_passes=0)


def test_jitter_only_in_training_and_bounded():
    model = make_model(fusion="add")
    torch.manual_seed(8)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        a = model.multipass(ids, passes=3)
        b = model.multipass(ids, passes=3)
        c = model.multipass(ids, passes=3, jitter=0.0)
    for x, y, z in zip(a.hidden, b.hidden, c.hidden):
        assert torch.equal(x, y) and torch.equal(x, z)

    seen: list[torch.Tensor] = []
    handle = model.fusion.register_forward_pre_hook(lambda mod, args: seen.append(args[1].detach().clone()))
    model.train()
    try:
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            noisy = model.multipass(ids, passes=3, generator=g)
            g = torch.Generator().manual_seed(0)
            noisy_again = model.multipass(ids, passes=3, generator=g)
            seen.clear()
            g = torch.Generator().manual_seed(1)
            big = model.multipass(ids, passes=2, jitter=0.1, generator=g)
    finally:
        handle.remove()
        model.eval()
    sigma = model.config.feedback_jitter
    assert torch.equal(noisy.hidden[0], a.hidden[0])  # pass 1 has no feedback, hence no jitter
    assert (noisy.hidden[1] - a.hidden[1]).abs().max() > 1e-6  # jitter is applied in training mode
    for x, y in zip(noisy.hidden, noisy_again.hidden):
        assert torch.equal(x, y)  # reproducible from the generator
    # The fused state is exactly h^(1)_{t-1} + ε with ε ~ U[-σ, σ]: check σ = 0.1 from the recorded input.
    assert len(seen) == 1
    eps = (seen[0] - shift(big.hidden[0]))[:, 1:]
    assert eps.abs().max() <= 0.1 + 1e-6 and eps.max() > 0.08 and eps.min() < -0.08  # symmetric U[-σ, σ]
    assert eps.abs().mean() > 0.03  # roughly uniform, not a few isolated entries
    assert sigma == 0.02


def test_prefix_mixin_keeps_prefix_plain():
    model = make_model()
    B, T = 6, 10
    torch.manual_seed(9)
    ids = torch.randint(0, 64, (B, T))
    with torch.no_grad():
        out = model.multipass(ids, passes=2, prefix_mixin=1.0, generator=torch.Generator().manual_seed(3))
        again = model.multipass(ids, passes=2, prefix_mixin=1.0, generator=torch.Generator().manual_seed(3))
        no_mixin = model.multipass(ids, passes=2)
    for x, y in zip(out.hidden, again.hidden):
        assert torch.equal(x, y)  # the prefix draw is reproducible from the generator
    # Without mixin only position 0 is plain in pass 2.
    assert bool(((no_mixin.hidden[1][:, 1:] - no_mixin.hidden[0][:, 1:]).abs().amax(-1) > 1e-4).all())
    prefixes = []
    for b in range(B):
        same = (out.hidden[1][b] == out.hidden[0][b]).all(-1)  # (T,) positions whose state is unchanged
        p = int(same.long().cumprod(0).sum()) - 1  # the plain prefix is 0..p
        prefixes.append(p)
        assert not bool(same[p + 1 :].any())  # a contiguous prefix, then fused
        # Exactly a pass whose prefix 0..p is given as plain_mask.
        mask = (torch.arange(T) <= p)[None]
        with torch.no_grad():
            ref = model.multipass(ids[b : b + 1], passes=2, plain_mask=mask)
        torch.testing.assert_close(out.hidden[1][b], ref.hidden[1][0], atol=1e-5, rtol=0)
    assert len(set(prefixes)) > 1 and max(prefixes) > 0, prefixes  # p is random per sequence

    # prefix_mixin = f draws p from {0, .., ceil(f·T) - 1} and keeps t <= p plain: with ceil(f·T) = 2
    # the plain prefix is position 0 alone or positions 0 and 1, and both occur.
    with torch.no_grad():
        small = model.multipass(ids, passes=2, prefix_mixin=0.2, generator=torch.Generator().manual_seed(4))
    same = (small.hidden[1] == small.hidden[0]).all(-1)
    prefix_len = same.long().cumprod(-1).sum(-1)
    assert set(prefix_len.tolist()) == {1, 2}, prefix_len


def test_per_row_generators_make_rows_independent_of_batching():
    model = make_model().train()
    torch.manual_seed(11)
    ids = torch.randint(0, 64, (3, 8))

    def run(rows, seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        with torch.no_grad():
            return model.multipass(ids[rows], passes=3, prefix_mixin=0.5, generator=gens).hidden[-1]

    full = run([0, 1, 2], [5, 6, 7])
    alone = run([1], [6])
    swapped = run([2, 1], [7, 6])
    assert torch.equal(full[1], alone[0]) and torch.equal(full[1], swapped[1])
    assert not torch.equal(run([1], [8])[0], alone[0])  # the draws do depend on the row's generator


# --------------------------------------------------------------------------------------------------
# 8. Config validation


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(d_model=30, n_heads=4), "d_model"),
        (dict(n_heads=4, n_kv_heads=3), "n_heads"),
        (dict(fusion="mul"), "fusion"),
        (dict(feedback_source="residual"), "feedback_source"),
        (dict(gate_init_std=0.0), "gate_init_std"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        tiny_config(**overrides)


def test_config_from_dict_unknown_key():
    data = tiny_config().to_dict()
    assert FullBandConfig.from_dict(data) == tiny_config()
    with pytest.raises(ValueError, match="n_layer"):
        FullBandConfig.from_dict({**data, "n_layer": 3})


def test_logits_to_keep_only_trims_logits():
    model = make_model()
    torch.manual_seed(12)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        full = model(ids)
        last = model(ids, logits_to_keep=3)
    assert last.logits.shape == (2, 3, 64)
    torch.testing.assert_close(last.logits, full.logits[:, -3:], atol=1e-6, rtol=0)
    assert torch.equal(last.hidden, full.hidden)  # every position's state is still returned


def test_kv_cache_overflow_raises():
    model = make_model()
    cache = KVCache(model.config, 1, 4)
    model(torch.zeros(1, 3, dtype=torch.long), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="overflow"):
        model(torch.zeros(1, 2, dtype=torch.long), past_key_values=cache, use_cache=True)


# --------------------------------------------------------------------------------------------------
# 9. Storage


@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip(tmp_path, tied):
    model = make_model(tie_embeddings=tied, n_kv_heads=2, qk_norm=True, fusion="concat")
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["tie_embeddings"] is tied
    raw = (tmp_path / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])  # a safetensors header, not a pickle
    assert ("lm_head.weight" in header) is (not tied)
    loaded = load_pretrained(tmp_path).eval()
    assert loaded.config == model.config
    if tied:
        assert loaded.lm_head is None
    torch.manual_seed(10)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        a, b = model.multipass(ids, passes=3), loaded.multipass(ids, passes=3)
    for x, y in zip(a.logits + a.hidden, b.logits + b.hidden):
        assert torch.equal(x, y)
    as64 = load_pretrained(tmp_path, dtype=torch.float64)
    assert as64.embed.weight.dtype == torch.float64


def test_load_errors(tmp_path):
    model = make_model()
    good, truncated, no_config = tmp_path / "good", tmp_path / "truncated", tmp_path / "no_config"
    for d in (good, truncated, no_config):
        model.save_pretrained(d)
    raw = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_pretrained(truncated)
    (no_config / "config.json").unlink()
    with pytest.raises(CheckpointError, match="neither a model directory \\(config.json"):
        load_pretrained(no_config)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(tmp_path / "missing")
    load_pretrained(good)  # the untouched copy still loads

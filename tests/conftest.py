"""Shared helpers for the core equivalence tests: tiny seeded models and uncached references.

Everything here is deliberately independent of the code under test's internals: references only call
``model.forward`` without a KV cache and build their own feedback tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

from fullband import FullBandConfig, FullBandLM

# Under pytest-xdist (scripts/test.sh runs two workers on a 2-core machine) each worker and the processes its tests
# start keep to one thread: two workers of two threads each on two cores make torch's thread pools wait on each
# other, several times slower than one thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

FUSIONS = ("gate", "concat", "add")

# Model features the exactness tests are parametrised over (all tiny: 2 layers, d_model 32).
FEATURES = {
    "mha_bias": dict(qkv_bias=True),
    "gqa_qknorm_untied": dict(n_kv_heads=2, qk_norm=True, tie_embeddings=False),
    "gate_window": dict(n_kv_heads=2, attn_output_gate=True, sliding_window=4, full_attention_every=2),
}


# The core equivalence tests run on the device named by FULLBAND_TEST_DEVICE (default cpu; e.g. cuda), and
# with FULLBAND_TEST_DTYPE=bfloat16 their float32 cases run in bf16 with the tolerance bf16 allows (float64
# cases test exactness and stay float64). benchmarks/gpu_check.sh runs them both ways on a GPU.
TEST_DEVICE = os.environ.get("FULLBAND_TEST_DEVICE", "cpu")
TEST_BF16 = os.environ.get("FULLBAND_TEST_DTYPE", "float32").lower() in ("bf16", "bfloat16")
# bf16 keeps 8 bits of mantissa: logits of these tiny models (|logit| < ~5) agree to ~2^-8 relative per
# rounding, and a few layers of differently ordered reductions (cached vs uncached) compound that.
BF16_ATOL = 0.1


@pytest.fixture
def device() -> torch.device:
    """The device of the core equivalence tests (FULLBAND_TEST_DEVICE)."""
    if TEST_DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"FULLBAND_TEST_DEVICE={TEST_DEVICE} but CUDA is not available")
    return torch.device(TEST_DEVICE)


def float32_case(atol: float) -> tuple[torch.dtype, float]:
    """(dtype, atol) of a float32 equivalence check: float32 and ``atol`` unless FULLBAND_TEST_DTYPE asks
    for the bf16 variant."""
    return (torch.bfloat16, BF16_ATOL) if TEST_BF16 else (torch.float32, atol)


@pytest.fixture
def single_thread():
    """Tiny models run fastest on one thread (and do not fight other processes for cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_config(**overrides) -> FullBandConfig:
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32, init_std=0.1)
    base.update(overrides)
    return FullBandConfig(**base)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> FullBandLM:
    """A tiny random model in eval mode. Norm gains and biases are randomised too, so a reference that
    forgets one of them (or applies it in the wrong place) cannot agree by accident."""
    torch.manual_seed(seed)
    model = FullBandLM(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model.to(dtype).eval()


def shift(h: torch.Tensor) -> torch.Tensor:
    """Row t of the result is h[:, t-1]; row 0 is zero (it is always plain, so never used)."""
    return torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)


@torch.no_grad()
def reference_recurrence(model: FullBandLM, ids: torch.Tensor, plain: torch.Tensor | None = None):
    """The exact recurrence of docs/method.md §2, uncached and token by token: position t is recomputed from
    scratch over the prefix 0..t, fused with the previously computed h_{t-1} unless plain.

    Returns (logits (B, T, V), hidden (B, T, D))."""
    B, T = ids.shape
    if plain is None:
        plain = torch.zeros(B, T, dtype=torch.bool)
    plain = plain.to(model.device).clone()
    plain[:, 0] = True
    D = model.config.d_model
    dtype = model.embed.weight.dtype
    hidden = torch.zeros(B, T, D, dtype=dtype, device=model.device)
    logits = torch.zeros(B, T, model.config.vocab_size, dtype=dtype, device=model.device)
    for t in range(T):
        out = model(ids[:, : t + 1], feedback=shift(hidden[:, : t + 1]), plain_mask=plain[:, : t + 1])
        hidden[:, t] = out.hidden[:, t]
        logits[:, t] = out.logits[:, t]
    return logits, hidden


@torch.no_grad()
def reference_decode(
    model: FullBandLM,
    prompt: torch.Tensor,
    n_new: int,
    mode: str = "soft",
    fused_passes: int = 0,
    forced: torch.Tensor | None = None,
):
    """Greedy decoding that recomputes the whole sequence at every step (no KV cache).

    The prompt's inputs are plain (standard/soft) or, for fused(n), fused with pass n's states from a
    Jacobi iteration computed here by plain forward calls; each generated position t is fused with the
    hidden state of position t-1 (standard: plain). ``forced`` (1-D) teacher-forces the tokens fed back
    so the per-step logits can be compared even where greedy choices would differ.

    Returns (tokens (n_new,), per-step logits (n_new, V)); the prompt must be (1, T)."""
    T = prompt.shape[1]
    dev = model.device
    prompt = prompt.to(dev)
    fb = torch.zeros(1, T, model.config.d_model, dtype=model.embed.weight.dtype, device=dev)
    plain = torch.ones(1, T, dtype=torch.bool, device=dev)
    if mode == "fused":
        h = model(prompt).hidden
        pos0 = torch.zeros(1, T, dtype=torch.bool, device=dev)
        pos0[:, 0] = True
        for _ in range(fused_passes - 1):
            h = model(prompt, feedback=shift(h), plain_mask=pos0).hidden
        fb, plain = shift(h), pos0
    seq = prompt
    tokens, step_logits = [], []
    for j in range(n_new):
        out = model(seq, feedback=None if mode == "standard" else fb, plain_mask=plain)
        step_logits.append(out.logits[0, -1])
        tok = out.logits[0, -1].argmax() if forced is None else forced[j]
        tokens.append(int(tok))
        seq = torch.cat([seq, torch.tensor([[int(tok)]], device=dev)], dim=1)
        fb = torch.cat([fb, out.hidden[:, -1:]], dim=1)
        plain = torch.cat([plain, torch.zeros(1, 1, dtype=torch.bool, device=dev)], dim=1)
    return torch.tensor(tokens, device=dev), torch.stack(step_logits)

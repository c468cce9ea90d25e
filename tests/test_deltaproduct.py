"""The DeltaProduct baseline (model.arch deltaproduct, fullband.baselines.deltaproduct): the cached decode equal to the
full forward, left padding and packed documents that cannot move a state, the recurrence against its closed form
with explicit Householder matrices, a reflection (beta near 2) that counts parity at any length, storage that
restores the arch, the trainer's one-pass runs through the sweep's overrides, and what it refuses."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from test_lstm import check_cached_decoding, check_doors, check_packed_documents, check_storage
from test_train import steps_of

from experiments.sweeps import DELTA
from fullband.architectures import build_model
from fullband.baselines import BaselineConfig, DeltaProductLM
from fullband.baselines.deltaproduct import DeltaProductMixer, delta_product_scan
from fullband.config import build_config, load_config
from fullband.data.synthetic import export_jsonl, state_tracking_task
from fullband.decoding import DecodeSettingsError
from fullband.errors import ConfigError, FullbandError
from fullband.generation import generate
from fullband.loading import PRESET_DIR, load_model
from fullband.train import train

V = 29


def delta(seed: int = 0, tie: bool = True, steps: int | None = None) -> DeltaProductLM:
    """A tiny float64 DeltaProduct model (2 layers, 3 heads of 4) with random norm gains, so a norm applied in the
    wrong place cannot agree; init_std 0.5 spreads beta over (0, 2), reflections included."""
    torch.manual_seed(seed)
    model = build_model(BaselineConfig(vocab_size=V, d_model=12, n_layers=2, n_heads=3, d_ff=16, arch="deltaproduct",
                                       householder_steps=steps, max_seq_len=64, tie_embeddings=tie, init_std=0.5))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.double().eval()


def test_full_forward_equals_the_token_by_token_decode_with_its_cache():
    model = delta()
    torch.manual_seed(1)
    ids = torch.randint(0, V, (3, 20))
    full = model(ids).logits
    cache = model.new_cache(3, 20)
    steps = [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    assert cache.S.shape == (2, 3, 3, 4, 4)  # (n_layers, B, n_heads, d, d): O(1) in the context
    # a prompt prefilled in one call, then continued token by token, from the same states
    cache = model.new_cache(3, 20)
    head = model.prefill(ids[:, :7], past_key_values=cache, use_cache=True).logits
    rest = [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(7, 20)]
    torch.testing.assert_close(torch.cat([head, *rest], dim=1), full, rtol=0, atol=1e-10)


def test_left_padding_leaves_each_row_as_if_alone():
    model = delta(tie=False)
    torch.manual_seed(2)
    lengths, T = [9, 4, 1], 9
    ids = torch.randint(1, V, (3, T))  # the padding tokens are real token ids: only the mask keeps them out
    mask = torch.arange(T).unsqueeze(0) >= T - torch.tensor(lengths).unsqueeze(1)
    cache = model.new_cache(3, T + 1)
    padded = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    states = cache.S.clone()
    after = model(ids[:, :1], past_key_values=cache, use_cache=True).logits  # one more token from those states
    for row, n in enumerate(lengths):
        alone_cache = model.new_cache(1, n + 1)
        alone = model(ids[row : row + 1, T - n :], past_key_values=alone_cache, use_cache=True).logits
        torch.testing.assert_close(padded[row, T - n :], alone[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(states[:, row], alone_cache.S[:, 0], rtol=0, atol=1e-12)
        alone_after = model(ids[row : row + 1, :1], past_key_values=alone_cache, use_cache=True).logits
        torch.testing.assert_close(after[row], alone_after[0], rtol=0, atol=1e-12)


def test_packed_documents_equal_each_document_alone():
    check_packed_documents(delta(), seed=3)


def sequential_scan(q, k, v, beta, state, keep):
    """The recurrence one sub-step at a time, as the papers write it: S <- S - beta (S k - v) k^T."""
    B, T, H, d = q.shape
    S, outputs = state.clone(), []
    for t in range(T):
        S = S * keep[:, t, None, None, None].to(S.dtype)
        for j in range(k.shape[2]):
            kj, vj, bj = k[:, t, j], v[:, t, j], beta[:, t, j]
            error = (S @ kj.unsqueeze(-1)).squeeze(-1) - vj
            S = S - (bj.unsqueeze(-1) * error).unsqueeze(-1) * kj.unsqueeze(-2)
        outputs.append((S @ q[:, t].unsqueeze(-1)).squeeze(-1))
    return torch.stack(outputs, dim=1), S


@pytest.mark.parametrize("chunk", [1, 2, 5, 13, 32])
def test_the_chunkwise_scan_equals_the_recurrence_step_by_step_with_its_gradients(chunk):
    """Chunk boundaries inside and between documents, a document starting a chunk, padding (beta = 0), a carried
    initial state and reflections (beta near 2): outputs, final state and the gradients of all inputs."""
    torch.manual_seed(6)
    B, T, n, H, d = 3, 13, 2, 2, 4
    q = F.normalize(torch.randn(B, T, H, d, dtype=torch.float64), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(B, T, n, H, d, dtype=torch.float64), dim=-1).requires_grad_()
    v = torch.randn(B, T, n, H, d, dtype=torch.float64, requires_grad=True)
    beta = (2 * torch.rand(B, T, n, H, dtype=torch.float64)).requires_grad_()
    with torch.no_grad():
        beta[0, :3] = 0.0  # left padding
        beta[1, 4, 0] = 1.999  # a reflection
    state = torch.randn(B, H, d, d, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, [5, 6, 10]] = False  # one-token document, a document starting at chunk 5's boundary
    keep[2, 2] = False
    got = delta_product_scan(q, k, v, beta, state, keep, chunk=chunk)
    expected = sequential_scan(q, k, v, beta, state, keep)
    weights = [torch.randn_like(t) for t in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    inputs = (q, k, v, beta, state)
    grads = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, got)), inputs)
    reference = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, expected)), inputs)
    for a, b in zip(grads, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_bfloat16_scans_within_bfloat16_rounding_of_float64():
    """torch has no bfloat16 triangular solve: the chunkwise form solves in float32 and returns bfloat16 (2 chunks
    here), as close to the float64 recurrence as bfloat16 inputs allow."""
    torch.manual_seed(7)
    B, T, n, H, d = 2, 40, 2, 2, 8
    q = F.normalize(torch.randn(B, T, H, d, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, n, H, d, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, n, H, d, dtype=torch.float64)
    beta = 2 * torch.rand(B, T, n, H, dtype=torch.float64)
    expected, _ = sequential_scan(q, k, v, beta, q.new_zeros(B, H, d, d), torch.ones(B, T, dtype=torch.bool))
    half = [t.to(torch.bfloat16) for t in (q, k, v, beta)]
    got, state = delta_product_scan(*half)
    assert got.dtype == state.dtype == torch.bfloat16
    assert float((got.double() - expected).abs().mean() / expected.abs().mean()) < 0.02


def product(matrices: list[torch.Tensor], d: int) -> torch.Tensor:
    """M_1 M_2 ... M_n, the identity when there are none."""
    return functools.reduce(torch.matmul, matrices, torch.eye(d, dtype=torch.float64))


def closed_form(S0: torch.Tensor, subs: list[tuple[torch.Tensor, torch.Tensor]], m: int) -> torch.Tensor:
    """The state after the first m sub-steps (H_i, beta_i v_i k_i^T): S_0 H_1 ... H_m + sum_i beta_i v_i k_i^T
    H_{i+1} ... H_m."""
    d = S0.shape[-1]
    return S0 @ product([H for H, _ in subs[:m]], d) + sum(
        (write @ product([H for H, _ in subs[i + 1 : m]], d) for i, (_, write) in enumerate(subs[:m])),
        torch.zeros(d, d, dtype=torch.float64))


def reference_mixer(
    mixer: DeltaProductMixer, x: torch.Tensor, S0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """The outputs S_t q_t (B, T, H, d) and final states by the closed form, and every beta."""
    (B, T, D), (H, d) = x.shape, S0.shape[1:3]
    n = mixer.k_proj.weight.shape[0] // D
    Wq, Wk, Wv, Wb = (p.weight for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.b_proj))
    betas, outputs, states = [], torch.zeros(B, T, H, d, dtype=torch.float64), torch.zeros_like(S0)
    for b in range(B):
        for h in range(H):
            heads = slice(h * d, (h + 1) * d)
            subs = []  # (H_m, beta_m v_m k_m^T) for m = (t, j) in order
            for t in range(T):
                for j in range(n):
                    k = F.silu(Wk[j * D : (j + 1) * D][heads] @ x[b, t])
                    k = k / k.norm()
                    v = Wv[j * D : (j + 1) * D][heads] @ x[b, t]
                    beta = 2 * torch.sigmoid(Wb[j * H + h] @ x[b, t])
                    betas.append(float(beta))
                    householder = torch.eye(d, dtype=torch.float64) - beta * torch.outer(k, k)
                    subs.append((householder, beta * torch.outer(v, k)))
            for t in range(T):
                q = F.silu(Wq[heads] @ x[b, t])
                outputs[b, t, h] = closed_form(S0[b, h], subs, (t + 1) * n) @ (q / q.norm())
            states[b, h] = closed_form(S0[b, h], subs, T * n)
    return outputs, states, betas


def test_the_recurrence_equals_its_closed_form_with_explicit_householder_matrices():
    """S_T = S_0 prod_m H_m + sum_m beta_m v_m k_m^T prod_{l > m} H_l over the sub-steps m = (t, j) in order, with
    H = I - beta k k^T built as a matrix; o_t = S_t q_t. The projections are recomputed from the weights as the
    paper writes them, so the reference shares nothing with the layer's code but its weights."""
    mixer = delta(steps=3).layers[0].mixer  # 3 heads of 4, 3 Householder steps
    torch.manual_seed(4)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    S0 = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        out, S_T = mixer(x, None, None, S0)
        expected_o, expected_S, betas = reference_mixer(mixer, x, S0)
    torch.testing.assert_close(S_T, expected_S, rtol=0, atol=1e-10)
    torch.testing.assert_close(out, mixer.o_proj(mixer.o_norm(expected_o).reshape(x.shape)), rtol=0, atol=1e-10)
    assert min(betas) < 0.5 and max(betas) > 1.5  # decays and reflections both exercised


def parity_model() -> DeltaProductLM:
    """One block whose first Householder step reflects (beta = 2 sigmoid(20), eigenvalue -1 + 4e-9) on a 1 and
    does nothing (beta = 2 sigmoid(-20)) on a 0, along the fixed key e_0 with the value e_0: the state's entry
    s = S[0, 0] goes s -> 2 - s on a 1, so it is 0 after an even number of ones and 2 after an odd one. The second
    step's key is 0 (no update), the MLP is 0, and the head compares s with 1."""
    model = build_model(BaselineConfig(vocab_size=2, d_model=4, n_layers=1, n_heads=1, d_ff=4, arch="deltaproduct",
                                       max_seq_len=4096, tie_embeddings=False)).double().eval()
    mixer = model.layers[0].mixer
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.zero_()
        model.embed.weight[0, 0] = model.embed.weight[1, 1] = 1.0  # normed: 2 e_0 for a 0, 2 e_1 for a 1
        mixer.q_proj.weight[0, :2] = mixer.k_proj.weight[0, :2] = 1.0  # q = k = e_0 for both tokens
        mixer.v_proj.weight[0, :2] = 0.5  # v = e_0
        mixer.b_proj.weight[0, :2] = torch.tensor([-10.0, 10.0])  # beta: ~0 on a 0, ~2 on a 1
        mixer.o_proj.weight[3, 0] = 1.0  # RMSNorm(s e_0) (s in {0, 2}) into the residual's unused coordinate
        model.lm_head.weight[0, :2] = 1.0  # "even": the token's constant coordinate, 1
        model.lm_head.weight[1, 3] = 1.0  # "odd": RMSNorm(s), 0 or 2
    return model


@torch.no_grad()
def test_a_reflection_counts_parity_at_any_length():
    model = parity_model()
    torch.manual_seed(5)
    bits = torch.randint(0, 2, (8, 1500))
    parity = bits.cumsum(dim=1) % 2
    _, _, _, beta = model.layers[0].mixer.project(model.layers[0].mixer_norm(model.embed(torch.tensor([[0, 1]]))))
    assert float(beta[0, 1, 0, 0]) > 1.99 and float(beta[0, 0, 0, 0]) < 1e-8  # eigenvalue 1 - beta near -1
    assert torch.equal(model(bits).logits.argmax(-1), parity)  # every prefix, 1 to 1500 bits
    # and through the O(1) decode, one token at a time
    cache = model.new_cache(8, 0)
    steps = [model(bits[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(200)]
    assert torch.equal(torch.cat(steps, dim=1).argmax(-1), parity[:, :200])


def test_cached_generation_and_scoring_equal_the_full_forward():
    check_cached_decoding(delta())


def test_storage_restores_the_arch_and_its_householder_steps(tmp_path):
    stored = check_storage(delta(tie=False, steps=3).float(), tmp_path)
    assert (stored["arch"], stored["householder_steps"]) == ("deltaproduct", 3)


def test_feedback_passes_and_bad_configs_are_refused():
    model = delta()
    for mode in ("soft", "fused"):
        with pytest.raises(DecodeSettingsError, match="a DeltaProduct model has no latent feedback; use decode_mode "
                                                      "standard"):
            generate(model, [[1, 2]], 2, mode=mode)
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="no latent feedback"):
        model.prefill(ids, fused_passes=2)
    with pytest.raises(ValueError, match="no latent feedback"):
        model(ids, feedback=torch.zeros(1, 2, 12, dtype=torch.float64))
    with pytest.raises(ValueError, match="2 passes asked of a DeltaProduct model"):
        next(model.iterate_passes(ids, 2))
    with pytest.raises(ValueError, match="cannot be combined with a recurrent-state cache"):
        model(ids, segment_ids=torch.zeros_like(ids), use_cache=True)

    assert BaselineConfig(arch="deltaproduct").householder_steps == 2  # DeltaProduct_2 unless told
    assert BaselineConfig(arch="lstm").householder_steps is None
    bad = [({"householder_steps": 0}, "householder_steps.*positive integer"),
           ({"d_model": 10, "n_heads": 4}, "d_model.*divisible by n_heads")]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message):
            BaselineConfig(arch="deltaproduct", **fields)
    with pytest.raises(ValueError, match="householder_steps.*model.arch lstm has no Householder"):
        BaselineConfig(arch="lstm", householder_steps=2)
    with pytest.raises(ConfigError, match="model.householder_steps: a field of BaselineConfig, not of this"):
        build_config({"model": {"householder_steps": 2}})
    for section, message in (({"arch": "deltaproduct", "sliding_window": 4}, "sliding_window: a field of FullBand"),
                             ({"arch": "deltaproduct", "n_kv_heads": 2}, "n_kv_heads: a field of FullBandConfig"),
                             ({"arch": "mamba"}, "allowed values: fbt, lstm, deltaproduct")):
        with pytest.raises(ConfigError, match=message):
            build_config({"model": section})
    model_section = {"arch": "deltaproduct"}
    for schedule in ("paper", "exact", "fixed:2"):
        with pytest.raises(ConfigError, match="model.arch deltaproduct has no latent feedback.*schedule standard"):
            build_config({"model": model_section, "train": {"schedule": schedule}})
    for train_section, message in (({"keep_best": "sequential", "eval_every": 1}, "keep_best='sequential'"),
                                   ({"parallel": "fsdp"}, "model.arch deltaproduct trains with ddp"),
                                   ({"activation_checkpointing": "full"}, "model.arch deltaproduct has none")):
        with pytest.raises(ConfigError, match=message):
            build_config({"model": model_section, "train": {"schedule": "standard", **train_section}})


def test_trainer_runs_the_sweep_overrides_and_every_door_takes_or_refuses_it(tmp_path, capsys):
    """A few steps of the state-tracking preset with DELTA (the delta_fresh sweep's overrides) at a tiny size,
    the kept model benched in standard mode, and the doors that refuse it."""
    source = export_jsonl(state_tracking_task("parity", 1, 8), tmp_path / "train.jsonl", 200, seed=0)
    tiny = {"model.d_model": "16", "model.d_ff": "32", "model.n_heads": "2", "data.source": str(source),
            "data.val_fraction": "0.1", "train.tokens": str(steps_of(4)), "train.batch_size": "4",
            "train.eval_every": "2", "eval.batches": "1", "eval.batch_size": "4", "train.device": "cpu",
            "train.progress": "false"}
    cfg = load_config(PRESET_DIR / "state-tracking.yaml", {**DELTA, **tiny})
    result = train(cfg, tmp_path / "run", data_dir=tmp_path / "data")
    assert result.compute_tokens == result.tokens == steps_of(4)
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [set(e["loss"]) for e in evals] == [{"standard"}] * 2  # one pass: no fused or sequential loss
    model, tokenizer = load_model(tmp_path / "run" / "best", device="cpu")
    assert isinstance(model, DeltaProductLM) and model.config.householder_steps == 2
    assert model.decode_settings.mode == "standard"
    assert generate(model, [tokenizer.encode("parity 0110 =")], 3).shape == (1, 3)
    with pytest.raises(FullbandError, match="model.arch deltaproduct.*drop --init-from"):
        train(cfg, tmp_path / "again", data_dir=tmp_path / "data", init_from=tmp_path / "run")

    check_doors(tmp_path / "run" / "best", tmp_path, capsys,
                "a DeltaProduct model has no latent feedback; use decode_mode standard")

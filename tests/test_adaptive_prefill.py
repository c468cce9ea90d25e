"""Adaptive fused prefill (fused_passes="auto"): the exact limit, equality with fused(k*) for the reported
k*, per-row stopping (batched == one by one), the cap, the CLI and the Hugging Face export."""

from __future__ import annotations

import pytest
import torch
from conftest import FEATURES, make_model, shift

from fullband.generation import generate, left_pad, sequential_forward
from fullband.model import FullBandLM

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [5, 17, 33, 2, 40, 9, 1, 22]


@torch.no_grad()
def pass_changes(model: FullBandLM, prompt: list[int], passes: int) -> list[float]:
    """Independent reference: max_t ||h^(k) - h^(k-1)|| / ||h^(k-1)|| for k = 1..passes, from plain
    uncached forward calls (position 0 plain, every other position fused with the previous pass)."""
    ids = torch.tensor([prompt])
    plain = torch.zeros(1, len(prompt), dtype=torch.bool)
    plain[:, 0] = True
    h = model(ids).hidden
    changes = []
    for _ in range(passes):
        new = model(ids, feedback=shift(h), plain_mask=plain).hidden
        changes.append(float(((new - h).norm(dim=-1) / h.norm(dim=-1)).max()))
        h = new
    return changes


def contractive_model(feature: str, dtype: torch.dtype = torch.float32) -> FullBandLM:
    """A tiny model whose pass iteration contracts, like a trained FBT's (a random gate fusion does not):
    additive fusion e + W h with a small W, so the relative changes fall pass after pass."""
    model = make_model(fusion="add", dtype=dtype, **FEATURES[feature])
    with torch.no_grad():
        model.fusion.proj.weight.mul_(0.1)
    return model


def tol_stopping_at(changes: list[float], k: int) -> float:
    """A tolerance at which the iteration stops after exactly k passes (between the k-th change and the
    smallest earlier one), so the test does not sit on a rounding boundary."""
    earlier = min(changes[: k - 1]) if k > 1 else float("inf")
    assert changes[k - 1] < earlier, f"changes are not decreasing enough for the test: {changes}"
    return changes[k - 1] * 1.01 if earlier == float("inf") else (changes[k - 1] * earlier) ** 0.5


@pytest.mark.parametrize("feature", list(FEATURES))
def test_tol_zero_with_cap_at_least_prompt_length_is_the_sequential_prefill(feature):
    model = make_model(dtype=torch.float64, **FEATURES[feature])
    ids = torch.tensor([PROMPT])
    out = model.prefill(ids, "auto", fused_tol=0.0, fused_max_passes=len(PROMPT) + 3)
    seq_logits, seq_hidden = sequential_forward(model, ids)
    torch.testing.assert_close(out.hidden, seq_hidden, atol=1e-10, rtol=0)
    torch.testing.assert_close(out.logits, seq_logits, atol=1e-10, rtol=0)
    # A T-token prompt is exact after T - 1 fused passes; the next pass changes nothing, so it stops
    # there instead of running to the cap.
    assert int(out.fused_passes[0]) <= len(PROMPT)
    # Not vacuous: fewer passes than the prompt needs leave it away from the sequential states.
    short = model.prefill(ids, len(PROMPT) - 3)
    assert (short.hidden - seq_hidden).abs().max() > 1e-6


@pytest.mark.parametrize("k", [1, 3, 5])
def test_result_equals_fused_k_for_the_reported_k(k):
    model = contractive_model("gate_window")
    changes = pass_changes(model, PROMPT, 6)
    tol = tol_stopping_at(changes, k)
    stats: dict = {}
    ids = torch.tensor([PROMPT])
    out = model.prefill(ids, "auto", fused_tol=tol, fused_max_passes=6)
    assert out.fused_passes.tolist() == [k]
    fixed = model.prefill(ids, k)
    assert torch.equal(out.hidden, fixed.hidden) and torch.equal(out.logits, fixed.logits)
    # The decode that follows (KV cache of the last pass, carried state) is fused(k*)'s too.
    tokens = generate(model, [PROMPT], 6, mode="fused", fused_passes="auto", fused_tol=tol, fused_max_passes=6,
                      stats=stats)
    assert stats == {"fused_passes": [k], "fused_converged": [True]}
    assert torch.equal(tokens, generate(model, [PROMPT], 6, mode="fused", fused_passes=k))


def test_cap_is_respected():
    model = make_model(**FEATURES["mha_bias"])
    out = model.prefill(torch.tensor([PROMPT]), "auto", fused_tol=0.0, fused_max_passes=2)
    assert out.fused_passes.tolist() == [2] and out.converged.tolist() == [False]
    assert torch.equal(out.hidden, model.prefill(torch.tensor([PROMPT]), 2).hidden)


@pytest.mark.parametrize("feature", ["mha_bias", "gate_window"])
def test_batched_ragged_equals_one_by_one_with_different_stopping_passes(feature):
    model = contractive_model(feature, torch.float64)
    prompts = [PROMPT, [9, 1, 22, 61, 3, 3, 50, 12, 7], [44], [30, 31, 32]]
    tol = tol_stopping_at(pass_changes(model, PROMPT, 6), 4)
    kw = dict(mode="fused", fused_passes="auto", fused_tol=tol, fused_max_passes=6)
    singles, single_passes = [], []
    for p in prompts:
        stats: dict = {}
        singles.append(generate(model, [p], 7, stats=stats, **kw)[0])
        single_passes += stats["fused_passes"]
    stats = {}
    batched = generate(model, prompts, 7, stats=stats, **kw)
    assert stats["fused_passes"] == single_passes
    assert len(set(single_passes)) > 1, single_passes  # rows really stop at different passes
    assert single_passes[2] == 1  # a one-token prompt is plain: the first fused pass changes nothing
    for i, single in enumerate(singles):
        assert torch.equal(batched[i], single), (i, batched[i], single)
    # The logits a row ends its prefill with are those of fused(k*) alone, to float64 precision.
    ids, mask = left_pad(prompts)
    batched_out = model.prefill(ids, "auto", attention_mask=mask, fused_tol=tol, fused_max_passes=6)
    assert batched_out.fused_passes.tolist() == single_passes
    for i, k in enumerate(single_passes):
        alone = model.prefill(torch.tensor([prompts[i]]), k).logits[0, -1]
        torch.testing.assert_close(batched_out.logits[i, -1], alone, atol=1e-12, rtol=0)


def test_fixed_passes_are_reported_and_other_modes_report_zero():
    model = make_model()
    stats: dict = {}
    generate(model, [PROMPT, [1, 2]], 2, mode="fused", fused_passes=3, stats=stats)
    assert stats == {"fused_passes": [3, 3]}
    generate(model, [PROMPT], 2, mode="soft", fused_passes="auto", stats=stats)
    assert stats == {"fused_passes": [0]}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fused_passes="sometimes"), "integer >= 1, 'auto' or 'exact'"),
        (dict(fused_passes="auto", fused_tol=-1.0), "fused_tol must be a number >= 0"),
        (dict(fused_passes="auto", fused_tol=float("nan")), "fused_tol must be a number >= 0"),
        (dict(fused_passes="auto", fused_max_passes=0), "fused_max_passes must be an integer >= 1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(make_model(), [PROMPT], 2, mode="fused", **kwargs)


def test_cli_generate_auto(tmp_path, capsys):
    from fullband.cli import main
    from fullband.data.tokenizers import ByteTokenizer

    model = make_model(vocab_size=259, max_seq_len=64)
    model.save_pretrained(tmp_path / "m")
    ByteTokenizer().save(tmp_path / "m" / "tokenizer")
    code = main(["generate", str(tmp_path / "m"), "--prompt", "ab", "--mode", "fused", "--fused-passes", "auto",
                 "--fused-tol", "0", "--fused-max-passes", "9", "--max-new-tokens", "3", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "adaptive fused prefill: 3 fused passes" in err  # BOS + 2 bytes: exact after 2, unchanged at 3
    assert out.startswith("ab")
    assert main(["generate", str(tmp_path / "m"), "--prompt", "ab", "--fused-passes", "often"]) == 2
    assert "fused_passes must be an integer >= 1, 'auto' or 'exact', got 'often'" in capsys.readouterr().err


def test_hf_export_generate_auto_matches_fullband(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from fullband.hf import export_hf

    model = contractive_model("gqa_qknorm_untied")
    model.save_pretrained(tmp_path / "fb")
    hf = AutoModelForCausalLM.from_pretrained(export_hf(tmp_path / "fb", tmp_path / "exp"), trust_remote_code=True)
    tol = tol_stopping_at(pass_changes(model, PROMPT, 6), 3)
    stats: dict = {}
    ref = generate(model, [PROMPT], 6, mode="fused", fused_passes="auto", fused_tol=tol, fused_max_passes=6,
                   stats=stats)
    out = hf.eval().generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, decode_mode="fused",
                             fused_passes="auto", fused_tol=tol, fused_max_passes=6, return_dict_in_generate=True)
    assert torch.equal(out.sequences[:, len(PROMPT):], ref)
    assert out.past_key_values.prefill_passes.tolist() == stats["fused_passes"] == [3]

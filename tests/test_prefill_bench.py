"""benchmarks/prefill.py's bookkeeping: the passes each mode stands for, its bound, the paired ratios and the table;
and its fullband engine on a tiny model (the vLLM engine is run by hand: it takes minutes to build). With
--decode-tokens: the decode step's target and table, the modes, and what each engine's per-token time spans (fullband
on a tiny model, vLLM's arithmetic on a stand-in engine)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import prefill  # noqa: E402

from fullband.decoding import DecodeSettingsError  # noqa: E402
from fullband.engine import Engine  # noqa: E402
from fullband.model import FullBandConfig, FullBandLM  # noqa: E402


def test_passes_and_bounds():
    assert prefill.passes_of("standard", 16) == 1
    assert prefill.passes_of("fused:1", 16) == 2
    assert prefill.passes_of("fused:2", 16) == 3
    assert prefill.passes_of("fused:exact", 16) == 16  # T token steps
    assert prefill.passes_of("fused:auto", 16) is None  # not measured
    assert prefill.passes_of("fused:auto", 16, auto_fused_passes=4) == 5
    assert prefill.bound_of(3) == pytest.approx(3.3)
    assert prefill.bound_of(None) is None


def test_mode_result_pairs_ratios_by_repetition():
    result = prefill.mode_result([3.0, 6.6, 2.0], [1.0, 2.0, 1.0], passes=3)
    assert result["ratios"] == pytest.approx([3.0, 3.3, 2.0])
    assert result["ratio"]["median"] == pytest.approx(3.0)
    assert result["best_ratio"] == pytest.approx(2.0)  # fastest over fastest standard
    assert result["bound"] == pytest.approx(3.3) and result["within_bound"] is True
    assert prefill.mode_result([4.0], [1.0], passes=3)["within_bound"] is False
    assert prefill.mode_result([4.0], [1.0], passes=None)["within_bound"] is None


def test_table_marks_refused_and_over_bound():
    rows = [{"model": "m", "engine": "vllm", "batch": 1, "prompt_len": 8, "mode": "fused:auto",
             "refused": prefill.VLLM_REFUSED["fused:auto"]},
            {"model": "m", "engine": "vllm", "batch": 1, "prompt_len": 8, "mode": "fused:2",
             **prefill.mode_result([4.0], [1.0], passes=3)},
            {"model": "m", "engine": "fullband", "batch": 1, "prompt_len": 8, "mode": "fused:exact",
             **prefill.mode_result([2.0], [1.0], passes=8)}]
    text = prefill.table(rows)
    assert "refused by vLLM" in text
    assert "| 4.000 [4.000–4.000] | 4.000 | 3 | 3.30 | **no** |" in text
    assert "8 (T token steps) | 8.80 | yes |" in text


def test_fullband_engine_times_every_mode_and_reads_auto_passes():
    torch.manual_seed(0)
    model = FullBandLM(FullBandConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                                      max_seq_len=8)).eval()
    engine = prefill.FullbandPrefill(model, lambda: None, prefill.MODES)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    runs = prefill.bench_point([engine], prompts, repeats=2)
    assert set(runs) == {("fullband", label) for label in prefill.MODES}
    for seconds, _ in runs.values():
        assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert runs[("fullband", "fused:2")][1] == [2, 2]
    assert runs[("fullband", "fused:exact")][1] == [4, 4]  # the Jacobi passes it stands for
    assert 1 <= runs[("fullband", "fused:auto")][1][0] <= 8


# ---- --decode-tokens ------------------------------------------------------------------------------------------------


def tiny_model(max_seq_len: int) -> FullBandLM:
    torch.manual_seed(0)
    return FullBandLM(FullBandConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                                     max_seq_len=max_seq_len)).eval()


def test_decode_result_targets_every_mode_but_standard():
    soft = prefill.decode_result("soft", [1.03, 2.0, 1.01], [1.0, 2.0, 1.0])
    assert soft["ratios"] == pytest.approx([1.03, 1.0, 1.01])
    assert soft["ratio"]["median"] == pytest.approx(1.01) and soft["per_token_s"]["median"] == pytest.approx(1.03)
    assert soft["target"] == prefill.DECODE_TARGET == 1.02 and soft["within_target"] is True
    fused = prefill.decode_result("fused:2", [1.1, 1.05], [1.0, 1.0])
    assert fused["ratio"]["median"] == pytest.approx(1.075) and fused["within_target"] is False
    assert fused["best_ratio"] == pytest.approx(1.05)  # fastest over fastest standard
    standard = prefill.decode_result("standard", [1.0, 2.0], [1.0, 2.0])
    assert standard["target"] is None and standard["within_target"] is None


def test_per_token_seconds_spans_the_steps_after_the_first_token():
    assert prefill.per_token_seconds(10.0, 17.0, tokens=8) == pytest.approx(1.0)  # 7 steps after the first token


def test_decode_table_marks_over_target_and_refused():
    head = {"model": "m", "batch": 16, "prompt_len": 16, "decode_tokens": 32}
    rows = [{**head, "engine": "fullband", "mode": "standard",
             **prefill.decode_result("standard", [0.010, 0.012], [0.010, 0.012])},
            {**head, "engine": "fullband", "mode": "soft", **prefill.decode_result("soft", [0.0101], [0.010])},
            {**head, "engine": "vllm", "mode": "fused:2", **prefill.decode_result("fused:2", [0.0125], [0.010])},
            {**head, "engine": "vllm", "mode": "fused:auto", "refused": prefill.VLLM_REFUSED["fused:auto"]}]
    lines = prefill.table(rows, decoding=True).splitlines()
    assert lines[0].endswith("| target | within 1.02 |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[2] == ("| m | fullband | 16 | 16 | 32 | standard | 11.00 [10.00–12.00] | 1.000 [1.000–1.000] | 1.000 "
                        "| – | – |")
    assert lines[3].endswith("| 1.010 [1.010–1.010] | 1.010 | 1.02 | yes |")
    assert lines[4].endswith("| 1.250 [1.250–1.250] | 1.250 | 1.02 | **no** |")
    assert "refused by vLLM" in lines[5]


def test_modes_with_standard_first_once_each():
    assert prefill.modes_with_standard(["soft", "fused", "fused:1", "soft"]) == ("standard", "soft", "fused:1")
    assert prefill.modes_with_standard(["fused:2", "standard"]) == ("standard", "fused:2")
    assert prefill.modes_with_standard(list(prefill.DECODE_MODES)) == prefill.DECODE_MODES
    with pytest.raises(DecodeSettingsError):
        prefill.modes_with_standard(["fused:"])


def test_fullband_decode_times_a_forward_and_a_sample_per_token(monkeypatch):
    """The clock counts the model's calls and the engine's samples: a decode step's time must span exactly one of
    each per token (what a vLLM decode step does), and no prefill, in every mode."""
    model = tiny_model(max_seq_len=16)
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append("forward"))
    sample = Engine._sample
    monkeypatch.setattr(Engine, "_sample", lambda self: calls.append("sample") or sample(self))
    monkeypatch.setattr(prefill, "time", SimpleNamespace(perf_counter=lambda: len(calls)))
    engine = prefill.FullbandDecode(model, lambda: None, prefill.DECODE_MODES, new_tokens=5)
    for label in engine.modes():
        seconds, _ = engine.run(label, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
        assert seconds == 2.0, label


class StandInLLM:
    """vllm.LLM's generate as VLLMDecode calls it: a prefill costs 100 on the clock, each token 3."""

    def __init__(self, clock: list[float], tokens_given: int | None = None):
        self.clock, self.tokens_given = clock, tokens_given

    def generate(self, requests, sampling, use_tqdm):
        self.clock[0] += 100 + 3 * sampling.max_tokens
        tokens = self.tokens_given or sampling.max_tokens
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * tokens)]) for _ in requests]


def stand_in_vllm_decode(llm: StandInLLM, new_tokens: int) -> prefill.VLLMDecode:
    engine = object.__new__(prefill.VLLMDecode)  # without building vLLM engines
    engine.engines = {"soft": llm}
    engine.first, engine.all = SimpleNamespace(max_tokens=1), SimpleNamespace(max_tokens=new_tokens)
    return engine


def test_vllm_decode_subtracts_the_one_token_call(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(prefill, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = stand_in_vllm_decode(StandInLLM(clock), new_tokens=8)
    assert engine.run("soft", [[1, 2], [3, 4]]) == (pytest.approx(3.0), None)  # the prefill left out


def test_vllm_decode_refuses_rows_that_stopped_early(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(prefill, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = stand_in_vllm_decode(StandInLLM(clock, tokens_given=1), new_tokens=8)
    with pytest.raises(SystemExit, match="expected 8 tokens"):
        engine.run("soft", [[1, 2]])

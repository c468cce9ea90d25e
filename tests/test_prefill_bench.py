"""benchmarks/prefill.py's bookkeeping: the passes each mode stands for, its bound, the paired ratios and the table;
and its fullband engine on a tiny model (the vLLM engine is run by hand: it takes minutes to build)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import prefill  # noqa: E402

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
    engine = prefill.FullbandPrefill(model, lambda: None)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    runs = prefill.bench_point([engine], prompts, repeats=2)
    assert set(runs) == {("fullband", label) for label in prefill.MODES}
    for seconds, _ in runs.values():
        assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert runs[("fullband", "fused:2")][1] == [2, 2]
    assert runs[("fullband", "fused:exact")][1] == [4, 4]  # the Jacobi passes it stands for
    assert 1 <= runs[("fullband", "fused:auto")][1][0] <= 8

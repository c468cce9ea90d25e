"""pass@k against hand-computed values, bootstrap intervals, and per-cell summaries."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from fullband.bench.metrics import bootstrap_ci, pass_at_k, summarize


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 2 / 5),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 3, 1 - 35 / 120),  # 1 - C(7,3)/C(10,3)
        (10, 0, 5, 0.0),
        (10, 8, 3, 1.0),  # fewer than k wrong samples: some draw of k always contains a right one
        (4, 4, 4, 1.0),
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_the_binomial_formula_everywhere():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="at least 3 samples"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(2, 3, 1)


def test_bootstrap_is_seeded_and_brackets_the_estimate():
    rng = np.random.default_rng(1)
    groups = [[float(v)] for v in rng.integers(0, 2, 200)]
    lo, hi = bootstrap_ci(groups, np.mean, 500, seed=3)
    assert (lo, hi) == bootstrap_ci(groups, np.mean, 500, seed=3)
    mean = np.mean(groups)
    assert lo < mean < hi
    # The normal approximation of a proportion's 95% interval: half-width 1.96 * sqrt(p(1-p)/n).
    assert (hi - lo) / 2 == pytest.approx(1.96 * np.sqrt(mean * (1 - mean) / 200), rel=0.2)
    assert bootstrap_ci([[1.0], [1.0]], np.mean) == (1.0, 1.0)


def test_summarize_one_cell():
    scores = [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    lengths = [[3, 5, 7], [1, 1, 1], [10, 10, 10]]
    out = summarize(scores, lengths, ks=[1, 2, 5], n_resamples=200)
    assert out["problems"] == 3 and out["samples"] == 9
    assert out["accuracy"] == pytest.approx(4 / 9)
    assert out["pass_at_k"]["1"]["value"] == pytest.approx(4 / 9)
    assert out["pass_at_k"]["2"]["value"] == pytest.approx((pass_at_k(3, 1, 2) + 1 + 0) / 3)
    assert "5" not in out["pass_at_k"]  # more than the 3 samples per problem
    assert out["mean_length"] == pytest.approx(48 / 9)
    assert out["median_length"] == 5.0  # 1 1 1 3 [5] 7 10 10 10
    lo, hi = out["accuracy_ci"]
    assert 0 <= lo <= out["accuracy"] <= hi <= 1

"""Benchmark statistics: pass@k (Chen et al. 2021), generated-length summaries, bootstrap intervals."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator 1 - C(n-c, k) / C(n, k) of the probability that at least one of k samples
    is correct, from n samples of which c are correct (Chen et al. 2021, computed as a stable product)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def bootstrap_ci(groups: Sequence[Sequence[float]], statistic: Callable[[np.ndarray], float], n_resamples: int = 1000,
                 seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over the concatenated values, resampling whole
    groups (one group per problem, so the samples of one problem stay together)."""
    if not groups:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(g, dtype=float) for g in groups]
    stats = np.empty(n_resamples)
    for i in range(n_resamples):
        pick = rng.integers(0, len(arrays), len(arrays))
        stats[i] = statistic(np.concatenate([arrays[j] for j in pick]))
    alpha = (1 - level) / 2
    return float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


def summarize(scores: Sequence[Sequence[float]], lengths: Sequence[Sequence[int]], ks: Sequence[int],
              n_resamples: int = 1000, seed: int = 0) -> dict:
    """Metrics of one task x mode x temperature cell from per-problem sample scores (1.0 = correct) and generated
    lengths: accuracy (pass@1) and the unbiased pass@k, each with a 95% bootstrap interval over problems."""
    out: dict = {"problems": len(scores), "samples": sum(len(s) for s in scores)}
    out["accuracy"] = float(np.mean(np.concatenate([np.asarray(s, float) for s in scores])))
    out["accuracy_ci"] = bootstrap_ci(scores, np.mean, n_resamples, seed)
    out["pass_at_k"] = {}
    fewest = min(len(s) for s in scores)  # pass@k needs k samples of every problem
    for k in (k for k in ks if k <= fewest):
        per_problem = [[pass_at_k(len(s), int(sum(1 for v in s if v >= 1.0)), k)] for s in scores]
        out["pass_at_k"][str(k)] = {"value": float(np.mean(per_problem)),
                                    "ci": bootstrap_ci(per_problem, np.mean, n_resamples, seed)}
    flat = np.concatenate([np.asarray(x, float) for x in lengths])
    out["mean_length"] = float(flat.mean())
    out["mean_length_ci"] = bootstrap_ci(lengths, np.mean, n_resamples, seed)
    out["median_length"] = float(np.median(flat))
    out["median_length_ci"] = bootstrap_ci(lengths, np.median, n_resamples, seed)
    return out

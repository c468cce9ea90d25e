"""The interval every experiment table reports: the mean over seeds with its 95% Student-t interval.

With 3 seeds ± one standard deviation covers the mean only about 58% of the time; the t interval
(mean ± t(0.975, n − 1) · sd / √n) is what "95%" means. Kept free of scipy, which fullband does not need.
"""

from __future__ import annotations

import math
import statistics

# t(0.975, df) for df = 1..30 (two-sided 95%); beyond 30 a Cornish-Fisher expansion is within 0.001.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 values (df >= 1), got df={df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t interval) of `values`, one per seed."""
    if len(values) < 2:
        raise ValueError(f"a 95% interval needs at least 2 seeds, got {len(values)}")
    return statistics.mean(values), t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def fmt(values: list[float], spec: str = ".3f") -> str:
    """"mean [low, high]" (the 95% t interval) for two values or more, each with the format `spec` (e.g. "+.3f",
    ".3g"); for one value, that value and "(1 seed)": no interval can be given."""
    if len(values) == 1:
        return f"{format(values[0], spec)} (1 seed)"
    mean, half = interval(values)
    return f"{format(mean, spec)} [{format(mean - half, spec)}, {format(mean + half, spec)}]"


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval (low, high) of a proportion: `successes` of `n` graded rows.

    Where every seed of a sweep scores the same (e.g. 1.000), the t interval over seeds has zero width; the rows
    themselves still carry binomial uncertainty, which this interval over the pooled rows gives. It treats the rows
    as independent draws, so it says nothing about the spread between seeds: report it beside the t interval."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"a Wilson interval needs 0 <= successes <= n and n >= 1, got {successes} of {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)

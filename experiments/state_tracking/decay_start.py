"""Does a run's extrapolation at the start of its learning-rate decay predict where the run ends? For sweeps graded
along training (`along` in their records), per run: the validation score at 8x (128 moves) at the decay's first
step, against the kept model's 8x score on the validation and the test rows. Prints, per sweep, each run's three
scores and the Pearson r (with its Fisher 95% interval, over that sweep's seeds); then, over every run given, how the
runs at or above ``--threshold`` at the decay's start end, and how the runs below it end.

    python -m experiments.state_tracking.decay_start steps8000_decay05_s5 steps8000_decay05_wd01_s5 --step 4000
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from experiments.state_tracking.table import RESULTS, load, main_mode

MOVES = "128"  # 8x the training records' 16 moves


def fisher_interval(r: float, n: int) -> tuple[float, float]:
    """The 95% interval of a Pearson r over n independent pairs (Fisher's z)."""
    z, half = math.atanh(max(min(r, 0.999999), -0.999999)), 1.959964 / math.sqrt(n - 3)
    return math.tanh(z - half), math.tanh(z + half)


def runs_of(name: str, step: int, results: Path) -> list[dict]:
    """Per run of a sweep: its seed, its 8x validation score at ``step`` and its kept model's 8x scores."""
    records = load(name, results)
    mode = main_mode(records)
    out = []
    for r in sorted(records, key=lambda r: r["seed"]):
        along = {a["step"]: a["val"] for a in r.get("along", [])}
        if step not in along:
            raise SystemExit(f"{name} seed {r['seed']} has no graded checkpoint at step {step} "
                             f"(its checkpoints: {sorted(along) or 'none'})")
        out.append({"sweep": name, "seed": r["seed"], "start": along[step][MOVES],
                    "val": r["val_lengths"][MOVES][mode]["accuracy"], "test": r["lengths"][MOVES][mode]["accuracy"]})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="+", help="sweeps graded along training (S5, records of 1..16 moves)")
    p.add_argument("--step", type=int, default=4000, help="the decay's first step (default 4000: 8000 steps, "
                   "decay_fraction 0.5)")
    p.add_argument("--threshold", type=float, default=0.20, help="8x validation score at --step that splits the "
                   "runs (default 0.20)")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    everything = []
    print(f"| sweep | seeds | 8x val at step {args.step}, per seed | kept model 8x val | kept model 8x test | "
          "r (start, end val) [95%] | r (start, end test) [95%] |\n|---|---|---|---|---|---|---|")
    for name in args.names:
        runs = runs_of(name, args.step, args.results)
        everything += runs
        starts, vals, tests = ([r[k] for r in runs] for k in ("start", "val", "test"))
        cells = []
        for ends in (vals, tests):
            if len(runs) > 3:
                r = statistics.correlation(starts, ends)
                low, high = fisher_interval(r, len(runs))
                cells.append(f"{r:+.2f} [{low:+.2f}, {high:+.2f}]")
            else:
                cells.append("–")
        print(f"| {name} | {len(runs)} | {' '.join(f'{x:.3f}' for x in starts)} | {' '.join(f'{x:.3f}' for x in vals)}"
              f" | {' '.join(f'{x:.3f}' for x in tests)} | {cells[0]} | {cells[1]} |")
    print()
    for side, chosen in (("at or above", [r for r in everything if r["start"] >= args.threshold]),
                         ("below", [r for r in everything if r["start"] < args.threshold])):
        if not chosen:
            print(f"no run {side} {args.threshold} at step {args.step}")
            continue
        tests = [r["test"] for r in chosen]
        print(f"{len(chosen)} runs {side} {args.threshold} at step {args.step}: 8x test >= 0.99 in "
              f"{sum(t >= 0.99 for t in tests)}, >= 0.95 in {sum(t >= 0.95 for t in tests)}, "
              f"the worst {min(tests):.3f}, the mean {statistics.mean(tests):.3f}")


if __name__ == "__main__":
    main()

"""Twins: the same seed, data and rows trained twice by runs that differ only in rounding (the preset's token steps
compiled, sweep ``compiled_s5``, and uncompiled, ``preset_fresh``), graded on the validation rows. Per length: each
twin's accuracy over the seeds (95% t interval), the paired difference, how many pairs agree within 0.05, and the
share of runs at >= 0.99; for twins whose records keep their curves, where they part: the first training step at
which the two runs' training losses (same batches, same initial weights) differ by more than 1e-4, 1e-2 and 0.5
relative, and their final validation losses of the exact recurrence.

    python -m experiments.state_tracking.twins compiled_s5 preset_fresh --task s5
    python -m experiments.state_tracking.twins compiled_s5 preset_fresh --task s5 --json results/twins_s5.json
    python -m experiments.state_tracking.twins compiled_s5 preset_fresh --best-of 32   # best of the two per seed

``--best-of MOVES``: the twins as two restarts of a seed (twice the compute), the one kept chosen by its accuracy on the
validation rows of MOVES moves (ties: the first sweep's), reported on the test rows against the first sweep's run
alone, paired by seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.state_tracking.table import main_mode
from experiments.stats import fmt

RESULTS = Path(__file__).resolve().parent / "results"


def exact_loss(loss: float | dict) -> float:
    """The validation loss of the exact recurrence (what keep_best chooses on) of an evaluation's record."""
    return loss["sequential"] if isinstance(loss, dict) else loss


PARTING = (1e-4, 1e-2, 0.5)


def parting_step(a: list[list[float]], b: list[list[float]], tolerance: float) -> int | None:
    """The first step at which two loss curves ([step, loss] pairs) differ by more than ``tolerance`` relative to the
    larger loss (None: they never do, or they share no step)."""
    other = {int(step): loss for step, loss in b}
    for step, loss in a:
        step = int(step)
        if step in other and abs(loss - other[step]) > tolerance * max(abs(loss), abs(other[step])):
            return step
    return None


def twins(first: list[dict], second: list[dict], task: str, rows: str = "val") -> dict:
    """The comparison of the seeds of ``task`` present in both sweeps' records."""
    a = {r["seed"]: r for r in first if r["task"] == task}
    b = {r["seed"]: r for r in second if r["task"] == task}
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        raise SystemExit(f"{task}: {len(seeds)} seed(s) in both sweeps; twins need at least 2")
    mode = main_mode([a[s] for s in seeds])
    key = "val_lengths" if rows == "val" else "lengths"
    lengths = sorted({int(m) for s in seeds for m in a[s].get(key, {})} & {int(m) for s in seeds for m in
                                                                           b[s].get(key, {})})
    table = []
    for moves in lengths:
        x = [a[s][key][str(moves)][mode]["accuracy"] for s in seeds]
        y = [b[s][key][str(moves)][mode]["accuracy"] for s in seeds]
        diff = [p - q for p, q in zip(x, y)]
        table.append({"moves": moves, "first": x, "second": y, "first_t": fmt(x), "second_t": fmt(y),
                      "difference_t": fmt(diff, "+.3f"), "within_005": sum(abs(d) <= 0.05 for d in diff),
                      "ge099": sum(v >= 0.99 for v in x + y), "runs": 2 * len(seeds)})
    parts = []
    for s in seeds:
        if a[s].get("train_curve") and b[s].get("train_curve") and a[s].get("val_curve") and b[s].get("val_curve"):
            parts.append({"seed": s, "parting_steps": {str(t): parting_step(a[s]["train_curve"], b[s]["train_curve"], t)
                                                       for t in PARTING},
                          "first_losses": [a[s]["train_curve"][0][1], b[s]["train_curve"][0][1]],
                          "final_val_losses": [exact_loss(a[s]["val_curve"][-1][1]),
                                               exact_loss(b[s]["val_curve"][-1][1])]})
    return {"task": task, "mode": mode, "rows": rows, "seeds": seeds, "lengths": table, "curves": parts}


def best_of_two(first: list[dict], second: list[dict], task: str, choose_moves: int) -> dict:
    """Per seed with both runs, the run kept when the better of the two on the validation rows of ``choose_moves``
    moves is kept; its test-row accuracy per length against the first sweep's run alone."""
    a = {r["seed"]: r for r in first if r["task"] == task}
    b = {r["seed"]: r for r in second if r["task"] == task}
    seeds = sorted(set(a) & set(b))
    mode = main_mode([a[s] for s in seeds])
    key = str(choose_moves)
    kept = {s: (b[s] if b[s]["val_lengths"][key][mode]["accuracy"] > a[s]["val_lengths"][key][mode]["accuracy"]
                else a[s]) for s in seeds}
    table = []
    for moves in sorted({int(m) for s in seeds for m in a[s]["lengths"]}):
        alone = [a[s]["lengths"][str(moves)][mode]["accuracy"] for s in seeds]
        best = [kept[s]["lengths"][str(moves)][mode]["accuracy"] for s in seeds]
        table.append({"moves": moves, "alone": alone, "best_of_two": best, "alone_t": fmt(alone),
                      "best_t": fmt(best), "difference_t": fmt([x - y for x, y in zip(best, alone)], "+.3f"),
                      "best_ge099": sum(v >= 0.99 for v in best)})
    return {"task": task, "mode": mode, "choose_moves": choose_moves, "seeds": seeds,
            "second_kept": [s for s in seeds if kept[s] is b[s]], "lengths": table}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("first", help="a sweep's results (e.g. compiled_s5)")
    p.add_argument("second", help="its twin sweep (e.g. preset_fresh)")
    p.add_argument("--task", default="s5")
    p.add_argument("--rows", choices=("val", "test"), default="val")
    p.add_argument("--json", default=None, help="also write the comparison here")
    p.add_argument("--best-of", type=int, default=None, metavar="MOVES",
                   help="keep the better twin per seed by its validation rows of MOVES moves; report test rows")
    args = p.parse_args(argv)
    records = [json.loads((RESULTS / f"{name}.json").read_text()) for name in (args.first, args.second)]
    if args.best_of is not None:
        best = best_of_two(*records, args.task, args.best_of)
        print(f"{args.task}, {best['mode']}: per seed the better of {args.first} and {args.second} on the validation "
              f"rows of {args.best_of} moves (2 runs of compute), on the test rows; seeds {best['seeds']}, "
              f"{args.second} kept for {best['second_kept']}")
        print(f"\n| moves | {args.first} alone | best of two | paired difference | best of two >= 0.99 |")
        print("|---|---|---|---|---|")
        for row in best["lengths"]:
            print(f"| {row['moves']} | {row['alone_t']} | {row['best_t']} | {row['difference_t']} | "
                  f"{row['best_ge099']} of {len(best['seeds'])} |")
        if args.json:
            Path(args.json).write_text(json.dumps(best, indent=1) + "\n")
        return
    result = twins(*records, args.task, args.rows)
    n = len(result["seeds"])
    print(f"{args.task}, {args.rows} rows, {result['mode']}: {args.first} vs {args.second}, seeds {result['seeds']}")
    print(f"\n| moves | {args.first} | {args.second} | paired difference | pairs within 0.05 | runs >= 0.99 |")
    print("|---|---|---|---|---|---|")
    for row in result["lengths"]:
        print(f"| {row['moves']} | {row['first_t']} | {row['second_t']} | {row['difference_t']} | "
              f"{row['within_005']} of {n} | {row['ge099']} of {row['runs']} |")
    if result["curves"]:
        print("\nwhere the twins part: the first step whose training losses differ by more than "
              + ", ".join(f"{t:g}" for t in PARTING) + " relative (same batches and initial weights)")
        print("\n| seed | step 1 losses | " + " | ".join(f"parted > {t:g}" for t in PARTING)
              + " | final validation loss (exact) |")
        print("|---|---|" + "---|" * len(PARTING) + "---|")
        for c in result["curves"]:
            steps = " | ".join(str(c["parting_steps"][str(t)]) for t in PARTING)
            print(f"| {c['seed']} | {c['first_losses'][0]:.7f} / {c['first_losses'][1]:.7f} | {steps} | "
                  f"{c['final_val_losses'][0]:.2g} / {c['final_val_losses'][1]:.2g} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

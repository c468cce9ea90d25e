"""A sweep's accuracy per length two ways: the 95% t interval over seeds (what every table reports) and the 95%
Wilson interval over the pooled rows (all seeds' graded rows together, treated as independent), with each seed's
score and how many seeds reach 0.90 and 0.99. Where every seed scores the same (1.000 everywhere) the t interval
has zero width; the Wilson interval shows the rows' own binomial uncertainty. Neither replaces the other: the t
interval is the spread between seeds (runs), the Wilson interval only the finite number of rows.

    python -m experiments.state_tracking.pooled compiled_s5                 # S5, test rows, fused:exact
    python -m experiments.state_tracking.pooled preset_fresh --task parity --rows val
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.state_tracking.table import main_mode
from experiments.stats import fmt, wilson

RESULTS = Path(__file__).resolve().parent / "results"


def pooled(records: list[dict], task: str, rows: str = "test", mode: str | None = None) -> list[dict]:
    """One dict per length (moves, ascending) of `task`'s records: seeds, per-seed accuracy, the t interval's text,
    pooled correct / rows, the Wilson interval, and the number of seeds at ≥ 0.90 and ≥ 0.99."""
    runs = sorted((r for r in records if r["task"] == task), key=lambda r: r["seed"])
    if not runs:
        raise SystemExit(f"no run of task {task!r}")
    mode = mode or main_mode(runs)
    key = "lengths" if rows == "test" else "val_lengths"
    out = []
    for moves in sorted({int(m) for r in runs for m in r.get(key, {})}):
        cells = [r[key][str(moves)][mode] for r in runs if str(moves) in r.get(key, {})]
        accs = [c["accuracy"] for c in cells]
        right = sum(c["correct"].count("1") for c in cells)
        n = sum(len(c["correct"]) for c in cells)
        out.append({"moves": moves, "mode": mode, "seeds": [r["seed"] for r in runs], "accuracy": accs,
                    "t": fmt(accs), "correct": right, "rows": n, "wilson": wilson(right, n),
                    "ge090": sum(a >= 0.90 for a in accs), "ge099": sum(a >= 0.99 for a in accs)})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the sweep (experiments/state_tracking/results/NAME.json)")
    parser.add_argument("--task", default="s5")
    parser.add_argument("--rows", choices=("test", "val"), default="test")
    parser.add_argument("--mode", default=None, help="default: the mode the model is used in")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    records = json.loads((args.results / f"{args.name}.json").read_text())
    lines = pooled(records, args.task, args.rows, args.mode)
    print(f"{args.name}, {args.task}, {args.rows} rows, {lines[0]['mode']}, seeds {lines[0]['seeds']}\n")
    print("| moves | per seed | mean [95% t interval over seeds] | pooled rows right | 95% Wilson interval over"
          " pooled rows | seeds ≥ 0.90 | seeds ≥ 0.99 |")
    print("|---|---|---|---|---|---|---|")
    for line in lines:
        low, high = line["wilson"]
        n_seeds = len(line["accuracy"])
        print(f"| {line['moves']} | {' '.join(f'{a:.3f}' for a in line['accuracy'])} | {line['t']} | "
              f"{line['correct']} / {line['rows']} | [{low:.3f}, {high:.3f}] | {line['ge090']} of {n_seeds} | "
              f"{line['ge099']} of {n_seeds} |")


if __name__ == "__main__":
    main()

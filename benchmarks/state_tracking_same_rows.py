"""Grade kept state-tracking models on the held-out rows of another training length, so that models trained
on different L are compared on the same prompts, paired.

benchmarks/state_tracking.py grades a model trained on 1..L moves on prompts of L, 2L, 4L and 8L moves drawn
for that L. A model trained on 1..16 moves and one trained on 1..8 moves therefore never see the same
64-move prompt. This script regrades kept models (`--save-models`) with the exact recurrence on the rows of
`--rows-len` (the same rows benchmarks/state_tracking.py draws for that L) and pairs them, row by row, with
the per-row results of a reference JSONL written by benchmarks/state_tracking.py at that L.

    python benchmarks/state_tracking_same_rows.py --runs runs/state_tracking_models/s5_len16_2000 \\
        --reference benchmarks/results/explore/last_gate_init0.2_2000.jsonl --tasks s5 --rows-len 8
    python benchmarks/state_tracking_same_rows.py --quick ...     # tiny, for the test suite

Prints a markdown table (mean ± sd over seeds per number of moves, and the paired difference against the
reference) and writes one JSON line per run, task and seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from fullband.state_tracking import Recipe, accuracy, evaluate, load_kept_model, write_analysis


def reference_rows(path: Path, rows_len: int) -> dict[tuple[str, int], dict[str, str]]:
    """{(task, seed): {multiple: per-row exact-recurrence bits}} of the FBT runs of a state_tracking.py JSONL."""
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["model"] != "fbt":
            continue
        if record["train_len"] != rows_len:
            raise SystemExit(f"{path}: trained on 1..{record['train_len']} moves, not --rows-len {rows_len}")
        out[(record["task"], record["seed"])] = {m: r["exact"] for m, r in record["eval"].items()}
    return out


def mean_sd(values: list[float], signed: bool = False) -> str:
    mean = f"{round(statistics.mean(values), 2) + 0.0:{'+' if signed else ''}.2f}"  # + 0.0: no "-0.00"
    return f"{mean} ± {statistics.stdev(values):.2f}" if len(values) > 1 else mean


def summarise(records: list[dict], reference: dict, rows_len: int, multiples: tuple[int, ...]) -> str:
    head = "| run | task | seeds | " + " | ".join(f"{m * rows_len} moves" for m in multiples) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(multiples)]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["label"], r["task"]), []).append(r)
    for (label, task), rs in groups.items():
        cells = [mean_sd([accuracy(r["eval"][str(m)]) for r in rs]) for m in multiples]
        lines.append(f"| {label} | {task} | {len(rs)} | " + " | ".join(cells) + " |")
        paired = [r for r in rs if (task, r["seed"]) in reference]
        if paired:
            diffs = [mean_sd([accuracy(r["eval"][str(m)]) - accuracy(reference[(task, r["seed"])][str(m)])
                              for r in paired], signed=True) for m in multiples]
            lines.append(f"| {label} − reference, same rows | {task} | {len(paired)} | " + " | ".join(diffs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, metavar="DIR",
                   help="directories of models kept by benchmarks/state_tracking.py (<task>_s<seed>_fbt/)")
    p.add_argument("--reference", type=Path, help="a state_tracking.py JSONL trained on 1..--rows-len moves")
    p.add_argument("--tasks", default="s5")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rows-len", type=int, default=8, help="grade on the rows state_tracking.py draws for this L")
    p.add_argument("--eval-rows", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/state_tracking_same_rows.jsonl")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    args = p.parse_args(argv)
    multiples = (1, 2) if args.quick else (1, 2, 4, 8)
    if args.quick:
        args.eval_rows = 4
    torch.set_num_threads(args.threads)
    recipe = Recipe(train_len=args.rows_len, eval_rows=args.eval_rows, multiples=multiples)
    reference = reference_rows(args.reference, args.rows_len) if args.reference else {}
    records = []
    for run in map(Path, args.runs):
        for task in args.tasks.split(","):
            for seed in args.seeds:
                path = run / f"{task}_s{seed}_fbt"
                if not path.is_dir():
                    print(f"skip {task} seed {seed}: no {path}", file=sys.stderr)
                    continue
                grades = evaluate(load_kept_model(path), task, recipe, ("exact",))
                records.append({"label": run.name, "task": task, "seed": seed, "model": str(path),
                                "rows_train_len": args.rows_len, "eval_rows": args.eval_rows,
                                "eval": {m: r["exact"] for m, r in grades.items()}})
    write_analysis(records, args.out)
    print(summarise(records, reference, args.rows_len, multiples))


if __name__ == "__main__":
    main()

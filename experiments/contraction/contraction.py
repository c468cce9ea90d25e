"""Is the feedback map a contraction? The paper's Fig. 3, small: for the FBTs trained by
the lm_recipes sweep (`python -m experiments.run lm_recipes`; e.g. the paper's 75/22/3 schedule, arm `fbt`,
against 75% one pass + 25% two passes, arm `fbt_7525`), run the Jacobi iteration of fused passes
(``fullband.tools.jacobi.jacobi_curve``) far past the trained depth and report, per arm, the mean over seeds and its
95% t interval of

- the relative change of the top states ||h^(k) − h^(k−1)|| / ||h^(k−1)|| at several k (positions ≥ k);
- the loss after k fused passes minus the exact recurrence's loss on the same positions;
- the contraction ratio: the median over k = 3..10 of change(k) / change(k − 1) (< 1: each pass shrinks
  the change, the iteration converges; ≥ 1: it does not).

    python -m experiments.contraction.contraction --arms fbt,fbt_7525 --seeds 0 1 2
    python -m experiments.contraction.contraction --summary-only
    python -m experiments.contraction.contraction --runs experiments/traces/results/reasoning_traces.jsonl \
        --arms fixed-fbt,fixed-fbt_from0 --out experiments/contraction/results/contraction_addition.jsonl
        # (the addition models)

--runs takes the results of an LM sweep (arm = the recipe arm) or of reasoning_traces.py (arm = TASK-MODEL).

The iteration is exact after seq_len − 1 passes (every position holds the sequential state), so with
--seq-len 128 it runs 127 passes; one JSON line per (arm, seed) is appended to --out (resumable).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from experiments.stats import fmt
from fullband.loading import load_model_and_data
from fullband.tools.jacobi import jacobi_curve

SHOWN = (1, 2, 3, 4, 5, 10, 30, 100)


def contraction_ratio(change: list[float | None]) -> float:
    ratios = [change[k] / change[k - 1] for k in range(3, min(11, len(change))) if change[k] and change[k - 1]]
    return statistics.median(ratios)


def summarise(records: list[dict]) -> str:
    arms = list(dict.fromkeys(r["arm"] for r in records))
    last = min(len(r["curve"]["passes"]) for r in records) - 1
    ks = [k for k in SHOWN if k <= last] + ([last] if last not in SHOWN else [])
    lines = ["Relative change of the top states per fused pass, ||h^(k) − h^(k−1)|| / ||h^(k−1)|| on positions ≥ k:",
             "", "| arm | seeds | contraction ratio | " + " | ".join(f"k={k}" for k in ks) + " |",
             "|---" * (3 + len(ks)) + "|"]
    for arm in arms:
        runs = [r for r in records if r["arm"] == arm]
        cells = [fmt([r["curve"]["relative_change"][k] for r in runs], ".3g") for k in ks]
        ratio = fmt([contraction_ratio(r["curve"]["relative_change"]) for r in runs], ".3f")
        lines.append(f"| {arm} | {len(runs)} | {ratio} | " + " | ".join(cells) + " |")
    lines += ["", "Loss after k fused passes minus the exact recurrence's loss on the same positions (nats/token):",
              "", "| arm | seeds | " + " | ".join(f"k={k}" for k in (0, *ks)) + " |", "|---" * (3 + len(ks)) + "|"]
    for arm in arms:
        runs = [r for r in records if r["arm"] == arm]
        # None: no scored position at or after k (e.g. the last position of a window is a prompt token)
        diffs = [[r["curve"]["loss"][k] - r["curve"]["sequential_loss"][k] for r in runs
                  if r["curve"]["loss"][k] is not None] for k in (0, *ks)]
        cells = [fmt(d, ".4f") if d else "" for d in diffs]
        lines.append(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="fbt,fbt_7525")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs", default="experiments/lm_recipes/results/lm_recipes.jsonl",
                   help="an LM sweep's or reasoning_traces.py's results (their run dirs)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--batches", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="experiments/contraction/results/contraction.jsonl")
    p.add_argument("--summary-only", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if not args.summary_only:
        runs = {(r.get("arm") or f"{r['task']}-{r['model']}", r["seed"]): r
                for r in map(json.loads, Path(args.runs).read_text().splitlines())}
        for arm in args.arms.split(","):
            for seed in args.seeds:
                done = {(r["arm"], r["seed"]) for r in map(json.loads, out.read_text().splitlines())} \
                    if out.exists() else set()
                if (arm, seed) in done:
                    continue
                if (arm, seed) not in runs:
                    print(f"skip {arm} seed {seed}: not in {args.runs} (train it first: "
                          "python -m experiments.run lm_recipes)", file=sys.stderr)
                    continue
                model, dataset, _, _ = load_model_and_data(runs[(arm, seed)]["run_dir"])
                batches = dataset.split("val").eval_batches(args.seq_len, args.batch_size, args.batches)
                curve = jacobi_curve(model, batches, args.seq_len - 1)
                out.parent.mkdir(parents=True, exist_ok=True)
                with out.open("a") as f:
                    f.write(json.dumps({"arm": arm, "seed": seed, "run_dir": runs[(arm, seed)]["run_dir"],
                                        "curve": asdict(curve)}) + "\n")
                print(f"{arm} seed {seed}: ratio {contraction_ratio(curve.relative_change):.3f}", file=sys.stderr,
                      flush=True)
    print(summarise([json.loads(line) for line in out.read_text().splitlines()]))


if __name__ == "__main__":
    main()

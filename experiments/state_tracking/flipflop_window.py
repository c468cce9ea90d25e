"""Flip-flop through a short attention window: how much of the test set a model that sees only the last
few tokens can answer, and how a trained windowed baseline splits between the rows it can see and the rest.

With a sliding window of w keys in each of n layers, the position that predicts the answer's digit sees the
last n·(w − 1) + 1 tokens; a row is *visible* when its last write lies among them. A model that reads the
visible rows right and guesses the others scores visible + (1 − visible) / 2 at any prompt length: that is
the ceiling of every windowed model without feedback, and the floor a full-attention model can reach by
attending to the last write. This script computes the visible fraction on the held-out rows of the benchmark
loop removed after 38f4146 (seed 10,000 + multiple of L) and, given that loop's JSONL (history/results/), the
accuracy of each run on the visible and on the hidden rows (an FBT by its exact recurrence, a baseline by its
one pass). The visible fraction depends on the task and the window only, not on how a model was trained.

    python -m experiments.state_tracking.flipflop_window \\
        --results experiments/state_tracking/history/results/explore/len16_4000_baseline_window.jsonl \\
        --train-len 16 --out experiments/state_tracking/results/flipflop_window.json
    python -m experiments.state_tracking.flipflop_window --quick      # tiny, for the test suite

Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.state_tracking.tasks import IGNORE, encode_batch, task_base, task_with_moves
from experiments.stats import fmt
from fullband.config import load_config
from fullband.data import ByteTokenizer
from fullband.data.synthetic import synthetic_examples
from fullband.loading import PRESET_DIR


def visible_rows(task: str, moves: int, rows: int, seed: int, receptive_field: int) -> list[bool]:
    """Per held-out row of `task` with `moves` moves (drawn with this seed): is the last
    write among the `receptive_field` tokens that end at the position predicting the answer's digit?"""
    tok = ByteTokenizer()
    examples = synthetic_examples(task_with_moves(task, moves), rows, seed)
    _, labels = encode_batch(examples, tok)
    first_move = 1 + len(tok.encode("flipflop "))  # after bos
    out = []
    for ex, label in zip(examples, labels.tolist()):
        moves_text = ex.prompt.removeprefix("flipflop ").removesuffix(" :")
        last_write = first_move + max(i for i, c in enumerate(moves_text) if c != ".")
        digit = next(i for i, t in enumerate(label) if t != IGNORE and tok.decode([t]).strip())  # label i = token i+1
        out.append(digit - last_write < receptive_field)
    return out


def graded_mode(record: dict) -> str:
    """How the run's model is used: an FBT by its exact recurrence, a baseline by its one plain pass."""
    return "exact" if "exact" in record["eval"]["1"] else "plain"


def run_split(record: dict, visible: dict[str, list[bool]]) -> dict[str, list[float | None]]:
    """Accuracy of a run (in its graded mode) on the visible rows and on the hidden rows, per multiple."""
    split = {"visible": [], "hidden": []}
    for m, seen in visible.items():
        bits = record["eval"][m][graded_mode(record)]
        for name, want in (("visible", True), ("hidden", False)):
            graded = [int(b) for b, v in zip(bits, seen, strict=True) if v == want]
            split[name].append(round(sum(graded) / len(graded), 3) if graded else None)
    return split


def mean_interval(values: list[float]) -> str:
    return fmt(values, ".2f") if values else "–"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="flipflop", help="flip-flop or a variant (flipflop:write_percent=5)")
    p.add_argument("--train-len", type=int, default=16)
    p.add_argument("--eval-rows", type=int, default=200)
    p.add_argument("--preset", default="state-tracking", help="the model whose window and depth count")
    p.add_argument("--results", nargs="*", default=[],
                   help="JSONL files of the removed benchmark loop (history/results/) to split")
    p.add_argument("--out", default="experiments/state_tracking/results/flipflop_window.json")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if task_base(args.task) != "flipflop" or "trace=true" in args.task:
        p.error(f"--task {args.task!r}: this script reads final-answer flip-flop rows (flipflop[:write_percent=N])")
    multiples = (1, 2) if args.quick else (1, 2, 4, 8)
    if args.quick:
        args.train_len, args.eval_rows = 4, 20
    model = load_config(PRESET_DIR / f"{args.preset}.yaml").model
    if model.sliding_window is None or not all(model.layer_is_sliding(i) for i in range(model.n_layers)):
        raise SystemExit(f"preset {args.preset!r} has a full-attention layer: every row is visible")
    field = model.n_layers * (model.sliding_window - 1) + 1
    visible = {str(m): visible_rows(args.task, m * args.train_len, args.eval_rows, 10_000 + m, field)
               for m in multiples}
    share = [sum(v) / len(v) for v in visible.values()]
    head = " | ".join(f"{m * args.train_len} moves" for m in multiples)
    lines = [f"receptive field: {field} tokens ({model.n_layers} layers × window {model.sliding_window})", "",
             f"| {args.task} | {head} |", "|---" * (1 + len(multiples)) + "|",
             "| rows whose last write is visible | " + " | ".join(f"{s:.3f}" for s in share) + " |",
             "| ceiling without feedback (visible + hidden / 2) | "
             + " | ".join(f"{s + (1 - s) / 2:.3f}" for s in share) + " |"]
    runs = []
    for path in args.results:
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)
            if record["task"] != args.task:
                continue
            if record["train_len"] != args.train_len or len(record["eval"]["1"]["plain"]) != args.eval_rows:
                raise SystemExit(f"{path}: {record['model']} seed {record['seed']} was not graded on these rows")
            runs.append({"model": f"{record['model']} {graded_mode(record)}", "seed": record["seed"],
                         **run_split(record, visible)})
    for model_name in dict.fromkeys(r["model"] for r in runs):
        group = [r for r in runs if r["model"] == model_name]
        for name in ("visible", "hidden"):
            cells = [mean_interval([r[name][i] for r in group if r[name][i] is not None])
                     for i in range(len(multiples))]
            seeds = f"{len(group)} seed" + "s" * (len(group) > 1)
            lines.append(f"| {model_name} on the {name} rows ({seeds}) | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"task": args.task, "train_len": args.train_len, "receptive_field": field,
                                          "visible_share": dict(zip(visible, share)), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()

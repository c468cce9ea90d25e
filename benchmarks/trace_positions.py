"""Where does a standard transformer's written trace go wrong beyond its training length?

The written-trace control of docs/results.md (`TASK:trace=true`: the answer lists the state after every
move, then `=> final`) gives a transformer trained on 1..L moves no whole correct answer at 2L moves and
beyond. This script tells apart the two ways that can happen: the states go wrong one after another as
errors accumulate (the update is right, the state drifts), or the trace is wrong from its first state and
has the wrong length (the model fetches the wrong move from the prompt: it has learnt where move i sits
relative to the i-th written state only for prompts of at most L moves). It trains the standard transformer
of benchmarks/state_tracking.py (the `state-tracking` preset with full attention, one pass, the same batches
and steps), decodes greedily on held-out prompts of L·m moves and, per row, compares the written states with
the true ones:

    python benchmarks/trace_positions.py                       # every task, seeds 0 1 2, 2000 steps
    python benchmarks/trace_positions.py --quick               # tiny, for the test suite

Columns: `states right` = written states equal to the true state at the same index, over all true states;
`first wrong` = the median index (0-based) of the first wrong or missing state; `length right` = rows that
write as many states as there are moves. Prints a markdown table, writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from fullband.config import load_config
from fullband.data import ByteTokenizer
from fullband.data.synthetic import STATE_TRACKING_TASKS, synthetic_examples
from fullband.generation import generate
from fullband.loading import PRESET_DIR
from fullband.model import FullBandLM
from fullband.state_tracking import Recipe, task_with_moves, train_model


def written_states(answer: str, one_char_each: bool = False) -> list[str]:
    """The states of a trace answer, in order (`" 1 0 4 => 4"` -> ["1", "0", "4"]); parity writes one
    digit per state without spaces (`" 1101"`, `one_char_each`). Text after a newline is not the answer."""
    trace = answer.split("\n")[0].split("=>")[0]
    return list("".join(trace.split())) if one_char_each else trace.split()


def compare_trace(want: str, got: str, one_char_each: bool = False) -> dict:
    """Per row: how many states are right at their index, the first wrong or missing one, and whether the
    trace has the right length."""
    true, written = written_states(want, one_char_each), written_states(got, one_char_each)
    right = [a == b for a, b in zip(true, written)]
    first_wrong = next((i for i, ok in enumerate(right) if not ok), len(right))
    return {"right": sum(right), "states": len(true), "first_wrong": first_wrong,
            "length_right": len(written) == len(true)}


@torch.no_grad()
def probe(model: FullBandLM, task: str, moves: int, rows: int) -> dict:
    """Greedy traces of `rows` held-out prompts of `moves` moves, compared with the true states."""
    tok = ByteTokenizer()
    examples = synthetic_examples(task_with_moves(task, moves), rows, 10_000 + moves)
    prompts = [[tok.bos_id, *tok.encode(ex.prompt)] for ex in examples]
    longest = max(len(tok.encode(ex.answer)) for ex in examples)
    texts = [tok.decode([t for t in row.tolist() if t < 256])  # bytes only
             for row in generate(model, prompts, max_new_tokens=longest + 4)]
    per_char = task.startswith("parity")
    per_row = [compare_trace(ex.answer, text, per_char) for ex, text in zip(examples, texts)]
    return {"states_right": sum(r["right"] for r in per_row) / sum(r["states"] for r in per_row),
            "median_first_wrong": statistics.median(r["first_wrong"] for r in per_row),
            "length_right": sum(r["length_right"] for r in per_row) / len(per_row),
            "example": {"answer": examples[0].answer, "generated": texts[0].split("\n")[0]}}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(STATE_TRACKING_TASKS),
                   help="comma-separated state-tracking tasks (each in its trace format)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train-len", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--multiples", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/explore/trace_positions.json")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for the test suite")
    args = p.parse_args(argv)
    if args.quick:
        args.train_len, args.steps, args.multiples, args.rows = 2, 3, [1, 2], 3
    torch.set_num_threads(args.threads)
    config = load_config(PRESET_DIR / "state-tracking.yaml")
    recipe = Recipe(train_len=args.train_len, steps=args.steps)
    records = []
    for name in args.tasks.split(","):
        task = f"{name}:trace=true"
        for seed in args.seeds:
            model, info = train_model(task, "baseline", seed, config, recipe)
            for m in args.multiples:
                result = probe(model, task, m * args.train_len, args.rows)
                records.append({"task": task, "seed": seed, "steps": args.steps, "train_len": args.train_len,
                                "moves": m * args.train_len, "rows": args.rows, **result})
                print(f"{task} seed {seed} {m * args.train_len} moves: {result['states_right']:.3f} of states "
                      f"right", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print("| task, written trace | seed | moves | states right | first wrong (median) | length right |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['task']} | {r['seed']} | {r['moves']} | {r['states_right']:.2f} | {r['median_first_wrong']:g} | "
              f"{r['length_right']:.2f} |")
    return records


if __name__ == "__main__":
    main()

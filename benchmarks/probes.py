"""Layer-0 linear probes (the paper's §4.4, small): is a task's running state linearly readable from the
input of the first block after one recurrent prefill step, while the plain pass's input (the token
embedding) cannot hold it?

For each task (completion tracking, delayed memory, multi-register latest-write) and seed, a small model
is trained on the task's final answer (``fullband.state_tracking.train_model``, prompts of 1..L moves,
length curriculum, loss on the answer), then probed on held-out prompts of L moves with
``fullband.probe.collect`` (logistic regression per layer, 4-fold cross-validation grouped by prompt):

  standard  one plain pass: layer 0 is the token embedding alone
  fused:1   one fused prefill pass after the plain one: layer 0 = e_t ⊗ h_{t-1} of the plain pass
  exact     fused prefill with as many passes as the prompt has tokens: the exact recurrence

Models (``--kinds``):
  fbt_k2    the paper's kind of FBT: full attention, two passes every step (K = 2)
  fbt       the state-tracking preset: 4-token attention window, K = sequence length passes

    python benchmarks/probes.py                  # all tasks, seeds 0 1 2, both kinds (resumes)
    python benchmarks/probes.py --quick          # tiny, for the test suite
    python benchmarks/probes.py --summary-only   # tables from the JSONL

Results append to a JSON-lines file (one line per task, kind and seed); the summary prints the layer-0
and top-layer probe accuracy (mean ± sd over seeds), the majority-class rate, the paired difference
fused:1 − standard at layer 0 on the same targets, and the model's answer accuracy.
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
from fullband.data.synthetic import synthetic_examples
from fullband.loading import PRESET_DIR
from fullband.probe import collect, probe_accuracy
from fullband.state_tracking import PROBE_TASKS, Recipe, accuracy, evaluate, task_with_moves, train_model

KINDS = ("fbt_k2", "fbt")
TRAIN_LEN = {"completion": 8, "delayed": 8, "registers": 4}


def mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def summarise(path: Path) -> str:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    lines = ["| task | model | seeds | answer acc. (exact / plain) | majority | layer 0: standard | fused:1 | exact "
             "| paired fused:1 − standard (layer 0) | top layer: standard | fused:1 | exact |",
             "|---" * 12 + "|"]
    for task in dict.fromkeys(r["task"] for r in records):
        for kind in KINDS:
            runs = [r for r in records if r["task"] == task and r["kind"] == kind]
            if not runs:
                continue

            def layer(mode: str, index: int, rs: list = runs) -> list[float]:
                return [r["probe"][mode][index] for r in rs]

            answer = " / ".join(mean_sd([r["answer"][m] for r in runs]) for m in ("exact", "plain"))
            paired = [a - b for a, b in zip(layer("fused:1", 0), layer("standard", 0))]
            lines.append(
                f"| {task} | {kind} | {len(runs)} | {answer} | {mean_sd([r['majority'] for r in runs])} | "
                + " | ".join(mean_sd(layer(m, 0)) for m in ("standard", "fused:1", "exact"))
                + f" | {mean_sd(paired)} | "
                + " | ".join(mean_sd(layer(m, -1)) for m in ("standard", "fused:1", "exact")) + " |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(PROBE_TASKS))
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--preset", default="state-tracking")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--probe-examples", type=int, default=200, help="held-out prompts of L moves to probe")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/probes.jsonl")
    p.add_argument("--summary-only", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for the test suite")
    args = p.parse_args(argv)
    if set(args.tasks.split(",")) - set(PROBE_TASKS):
        p.error(f"--tasks: choose from {', '.join(PROBE_TASKS)}")
    if set(args.kinds.split(",")) - set(KINDS):
        p.error(f"--kinds: choose from {', '.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    config = load_config(PRESET_DIR / f"{args.preset}.yaml")
    tok = ByteTokenizer()
    if not args.summary_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        for task in args.tasks.split(","):
            train_len = 2 if args.quick else TRAIN_LEN[task]
            recipe = Recipe(train_len=train_len, steps=3 if args.quick else args.steps,
                            batch_size=config.train.batch_size, eval_rows=8 if args.quick else 200, multiples=(1,))
            for seed in args.seeds[:1] if args.quick else args.seeds:
                for kind in args.kinds.split(","):
                    done = {(r["task"], r["kind"], r["seed"]) for r in map(json.loads, out.read_text().splitlines())} \
                        if out.exists() else set()
                    if (task, kind, seed) in done:
                        continue
                    model, info = train_model(task, kind, seed, config, recipe)
                    answer = evaluate(model, task, recipe, ("exact", "plain"))["1"]
                    task_obj = task_with_moves(task, train_len)
                    examples = synthetic_examples(task_obj, 8 if args.quick else args.probe_examples, 20_000)
                    longest = max(len(tok.encode(ex.prompt)) + 1 for ex in examples)
                    modes = [("standard", 0), ("fused:1", 1), ("exact", longest)]
                    with torch.no_grad():
                        data = collect(model, tok, task_obj, examples, modes)
                    probe, majority = {}, None
                    for mode, _ in modes:
                        probe[mode] = []
                        for features in data.features[mode]:
                            acc, majority = probe_accuracy(features, data.labels, data.groups, len(data.classes),
                                                           folds=2 if args.quick else 4, seed=0)
                            probe[mode].append(round(acc, 4))
                    record = {"task": task, "kind": kind, "seed": seed, "train_len": train_len, "train": info,
                              "answer": {m: accuracy(bits) for m, bits in answer.items()},
                              "targets": len(data.labels), "classes": data.classes, "majority": round(majority, 4),
                              "probe": probe}
                    with out.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                    print(f"{task} {kind} seed {seed}: {info['train_seconds']} s, answer {record['answer']}, "
                          f"layer 0 {({m: v[0] for m, v in probe.items()})}", file=sys.stderr, flush=True)
    print(summarise(out))


if __name__ == "__main__":
    main()

"""The exact recurrence's training step against one pass of the same model: the `state-tracking` preset's model,
trained token by token (`sequential_loss`, what the preset's `train.exact_mode: sequential` runs) with its token
steps compiled ``--chunks`` positions per call (`model.compile_recurrence`; the preset ships 8), against one
plain pass (`multipass_loss(..., 1)`: the transformer step of the same weights). A step is zero_grad, forward,
backward and AdamW's step on random byte tokens, one document of the preset's 32 tokens a row (the longest
record), at the preset's batch and at ``--batch-multiples`` of it.

Every variant is a model of its own with the same initial weights; each repetition runs every variant's steps once,
in an order rotated from repetition to repetition, and the ratio to one pass is taken within a repetition (paired):
median (min–max). The compiled variants take two untimed steps first (compiling them).

Usage:
    python benchmarks/exact_step.py --threads 1                      # chunks 8, batch 1x and 4x, 20 steps x 5
    python benchmarks/exact_step.py --threads 1 --chunks 8 16 32     # other chunk sizes
    python benchmarks/exact_step.py --quick
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from common import add_common_arguments, machine_info, print_header, setup_device, write_record
from state_tracking_models import build, train_steps

ONE_PASS = "one pass"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p, "2 steps, 2 repetitions, chunk 8, batch 1x", "repetitions (default 5; quick 2)",
                         ["float32"])
    p.add_argument("--steps", type=int, default=None, help="training steps timed per repetition (default 20)")
    p.add_argument("--chunks", type=int, nargs="+", default=[8], help="compiled positions per call (default 8)")
    p.add_argument("--batch-multiples", type=int, nargs="+", default=None,
                   help="batches as multiples of the preset's (default 1 4; quick 1)")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results/exact_step[_quick].json")
    args = p.parse_args(argv)
    device, dtype, sync = setup_device(args, p)
    steps = args.steps or (2 if args.quick else 20)
    repeats = args.repeats or (2 if args.quick else 5)
    multiples = args.batch_multiples or ([1] if args.quick else [1, 4])
    out = args.out or Path(f"benchmarks/results/exact_step{'_quick' if args.quick else ''}.json")
    machine = machine_info(args.threads, args.device)
    command = print_header("the exact recurrence's training step against one pass", argv, machine, args)

    variants = {ONE_PASS: 0, **{f"exact, compiled {c} a call": c for c in args.chunks}}
    built = {name: build({}, device, dtype) for name in variants}
    for name, chunk in variants.items():
        built[name][0].compile_recurrence(chunk)
    config = built[ONE_PASS][2]
    results = {}
    print("| batch | variant | ms per step, median (min–max) | × one pass, median (min–max) |")
    print("|---|---|---|---|")
    for multiple in multiples:
        batch = config.train.batch_size * multiple
        ids = torch.randint(0, config.model.vocab_size, (batch, config.train.seq_len + 1), device=device,
                            generator=torch.Generator().manual_seed(0))
        for name, (model, optimizer, _) in built.items():
            if name != ONE_PASS:
                train_steps(model, optimizer, ids, True, 2, sync)  # compiles, untimed
        seconds = {name: [] for name in variants}
        names = list(variants)
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                model, optimizer, _ = built[name]
                seconds[name].append(train_steps(model, optimizer, ids, name != ONE_PASS, steps, sync))
        results[batch] = {}
        for name in names:
            ratios = [a / b for a, b in zip(seconds[name], seconds[ONE_PASS])]
            results[batch][name] = {"seconds": seconds[name], "ratio_to_one_pass": ratios}
            ms = [1000 * s for s in seconds[name]]
            print(f"| {batch} | {name} | {statistics.median(ms):.1f} ({min(ms):.1f}–{max(ms):.1f}) | "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |", flush=True)
    record = {"benchmark": "exact_step", "command": command, "machine": machine, "steps": steps, "repeats": repeats,
              "seq_len": config.train.seq_len, "results": results}
    return write_record(out, record)


if __name__ == "__main__":
    main()

"""The four models of the state-tracking comparison (experiments/state_tracking, sweeps `preset_fresh`,
`baseline_fresh`, `lstm_fresh`, `delta_fresh`) on a quiet machine: time per training step, and time to grade
a batch of long prompts, each through the path its sweep uses.

- FBT: the `state-tracking` preset, the exact recurrence trained token by token (`sequential_loss`, what
  `train.exact_mode: sequential` runs) and graded with `prefill(fused_passes="exact")` (fused:exact);
- transformer (full attention), LSTM, DeltaProduct_2: the preset with the sweep's overrides
  (`experiments/sweeps.py`: BASELINE, LSTM, DELTA), one pass (`multipass_loss(..., 1)`, the standard schedule) and
  graded in standard mode.

A training step is zero_grad, forward, backward and AdamW's step on the preset's batch (32 rows of 32 random byte
tokens, one document a row: the longest record of the preset). Grading is one no-grad prefill of `--rows` prompts
of `--grade-tokens` tokens (about 512 moves, 32× the training length), keeping the last position's logits, as
`fullband bench` scores a prompt. Each repetition times every model once, in an order rotated between
repetitions; ratios to the LSTM are taken within a repetition (paired) and summarised by median (min-max).

Usage:
    python benchmarks/state_tracking_models.py            # 20 steps x 5 repetitions, 200 prompts of 530 tokens
    python benchmarks/state_tracking_models.py --quick    # seconds
    python benchmarks/state_tracking_models.py --threads 1 --compile-chunk 8   # + the preset's steps compiled
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import add_common_arguments, machine_info, print_header, setup_device, write_record

# the models compared are the sweeps' own overrides: import them from the repository's experiments package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.sweeps import BASELINE, DELTA, LSTM  # noqa: E402
from fullband.architectures import build_model
from fullband.config import load_config
from fullband.loading import preset_path
from fullband.train.objective import multipass_loss, sequential_loss

MODELS = {"FBT (preset)": {}, "transformer": BASELINE, "LSTM": LSTM, "DeltaProduct_2": DELTA}
COMPILED = "FBT (preset, compiled steps)"  # with --compile-chunk


def build(overrides: dict[str, str], device: torch.device, dtype: torch.dtype):
    config = load_config(preset_path("state-tracking"), overrides)
    torch.manual_seed(0)
    model = build_model(config.model).to(device=device, dtype=dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay)
    return model, optimizer, config


def train_steps(model, optimizer, ids: torch.Tensor, exact: bool, steps: int, sync) -> float:
    """Seconds per step over ``steps`` optimizer steps."""
    inputs, labels = ids[:, :-1], ids[:, 1:]
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out = sequential_loss(model, inputs, labels) if exact else multipass_loss(model, inputs, labels, 1)
        out.loss.backward()
        optimizer.step()
    sync()
    return (time.perf_counter() - start) / steps


@torch.no_grad()
def grade(model, prompts: torch.Tensor, exact: bool, sync) -> float:
    model.eval()
    sync()
    start = time.perf_counter()
    if exact:
        model.prefill(prompts, "exact", logits_to_keep=1)
    else:
        model(prompts, logits_to_keep=1)
    sync()
    model.train()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p, "2 steps, 2 repetitions, 16 prompts of 64 tokens", "repetitions (default 5; quick 2)",
                         ["float32"])
    p.add_argument("--steps", type=int, default=None, help="training steps timed per repetition (default 20)")
    p.add_argument("--rows", type=int, default=None, help="prompts graded at once (default 200, a sweep's rows)")
    p.add_argument("--grade-tokens", type=int, default=None,
                   help="tokens per graded prompt (default 530: an S5 prompt of 512 moves)")
    p.add_argument("--compile-chunk", type=int, default=0,
                   help="also time the preset with FullBandLM.compile_recurrence(N): its token steps N positions per "
                        "torch.compile'd call (compiled by two untimed steps first; default 0: not timed)")
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/state_tracking_models.json (--quick: ..._quick.json)")
    args = p.parse_args(argv)
    args.out = args.out or Path(f"benchmarks/results/state_tracking_models{'_quick' if args.quick else ''}.json")
    device, dtype, sync = setup_device(args, p)
    steps = args.steps or (2 if args.quick else 20)
    repeats = args.repeats or (2 if args.quick else 5)
    rows = args.rows or (16 if args.quick else 200)
    grade_tokens = args.grade_tokens or (64 if args.quick else 530)
    machine = machine_info(args.threads, args.device)
    command = print_header("state-tracking models: training step and grading", argv, machine, args)

    models = dict(MODELS)
    if args.compile_chunk:
        models[COMPILED] = {}
    built = {name: build(overrides, device, dtype) for name, overrides in models.items()}
    config = next(iter(built.values()))[2]
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (config.train.batch_size, config.train.seq_len + 1), generator=generator)
    prompts = torch.randint(0, 256, (rows, grade_tokens), generator=generator)
    batch, prompts = batch.to(device), prompts.to(device)
    if args.compile_chunk:
        built[COMPILED][0].compile_recurrence(args.compile_chunk)
        compile_s = train_steps(*built[COMPILED][:2], batch, True, 2, sync) * 2
        print(f"{COMPILED}: compiled in {compile_s:.0f} s (two steps)", flush=True)
    step_s = {name: [] for name in models}
    grade_s = {name: [] for name in models}
    names = list(models)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            model, optimizer, cfg = built[name]
            exact = cfg.train.schedule == "exact"
            step_s[name].append(train_steps(model, optimizer, batch, exact, steps, sync))
            grade_s[name].append(grade(model, prompts, exact, sync))
    results = {}
    print("| model | parameters | ms per training step | × the LSTM's | grading s | × the LSTM's |")
    print("|---|---|---|---|---|---|")
    for name, (model, _, _) in built.items():
        step_ratio = [a / b for a, b in zip(step_s[name], step_s["LSTM"])]
        grade_ratio = [a / b for a, b in zip(grade_s[name], grade_s["LSTM"])]
        params = sum(p.numel() for p in model.parameters())
        results[name] = {"parameters": params, "step_s": step_s[name], "grade_s": grade_s[name],
                         "step_over_lstm": step_ratio, "grade_over_lstm": grade_ratio}
        print(f"| {name} | {params:,} | {1000 * statistics.median(step_s[name]):.1f} | "
              f"{statistics.median(step_ratio):.2f} ({min(step_ratio):.2f}-{max(step_ratio):.2f}) | "
              f"{statistics.median(grade_s[name]):.2f} | "
              f"{statistics.median(grade_ratio):.2f} ({min(grade_ratio):.2f}-{max(grade_ratio):.2f}) |", flush=True)
    record = {"benchmark": "state_tracking_models", "command": command, "machine": machine, "steps": steps,
              "repeats": repeats, "batch": list(batch.shape), "graded": [rows, grade_tokens], "results": results}
    if args.compile_chunk:
        record["compile_chunk"], record["compile_s"] = args.compile_chunk, compile_s
    return write_record(args.out, record)


if __name__ == "__main__":
    main()

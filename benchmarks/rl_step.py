"""One GRPO step of ``fullband rl``, split into its parts as its metrics.jsonl splits it, per rollout decode mode:
rollout (``generate``, sampled at temperature 1), scoring (``rollout_logprobs`` without gradients: the old or
reference log-probabilities; then ``rollout_logprobs_and_entropies`` with gradients and the clipped loss), backward
and the optimizer (gradient clip and AdamW). Beside them, the scoring a trainer would do if it ignored the mode: one
plain pass over prompt + completion, no gradients ("plain scoring").

The `state-tracking` preset's model (random weights; the gate at its init) by default, ``--rows`` rollouts (prompts
× group) of ``--prompt-len`` random prompt tokens and ``--new-tokens`` sampled tokens each (no end token, so every
rollout has that length). Each repetition runs the parts in order; the table gives medians over repetitions.

Usage:
    python benchmarks/rl_step.py                 # 128 rollouts (16 prompts × 8), prompt 24 + 16 new tokens
    python benchmarks/rl_step.py --quick         # 16 rollouts, 2 repetitions (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import add_common_arguments, machine_info, print_header, setup_device, write_record

from fullband.config import load_config
from fullband.decoding import DecodeSettings
from fullband.generation import generate
from fullband.loading import preset_path
from fullband.model import FullBandLM
from fullband.rl import group_advantages, grpo_loss, rollout_logprobs, rollout_logprobs_and_entropies

MODES = ("standard", "soft", "fused:2", "fused:exact")


def timed(sync, fn, *args, **kwargs):
    """(seconds, result) of fn(*args, **kwargs), the device synchronised before and after."""
    sync()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    sync()
    return time.perf_counter() - start, out


def scored_loss(model, prompts, completions, decode, old, advantages) -> torch.Tensor:
    """The trainer's forward: the log-probabilities (and entropies) with gradients, the clipped loss."""
    new, _ = rollout_logprobs_and_entropies(model, prompts, completions, decode)
    return grpo_loss(new, old, advantages).loss


def backward(optimizer, loss) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()


def optimizer_step(model, optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p, "16 rollouts, 2 repetitions", "repetitions per mode (default 3; quick 2)", ["float32"])
    p.add_argument("--preset", default="state-tracking", help="the model config's preset (default state-tracking)")
    p.add_argument("--rows", type=int, default=None, help="rollouts per step (default 128)")
    p.add_argument("--group", type=int, default=8, help="rollouts per prompt (default 8)")
    p.add_argument("--prompt-len", type=int, default=24, help="prompt tokens (default 24)")
    p.add_argument("--new-tokens", type=int, default=16, help="sampled tokens per rollout (default 16)")
    p.add_argument("--modes", default=",".join(MODES), help=f"rollout decode modes (default {','.join(MODES)})")
    p.add_argument("--out", type=Path, default=None, help="JSON record (default benchmarks/results/rl_step.json)")
    args = p.parse_args(argv)
    device, dtype, sync = setup_device(args, p)
    rows = args.rows or (16 if args.quick else 128)
    repeats = args.repeats or (2 if args.quick else 3)
    out = args.out or Path(f"benchmarks/results/rl_step{'_quick' if args.quick else ''}.json")
    machine = machine_info(args.threads, args.device)
    command = print_header("one GRPO step: rollout, scoring, update", argv, machine, args)

    cfg = load_config(preset_path(args.preset)).model
    results = {}
    print(f"{rows} rollouts ({rows // args.group} prompts × {args.group}), prompt {args.prompt_len} tokens + "
          f"{args.new_tokens} sampled; medians of {repeats} repetitions, seconds\n")
    print("| mode | rollout | scoring (no grad) | scoring (grad) + loss | backward | optimizer | step | plain scoring "
          "(wrong for this mode) |")
    print("|---" * 8 + "|")
    for label in args.modes.split(","):
        torch.manual_seed(0)
        model = FullBandLM(cfg).to(device=device, dtype=dtype).eval()
        decode = DecodeSettings().with_label(label)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
                   for _ in range(rows // args.group)]
        prompts = [p for p in prompts for _ in range(args.group)]
        parts: dict[str, list[float]] = {name: [] for name in ("rollout", "scoring", "scoring_grad", "backward",
                                                               "optimizer", "plain_scoring")}
        for rep in range(repeats):
            with torch.no_grad():
                seconds, sampled = timed(sync, generate, model, prompts, args.new_tokens, decode=decode,
                                         temperature=1.0, seed=rep)
                parts["rollout"].append(seconds)
                completions = sampled.tolist()
                seconds, old = timed(sync, rollout_logprobs, model, prompts, completions, decode)
                parts["scoring"].append(seconds)
                seconds, _ = timed(sync, rollout_logprobs, model, prompts, completions, DecodeSettings())
                parts["plain_scoring"].append(seconds)
            rewards = torch.rand(len(prompts), generator=g).round()
            advantages = group_advantages(rewards, args.group)
            seconds, loss = timed(sync, scored_loss, model, prompts, completions, decode, old, advantages)
            parts["scoring_grad"].append(seconds)
            parts["backward"].append(timed(sync, backward, optimizer, loss)[0])
            parts["optimizer"].append(timed(sync, optimizer_step, model, optimizer)[0])
        median = {k: statistics.median(v) for k, v in parts.items()}
        step = sum(median[k] for k in ("rollout", "scoring", "scoring_grad", "backward", "optimizer"))
        results[label] = {"seconds": parts, "median": median, "step_median": step}
        print(f"| {label} | {' | '.join(f'{median[k]:.3f}' for k in list(parts)[:-1])} | {step:.3f} | "
              f"{median['plain_scoring']:.3f} |", flush=True)
    record = {"benchmark": "rl_step", "command": command, "machine": machine, "preset": args.preset, "rows": rows,
              "group": args.group, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": repeats,
              "results": results}
    return write_record(out, record)


if __name__ == "__main__":
    main()

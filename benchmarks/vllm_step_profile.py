"""Where vLLM's decode step goes, standard against soft: the d512 6-layer random FBT of `prefill.py`, one in-process
engine per mode, a batch of one 16-token prompt. Four unprofiled `generate` calls per mode, alternating, give the time
per token (prefill cancelled as in `prefill.py --decode-tokens`); then one `generate` of ``--tokens`` greedy tokens per
mode under cProfile, whose per-step cumulative times of the functions named below are printed side by side (cProfile
inflates Python-heavy code: read the differences, not the totals).

Usage:
    python benchmarks/vllm_step_profile.py                # 128 tokens, 1 thread
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
from pathlib import Path

import torch
from prefill import DECODE_MODELS, VLLMDecode, build_model

from fullband.hf import export_hf

FUNCTIONS = {  # label: (file suffix, function name) in pstats' keys
    "execute_model (the worker's step)": ("gpu_model_runner.py", "execute_model"),
    "the model's forward": ("fullband/vllm/model.py", "forward"),
    "_build_attention_metadata": ("gpu_model_runner.py", "_build_attention_metadata"),
    "_prepare_inputs": ("gpu_model_runner.py", "_prepare_inputs"),
    "the scheduler's schedule": ("sched/scheduler.py", "schedule"),
}
MODES = ("standard", "soft")


def per_step_ms(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """Cumulative ms per step of each of FUNCTIONS (the largest entry where several match, e.g. nested forwards)."""
    out = {}
    for label, (suffix, name) in FUNCTIONS.items():
        times = [entry[3] for (path, _, func), entry in stats.stats.items() if path.endswith(suffix) and func == name]
        out[label] = 1000 * max(times, default=0.0) / steps
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens a generate call (default 128)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = [list(range(3, 19))]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, saved = build_model("d512-L6", DECODE_MODELS["d512-L6"], root, 16 + args.tokens + 2, "cpu",
                                   torch.float32)
        engines = VLLMDecode(export_hf(saved, root / "export"), model.config, MODES, 1, 16, args.threads, args.tokens)
        try:
            for mode in MODES:
                engines.run(mode, prompts)  # warm-up
            per_token = {mode: [] for mode in MODES}
            for rep in range(4):
                for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                    per_token[mode].append(1000 * engines.run(mode, prompts)[0])
            profiled = {}
            for mode in MODES:
                profile = cProfile.Profile()
                profile.enable()
                engines.generate_seconds(mode, prompts, engines.all)
                profile.disable()
                profiled[mode] = per_step_ms(pstats.Stats(profile), args.tokens)
        finally:
            engines.close()
    print("unprofiled ms per token, 4 alternating runs: " + "; ".join(
        f"{mode} {min(v):.2f}–{max(v):.2f}" for mode, v in per_token.items()))
    print(f"\n| per step, profiled ({args.tokens} tokens) | " + " | ".join(MODES) + " |\n|---|---|---|")
    for label in FUNCTIONS:
        print(f"| {label} | " + " | ".join(f"{profiled[mode][label]:.2f} ms" for mode in MODES) + " |")


if __name__ == "__main__":
    main()

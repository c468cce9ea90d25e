"""The prompt phase of a model trained with the exact schedule: fused:exact (the exact recurrence, one decode step
per prompt token) against fused:auto at tolerance 0 (Jacobi passes until the states stop changing: up to T passes
over T tokens), which compute the same states.

The `state-tracking` preset's model (random weights, eval mode, no_grad), a batch of prompts of T random tokens at
each length; each repetition times both modes back to back, in an order alternating between repetitions, and the
ratio is taken within a repetition (paired), summarised by its median and min..max. fused:auto's time grows with
T^2 (about T passes of T tokens), fused:exact's with T.

Usage:
    python benchmarks/exact_prefill.py                    # T = 32, 64, 128, 256, 200 rows (a few minutes)
    python benchmarks/exact_prefill.py --quick            # T = 16, 32, 16 rows (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import add_common_arguments, machine_info, print_header, setup_device, write_record

from fullband.config import load_config
from fullband.loading import preset_path
from fullband.model import FullBandLM


def time_prefill(model: FullBandLM, ids: torch.Tensor, passes: str, sync) -> tuple[float, torch.Tensor]:
    sync()
    start = time.perf_counter()
    out = model.prefill(ids, passes, fused_tol=0.0, fused_max_passes=ids.shape[1] + 1, logits_to_keep=1)
    sync()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p, "two short lengths, 16 rows", "repetitions per length (default 3; quick 2)",
                         ["float32", "bfloat16"])
    p.add_argument("--lengths", default=None, help="comma-separated prompt lengths (default 32,64,128,256)")
    p.add_argument("--rows", type=int, default=None, help="prompts per batch (default 200, the rows of a sweep)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/exact_prefill.json"))
    args = p.parse_args(argv)
    device, dtype, sync = setup_device(args, p)
    lengths = [int(x) for x in (args.lengths or ("16,32" if args.quick else "32,64,128,256")).split(",")]
    rows = args.rows or (16 if args.quick else 200)
    repeats = args.repeats or (2 if args.quick else 3)
    machine = machine_info(args.threads, args.device)
    command = print_header("fused:exact vs fused:auto (tol 0) prefill, exact-schedule model", argv, machine, args)

    cfg = load_config(preset_path("state-tracking")).model
    torch.manual_seed(0)
    model = FullBandLM(cfg).to(device=device, dtype=dtype).eval()
    results = {}
    print("| T | rows | fused:auto (s) | passes | fused:exact (s) | exact / auto, median (min-max) | max state diff |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for T in lengths:
            ids = torch.randint(0, cfg.vocab_size, (rows, T), generator=torch.Generator().manual_seed(T)).to(device)
            auto_s, exact_s, ratios = [], [], []
            for rep in range(repeats):
                timings = {}
                for mode in (("auto", "exact") if rep % 2 == 0 else ("exact", "auto")):
                    timings[mode], out = time_prefill(model, ids, mode, sync)
                    if mode == "auto":
                        auto_out = out
                    else:
                        exact_out = out
                auto_s.append(timings["auto"])
                exact_s.append(timings["exact"])
                ratios.append(timings["exact"] / timings["auto"])
            diff = float((auto_out.hidden.float() - exact_out.hidden.float()).abs().max())
            passes = int(auto_out.passes.max())
            results[str(T)] = {"rows": rows, "auto_s": auto_s, "exact_s": exact_s, "ratio_exact_over_auto": ratios,
                               "auto_passes": passes, "max_state_diff": diff}
            print(f"| {T} | {rows} | {statistics.median(auto_s):.3f} | {passes} | {statistics.median(exact_s):.3f} | "
                  f"{statistics.median(ratios):.4f} ({min(ratios):.4f}-{max(ratios):.4f}) | {diff:.1e} |", flush=True)
    record = {"benchmark": "exact_prefill", "command": command, "machine": machine, "model": "state-tracking preset",
              "dtype": args.dtype, "repeats": repeats, "results": results}
    return write_record(args.out, record)


if __name__ == "__main__":
    main()

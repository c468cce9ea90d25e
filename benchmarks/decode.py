"""Per-token decode time of soft vs standard decoding, and the prefill cost of fused(n).

Same model (random weights, eval mode, no_grad), same prompts, every mode interleaved in one run: each
repetition runs every mode once, in an order rotated from repetition to repetition, so machine noise
(other processes on a shared CPU) hits all modes alike. Ratios are taken within a repetition (paired)
and summarised by their median and min..max over repetitions.

The JSON keeps, per mode, per-repetition summaries (``repetitions``: one list per quantity, index =
repetition): prefill and mean step time, median and IQR of the step times, the ratios to standard, and
median and IQR of the paired step ratios; not every step's time.

Timing goes through ``generate_stream``: the first token arrives after the prefill (plain pass, plus n
fused passes in fused(n) mode), so

- prefill time  = time until the first token is yielded (prefill + one argmax),
- per-token time = (time of the last token - time of the first token) / (new tokens - 1),
  i.e. the mean of the cached single-token decode steps.

Usage:
    python benchmarks/decode.py                 # full run (a few minutes on 2 CPU cores)
    python benchmarks/decode.py --quick         # smoke run (< 30 s)
    python benchmarks/decode.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from common import add_common_arguments, chosen_models, machine_info, print_header, setup_device

from fullband.generation import generate_stream
from fullband.model import FullBandConfig, FullBandLM

# name -> (config kwargs). "d512" is the model the ≤ 1.05 goal is about.
MODELS = {
    "d512-L6": dict(vocab_size=8192, d_model=512, n_layers=6, n_heads=8, d_ff=1536),
    "d128-L2": dict(vocab_size=8192, d_model=128, n_layers=2, n_heads=4, d_ff=384),
}
QUICK_MODELS = {
    "d128-L2": MODELS["d128-L2"],
    "d256-L2": dict(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, d_ff=768),
}
# (label, generate_stream kwargs)
MODES = [
    ("standard", dict(mode="standard")),
    ("soft", dict(mode="soft")),
    ("fused(1)", dict(mode="fused", fused_passes=1)),
    ("fused(2)", dict(mode="fused", fused_passes=2)),
]


def macs_per_token(cfg: FullBandConfig, context: int) -> dict:
    """Multiply-accumulates of one decode step (one token, one row), analytic."""
    d, hd = cfg.d_model, cfg.resolved_head_dim
    proj = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2  # q, o + k, v
    mlp = 3 * d * cfg.d_ff
    attn = 2 * cfg.n_heads * hd * context  # q·K and p·V over the cached context
    stack = cfg.n_layers * (proj + mlp + attn)
    head = d * cfg.vocab_size
    fusion = 2 * d * d  # W_U h and W_G RMSNorm(e) (gate fusion)
    return {"stack": stack, "head": head, "fusion": fusion, "fusion_share": fusion / (stack + head)}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired(runs: list[dict], base: list[dict], key: str) -> dict:
    return summary([r[key] / b[key] for r, b in zip(runs, base, strict=True)])


def timed_next(it, sync) -> float:
    sync()
    t0 = time.perf_counter()
    next(it)
    sync()
    return time.perf_counter() - t0


def run_interleaved(model, prompts, new_tokens: int, modes: list, sync) -> dict:
    """Run every mode's stream side by side, one step of each in turn (order reversed on every other
    round: ABCD DCBA ...), so that noise from other processes hits every mode alike.

    Round 0 is each stream's prefill (up to its first token); round i >= 1 is one cached decode step
    (forward of one token + argmax). Returns, per mode, the prefill time and the decode step times.
    """
    streams = {label: generate_stream(model, prompts, new_tokens, **mk) for label, mk in modes}
    out = {label: {"prefill_s": 0.0, "steps_s": []} for label, _ in modes}
    for step in range(new_tokens):
        order = modes if step % 2 == 0 else modes[::-1]
        for label, _ in order:
            dt = timed_next(streams[label], sync)
            if step == 0:
                out[label]["prefill_s"] = dt
            else:
                out[label]["steps_s"].append(dt)
    for it in streams.values():  # each stream ends after new_tokens tokens (no EOS is set)
        assert next(it, None) is None
    return out


def bench_model(name, kwargs, args, dtype, device, sync) -> dict:
    torch.manual_seed(0)
    cfg = FullBandConfig(max_seq_len=args.prompt_len + args.new_tokens, **kwargs)
    model = FullBandLM(cfg).to(device=device, dtype=dtype).eval()
    context = args.prompt_len + args.new_tokens // 2
    flops = macs_per_token(cfg, context)
    result = {"config": cfg.to_dict(), "params": model.num_parameters(), "macs_per_token": flops}
    result["batches"] = {}
    for batch in args.batch:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, cfg.vocab_size, (batch, args.prompt_len), generator=g).to(device)
        with torch.no_grad():
            run_interleaved(model, prompts, min(args.new_tokens, 8), MODES, sync)  # warm-up
            raw: dict[str, list[dict]] = {label: [] for label, _ in MODES}
            for rep in range(args.repeats):
                order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
                for label, r in run_interleaved(model, prompts, args.new_tokens, order, sync).items():
                    r["per_token_s"] = statistics.fmean(r["steps_s"])
                    raw[label].append(r)
            fusion_s = fusion_call_s(model, batch, sync)
        std = raw["standard"]
        res = {"modes": {}, "fusion_call_s": fusion_s}
        for label, _ in MODES:
            runs = raw[label]
            step_ratios = [
                a / b for r, s in zip(runs, std, strict=True) for a, b in zip(r["steps_s"], s["steps_s"], strict=True)
            ]
            res["modes"][label] = {
                "prefill_s": summary([r["prefill_s"] for r in runs]),
                "per_token_s": summary([r["per_token_s"] for r in runs]),
                # ratios to standard, paired within a repetition (mean step time) ...
                "per_token_ratio": paired(runs, std, "per_token_s"),
                "prefill_ratio": paired(runs, std, "prefill_s"),
                # ... and over all pairs of adjacent decode steps (robust to outlier steps)
                "step_ratio": summary(step_ratios)
                | {"p25": quantile(step_ratios, 0.25), "p75": quantile(step_ratios, 0.75)},
                "repetitions": repetition_summaries(runs, std),
            }
        result["batches"][str(batch)] = res
        print(f"  {name} batch {batch}: done", file=sys.stderr, flush=True)
    return result


def repetition_summaries(runs: list[dict], std: list[dict]) -> dict:
    """One list per quantity, index = repetition: prefill and mean step time, the step times' median and
    [p25, p75], the ratios to standard in that repetition, and the paired step ratios' median and
    [p25, p75]. 6 significant digits."""
    out: dict[str, list[float]] = {}
    for r, s in zip(runs, std, strict=True):
        ratios = [a / b for a, b in zip(r["steps_s"], s["steps_s"], strict=True)]
        rep = {
            "prefill_s": r["prefill_s"],
            "per_token_s": r["per_token_s"],
            "prefill_ratio": r["prefill_s"] / s["prefill_s"],
            "per_token_ratio": r["per_token_s"] / s["per_token_s"],
        }
        for key, values in (("step_s", r["steps_s"]), ("step_ratio", ratios)):
            rep[f"{key}_median"] = statistics.median(values)
            rep[f"{key}_p25"] = quantile(values, 0.25)
            rep[f"{key}_p75"] = quantile(values, 0.75)
        for key, value in rep.items():
            out.setdefault(key, []).append(float(f"{value:.6g}"))
    return out


def dumps(payload: dict) -> str:
    """json.dumps(indent=1), with lists of numbers kept on one line."""
    text = json.dumps(payload, indent=1)
    numbers = re.compile(r"\[\s*([-0-9.eE+,\s]+?)\s*\]")
    return numbers.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)


def fusion_call_s(model, batch: int, sync, calls: int = 200, rounds: int = 5) -> float:
    """Median time of one call of the fusion module on a (batch, 1, D) decode-step input."""
    d = model.config.d_model
    p = next(model.parameters())
    e = torch.randn(batch, 1, d, device=p.device, dtype=p.dtype)
    h = torch.randn(batch, 1, d, device=p.device, dtype=p.dtype)
    for _ in range(20):
        model.fusion(e, h)
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            model.fusion(e, h)
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def fmt_ratio(s: dict) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"


def table(results: dict) -> str:
    lines = [
        "| model | batch | mode | prefill ms | prefill / standard | per-token ms | per-token / standard "
        "| paired-step ratio, median [p25–p75] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        for batch, b in res["batches"].items():
            for label, m in b["modes"].items():
                lines.append(
                    f"| {name} | {batch} | {label} | {m['prefill_s']['median'] * 1e3:.2f} "
                    f"| {fmt_ratio(m['prefill_ratio'])} | {m['per_token_s']['median'] * 1e3:.3f} "
                    f"| {fmt_ratio(m['per_token_ratio'])} "
                    f"| {m['step_ratio']['median']:.3f} [{m['step_ratio']['p25']:.3f}–{m['step_ratio']['p75']:.3f}] |"
                )
    lines += [
        "",
        "| model | params | stack MACs/token | head MACs/token | fusion MACs/token (2·D²) | fusion share |",
        "|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        f = res["macs_per_token"]
        lines.append(
            f"| {name} | {res['params'] / 1e6:.2f} M | {f['stack'] / 1e6:.2f} M | {f['head'] / 1e6:.2f} M "
            f"| {f['fusion'] / 1e6:.3f} M | {100 * f['fusion_share']:.2f} % |"
        )
    lines += [
        "",
        "| model | batch | fusion module alone, µs/call | standard step, µs | fusion / standard step |",
        "|---|---|---|---|---|",
    ]
    for name, res in results.items():
        for batch, b in res["batches"].items():
            step = b["modes"]["standard"]["per_token_s"]["median"]
            lines.append(
                f"| {name} | {batch} | {b['fusion_call_s'] * 1e6:.1f} | {step * 1e6:.0f} "
                f"| {100 * b['fusion_call_s'] / step:.1f} % |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(
        p,
        "small models, few tokens: a smoke run (< 30 s)",
        "interleaved repetitions (default 7; quick 3)",
        ["float32", "bfloat16", "float16"],
    )
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default 1 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; quick 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 128; quick 16)")
    p.add_argument("--models", nargs="+", default=None, help=f"subset of {list(MODELS)}")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode[_quick].json)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = "benchmarks/results/decode" + ("_quick" if args.quick else "") + ".json"
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.batch is None:
        args.batch = [1, 8]
    if args.prompt_len is None:
        args.prompt_len = 16 if args.quick else 64
    if args.new_tokens is None:
        args.new_tokens = 16 if args.quick else 128
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (per-token time needs two stamps)")
    models = chosen_models(p, args, MODELS, QUICK_MODELS)

    device, dtype, sync = setup_device(args, p)

    started = time.time()
    results = {name: bench_model(name, kw, args, dtype, device, sync) for name, kw in models.items()}
    elapsed = time.time() - started

    machine = machine_info(args.threads, args.device)
    command = print_header("decode benchmark", argv, machine, args)
    print(
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (greedy), {args.repeats} repetitions, "
        "modes interleaved step by step. Times: medians over repetitions. Ratios to standard: "
        "'/ standard' columns are paired per repetition, median (min–max) over repetitions; the paired-step "
        "ratio divides each decode step by the adjacent step of standard, median [p25–p75] over all steps. "
        f"Fusion share: analytic, at the mean context ({args.prompt_len + args.new_tokens // 2} tokens).\n"
    )
    print(table(results))
    print(f"\nwall time {elapsed:.1f} s")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "decode",
        "command": command,
        "machine": machine,
        "settings": {
            "repeats": args.repeats,
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "dtype": args.dtype,
            "quick": args.quick,
        },
        "wall_s": elapsed,
        "results": results,
    }
    out.write_text(dumps(payload) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

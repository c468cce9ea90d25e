"""The benchmark loop: tasks x decode modes x temperatures x samples -> samples.jsonl, results.json/.md. Every sample
is appended as soon as it is scored, keyed, so a rerun with the same ``--out`` resumes; greedy decoding generates one
sample per problem whatever ``--samples`` says."""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fullband.bench.metrics import summarize
from fullband.bench.plots import plot_results
from fullband.bench.tasks import BenchTask, Problem
from fullband.decoding import DecodeSettings
from fullband.errors import ConfigError, FullbandError
from fullband.generation import decode_settings, generate_stream
from fullband.loading import encode_prompt
from fullband.sampling import SamplingParams
from fullband.stop_strings import tokens_until_stop

SAMPLES = "samples.jsonl"
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
SETTINGS = "bench_config.json"


def parse_modes(text: str, base: DecodeSettings | None = None) -> list[DecodeSettings]:
    """Comma-separated modes (standard, soft, fused, fused:N, fused:auto) as decode settings: ``base`` (the
    model's stored settings; "fused" takes its passes, fused:auto its tolerance and cap) in each mode, once."""
    base = base or DecodeSettings()
    modes = [base.with_label(m) for m in text.split(",") if m.strip()]
    if not modes:
        raise ConfigError("--modes is empty; give e.g. standard,soft,fused:1")
    return list({m.label: m for m in modes}.values())


def parse_temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--temperatures must be comma-separated numbers, got {text!r}") from None
    if not temps or any(t < 0 for t in temps):
        raise ConfigError(f"--temperatures needs numbers >= 0 (0 = greedy), got {text!r}")
    return sorted(set(temps))


@dataclass
class BenchSettings:
    model: str
    modes: list[str]
    temperatures: list[float]
    samples: int
    ks: list[int]
    limit: int | None = None
    max_new_tokens: int | None = None
    batch_size: int = 16
    seed: int = 0
    top_p: float | None = None
    # fused:auto's tolerance and cap; None: the model's stored ones (the results record the values used)
    fused_tol: float | None = None
    fused_max_passes: int | None = None
    bootstrap: int = 1000
    extra: dict[str, Any] = field(default_factory=dict)


def _key(task: str, mode: str, temperature: float, problem: str, sample: int) -> str:
    return json.dumps([task, mode, temperature, problem, sample])


def load_samples(path: Path) -> dict[str, dict]:
    """Finished samples of an earlier (possibly interrupted) run. A torn last line (the one being written
    when the run was killed) is cut off so that new rows start on a line of their own."""
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        done[_key(row["task"], row["mode"], row["temperature"], row["problem"], row["sample"])] = row
    return done


def stop_token_ids(tokenizer: Any, stops: Sequence[str]) -> set[int]:
    """Token ids whose text contains a one-character stop string (a newline): a row ends on them without
    decoding its whole text. Longer stop strings are found by decoding."""
    single = [s for s in stops if len(s) == 1]
    if not single:
        return set()
    return {i for i in range(tokenizer.vocab_size) if any(s in tokenizer.decode([i]) for s in single)}


@torch.no_grad()
def generate_batch(
    model: Any, tokenizer: Any, prompts: Sequence[list[int]], max_new_tokens: int, task: BenchTask, stop_ids: set[int],
    sampling: SamplingParams, decode: DecodeSettings
) -> tuple[list[list[int]], list[int], list[bool | None]]:
    """Generate for a batch until each row hits EOS or a stop string of the task (or the token cap). Per row: the
    generated ids (EOS excluded, stop string included), its fused prefill passes and (fused:auto) whether its
    prefill converged."""
    stats: dict[str, Any] = {}
    eos = tokenizer.eos_id
    stream = generate_stream(model, prompts, max_new_tokens, sampling=sampling, decode=decode, eos_token_id=eos,
                             stats=stats)
    rows = tokens_until_stop(stream, len(prompts), eos, tokenizer.decode, [s for s in task.stop if len(s) > 1],
                             stop_ids)
    passes = stats.get("fused_passes", [0] * len(prompts))
    converged = stats.get("fused_converged", [None] * len(prompts))
    return rows, [int(p) for p in passes], converged


def run_task(model: Any, tokenizer: Any, task: BenchTask, settings: BenchSettings, modes: Sequence[DecodeSettings],
             out_dir: Path, done: dict[str, dict], progress: bool = True) -> list[dict]:
    """Generate and score every missing sample of one task; returns all its sample rows."""
    problems = task.problems(settings.limit)
    if not problems:
        raise FullbandError(f"task {task.name} has no problems")
    encoded = {p.id: encode_prompt(tokenizer, p.prompt) for p in problems}
    context = model.config.max_seq_len
    max_new = settings.max_new_tokens or task.default_max_new_tokens
    longest = max(len(ids) for ids in encoded.values())
    if longest >= context:
        worst = max(problems, key=lambda p: len(encoded[p.id]))
        raise FullbandError(
            f"task {task.name}: problem {worst.id} has a {longest}-token prompt but the model's context is "
            f"{context} tokens; no room to generate. Use a model with a longer context or a smaller task"
        )
    stop_ids = stop_token_ids(tokenizer, task.stop)

    jobs: list[tuple[DecodeSettings, float, Problem, int]] = []
    for mode in modes:
        for temperature in settings.temperatures:
            n = 1 if temperature == 0 else settings.samples
            jobs += [(mode, temperature, p, s) for p in problems for s in range(n)]
    todo = [j for j in jobs if _key(task.name, j[0].label, j[1], j[2].id, j[3]) not in done]
    # Batches share a mode and temperature; similar prompt lengths waste less padding.
    todo.sort(key=lambda j: (j[0].label, j[1], len(encoded[j[2].id])))

    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc=task.name, unit="sample",
               file=sys.stderr, disable=not progress, dynamic_ncols=True)
    with open(out_dir / SAMPLES, "a", encoding="utf-8") as sink:
        for (label, temperature), cell in itertools.groupby(todo, key=lambda j: (j[0].label, j[1])):
            group = list(cell)
            mode = group[0][0]
            for batch_no, start in enumerate(range(0, len(group), settings.batch_size)):
                batch = group[start : start + settings.batch_size]
                prompts = [encoded[p.id] for _, _, p, _ in batch]
                room = context - max(len(ids) for ids in prompts)
                seed = random.Random(f"{settings.seed}/{task.name}/{label}/{temperature}/{batch_no}").getrandbits(62)
                tokens, passes, converged = generate_batch(
                    model, tokenizer, prompts, min(max_new, room), task, stop_ids,
                    SamplingParams(temperature=temperature, top_p=settings.top_p, seed=seed), mode,
                )
                completions = [task.cut(tokenizer.decode(t)) for t in tokens]
                scores = task.score([p for _, _, p, _ in batch], completions)
                for (_, _, problem, sample), toks, text, score, n_pass, conv in zip(
                        batch, tokens, completions, scores, passes, converged):
                    row = {"task": task.name, "mode": label, "temperature": temperature, "problem": problem.id,
                           "sample": sample, "prompt": problem.prompt, "completion": text, "score": score,
                           "correct": score >= 1.0, "length": len(toks), "fused_passes": n_pass,
                           "fused_converged": conv}
                    done[_key(task.name, label, temperature, problem.id, sample)] = row
                    sink.write(json.dumps(row) + "\n")
                sink.flush()
                bar.update(len(batch))
    bar.close()
    return [done[_key(task.name, m.label, t, p.id, s)] for m, t, p, s in jobs]


def aggregate(rows: Sequence[dict], settings: BenchSettings) -> dict:
    """results.json: per task, per mode, per temperature metrics; the best temperature per mode is the
    one with the highest accuracy (ties: the lower temperature)."""
    cells: dict[tuple[str, str, float], dict[str, list]] = {}
    for row in rows:
        cell = cells.setdefault((row["task"], row["mode"], row["temperature"]), {})
        cell.setdefault(row["problem"], []).append(row)
    results: dict[str, Any] = {}
    for (task, mode, temperature), by_problem in cells.items():
        groups = [sorted(v, key=lambda r: r["sample"]) for v in by_problem.values()]
        # At temperature 0 the one greedy sample stands for all: pass@k = pass@1 (deterministic).
        ks = settings.ks if temperature > 0 else [1]
        metrics = summarize([[r["score"] for r in g] for g in groups], [[r["length"] for r in g] for g in groups],
                            ks, settings.bootstrap, settings.seed)
        if temperature == 0:
            metrics["pass_at_k"] = {str(k): metrics["pass_at_k"]["1"] for k in settings.ks}
        passes = [r["fused_passes"] for g in groups for r in g]
        metrics["mean_fused_passes"] = sum(passes) / len(passes)
        # fused:auto samples whose prefill was cut off at fused_max_passes (rows of older runs lack the key)
        metrics["fused_unconverged"] = sum(r.get("fused_converged") is False for g in groups for r in g)
        results.setdefault(task, {}).setdefault(mode, {})[str(temperature)] = metrics
    for modes in results.values():
        for temps in modes.values():
            best = max(sorted(temps, key=float), key=lambda t: temps[t]["accuracy"])
            for t, metrics in temps.items():
                metrics["best"] = t == best
    return results


def _ci(value: float, ci: Sequence[float], digits: int = 3) -> str:
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _unconverged_notes(modes: dict, settings: BenchSettings) -> list[str]:
    """A warning per fused:auto cell some of whose prefills stopped at the pass cap, not at the tolerance."""
    notes = []
    for mode, temps in modes.items():
        for t in sorted(temps, key=float):
            cut, n = temps[t].get("fused_unconverged", 0), temps[t]["samples"]
            if cut:
                notes.append(
                    f"\n**Warning** ({mode}, temperature {t}): {cut} of {n} samples stopped at --fused-max-passes "
                    f"{settings.fused_max_passes} with their prompt's states still changing by more than --fused-tol "
                    f"{settings.fused_tol}, so they were answered from fused({settings.fused_max_passes}), not from "
                    "the converged prefill. A prompt of T tokens reaches the exact recurrence after T − 1 fused "
                    "passes: rerun with --fused-max-passes at least the longest prompt's length in tokens (and "
                    "--fused-tol 0 for the exact recurrence).")
    return notes


def format_markdown(results: dict, settings: BenchSettings) -> str:
    lines = [f"# Benchmark: {settings.model}", "",
             f"Samples per problem: {settings.samples} (1 at temperature 0, greedy). Intervals: 95% bootstrap "
             f"over problems ({settings.bootstrap} resamples, seed {settings.seed}). **Bold**: the best "
             "temperature of a mode (highest accuracy). Length: generated tokens per sample.", ""]
    for task, modes in results.items():
        ks = settings.ks
        lines += [f"## {task}", "",
                  "| mode | temperature | problems | accuracy (pass@1) | "
                  + " | ".join(f"pass@{k}" for k in ks) + " | mean length | median length | fused passes |",
                  "|---|---:|---:|---|" + "---|" * len(ks) + "---|---|---:|"]
        for mode, temps in modes.items():
            for t in sorted(temps, key=float):
                m = temps[t]
                passk = [(_ci(m["pass_at_k"][str(k)]["value"], m["pass_at_k"][str(k)]["ci"])
                          if str(k) in m["pass_at_k"] else "n/a") for k in ks]
                cells = [mode, t, str(m["problems"]), _ci(m["accuracy"], m["accuracy_ci"]), *passk,
                         _ci(m["mean_length"], m["mean_length_ci"], 1),
                         _ci(m["median_length"], m["median_length_ci"], 1), f"{m['mean_fused_passes']:.2f}"]
                if m["best"]:
                    cells = [f"**{c}**" for c in cells]
                lines.append("| " + " | ".join(cells) + " |")
        lines += _unconverged_notes(modes, settings)
        lines.append("")
    return "\n".join(lines)


def check_settings(out_dir: Path, settings: BenchSettings) -> None:
    """A rerun into the same directory must use the same model and sampling settings (it reuses samples)."""
    path = out_dir / SETTINGS
    current = asdict(settings)
    if path.is_file():
        previous = json.loads(path.read_text())
        fixed = ("model", "seed", "top_p", "max_new_tokens", "fused_tol", "fused_max_passes", "extra")
        changed = [k for k in fixed if previous.get(k) != current.get(k)]
        if changed:
            raise FullbandError(
                f"{out_dir} holds samples made with other settings ({', '.join(changed)} differ); "
                "resume with the same settings or choose another --out"
            )
    path.write_text(json.dumps(current, indent=2) + "\n")


def run_bench(model: Any, tokenizer: Any, tasks: Sequence[BenchTask], settings: BenchSettings,
              out_dir: str | os.PathLike, progress: bool = True, plots: bool = True) -> dict:
    """Run (or resume) a benchmark and write samples.jsonl, results.json, results.md and the plots. Each mode
    decodes with the model's stored settings in that mode (``parse_modes``)."""
    base = decode_settings(model, fused_tol=settings.fused_tol, fused_max_passes=settings.fused_max_passes)
    modes = parse_modes(",".join(settings.modes), base)
    settings = replace(settings, modes=[m.label for m in modes], fused_tol=base.fused_tol,
                       fused_max_passes=base.fused_max_passes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_settings(out_dir, settings)
    done = load_samples(out_dir / SAMPLES)
    rows: list[dict] = []
    for task in tasks:
        rows += run_task(model, tokenizer, task, settings, modes, out_dir, done, progress)
    results = aggregate(rows, settings)
    (out_dir / RESULTS_JSON).write_text(json.dumps({"settings": asdict(settings), "results": results}, indent=2))
    (out_dir / RESULTS_MD).write_text(format_markdown(results, settings))
    if plots:
        plot_results(results, out_dir)
    return results

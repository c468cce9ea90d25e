"""Shorter reasoning traces? Soft vs standard decoding of a base FBT on addition (the paper's §5 claim, small).

The paper reports that soft decoding (prompt prefilled plain, every generated token fused with the previous
top state) gives shorter reasoning traces (median generated length) at equal or better accuracy than standard
decoding. Two tasks, each trained from scratch (answer-only loss) and benchmarked greedily with `fullband bench`
on the held-out examples of the same task:

  fixed     synthetic:addition:max_digits=N                   every answer writes the digit-by-digit trace,
            so the length is fixed by the format (a control: soft and standard can differ only by errors)
  optional  synthetic:addition:max_digits=N,trace_percent=50   half the training answers write the trace,
            half answer directly (` => 132`): the model chooses at decode time whether to write a trace

Models (same size, same tokens, same train.seed, hence the same initialisation draw and data order):

  fbt        train.schedule paper: 75% of the tokens one pass, then K=2 (0.88) / K=3 (0.12) passes
  fbt_from0  feedback from the start: K=2 (0.88) / K=3 (0.12) throughout (experiments/sweeps.py ARMS)
  baseline   train.schedule standard (one pass: an ordinary transformer)

FBTs are decoded in modes standard and soft; the baseline in standard (soft is meaningless for a model that never
saw a fed-back state, so it is not run). Recorded per (task, model, seed): accuracy and mean/median generated
length (with the bench's bootstrap intervals), the fraction of completions that write a trace, per-row results,
tokens and token-equivalent compute (tokens × mean passes, the trainer's compute_tokens).

    OMP_NUM_THREADS=1 python -m experiments.traces.reasoning_traces --seeds 0 1 2          # train + bench, resumes
    # as run for docs (fbt and baseline of every seed first, then fbt_from0; the same runs and records):
    OMP_NUM_THREADS=1 python -m experiments.traces.reasoning_traces --seeds 0 1 2 --models baseline,fbt --plot ''
    OMP_NUM_THREADS=1 python -m experiments.traces.reasoning_traces --seeds 0 1 2 --models fbt_from0
    OMP_NUM_THREADS=1 python -m experiments.traces.reasoning_traces --summary-only          # tables + plot
    python -m experiments.traces.reasoning_traces --quick --seeds 0 --out /tmp/rt.jsonl --work-dir /tmp/rt --plot ''

Every finished (task, model, seed) appends one JSON line to --out, so a rerun skips it; an interrupted
training resumes from its last checkpoint in --work-dir and an interrupted bench from its samples.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from experiments.plotting import pyplot, save
from experiments.stats import fmt, interval
from fullband.bench import BenchSettings, make_task, run_bench
from fullband.config import load_config
from fullband.loading import PRESET_DIR, load_model
from fullband.train import train

# name -> config overrides; the schedules are written as in experiments/sweeps.py.
MODELS: dict[str, dict[str, str]] = {
    "fbt": {"train.schedule": "paper"},
    "fbt_from0": {"train.schedule": json.dumps([{"until": 1.0, "passes": {2: 0.88, 3: 0.12}}])},
    "baseline": {"train.schedule": "standard"},
}
# Soft decoding only means something for a model trained with fed-back states.
MODES = {"fbt": ["standard", "soft"], "fbt_from0": ["standard", "soft"], "baseline": ["standard"]}
TASKS = {"fixed": "addition:max_digits={n}", "optional": "addition:max_digits={n},trace_percent=50"}

# The experiment's size: 2 tasks × 3 models × 3 seeds took 29.7 min on one thread (baseline ~65 s, fbt ~85 s,
# fbt_from0 ~145 s of training each, benches ~2 s); at 3M tokens every model reaches > 50% standard accuracy.
FULL = {"model.d_model": "64", "model.n_layers": "2", "model.n_heads": "4", "model.d_ff": "192",
        "model.max_seq_len": "128", "train.seq_len": "128", "train.batch_size": "16", "train.tokens": "3000000",
        "train.warmup_steps": "20", "eval.batches": "2", "eval.batch_size": "16", "eval.fused_passes": "1",
        "eval.sequential": "true", "data.synthetic_train_examples": "20000", "data.synthetic_val_examples": "500"}
QUICK = {**FULL, "model.d_model": "32", "model.d_ff": "64", "train.seq_len": "64", "model.max_seq_len": "64",
         "train.batch_size": "4", "train.tokens": "2048", "eval.batches": "1", "eval.batch_size": "2",
         "data.synthetic_train_examples": "300", "data.synthetic_val_examples": "20"}


def writes_trace(completion: str) -> bool:
    """True iff the completion writes something before its `=>` (a trace), not just ` => result`."""
    line = completion.split("\n", 1)[0]
    return bool(line.split("=>", 1)[0].strip()) if "=>" in line else bool(line.strip())


def mean_interval(values: list[float], digits: int = 3) -> str:
    return fmt(values, f".{digits}f")


def bench_run(run_dir: Path, spec: str, modes: list[str], rows: int, seed: int, val_examples: int) -> dict:
    """Greedy `fullband bench` of a trained run on the first `rows` held-out examples of its task: per mode the
    bench's metrics, the trace fraction and per-row (correct, length, trace)."""
    model, tokenizer = load_model(run_dir, device="cpu")
    settings = BenchSettings(model=str(run_dir), modes=modes, temperatures=[0.0], samples=1, ks=[1], limit=rows)
    task = make_task(f"synthetic:{spec}", seed=seed, val_examples=val_examples)
    results = run_bench(model, tokenizer, [task], settings, run_dir / "bench", progress=False, plots=False)
    samples = [json.loads(line) for line in (run_dir / "bench" / "samples.jsonl").read_text().splitlines()]
    out = {}
    for mode in modes:
        metrics = results[task.name][mode]["0.0"]
        per_row = sorted((s for s in samples if s["mode"] == mode), key=lambda s: int(s["problem"]))
        out[mode] = {key: metrics[key] for key in ("accuracy", "accuracy_ci", "mean_length", "mean_length_ci",
                                                    "median_length", "median_length_ci", "problems")}
        out[mode]["trace_fraction"] = statistics.mean(writes_trace(s["completion"]) for s in per_row)
        out[mode]["rows"] = {"correct": [int(s["correct"]) for s in per_row], "length": [s["length"] for s in per_row],
                             "trace": [int(writes_trace(s["completion"])) for s in per_row]}
    return out


def load_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summarise(records: list[dict]) -> str:
    """Markdown: per task, mean [95% t interval] over seeds per (model, mode); paired soft − standard per seed; FBT vs
    baseline at equal tokens; the budget."""
    lines = []
    for task in dict.fromkeys(r["task"] for r in records):
        rows = [r for r in records if r["task"] == task]
        seeds = sorted({r["seed"] for r in rows})
        lines += [f"\n#### {task}: `{rows[0]['spec']}` (seeds {seeds}, {rows[0]['bench']['standard']['problems']} "
                  "held-out rows, greedy)\n",
                  "| model | mode | seeds | tokens | tokens × mean passes | accuracy | median length | mean length "
                  "| writes a trace |", "|---|---|---|---|---|---|---|---|---|"]
        models = [m for m in MODELS if any(r["model"] == m for r in rows)]
        for model in models:
            runs = [r for r in rows if r["model"] == model]
            compute = statistics.mean(r["compute_tokens"] for r in runs)
            for mode in MODES[model]:
                cells = [mean_interval([r["bench"][mode][k] for r in runs], d) for k, d in
                         (("accuracy", 3), ("median_length", 1), ("mean_length", 1), ("trace_fraction", 3))]
                lines.append(f"| {model} | {mode} | {len(runs)} | {runs[0]['tokens']:,} | {compute:,.0f} | "
                             + " | ".join(cells) + " |")
        lines += ["", "Accuracy on the completions that write a trace and on those that answer directly "
                  "(pooled over seeds: correct / completions):", "",
                  "| model | mode | with a trace | direct |", "|---|---|---|---|"]
        for model in models:
            for mode in MODES[model]:
                pooled = [(c, t) for r in rows if r["model"] == model
                          for c, t in zip(r["bench"][mode]["rows"]["correct"], r["bench"][mode]["rows"]["trace"])]
                cells = []
                for traced in (1, 0):
                    hits = [c for c, t in pooled if t == traced]
                    cells.append(f"{sum(hits)}/{len(hits)} ({sum(hits) / len(hits):.3f})" if hits else "0/0")
                lines.append(f"| {model} | {mode} | " + " | ".join(cells) + " |")
        losses = [m for m in ("standard", "fused(1)", "sequential") if all(m in r["val_loss"] for r in rows)]
        lines += ["", "Teacher-forced validation loss on the answers (nats/token; sequential = the exact recurrence "
                  "that soft decoding computes; meaningless beyond standard for the baseline):", "",
                  "| model | " + " | ".join(losses) + " |", "|---" * (1 + len(losses)) + "|"]
        for model in models:
            runs = [r for r in rows if r["model"] == model]
            lines.append(f"| {model} | "
                         + " | ".join(mean_interval([r["val_loss"][m] for r in runs], 4) for m in losses) + " |")
        lines += ["", "Paired differences per seed (same model, same held-out rows), mean [95% t interval] over seeds; "
                  "'rows switching trace' = rows where the two modes differ in whether a trace is written:", "",
                  "| comparison | seeds | Δ accuracy | Δ median length | Δ mean length | Δ writes a trace "
                  "| rows switching trace |", "|---|---|---|---|---|---|---|"]
        by = {(r["model"], r["seed"]): r for r in rows}
        pairs = [(f"{m} soft − {m} standard", m, "soft", m, "standard") for m in models if m != "baseline"]
        pairs += [(f"{m} {mode} − baseline standard (equal tokens)", m, mode, "baseline", "standard")
                  for m in models if m != "baseline" for mode in MODES[m]]
        for label, ma, mode_a, mb, mode_b in pairs:
            common = [s for s in seeds if (ma, s) in by and (mb, s) in by]
            if not common:
                continue
            a = [by[(ma, s)]["bench"][mode_a] for s in common]
            b = [by[(mb, s)]["bench"][mode_b] for s in common]
            deltas = [mean_interval([x[k] - y[k] for x, y in zip(a, b)], d) for k, d in
                      (("accuracy", 3), ("median_length", 1), ("mean_length", 1), ("trace_fraction", 3))]
            switched = [sum(p != q for p, q in zip(x["rows"]["trace"], y["rows"]["trace"])) for x, y in zip(a, b)]
            lines.append(f"| {label} | {len(common)} | " + " | ".join(deltas) + f" | {mean_interval(switched, 1)} |")
    if records:
        cpu = sum(r["train_seconds"] + r["bench_seconds"] for r in records)
        lines += ["", f"Wall time of all {len(records)} runs (one thread): {cpu / 60:.1f} min."]
    return "\n".join(lines)


def plot(records: list[dict], out: Path) -> Path | None:
    """Accuracy, median length and trace fraction per (model, mode) per task: mean (95% t interval) over seeds, seeds as
    points."""
    if (plt := pyplot()) is None:
        return None
    tasks = list(dict.fromkeys(r["task"] for r in records))
    fig, axes = plt.subplots(3, len(tasks), figsize=(5.5 * len(tasks), 10), squeeze=False)
    for col, task in enumerate(tasks):
        rows = [r for r in records if r["task"] == task]
        cells = [(m, mode) for m in MODELS for mode in MODES[m] if any(r["model"] == m for r in rows)]
        for row, (key, ylabel) in enumerate((("accuracy", "exact-match accuracy"),
                                             ("median_length", "median generated length (tokens)"),
                                             ("trace_fraction", "fraction writing a trace"))):
            ax = axes[row][col]
            for x, (model, mode) in enumerate(cells):
                runs = sorted((r for r in rows if r["model"] == model), key=lambda r: r["seed"])
                values = [r["bench"][mode][key] for r in runs]
                color = f"C{list(MODELS).index(model)}"
                ax.bar(x, statistics.mean(values), color=color, alpha=0.35 if mode == "standard" else 0.7,
                       hatch="" if mode == "standard" else "//", edgecolor=color)
                ax.scatter([x + 0.12 * (i - (len(values) - 1) / 2) for i in range(len(values))], values, color="k",
                           s=14, zorder=3)
                if len(values) > 1:
                    ax.errorbar([x], [statistics.mean(values)], yerr=[interval(values)[1]], color="k",
                                capsize=4)
            ax.set_xticks(range(len(cells)), [f"{m}\n{mode}" for m, mode in cells], fontsize=8)
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", alpha=0.3)
            if key != "median_length":
                ax.set_ylim(0, 1.02)
            ax.set_title(f"{task}: {rows[0]['spec']}", fontsize=9)
    fig.suptitle("Addition, greedy, held-out rows: bar = mean over seeds (95% t interval), dots = seeds; "
                 "hatched = soft decoding", fontsize=10)
    return save(fig, out, dpi=90)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {', '.join(TASKS)}")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--max-digits", type=int, default=3, help="N: operands have 1..N digits")
    p.add_argument("--tokens", type=int, default=None, help="training tokens per run (default: 3,000,000)")
    p.add_argument("--bench-rows", type=int, default=300, help="held-out rows benchmarked per run")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the runs are sized for one)")
    p.add_argument("--work-dir", default="runs/reasoning_traces")
    p.add_argument("--out", default="experiments/traces/results/reasoning_traces.jsonl")
    p.add_argument("--plot", default="experiments/traces/reasoning_traces.png")
    p.add_argument("--summary-only", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for the test suite")
    args = p.parse_args(argv)
    tasks, models = args.tasks.split(","), args.models.split(",")
    if set(tasks) - set(TASKS) or set(models) - set(MODELS):
        p.error(f"--tasks from {', '.join(TASKS)}; --models from {', '.join(MODELS)}")
    sizes = dict(QUICK if args.quick else FULL)
    if args.tokens:
        sizes["train.tokens"] = str(args.tokens)
    rows = 8 if args.quick else args.bench_rows
    out, work = Path(args.out), Path(args.work_dir)
    if not args.summary_only:
        torch.set_num_threads(args.threads)
        out.parent.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            for task in tasks:
                spec = TASKS[task].format(n=args.max_digits)
                for model in models:
                    if any((r["task"], r["model"], r["seed"]) == (task, model, seed) for r in load_records(out)):
                        continue
                    overrides = {**sizes, **MODELS[model], "data.source": f"synthetic:{spec}",
                                 "data.format": "prompt_answer", "train.seed": str(seed), "train.progress": "false",
                                 "train.log_every": "100000"}
                    config = load_config(PRESET_DIR / "cpu.yaml", overrides)
                    run_dir = work / f"{task}-{model}-seed{seed}"
                    started = time.perf_counter()
                    # One prepared dataset per task: data.seed is fixed, so every run of a task sees the same
                    # training examples and the same held-out rows; train.seed sets init and data order.
                    result = train(config, run_dir, data_dir=work / f"data-{task}", resume=run_dir.exists())
                    trained = time.perf_counter()
                    bench = bench_run(run_dir, spec, MODES[model], rows, config.data.seed,
                                      config.data.synthetic_val_examples)
                    record = {"task": task, "spec": spec, "model": model, "seed": seed, "overrides": MODELS[model],
                              "sizes": sizes, "tokens": result.tokens, "compute_tokens": result.compute_tokens,
                              "val_loss": result.final_eval.loss, "bench": bench,
                              "train_seconds": round(trained - started, 1),
                              "bench_seconds": round(time.perf_counter() - trained, 1), "run_dir": str(run_dir)}
                    with out.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                    short = {m: (round(b["accuracy"], 3), b["median_length"]) for m, b in bench.items()}
                    print(f"{task} {model} seed {seed}: train {record['train_seconds']} s, bench "
                          f"{record['bench_seconds']} s, (accuracy, median length) {short}",
                          file=sys.stderr, flush=True)
    records = load_records(out)
    print(summarise(records))
    if args.plot and records:
        print(f"\nplot: {plot(records, Path(args.plot))}")


if __name__ == "__main__":
    main()

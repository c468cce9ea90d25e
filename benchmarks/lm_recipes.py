"""Language-modelling recipes over several seeds: the baseline transformer at several token budgets and FBT
recipes (the paper's, and the options beyond it), each a `fullband train` run of the `cpu` preset on the
built-in corpus. Validation loss per decode mode, mean ± sd over seeds, paired differences per seed on
the same validation windows, and the baseline at equal tokens and at (about) equal compute.

    python benchmarks/lm_recipes.py --arms baseline,fbt,fbt_7525 --seeds 0 1 2
    python benchmarks/lm_recipes.py --arms baseline@1.5,baseline@2,baseline@3   # token efficiency
    python benchmarks/lm_recipes.py --summary-only                               # tables + plot
    python benchmarks/lm_recipes.py --quick                                      # tiny, for the tests
    python benchmarks/lm_recipes.py --arms baseline,fbt_from0 --seeds 0 --out benchmarks/results/lm_long.jsonl \
        --work-dir runs/lm_long --set train.tokens=20000000 --set train.eval_every=610 --curve-plot docs/lm_long.png

An arm is NAME or NAME@X, X multiplying the preset's token budget (train.tokens). Every finished
(arm, seed) appends one JSON line to --out, so a rerun skips it; an interrupted run resumes from its last
checkpoint in --work-dir. Token-equivalent compute = tokens × mean passes (the trainer's compute_tokens).
`--set SECTION.FIELD=VALUE` applies to every arm (after the arm's own settings); with `train.eval_every` each
record keeps the validation curve (loss per mode against tokens and compute), which `--curve-plot` draws.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from fullband.config import load_config
from fullband.loading import PRESET_DIR
from fullband.train import train

PAPER_LATE = {2: 0.88, 3: 0.12}


def phases(*parts: tuple[float, dict[int, float]]) -> str:
    return json.dumps([{"until": until, "passes": passes} for until, passes in parts])

# name -> config overrides (values as on the command line); the baseline is the same model, one pass.
ARMS: dict[str, dict[str, str]] = {
    "baseline": {"train.schedule": "standard"},
    "fbt": {"train.schedule": "paper"},  # 75% one pass, then K=2 (0.88) / K=3 (0.12): 75/22/3
    "fbt_7525": {"train.schedule": phases((0.75, {1: 1.0}), (1.0, {2: 1.0}))},  # 75/25 without 3-pass batches
    "fbt_from25": {"train.schedule": phases((0.25, {1: 1.0}), (1.0, PAPER_LATE))},  # feedback from 25%
    "fbt_from50": {"train.schedule": phases((0.5, {1: 1.0}), (1.0, PAPER_LATE))},  # feedback from 50%
    "fbt_from0": {"train.schedule": "feedback-from-start"},  # the paper's late mix from step 0
    "fbt_ramp": {"train.schedule": "paper", "train.later_pass_weight_ramp": "0.5"},
    "fbt_fusion_lr3": {"train.schedule": "paper", "train.fusion_lr_multiplier": "3"},
    "fbt_warmup": {"train.schedule": "paper", "train.fusion_warmup_steps": "100"},
    "fbt_concat": {"train.schedule": "paper", "model.fusion": "concat"},
    "fbt_add": {"train.schedule": "paper", "model.fusion": "add"},
}


def parse_arm(spec: str) -> tuple[str, float]:
    name, _, mult = spec.partition("@")
    if name not in ARMS:
        raise SystemExit(f"unknown arm {name!r}; choose from {', '.join(ARMS)} (optionally NAME@X for X × tokens)")
    return name, float(mult) if mult else 1.0


def arm_label(name: str, mult: float) -> str:
    return name if mult == 1.0 else f"{name}@{mult:g}"


def mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def summarise(records: list[dict]) -> str:
    arms = list(dict.fromkeys(r["arm"] for r in records))
    modes = list(dict.fromkeys(m for r in records for m in r["loss"]))
    lines = ["| arm | seeds | tokens | tokens × mean passes | " + " | ".join(modes) + " |",
             "|---" * (4 + len(modes)) + "|"]
    for arm in arms:
        runs = [r for r in records if r["arm"] == arm]
        cells = [mean_sd([r["loss"][m] for r in runs]) if all(m in r["loss"] for r in runs) else "" for m in modes]
        compute = statistics.mean(r["compute_tokens"] for r in runs)
        lines.append(f"| {arm} | {len(runs)} | {runs[0]['tokens']:,} | {compute:,.0f} | " + " | ".join(cells) + " |")
    lines += ["", "Paired differences per seed (same validation windows), mean ± sd over seeds (nats/token; "
              "negative = the first is better):", "",
              "| comparison | seeds | difference |", "|---|---|---|"]
    baselines = {r["arm"]: r for r in records if r["name"] == "baseline"}
    by_seed: dict[tuple[str, int], dict] = {(r["arm"], r["seed"]): r for r in records}
    for arm in arms:
        runs = [r for r in records if r["arm"] == arm and r["name"] != "baseline"]
        if not runs:
            continue
        seeds = [r["seed"] for r in runs]
        for mode in ("fused(1)", "fused(2)", "sequential"):
            diffs = [by_seed[(arm, s)]["loss"][mode] - by_seed[(arm, s)]["loss"]["standard"] for s in seeds
                     if mode in by_seed[(arm, s)]["loss"]]
            if diffs:
                lines.append(f"| {arm}: {mode} − own standard | {len(diffs)} | {mean_sd(diffs)} |")
        compute = statistics.mean(r["compute_tokens"] for r in runs) / runs[0]["tokens"]
        for base in sorted({r["arm"] for r in baselines.values()}):
            mult = next(r["mult"] for r in records if r["arm"] == base)
            tag = "equal tokens" if mult == runs[0]["mult"] else f"baseline at {mult:g}× tokens"
            if tag != "equal tokens" and abs(mult - compute) > 0.15:
                continue  # only the baseline of (about) the same compute
            if tag != "equal tokens":
                tag += f" ≈ equal compute ({compute:.2f}×)"
            for mode in ("standard", "fused(1)", "fused(2)", "sequential"):
                diffs = [by_seed[(arm, s)]["loss"][mode] - by_seed[(base, s)]["loss"]["standard"] for s in seeds
                         if (base, s) in by_seed and mode in by_seed[(arm, s)]["loss"]]
                if diffs:
                    lines.append(f"| {arm} {mode} − {base} ({tag}) | {len(diffs)} | {mean_sd(diffs)} |")
    return "\n".join(lines)


def eval_curve(run_dir: Path) -> list[dict]:
    """The run's evaluations (eval.jsonl) with the training tokens and compute (metrics.jsonl) at each."""
    def lines(name: str) -> list[dict]:
        return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line]

    metrics = {r["step"]: r for r in lines("metrics.jsonl")}
    return [{"step": e["step"], "tokens": metrics[e["step"]]["tokens"],
             "compute_tokens": metrics[e["step"]]["compute_tokens"], "loss": e["loss"]} for e in lines("eval.jsonl")]


def curve_table(records: list[dict]) -> str:
    """Per seed and evaluation step: every arm's standard loss and each FBT arm's fused(1) and its differences
    from its own standard pass and from the first baseline arm at the same step (equal tokens)."""
    lines = []
    base_arm = next((r["arm"] for r in records if r["name"] == "baseline" and r.get("curve")), None)
    for seed in sorted({r["seed"] for r in records}):
        runs = [r for r in records if r["seed"] == seed and r.get("curve")]
        base = next((r for r in runs if r["arm"] == base_arm), None)
        fbts = [r for r in runs if r["name"] != "baseline"]
        if not fbts:
            continue
        head = ["step", "tokens"] + ([f"{base_arm} standard"] if base else [])
        for r in fbts:
            head += [f"{r['arm']} standard", f"{r['arm']} fused(1)", "fused(1) − own standard"]
            head += [f"fused(1) − {base_arm}"] if base else []
        lines += [f"seed {seed}:", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        base_at = {c["step"]: c for c in base["curve"]} if base else {}
        for point in fbts[0]["curve"]:
            step = point["step"]
            cells = [str(step), f"{point['tokens']:,}"]
            if base:
                cells.append(f"{base_at[step]['loss']['standard']:.4f}" if step in base_at else "")
            for r in fbts:
                at = {c["step"]: c for c in r["curve"]}.get(step)
                if at is None:
                    cells += [""] * (4 if base else 3)
                    continue
                std, fused = at["loss"]["standard"], at["loss"].get("fused(1)", float("nan"))
                cells += [f"{std:.4f}", f"{fused:.4f}", f"{fused - std:+.4f}"]
                if base:
                    cells.append(f"{fused - base_at[step]['loss']['standard']:+.4f}" if step in base_at else "")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def equal_token_differences(runs: list[dict], trained) -> list[tuple[dict, str, list[int], list[float]]]:
    """(FBT run, mode, tokens, loss − baseline's standard loss) at every evaluation step the FBT run shares
    with the baseline of the same seed *and budget* (a longer baseline@X is mid-run there, not at equal
    tokens). ``trained(run, mode)`` gives the run's curve points to use."""
    base = {(r["seed"], r["mult"]): {c["step"]: c["loss"]["standard"] for c in r["curve"]}
            for r in runs if r["name"] == "baseline"}
    out = []
    for r in runs:
        same = base.get((r["seed"], r["mult"]))
        if r["name"] == "baseline" or same is None:
            continue
        for mode in ("standard", "fused(1)"):
            points = [c for c in trained(r, mode) if c["step"] in same]
            out.append((r, mode, [c["tokens"] for c in points], [c["loss"][mode] - same[c["step"]] for c in points]))
    return out


def plot_curves(records: list[dict], out: Path) -> Path | None:
    """Validation loss during training against tokens and against compute (each arm's standard pass, each FBT
    arm's fused(1); one line per (arm, seed)), and the FBT arms' differences from the baseline at equal tokens.
    fused(1) points more than 0.5 nats above the same model's standard pass (the fusion is not trained yet,
    before an FBT's feedback phase) are left out."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fullband[plot]')", file=sys.stderr)
        return None
    runs = [r for r in records if r.get("curve")]
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))

    def trained(r: dict, mode: str) -> list[dict]:
        if mode == "standard":
            return r["curve"]
        if r["name"] == "baseline":
            return []
        return [c for c in r["curve"] if c["loss"]["fused(1)"] - c["loss"]["standard"] < 0.5]

    late = [c["loss"][m] for r in runs for m in ("standard", "fused(1)") for c in trained(r, m)
            if c["step"] >= r["curve"][-1]["step"] / 4]
    for ax, key, xlabel in ((axes[0], "tokens", "training tokens"),
                            (axes[1], "compute_tokens", "token-equivalent compute (tokens × mean passes)")):
        for r in runs:
            for mode in ("standard", "fused(1)"):
                if not (points := trained(r, mode)):
                    continue
                ax.plot([c[key] for c in points], [c["loss"][mode] for c in points],
                        color=f"C{arms.index(r['arm'])}", linestyle="-" if mode == "standard" else "--",
                        marker="." if mode == "standard" else "x", label=f"{r['arm']} {mode} (seed {r['seed']})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/token)")
        if late:  # the first evaluations are far above the rest: zoom on where the arms can be told apart
            span = max(late) - min(late)
            ax.set_ylim(min(late) - 0.05 * span, max(late) + 0.05 * span)
        ax.grid(alpha=0.3)
    for r, mode, tokens, diffs in equal_token_differences(runs, trained):
        style = "-" if mode == "standard" else "--"
        axes[2].plot(tokens, diffs, color=f"C{arms.index(r['arm'])}", linestyle=style,
                     marker="x" if style == "--" else ".", label=f"{r['arm']} {mode} − baseline (seed {r['seed']})")
    axes[2].axhline(0, color="k", linewidth=0.8)
    axes[2].set_xlabel("training tokens")
    axes[2].set_ylabel("loss difference at equal tokens (nats/token)")
    axes[2].grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    if axes[2].lines[1:]:
        axes[2].legend(fontsize=6)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot(records: list[dict], out: Path, arms: list[str]) -> Path | None:
    """Validation loss against tokens and against compute: the baselines' curve and the modes of the FBT
    arms in ``arms``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fullband[plot]')", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, xlabel in ((axes[0], "tokens", "training tokens"),
                            (axes[1], "compute_tokens", "token-equivalent compute (tokens × mean passes)")):
        base = sorted({r["arm"] for r in records if r["name"] == "baseline"},
                      key=lambda a: next(r["mult"] for r in records if r["arm"] == a))
        xs, ys, es = [], [], []
        for arm in base:
            runs = [r for r in records if r["arm"] == arm]
            vals = [r["loss"]["standard"] for r in runs]
            xs.append(statistics.mean(r[key] for r in runs))
            ys.append(statistics.mean(vals))
            es.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
        ax.errorbar(xs, ys, yerr=es, fmt="k-o", capsize=3, label="baseline (standard)")
        markers = {"standard": "s", "fused(1)": "^", "fused(2)": "v", "sequential": "D"}
        for i, arm in enumerate(a for a in dict.fromkeys(r["arm"] for r in records) if a not in base and a in arms):
            runs = [r for r in records if r["arm"] == arm]
            x = statistics.mean(r[key] for r in runs)
            for mode, marker in markers.items():
                if all(mode in r["loss"] for r in runs):
                    vals = [r["loss"][mode] for r in runs]
                    ax.errorbar([x], [statistics.mean(vals)], yerr=[statistics.stdev(vals) if len(vals) > 1 else 0],
                                fmt=marker, color=f"C{i}", capsize=3, label=f"{arm} {mode}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="baseline,fbt", help="comma-separated NAME or NAME@X (X × tokens)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--preset", default="cpu")
    p.add_argument("--work-dir", default="runs/lm_recipes")
    p.add_argument("--out", default="benchmarks/results/lm_recipes.jsonl")
    p.add_argument("--plot", default="docs/lm_recipes.png")
    p.add_argument("--plot-arms", default="fbt", help="FBT arms whose points the plot shows (comma-separated)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a config override for every arm, after the arm's own (repeatable)")
    p.add_argument("--curve-plot", default="", help="also plot the validation curves (runs with train.eval_every)")
    p.add_argument("--summary-only", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for the test suite")
    args = p.parse_args(argv)
    arms = [parse_arm(a) for a in args.arms.split(",")]
    sets = {}
    for item in args.sets:
        key, eq, value = item.partition("=")
        if not eq or "." not in key:
            raise SystemExit(f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. --set train.eval_every=500")
        sets[key] = value
    out, work = Path(args.out), Path(args.work_dir)
    quick = {"train.tokens": "1536", "train.seq_len": "32", "train.batch_size": "4", "eval.batches": "1",
             "eval.batch_size": "2", "data.max_train_bytes": "60000", "model.d_model": "32", "model.n_layers": "2",
             "model.d_ff": "64", "model.max_seq_len": "64"} if args.quick else {}
    if not args.summary_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            for name, mult in arms:
                label = arm_label(name, mult)
                done = {(r["arm"], r["seed"]) for r in map(json.loads, out.read_text().splitlines())} \
                    if out.exists() else set()
                if (label, seed) in done:
                    continue
                base = load_config(PRESET_DIR / f"{args.preset}.yaml", quick)
                overrides = {**quick, **ARMS[name], "train.seed": str(seed), "train.progress": "false",
                             "train.log_every": "100000", "train.tokens": str(round(base.train.tokens * mult))}
                overrides.update(sets)
                if "train.tokens" in sets:  # the budget of --set, still multiplied by the arm's @X
                    overrides["train.tokens"] = str(round(int(sets["train.tokens"]) * mult))
                config = load_config(PRESET_DIR / f"{args.preset}.yaml", overrides)
                run_dir = work / f"{label}-seed{seed}"
                started = time.perf_counter()
                result = train(config, run_dir, data_dir=work / "data", resume=run_dir.exists())
                record = {"arm": label, "name": name, "mult": mult, "seed": seed, "overrides": ARMS[name],
                          "tokens": result.tokens, "compute_tokens": result.compute_tokens,
                          "loss": result.final_eval.loss, "seconds": round(time.perf_counter() - started, 1),
                          "run_dir": str(run_dir), "sets": sets}
                if config.train.eval_every:
                    record["curve"] = eval_curve(run_dir)
                with out.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                print(f"{label} seed {seed}: {record['seconds']} s, {record['loss']}", file=sys.stderr, flush=True)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    print(summarise(records))
    if any(r.get("curve") for r in records):
        print("\nValidation loss during training (same validation windows at every step):\n")
        print(curve_table(records))
    if args.curve_plot and records:
        print(f"plot: {plot_curves(records, Path(args.curve_plot))}")
    if args.plot and records:
        print(f"\nplot: {plot(records, Path(args.plot), args.plot_arms.split(','))}")


if __name__ == "__main__":
    main()

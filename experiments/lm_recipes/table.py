"""The language-modelling tables of an LM sweep (experiments/sweeps.py: `python -m experiments.run lm_recipes`,
`lm_long`): validation loss per decode mode, mean and 95% t interval over seeds, paired differences per seed on
the same validation windows, the baseline at equal tokens and at (about) equal compute, and, for runs with
`train.eval_every`, the validation curves. Reads results/NAME.jsonl, which the runner fills run by run.

    python -m experiments.lm_recipes.table lm_recipes --plot-arms fbt,fbt_from0,fbt_from25,fbt_from50
    python -m experiments.lm_recipes.table lm_long --plot "" --curve-plot experiments/lm_recipes/lm_long.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from experiments.plotting import pyplot, save
from experiments.stats import fmt, interval

RESULTS = Path(__file__).resolve().parent / "results"


def mean_interval(values: list[float]) -> str:
    """Mean [95% t interval] over seeds, 4 decimals (nats/token)."""
    return fmt(values, ".4f")


def summarise(records: list[dict]) -> str:
    arms = list(dict.fromkeys(r["arm"] for r in records))
    modes = list(dict.fromkeys(m for r in records for m in r["loss"]))
    lines = ["| arm | seeds | tokens | tokens × mean passes | " + " | ".join(modes) + " |",
             "|---" * (4 + len(modes)) + "|"]
    for arm in arms:
        runs = [r for r in records if r["arm"] == arm]
        cells = [mean_interval([r["loss"][m] for r in runs]) if all(m in r["loss"] for r in runs) else ""
                 for m in modes]
        compute = statistics.mean(r["compute_tokens"] for r in runs)
        lines.append(f"| {arm} | {len(runs)} | {runs[0]['tokens']:,} | {compute:,.0f} | " + " | ".join(cells) + " |")
    lines += ["", "Paired differences per seed (same validation windows), mean [95% t interval] over seeds "
              "(nats/token; negative = the first is better):", "",
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
                lines.append(f"| {arm}: {mode} − own standard | {len(diffs)} | {mean_interval(diffs)} |")
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
                    lines.append(f"| {arm} {mode} − {base} ({tag}) | {len(diffs)} | {mean_interval(diffs)} |")
    return "\n".join(lines)


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
    if (plt := pyplot()) is None:
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
    return save(fig, out, dpi=90)


def plot(records: list[dict], out: Path, arms: list[str]) -> Path | None:
    """Validation loss against tokens and against compute: the baselines' curve and the modes of the FBT
    arms in ``arms``."""
    if (plt := pyplot()) is None:
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
            es.append(interval(vals)[1] if len(vals) > 1 else 0.0)
        ax.errorbar(xs, ys, yerr=es, fmt="k-o", capsize=3, label="baseline (standard)")
        markers = {"standard": "s", "fused(1)": "^", "fused(2)": "v", "sequential": "D"}
        for i, arm in enumerate(a for a in dict.fromkeys(r["arm"] for r in records) if a not in base and a in arms):
            runs = [r for r in records if r["arm"] == arm]
            x = statistics.mean(r[key] for r in runs)
            for mode, marker in markers.items():
                if all(mode in r["loss"] for r in runs):
                    vals = [r["loss"][mode] for r in runs]
                    ax.errorbar([x], [statistics.mean(vals)], yerr=[interval(vals)[1] if len(vals) > 1 else 0],
                                fmt=marker, color=f"C{i}", capsize=3, label=f"{arm} {mode}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    return save(fig, out, dpi=90)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help="the results file's name: an LM sweep, e.g. lm_recipes (results/lm_recipes.jsonl)")
    p.add_argument("--results", type=Path, default=RESULTS, help="where the sweeps' JSONL files are")
    p.add_argument("--plot", help="loss against tokens and compute (default NAME.png beside results/; '' = none)")
    p.add_argument("--plot-arms", default="fbt", help="FBT arms whose points the plot shows (comma-separated)")
    p.add_argument("--curve-plot", default="", help="also plot the validation curves (runs with train.eval_every)")
    args = p.parse_args(argv)
    path = args.results / f"{args.name}.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: run `python -m experiments.run {args.name}` first")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(summarise(records))
    if any(r.get("curve") for r in records):
        print("\nValidation loss during training (same validation windows at every step):\n")
        print(curve_table(records))
    if args.curve_plot:
        print(f"plot: {plot_curves(records, Path(args.curve_plot))}")
    out = args.results.parent / f"{args.name}.png" if args.plot is None else Path(args.plot)
    if str(out) not in ("", "."):
        print(f"\nplot: {plot(records, out, args.plot_arms.split(','))}")


if __name__ == "__main__":
    main()

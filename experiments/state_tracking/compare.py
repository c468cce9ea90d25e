"""Several sweeps side by side on the same test rows: per task, each model's accuracy in the mode it is used in (an
FBT's exact recurrence, a baseline's one pass) at every length, mean [95% t interval] over its seeds; what a run
cost (tokens, token-equivalent compute, training seconds); the paired differences of the first sweep against each
other one (the same rows and seeds); and a plot with one panel per task and one line per sweep.

    python -m experiments.state_tracking.compare preset_fresh lstm_fresh baseline_fresh --plot compare_fresh.png
    python -m experiments.state_tracking.compare preset_fresh delta_fresh lstm_fresh --plot compare_delta.png
    python -m experiments.state_tracking.compare preset_fresh len32_fresh --rows val   # choose on validation rows
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from experiments.plotting import pyplot, save
from experiments.state_tracking.table import RESULTS, against_by_task, load, main_mode, rows_of, sort_key
from experiments.stats import fmt, interval

NAMES = {"fbt": "FBT", "lstm": "LSTM", "deltaproduct": "DeltaProduct"}


def label_of(name: str, records: list[dict]) -> str:
    """"FBT", "LSTM", ... and the sweep and mode; an FBT graded in its plain pass only is the transformer baseline."""
    arch, mode = records[0].get("arch", "fbt"), main_mode(records)
    model = "transformer" if arch == "fbt" and mode == "standard" else NAMES.get(arch, arch)
    return f"{model} ({name}, {mode})"


def lengths_of(records: list[dict]) -> list[int]:
    return sorted({int(m) for r in records for m in r["lengths"]})


def accuracy_table(sweeps: dict[str, list[dict]]) -> str:
    lengths = sorted({m for records in sweeps.values() for m in lengths_of(records)})
    lines = ["| task | model | seeds | " + " | ".join(f"{m} moves" for m in lengths) + " |",
             "|---|---|---|" + "---|" * len(lengths)]
    tasks = dict.fromkeys(r["task"] for records in sweeps.values() for r in sorted(records, key=sort_key))
    for task in tasks:
        for name, records in sweeps.items():
            runs = [r for r in records if r["task"] == task]
            if not runs:
                continue
            mode = main_mode(records)
            cells = []
            for m in map(str, lengths):
                accs = [r["lengths"][m][mode]["accuracy"] for r in runs if m in r["lengths"]]
                cells.append(fmt(accs) if accs else "—")
            lines.append(f"| {task} | {label_of(name, records)} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(sweeps: dict[str, list[dict]]) -> str:
    lines = ["| model | runs | tokens | token-equivalent compute (tokens × passes computed) | train seconds, "
             "min–max |", "|---|---|---|---|---|"]
    for name, records in sweeps.items():
        seconds = [r["train_seconds"] for r in records]
        lines.append(f"| {label_of(name, records)} | {len(records)} | "
                     f"{statistics.mean(r['tokens'] for r in records) / 1e6:.2f} M | "
                     f"{statistics.mean(r['compute_tokens'] for r in records) / 1e6:.2f} M | "
                     f"{min(seconds)}–{max(seconds)} |")
    return "\n".join(lines)


def plot(sweeps: dict[str, list[dict]], out: Path, title: str) -> Path | None:
    if (plt := pyplot()) is None:
        return None
    tasks = list(dict.fromkeys(r["task"] for records in sweeps.values() for r in sorted(records, key=sort_key)))
    cols = min(3, len(tasks))
    rows_n = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.4 * cols, 3.3 * rows_n), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for i, (name, records) in enumerate(sweeps.items()):
            runs = [r for r in records if r["task"] == task]
            if not runs:
                continue
            mode, lengths = main_mode(records), lengths_of(runs)
            accs = [[r["lengths"][str(m)][mode]["accuracy"] for r in runs if str(m) in r["lengths"]] for m in lengths]
            # distinct markers and dashes, so that sweeps on top of each other (all at 1.0) stay visible
            ax.errorbar(lengths, [statistics.mean(a) for a in accs],
                        yerr=[interval(a)[1] if len(a) > 1 else 0.0 for a in accs], color=f"C{i}",
                        marker="osD^v"[i % 5], ls=("-", "--", ":", "-.")[i % 4], markersize=7 - i, capsize=3,
                        label=label_of(name, records))
        ax.axhline(0.95, color="grey", lw=0.6, ls="--")
        ax.set_xscale("log", base=2)
        ticks = sorted({m for records in sweeps.values() for m in lengths_of(records)})
        ax.set_xticks(ticks, [str(m) for m in ticks], fontsize=7)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("moves in the prompt")
        ax.set_ylabel("exact-match accuracy")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    # one legend for every sweep: a panel shows only the sweeps that ran its task
    legend = {}
    for ax in axes.flat:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(text, handle)
    axes.flat[0].legend(legend.values(), legend.keys(), fontsize=6, loc="lower left")
    fig.suptitle(title, fontsize=10)
    return save(fig, out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="+", help="results files (sweeps) to compare; the first is paired against the rest")
    p.add_argument("--results", type=Path, default=RESULTS, help="where the sweeps' JSON files are")
    p.add_argument("--rows", choices=("test", "val"), default="test", help="test rows (default) or validation rows")
    p.add_argument("--plot", type=Path, help="the plot's path (default: none)")
    args = p.parse_args(argv)
    sweeps = {name: rows_of(load(name, args.results), args.rows, name) for name in args.names}
    print(f"Accuracy on the {args.rows} rows, mean [95% t interval] over seeds:\n")
    print(accuracy_table(sweeps))
    print("\nCost per run (mean over runs):\n")
    print(cost_table(sweeps))
    first, *others = args.names
    for other in others:
        theirs = {(r["task"], r["seed"]): r for r in sweeps[other]}
        print(f"\nPaired on the same {args.rows} rows and seeds:\n")
        print(against_by_task(sweeps[first], theirs, main_mode(sweeps[first]), main_mode(sweeps[other]), first,
                              other))
    if args.plot:
        title = f"{args.rows} rows: " + " vs ".join(args.names)
        if written := plot(sweeps, args.plot, title):
            print(f"wrote {written}", file=sys.stderr)


if __name__ == "__main__":
    main()

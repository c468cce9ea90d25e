"""The table of docs/results.md, "The preset through the trainer at L = 16": one row per run of
benchmarks/state_tracking_trainer_len16.sh (`fullband train --config state-tracking`, then `fullband bench
OUT/best --modes standard,fused:auto` at 1, 2, 4 and 8 x L moves), with what the run cost (K per step, tokens,
token-equivalent compute, seconds), the step of the kept model, the accuracies (with the bootstrap interval
at the longest length), per task the paired difference fused:auto − standard on the same held-out rows
(mean ± sd over seeds), and a plot of accuracy against length per task and mode. Writes one JSON with every
row's grade per mode, so the table and the plot can be rebuilt without the runs; a run in the runs directory
replaces the JSON's record of its task and seed, and the JSON's other records stay (runs/ is not committed, so
the JSON is what a later machine has).

    python benchmarks/state_tracking_trainer_table.py                    # runs/st_trainer_*_s*_len16/ + the JSON
    python benchmarks/state_tracking_trainer_table.py --from-json        # the table from the committed JSON
    python benchmarks/state_tracking_trainer_table.py --label len16_8000 # runs/st_trainer_*_s*_len16_8000/
    python benchmarks/state_tracking_trainer_table.py --has s5 1         # exit 0 if the JSON holds that run
    python benchmarks/state_tracking_trainer_table.py --label len16_8000 --against len16  # 8000 − 4000 steps
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from fullband.state_tracking import paired_difference

ROOT = Path(__file__).resolve().parents[1]
MODES = ("standard", "fused:auto")
TASK_ORDER = ("parity", "summod", "flipflop", "cycle", "s3", "s5")


def read_run(run: Path, task: str, seed: int) -> dict | None:
    """One run's record, or None while it has not been graded at two lengths at least."""
    benches = sorted((int(p.name[len("bench"):]), p) for p in run.glob("bench*") if (p / "results.json").is_file())
    if len(benches) < 2:
        return None
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    passes = [s["passes"] for s in steps]
    best = run / "best" / "best.json"
    record = {"task": task, "seed": seed, "steps": steps[-1]["step"], "tokens": steps[-1]["tokens"],
              "compute_tokens": steps[-1]["compute_tokens"], "train_seconds": round(steps[-1]["elapsed_s"]),
              "passes_min": min(passes), "passes_max": max(passes),
              "passes_mean": round(statistics.mean(passes), 2),
              "kept_step": json.loads(best.read_text())["step"] if best.is_file() else steps[-1]["step"],
              "lengths": {}}
    for moves, bench in benches:
        (results,) = json.loads((bench / "results.json").read_text())["results"].values()
        rows = [json.loads(line) for line in (bench / "samples.jsonl").read_text().splitlines() if line.strip()]
        cell = {}
        for mode in MODES:
            r = results[mode]["0.0"]
            graded = sorted((row["problem"], row["correct"]) for row in rows if row["mode"] == mode)
            cell[mode] = {"accuracy": r["accuracy"], "ci": r["accuracy_ci"], "mean_passes": r["mean_fused_passes"],
                          "unconverged": r["fused_unconverged"],
                          "problems": [p for p, _ in graded], "correct": "".join("1" if c else "0" for _, c in graded)}
        record["lengths"][str(moves)] = cell
    return record


def collect(runs_dir: Path, label: str) -> list[dict]:
    records = []
    for run in sorted(runs_dir.glob(f"st_trainer_*_s*_{label}")):
        m = re.fullmatch(rf"st_trainer_(\w+?)_s(\d+)_{re.escape(label)}", run.name)
        if m and run.is_dir() and (rec := read_run(run, m[1], int(m[2]))):
            records.append(rec)
    return records


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """The records of `new`, and those of `old` whose task and seed `new` has not."""
    fresh = {(r["task"], r["seed"]) for r in new}
    return sorted([r for r in old if (r["task"], r["seed"]) not in fresh] + new, key=sort_key)


def paired(a: dict, b: dict) -> float:
    """The mean over the same rows of correct(a) − correct(b)."""
    if a["problems"] != b["problems"]:
        raise SystemExit("the two modes were graded on different rows: rerun fullband bench with the same task file")
    return paired_difference(a["correct"], b["correct"])


def sort_key(record: dict) -> tuple:
    task = record["task"]
    return TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER), task, record["seed"]


def table(records: list[dict]) -> str:
    """One row per run (every length any run was graded at; — where that run was not), then the paired
    differences per task over the seeds graded at each length."""
    records = sorted(records, key=sort_key)
    lengths = sorted({int(m) for r in records for m in r["lengths"]})
    at = " / ".join(str(m) for m in lengths)
    head = ["task", "seed", "K (min → max, mean)", "tokens / × mean passes", "train", "kept step",
            f"standard, {at} moves", f"fused:auto, {at} moves", f"fused:auto at {lengths[-1]} moves: 95% interval "
            "(mean passes)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in records:
        cells = [r["task"], str(r["seed"]), f"{r['passes_min']} → {r['passes_max']}, {r['passes_mean']}",
                 f"{r['tokens'] / 1e6:.2f} M / {r['compute_tokens'] / 1e6:.1f} M", f"{r['train_seconds']} s",
                 f"{r['kept_step']} of {r['steps']}"]
        for mode in MODES:
            cells.append(" / ".join(f"{r['lengths'][str(m)][mode]['accuracy']:.3f}" if str(m) in r["lengths"]
                                    else "—" for m in lengths))
        if str(lengths[-1]) in r["lengths"]:
            last = r["lengths"][str(lengths[-1])]["fused:auto"]
            cells.append(f"[{last['ci'][0]:.3f}, {last['ci'][1]:.3f}] ({last['mean_passes']:.0f}"
                         + (f", {last['unconverged']} unconverged)" if last["unconverged"] else ")"))
        else:
            cells.append("—")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"| task | seeds | paired fused:auto − standard, same rows, mean ± sd over seeds: {at} moves |",
              "|---|---|---|"]
    for task in dict.fromkeys(r["task"] for r in records):
        runs = [r for r in records if r["task"] == task]
        cells = []
        for m in lengths:
            d = [paired(r["lengths"][str(m)]["fused:auto"], r["lengths"][str(m)]["standard"])
                 for r in runs if str(m) in r["lengths"]]
            spread = f" ± {statistics.stdev(d):.3f}" if len(d) > 1 else ""
            cell = f"{statistics.mean(d):+.3f}{spread}" if d else "—"
            cells.append(cell + (f" ({len(d)} of {len(runs)} seeds)" if d and len(d) != len(runs) else ""))
        lines.append(f"| {task} | {[r['seed'] for r in runs]} | " + " / ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict], out: Path) -> Path | None:
    """One panel per task: accuracy against the prompt's moves, per mode the mean (± sd) over the seeds graded
    at each length and every seed as a thin line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fullband[plot]')", file=sys.stderr)
        return None
    records = sorted(records, key=sort_key)
    tasks = list(dict.fromkeys(r["task"] for r in records))
    cols = min(3, len(tasks))
    rows_n = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False)
    styles = {"fused:auto": ("C0", "o", "-"), "standard": ("C1", "x", ":")}
    for ax, task in zip(axes.flat, tasks):
        runs = [r for r in records if r["task"] == task]
        lengths = sorted({int(m) for r in runs for m in r["lengths"]})
        for mode, (color, marker, line) in styles.items():
            for r in runs:
                own = sorted(int(m) for m in r["lengths"])
                ax.plot(own, [r["lengths"][str(m)][mode]["accuracy"] for m in own], color=color, lw=0.6, alpha=0.4)
            accs = [[r["lengths"][str(m)][mode]["accuracy"] for r in runs if str(m) in r["lengths"]] for m in lengths]
            ax.errorbar(lengths, [statistics.mean(a) for a in accs],
                        yerr=[statistics.stdev(a) if len(a) > 1 else 0.0 for a in accs], color=color,
                        marker=marker, ls=line, capsize=3, label=f"FBT {mode} (mean ± sd over the seeds graded there)")
        ax.axvline(lengths[0], color="grey", lw=0.8, ls=":")
        ax.axhline(0.9, color="grey", lw=0.6, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(m) for m in lengths])
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task}, seeds {[r['seed'] for r in runs]} (trained on ≤ {lengths[0]} moves)", fontsize=9)
        ax.set_xlabel("moves in the prompt")
        ax.set_ylabel("exact-match accuracy")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="center left")
    # one line across three panels, two over a single one
    sep = " " if cols > 1 else "\n"
    fig.suptitle(f"fullband train --config state-tracking,{sep}then fullband bench OUT/best (kept model)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def against(records: list[dict], other: list[dict], label: str, other_label: str) -> str:
    """Per run both JSONs hold (same task and seed), this label − the other on the same rows with fused:auto, at
    every length both were graded at; and at the longest, how many failing rows the two share against what
    independent failures would share (failures of one run times those of the other over the rows)."""
    others = {(r["task"], r["seed"]): r for r in other}
    lines = [f"| task | seed | paired fused:auto, {label} − {other_label}, same rows (moves: difference) "
             "| failing rows at the longest: this / other / shared (independent: expected) |", "|---|---|---|---|"]
    for r in sorted(records, key=sort_key):
        o = others.get((r["task"], r["seed"]))
        common = sorted(int(m) for m in r["lengths"] if o and m in o["lengths"])
        if not common:
            continue
        diffs = ", ".join(f"{m}: {paired(r['lengths'][str(m)]['fused:auto'], o['lengths'][str(m)]['fused:auto']):+.3f}"
                          for m in common)
        a, b = (x["lengths"][str(common[-1])]["fused:auto"] for x in (r, o))
        fail_a, fail_b = ({i for i, c in enumerate(x["correct"]) if c == "0"} for x in (a, b))
        expected = len(fail_a) * len(fail_b) / len(a["correct"])
        lines.append(f"| {r['task']} | {r['seed']} | {diffs} | {len(fail_a)} / {len(fail_b)} / "
                     f"{len(fail_a & fail_b)} ({expected:.1f}) |")
    if len(lines) == 2:
        raise SystemExit(f"no task and seed graded in both {label} and {other_label}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs",
                   help="where the runs are (st_trainer_TASK_sSEED_LABEL, as the queue scripts name them)")
    p.add_argument("--label", default="len16", help="the runs' name suffix (default len16)")
    p.add_argument("--out", type=Path, help="the JSON of every run's record (default "
                   "benchmarks/results/state_tracking_trainer/LABEL.json)")
    p.add_argument("--from-json", action="store_true", help="print the table from --out, without the runs")
    p.add_argument("--has", nargs=2, metavar=("TASK", "SEED"),
                   help="exit 0 if --out holds the record of that run, 1 if not (for the queue scripts)")
    p.add_argument("--against", metavar="LABEL",
                   help="instead of the table: per run held by both JSONs (LABEL.json beside --out), this label "
                   "− LABEL on the same rows")
    p.add_argument("--plot", type=Path, help="where the plot goes (default docs/state_tracking_trainer_LABEL.png; "
                   "'' = no plot)")
    args = p.parse_args(argv)
    for flag, label in (("--label", args.label), ("--against", args.against or "_")):
        if not re.fullmatch(r"\w+", label):
            # p.error exits 2: --has's 1 ("not held") would make a queue train a run it cannot merge.
            p.error(f"{flag} {label!r}: letters, digits and _ only (a run directory's suffix)")
    args.out = args.out or ROOT / f"benchmarks/results/state_tracking_trainer/{args.label}.json"
    args.plot = ROOT / f"docs/state_tracking_trainer_{args.label}.png" if args.plot is None else args.plot
    old = json.loads(args.out.read_text()) if args.out.is_file() else []
    if args.has:
        task, seed = args.has
        sys.exit(0 if any(r["task"] == task and str(r["seed"]) == seed for r in old) else 1)
    if args.against:
        other = args.out.with_name(f"{args.against}.json")
        if not old or not other.is_file():
            raise SystemExit(f"--against needs {args.out} and {other}: grade both labels first")
        print(against(old, json.loads(other.read_text()), args.label, args.against))
        return
    if args.from_json:
        if not old:
            raise SystemExit(f"{args.out} does not exist: run without --from-json first")
        records = old
    else:
        new = collect(args.runs_dir, args.label)
        if not new and not old:
            raise SystemExit(f"no graded run st_trainer_*_s*_{args.label} in {args.runs_dir}: run "
                             "benchmarks/state_tracking_trainer_len16.sh")
        records = merge(old, new)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        partial = args.out.with_name(args.out.name + ".partial")
        partial.write_text(json.dumps(records) + "\n")
        partial.replace(args.out)  # a reader (or a kill) never sees half a JSON
        print(f"wrote {args.out} ({len(records)} runs, {len(new)} from {args.runs_dir})", file=sys.stderr)
    print(table(records))
    if str(args.plot) not in ("", ".") and (written := plot(records, args.plot)):
        print(f"wrote {written}", file=sys.stderr)


if __name__ == "__main__":
    main()

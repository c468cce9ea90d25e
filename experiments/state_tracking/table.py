"""The state-tracking table of a sweep (experiments/sweeps.py): one row per run (`fullband train --config
state-tracking`, then `fullband bench OUT/best --modes standard,fused:exact` at 1 .. 32 × L moves), with
what the run cost (K per step, tokens, token-equivalent compute, seconds), the step of the kept model, the
accuracies (with fullband bench's bootstrap interval at the longest length), per task the paired difference
recurrence − standard on the same test rows (mean and 95% t interval over seeds), and a plot of accuracy against
length per task and mode. It reads the sweep's JSON (experiments/state_tracking/results/NAME.json), which
`python -m experiments.run NAME` fills run by run, so the table is rebuilt without the runs (runs/ is not
committed).

    python -m experiments.state_tracking.table len16                     # table + len16.png beside the JSON
    python -m experiments.state_tracking.table len16_8000 --against len16  # 8000 − 4000 steps, same rows
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from experiments.plotting import pyplot, save
from experiments.state_tracking.tasks import paired_difference
from experiments.stats import fmt, interval

RESULTS = Path(__file__).resolve().parent / "results"
# The modes a sweep grades in, in table order. The FBT's exact recurrence is fused:exact (token by token) in the
# sweeps graded to 32x, fused:auto at tolerance 0 (its Jacobi fixed point: the same states) in the earlier ones.
RECURRENCE = ("fused:auto", "fused:exact")
MODES = ("standard", *RECURRENCE)
# How plots name the recurrent baselines of a sweep graded in standard mode (by the arch its records name)
BASELINE_NAMES = {"lstm": "LSTM", "deltaproduct": "DeltaProduct"}


def modes_of(records: list[dict]) -> list[str]:
    """The modes every record was graded in (a baseline sweep grades its one pass only)."""
    return [m for m in MODES if all(m in cell for r in records for cell in r["lengths"].values())]


def main_mode(records: list[dict]) -> str:
    """The mode a model is used in: an FBT's exact recurrence (fused:exact or fused:auto) where graded, else the one
    plain pass."""
    return modes_of(records)[-1]
TASK_ORDER = ("parity", "summod", "flipflop", "cycle", "s3", "s5", "s5x32", "s5x120")


def read_run(run: Path, task: str, seed: int, tests: dict[str, str], modes: list[str],
             vals: dict[str, str] | None = None) -> dict:
    """One graded run's record: its training (run/metrics.jsonl, run/best/best.json) and, per length in `tests`
    (moves → the test file graded as `jsonl:PATH`), each of `modes`' accuracy and per-row grades (run/bench);
    the same for the validation rows `vals` under "val_lengths"."""
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    passes = [s["passes"] for s in steps]
    best = run / "best" / "best.json"
    arch = ((yaml.safe_load((run / "config.yaml").read_text()) or {}).get("model") or {}).get("arch", "fbt")
    record = {"task": task, "seed": seed, "arch": arch, "steps": steps[-1]["step"], "tokens": steps[-1]["tokens"],
              "compute_tokens": steps[-1]["compute_tokens"], "train_seconds": round(steps[-1]["elapsed_s"]),
              "passes_min": min(passes), "passes_max": max(passes),
              "passes_mean": round(statistics.mean(passes), 2),
              "kept_step": json.loads(best.read_text())["step"] if best.is_file() else steps[-1]["step"],
              "lengths": {}}
    evals = run / "eval.jsonl"
    if evals.is_file():
        # the validation loss every train.eval_every steps and the training loss at each logged step: where two
        # runs that differ only in rounding part (issue: state tracking that survives a rounding change)
        record["val_curve"] = [[e["step"], e["loss"]] for e in map(json.loads, evals.read_text().splitlines())
                               if "loss" in e]
        record["train_curve"] = [[s["step"], s["loss"]] for s in steps if "loss" in s]
    results = json.loads((run / "bench" / "results.json").read_text())["results"]
    samples = [json.loads(line) for line in (run / "bench" / "samples.jsonl").read_text().splitlines() if line]
    for field, files in (("lengths", tests), ("val_lengths", vals or {})):
        if files:
            record[field] = {moves: graded_cell(results, samples, f"jsonl:{path}", modes)
                             for moves, path in sorted(files.items(), key=lambda item: int(item[0]))}
    return record


def graded_cell(results: dict, samples: list[dict], key: str, modes: list[str]) -> dict:
    """Per mode, the accuracy of one bench task (a test file) and its per-row grades."""
    cell = {}
    for mode in modes:
        r = results[key][mode]["0.0"]
        # sorted by the problem's id as a string: the order every record so far keeps, so rows pair across
        # sweeps (--against) as they pair across modes
        graded = sorted((row["problem"], row["correct"]) for row in samples
                        if row["task"] == key and row["mode"] == mode)
        cell[mode] = {"accuracy": r["accuracy"], "ci": r["accuracy_ci"], "mean_passes": r["mean_fused_passes"],
                      "unconverged": r["fused_unconverged"],
                      "problems": [p for p, _ in graded], "correct": "".join("1" if c else "0" for _, c in graded)}
    return cell


def paired(a: dict, b: dict) -> float:
    """The mean over the same rows of correct(a) − correct(b)."""
    if a["problems"] != b["problems"]:
        raise SystemExit("the two were graded on different rows: grade both on the same test files")
    return paired_difference(a["correct"], b["correct"])


def sort_key(record: dict) -> tuple:
    task = record["task"]
    return TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER), task, record["seed"]


def load(name: str, results: Path = RESULTS) -> list[dict]:
    path = results / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: run `python -m experiments.run {name}` first")
    return json.loads(path.read_text())


def rows_of(records: list[dict], rows: str, name: str) -> list[dict]:
    """The records with their grades on the test rows, or on the validation rows in their place."""
    if rows == "test":
        return records
    if not all("val_lengths" in r for r in records):
        raise SystemExit(f"{name} was not graded on validation rows (its sweep has no val_seed)")
    return [{**r, "lengths": r["val_lengths"]} for r in records]


def table(records: list[dict]) -> str:
    """One row per run (every length any run was graded at; — where that run was not), then per task the paired
    differences over the seeds graded at each length: mean and 95% t interval."""
    records = sorted(records, key=sort_key)
    modes, main = modes_of(records), main_mode(records)
    lengths = sorted({int(m) for r in records for m in r["lengths"]})
    at = " / ".join(str(m) for m in lengths)
    head = ["task", "seed", "K (min → max, mean)", "tokens / × mean passes", "train", "kept step",
            *(f"{mode}, {at} moves" for mode in modes), f"{main} at {lengths[-1]} moves: 95% interval (mean passes)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in records:
        cells = [r["task"], str(r["seed"]), f"{r['passes_min']} → {r['passes_max']}, {r['passes_mean']}",
                 f"{r['tokens'] / 1e6:.2f} M / {r['compute_tokens'] / 1e6:.1f} M", f"{r['train_seconds']} s",
                 f"{r['kept_step']} of {r['steps']}"]
        for mode in modes:
            cells.append(" / ".join(f"{r['lengths'][str(m)][mode]['accuracy']:.3f}" if str(m) in r["lengths"]
                                    else "—" for m in lengths))
        if str(lengths[-1]) in r["lengths"]:
            last = r["lengths"][str(lengths[-1])][main]
            cells.append(f"[{last['ci'][0]:.3f}, {last['ci'][1]:.3f}] ({last['mean_passes']:.0f}"
                         + (f", {last['unconverged']} unconverged)" if last["unconverged"] else ")"))
        else:
            cells.append("—")
        lines.append("| " + " | ".join(cells) + " |")
    # the paired gain of the recurrence over the plain pass, where both were graded
    both = "standard" in modes and main in RECURRENCE
    head = [f"{main} accuracy, mean [95% t interval]: {at} moves"]
    head += [f"paired {main} − standard, same rows, mean [95% t interval]: {at} moves"] if both else []
    lines += ["", "| task | seeds | " + " | ".join(head) + " |", "|---" * (2 + len(head)) + "|"]
    for task in dict.fromkeys(r["task"] for r in records):
        runs = [r for r in records if r["task"] == task]
        accs, diffs = [], []
        for m in lengths:
            graded = [r["lengths"][str(m)] for r in runs if str(m) in r["lengths"]]
            note = f" ({len(graded)} of {len(runs)} seeds)" if graded and len(graded) != len(runs) else ""
            accs.append(fmt([g[main]["accuracy"] for g in graded]) + note if graded else "—")
            diffs.append(fmt([paired(g[main], g["standard"]) for g in graded], "+.3f") + note
                         if graded and both else "—")
        cells = [" / ".join(accs)] + ([" / ".join(diffs)] if both else [])
        lines.append(f"| {task} | {[r['seed'] for r in runs]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict], out: Path, title: str) -> Path | None:
    """One panel per task: accuracy against the prompt's moves, per mode the mean over the seeds graded at each
    length with its 95% t interval, and every seed as a thin line."""
    if (plt := pyplot()) is None:
        return None
    records = sorted(records, key=sort_key)
    tasks = list(dict.fromkeys(r["task"] for r in records))
    cols = min(3, len(tasks))
    rows_n = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False)
    main = main_mode(records)
    styles = {mode: style for mode, style in ((main, ("C0", "o", "-")), ("standard", ("C1", "x", ":")))
              if mode in modes_of(records)}
    # A sweep graded in standard mode only trained a baseline: an LSTM (model.arch lstm), a DeltaProduct linear RNN
    # (model.arch deltaproduct) or a standard transformer.
    model = "FBT" if main in RECURRENCE else BASELINE_NAMES.get(records[0].get("arch"), "standard transformer,")
    for ax, task in zip(axes.flat, tasks):
        runs = [r for r in records if r["task"] == task]
        lengths = sorted({int(m) for r in runs for m in r["lengths"]})
        for mode, (color, marker, line) in styles.items():
            for r in runs:
                own = sorted(int(m) for m in r["lengths"])
                ax.plot(own, [r["lengths"][str(m)][mode]["accuracy"] for m in own], color=color, lw=0.6, alpha=0.4)
            accs = [[r["lengths"][str(m)][mode]["accuracy"] for r in runs if str(m) in r["lengths"]] for m in lengths]
            ax.errorbar(lengths, [statistics.mean(a) for a in accs],
                        yerr=[interval(a)[1] if len(a) > 1 else 0.0 for a in accs], color=color,
                        marker=marker, ls=line, capsize=3, label=f"{model} {mode} (mean, 95% t interval over seeds)")
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
    fig.suptitle(title, fontsize=10)
    return save(fig, out, dpi=120)


def against(records: list[dict], other: list[dict], label: str, other_label: str) -> str:
    """Per run both sweeps hold (same task and seed), this sweep − the other on the same rows, each in the mode it
    is used in (the exact recurrence for an FBT, standard for a baseline), at every length both were graded at; and
    at the longest, how many failing rows the two share against what independent failures would share (failures of
    one run times those of the other over the rows)."""
    mine, theirs = main_mode(records), main_mode(other)
    others = {(r["task"], r["seed"]): r for r in other}
    lines = [f"| task | seed | paired {label} {mine} − {other_label} {theirs}, same rows (moves: difference) "
             "| failing rows at the longest: this / other / shared (independent: expected) |", "|---|---|---|---|"]
    for r in sorted(records, key=sort_key):
        o = others.get((r["task"], r["seed"]))
        common = sorted(int(m) for m in r["lengths"] if o and m in o["lengths"])
        if not common:
            continue
        diffs = ", ".join(f"{m}: {paired(r['lengths'][str(m)][mine], o['lengths'][str(m)][theirs]):+.3f}"
                          for m in common)
        a, b = r["lengths"][str(common[-1])][mine], o["lengths"][str(common[-1])][theirs]
        fail_a, fail_b = ({i for i, c in enumerate(x["correct"]) if c == "0"} for x in (a, b))
        expected = len(fail_a) * len(fail_b) / len(a["correct"])
        lines.append(f"| {r['task']} | {r['seed']} | {diffs} | {len(fail_a)} / {len(fail_b)} / "
                     f"{len(fail_a & fail_b)} ({expected:.1f}) |")
    if len(lines) == 2:
        raise SystemExit(f"no task and seed graded in both {label} and {other_label}")
    return "\n".join(lines) + "\n\n" + against_by_task(records, others, mine, theirs, label, other_label)


def against_by_task(records: list[dict], others: dict[tuple[str, int], dict], mine: str, theirs: str, label: str,
                    other_label: str) -> str:
    """Per task, over the seeds both sweeps hold: the paired difference on the same rows, mean [95% t interval],
    at every length both graded."""
    lengths = sorted({int(m) for r in records for m in r["lengths"]
                      if (o := others.get((r["task"], r["seed"]))) and m in o["lengths"]})
    lines = [f"| task | seeds | paired {label} {mine} − {other_label} {theirs}, mean [95% t interval]: "
             + " / ".join(map(str, lengths)) + " moves |", "|---|---|---|"]
    for task in dict.fromkeys(r["task"] for r in sorted(records, key=sort_key)):
        pairs = [(r, others[(task, r["seed"])]) for r in records if r["task"] == task and (task, r["seed"]) in others]
        if not pairs:
            continue
        cells = []
        for m in map(str, lengths):
            diffs = [paired(r["lengths"][m][mine], o["lengths"][m][theirs]) for r, o in pairs
                     if m in r["lengths"] and m in o["lengths"]]
            cells.append(fmt(diffs, "+.3f") if diffs else "—")
        lines.append(f"| {task} | {[r['seed'] for r, _ in pairs]} | " + " / ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help="the results file's name: a sweep, e.g. len16 (results/len16.json)")
    p.add_argument("--results", type=Path, default=RESULTS, help="where the sweeps' JSON files are")
    p.add_argument("--against", metavar="NAME", help="instead of the table: per run held by both, NAME − this "
                   "on the same rows")
    p.add_argument("--plot", type=Path, help="where the plot goes (default NAME.png beside the JSON; '' = none)")
    p.add_argument("--rows", choices=("test", "val"), default="test",
                   help="grade on the test rows (default) or the validation rows a recipe is chosen on (a sweep with "
                   "val_seed)")
    args = p.parse_args(argv)
    records = rows_of(load(args.name, args.results), args.rows, args.name)
    if args.against:
        other = rows_of(load(args.against, args.results), args.rows, args.against)
        print(against(records, other, args.name, args.against))
        return
    print(table(records))
    out = args.results.parent / f"{args.name}.png" if args.plot is None else args.plot
    title = f"{args.name}: fullband train --config state-tracking, then fullband bench OUT/best"
    if str(out) not in ("", ".") and (written := plot(records, out, title)):
        print(f"wrote {written}", file=sys.stderr)


if __name__ == "__main__":
    main()

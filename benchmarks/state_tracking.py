"""State tracking with the final answer only: does the FBT's exact recurrence over the prompt
length-generalise where a transformer does not?

Each task is a sequence of moves whose answer is the final state (`parity 1101001 : 0`, S5 words of
generator letters, ...; `fullband.data.synthetic.state_tracking_task`). Models are trained on 1..L moves
and tested on exactly L, 2L, 4L and 8L moves (the same held-out rows for every model and seed).

Models, all with the architecture of the `state-tracking` preset:
  fbt               trained with K = sequence length passes (the exact recurrence over the whole prompt;
                    gradient through the last `--grad-passes` only), length curriculum, loss on the answer
  baseline          one pass, full attention, same steps and tokens
  baseline_compute  as baseline, trained for as many steps as the FBT's token-equivalent compute
                    (tokens × mean passes)
  baseline_window   (only with --models) one pass with the FBT's own short attention window, same steps
                    and tokens: the same architecture without the feedback, which cannot attend past
                    the window (flip-flop, where full attention can read the last write straight back)
Modes: `exact` = the exact recurrence (`sequential_forward`; fused prefill with passes >= prompt length
computes the same), `plain` = one ordinary pass. A row is correct when every answer token is the
argmax given the prompt and the previous answer tokens, i.e. greedy decoding reproduces the answer.

    python benchmarks/state_tracking.py                   # all tasks, seeds 0 1 2 (resumes)
    python benchmarks/state_tracking.py --quick           # tiny, for the test suite
    python benchmarks/state_tracking.py --summary-only    # tables and plot from the JSONL
    python benchmarks/state_tracking.py --compare paper=A.jsonl last=B.jsonl,C.jsonl   # one table across runs

Results append to a JSON-lines file (one line per task, seed and model), so an interrupted run resumes
where it stopped; the summary (mean ± sd over seeds, paired differences) is printed as markdown.
The trained weights are kept under --save-models (default runs/state_tracking_models/<out name>/) for
analyses of the learnt recurrence such as benchmarks/state_drift.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

from fullband.config import load_config
from fullband.data.synthetic import STATE_TRACKING_TASKS
from fullband.loading import PRESET_DIR
from fullband.state_tracking import (
    Recipe,
    accuracy,
    evaluate,
    evaluate_hold,
    paired_difference,
    task_base,
    train_model,
)

MODELS = ("fbt", "baseline", "baseline_compute")  # the default run
ALL_MODELS = (*MODELS, "baseline_window")


def load_records(path: Path) -> list[dict]:
    """The records of a results file (one JSON object per line); none if it does not exist yet."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def done_keys(path: Path) -> set[tuple]:
    return {(r["task"], r["seed"], r["model"]) for r in load_records(path)}


def mean_sd(values: list[float]) -> str:
    if len(values) == 1:  # no spread to show from one seed
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def summarise(path: Path) -> str:
    """Markdown: accuracy mean ± sd over seeds per task, model/mode and length; paired differences."""
    records = load_records(path)
    lines = []
    for task in dict.fromkeys(r["task"] for r in records):
        rows = [r for r in records if r["task"] == task]
        multiples = list(rows[0]["eval"])
        seeds = sorted({r["seed"] for r in rows})
        lines += [f"\n### {task} (train on 1..{rows[0]['train_len']} moves; seeds {seeds})\n",
                  "| model / mode | seeds | tokens | tokens × mean passes | "
                  + " | ".join(f"{m}×L" for m in multiples) + " |",
                  "|---" * (4 + len(multiples)) + "|"]
        for kind in ALL_MODELS:
            runs = [r for r in rows if r["model"] == kind]
            if not runs:
                continue
            for mode in runs[0]["eval"][multiples[0]]:
                cells = [mean_sd([accuracy(r["eval"][m][mode]) for r in runs]) for m in multiples]
                tok = statistics.mean(r["train"]["tokens"] for r in runs)
                comp = statistics.mean(r["train"]["compute_tokens"] for r in runs)
                lines.append(f"| {kind} {mode} | {len(runs)} | {tok:,.0f} | {comp:,.0f} | " + " | ".join(cells) + " |")
        fbt = {r["seed"]: r for r in rows if r["model"] == "fbt"}
        pairs = [("fbt exact − fbt plain", "fbt", "exact", "fbt", "plain"),
                 ("fbt exact − baseline", "fbt", "exact", "baseline", "plain"),
                 ("fbt exact − baseline_compute", "fbt", "exact", "baseline_compute", "plain"),
                 ("fbt exact − baseline_window", "fbt", "exact", "baseline_window", "plain")]
        for label, ka, ma, kb, mb in pairs:
            other = {r["seed"]: r for r in rows if r["model"] == kb}
            common = sorted(set(fbt) & set(other))
            if not common or ka != "fbt":
                continue
            cells = []
            for m in multiples:
                diffs = []
                for s in common:  # per seed, on the same rows
                    diffs.append(paired_difference(fbt[s]["eval"][m][ma], other[s]["eval"][m][mb]))
                cells.append(mean_sd(diffs))
            lines.append(f"| paired: {label} | {len(common)} | | | " + " | ".join(cells) + " |")
        kept_early = [r for r in rows if r["model"] == "fbt" and "eval_last" in r]
        if kept_early:  # what --keep best changed: the same runs' last models
            cells = [mean_sd([accuracy(r["eval_last"][m]["exact"]) for r in kept_early]) for m in multiples]
            seeds = sorted(r["seed"] for r in kept_early)
            lines.append(f"| fbt exact, the last step's model of the runs that kept an earlier one (seeds {seeds}) "
                         f"| {len(kept_early)} | | | " + " | ".join(cells) + " |")
        held = [r for r in rows if r["model"] == "fbt" and r.get("hold")]
        if held:
            cells = [mean_sd([accuracy(r["hold"][m]) for r in held]) for m in multiples]
            lines.append(f"| fbt exact, hold: L moves then (m − 1)·L no-ops | {len(held)} | | | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_diffs(a: dict, b: dict, multiples: list[str]) -> list[float] | None:
    """Per multiple, the mean over the same held-out rows of (correct_a − correct_b) of two FBT records'
    exact recurrence; None when the records were not graded on the same rows (other training length)."""
    if a["train_len"] != b["train_len"] or any(len(a["eval"][m]["exact"]) != len(b["eval"][m]["exact"])
                                               for m in multiples):
        return None
    return [paired_difference(a["eval"][m]["exact"], b["eval"][m]["exact"]) for m in multiples]


def _compare_cell(record: dict) -> str:
    """Exact accuracy at 1× / 2× / … of L; where --keep best kept an earlier model than the last, its step
    and the last step's accuracies."""
    def exact(evals: dict) -> str:
        return " / ".join(f"{accuracy(evals[m]['exact']):.2f}" for m in evals)

    kept, steps = record["train"].get("kept_step"), record["train"]["steps"]
    if kept in (None, steps):
        return exact(record["eval"])
    if "eval_last" not in record:  # a run recorded before the last model was graded too
        return f"{exact(record['eval'])} (step {kept})"
    return f"{exact(record['eval'])} (step {kept}; last step: {exact(record['eval_last'])})"


def compare(files: dict[str, list[Path]]) -> str:
    """Markdown: one row per task and seed, one column per label (its JSONL files read in order, e.g. one
    label per loss), each cell the FBT's exact-recurrence accuracy at 1× / 2× / … of the training length
    ("–" where that run is absent; "(step N)" where --keep best kept an earlier model than the last); then,
    per task and per later label, the paired difference from the first label on the same rows (mean ± sd
    over the seeds both have)."""
    runs: dict[tuple[str, int], dict[str, dict]] = {}
    for label, paths in files.items():
        for path in paths:
            for r in load_records(path):
                if r["model"] == "fbt":
                    runs.setdefault((r["task"], r["seed"]), {})[label] = r
    order = {t: i for i, t in enumerate(STATE_TRACKING_TASKS)}
    keys = sorted(runs, key=lambda k: (order.get(task_base(k[0]), len(order)), k[0], k[1]))
    lines = ["| task | seed | " + " | ".join(files) + " |", "|---" * (2 + len(files)) + "|"]
    for task, seed in keys:
        cells = [_compare_cell(r) if (r := runs[task, seed].get(label)) else "–" for label in files]
        lines.append(f"| {task} | {seed} | " + " | ".join(cells) + " |")
    first, *later = files
    paired = []
    for task in dict.fromkeys(task for task, _ in keys):
        for label in later:
            both = [runs[k] for k in keys if k[0] == task and first in runs[k] and label in runs[k]]
            if not both:
                continue
            multiples = list(both[0][first]["eval"])
            diffs = [paired_diffs(r[label], r[first], multiples) for r in both]
            if any(d is None for d in diffs):
                paired.append(f"| {task} | {label} − {first} | {len(both)} | not on the same rows |")
                continue
            cells = [mean_sd([d[i] for d in diffs]) for i in range(len(multiples))]
            paired.append(f"| {task} | {label} − {first} | {len(both)} | " + " / ".join(cells) + " |")
    if paired:
        lines += ["", "| task | paired, same rows | seeds | exact: 1× / 2× / … of L |", "|---|---|---|---|", *paired]
    return "\n".join(lines)


def plot(path: Path, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fullband[plot]')", file=sys.stderr)
        return None
    records = load_records(path)
    tasks = [t for t in STATE_TRACKING_TASKS if any(r["task"] == t for r in records)]
    cols = min(3, len(tasks))
    rows_n = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False)
    styles = {("fbt", "exact"): "C0-o", ("fbt", "plain"): "C0:x", ("baseline", "plain"): "C1-s",
              ("baseline_compute", "plain"): "C2--^", ("baseline_window", "plain"): "C3-.v"}
    for ax, task in zip(axes.flat, tasks):
        rows = [r for r in records if r["task"] == task]
        train_len = rows[0]["train_len"]
        for (kind, mode), style in styles.items():
            runs = [r for r in rows if r["model"] == kind and mode in r["eval"][next(iter(r["eval"]))]]
            if not runs:
                continue
            multiples = list(runs[0]["eval"])
            accs = [[accuracy(r["eval"][m][mode]) for r in runs] for m in multiples]
            means = [statistics.mean(a) for a in accs]
            sds = [statistics.stdev(a) if len(a) > 1 else 0.0 for a in accs]
            ax.errorbar([int(m) * train_len for m in multiples], means, yerr=sds, fmt=style, capsize=3,
                        label=f"{kind} {mode}")
        ax.axvline(train_len, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ticks = [int(m) * train_len for m in rows[0]["eval"]]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task} (trained on ≤ {train_len} moves)")
        ax.set_xlabel("moves in the prompt")
        ax.set_ylabel("exact-match accuracy")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    legend = {}  # every model/mode that appears in any panel, not only in the first
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    axes.flat[0].legend(legend.values(), legend.keys(), fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_validation(path: Path, out: Path) -> Path | None:
    """One panel per task: the validation accuracy of every run that validated (--val-every) against the
    step, one line per seed, a dot at the step of the kept model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fullband[plot]')", file=sys.stderr)
        return None
    records = [r for r in load_records(path) if r["train"].get("val_curve")]
    tasks = list(dict.fromkeys(r["task"] for r in records))
    if not tasks:
        print(f"{path}: no run with a validation curve (--val-every): no plot", file=sys.stderr)
        return None
    cols = min(3, len(tasks))
    rows_n = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.0 * rows_n), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        runs = sorted((r for r in records if r["task"] == task), key=lambda r: r["seed"])
        for r in runs:
            steps, _, accs = zip(*r["train"]["val_curve"])
            (line,) = ax.plot(steps, accs, lw=1.2, label=f"seed {r['seed']}")
            kept = r["train"]["kept_step"]
            ax.plot([kept], [accs[steps.index(kept)]], "o", color=line.get_color())
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task}: validation on {runs[0]['train_len']} moves", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("exact-match accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(STATE_TRACKING_TASKS),
                   help="comma-separated tasks, or variants NAME:KEY=VALUE;KEY=VALUE (e.g. cycle:size=3)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--preset", default="state-tracking", help="preset (model and optimiser settings)")
    p.add_argument("--train-len", type=int, default=8, help="L: training prompts have 1..L moves")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps of fbt and baseline")
    p.add_argument("--grad-passes", type=int, default=0, help="FBT: backpropagate through the last N passes (0 = all)")
    p.add_argument("--curriculum", type=float, default=0.5, help="fraction of steps over which max length grows")
    p.add_argument("--center-loss", type=float, default=0.0,
                   help="FBT: weight of the pull of the answer-predicting state towards the mean state of its answer")
    p.add_argument("--val-every", type=int, default=0,
                   help="every N steps, grade held-out rows of exactly L moves (loss and accuracy; 0 = never)")
    p.add_argument("--keep", choices=("last", "best"), default="last",
                   help="the model to test: the last step's, or the one with the lowest validation loss")
    p.add_argument("--eval-rows", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's train.batch_size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="config override of the preset for every model (repeatable), e.g. model.feedback_jitter=0.1")
    p.add_argument("--out", default="benchmarks/results/state_tracking.jsonl")
    p.add_argument("--save-models", default="runs/state_tracking_models", metavar="DIR",
                   help="keep each trained model (save_pretrained) in DIR/<out name>/<task>_s<seed>_<model>/, for "
                        "analyses such as benchmarks/state_drift.py ('' = do not keep them)")
    p.add_argument("--plot", default="docs/state_tracking.png")
    p.add_argument("--val-plot", default="", metavar="PNG",
                   help="also plot the validation accuracy against the step of the runs that validated (--val-every)")
    p.add_argument("--summary-only", action="store_true")
    p.add_argument("--compare", nargs="+", metavar="LABEL=FILE[,FILE...]",
                   help="print one table of the FBT's exact accuracy per task and seed across these JSONL files, "
                        "one column per label (e.g. one per loss), the paired differences from the first label "
                        "on the same rows, and exit")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for the test suite")
    args = p.parse_args(argv)
    if args.compare:
        pairs = [item.partition("=") for item in args.compare]
        if any(not sep or not label or not files for label, sep, files in pairs):
            p.error(f"--compare expects LABEL=FILE[,FILE...] items, got {args.compare}")
        args.compare = {label: [Path(f) for f in files.split(",")] for label, _, files in pairs}
        missing = [str(f) for files in args.compare.values() for f in files if not f.is_file()]
        if missing:
            p.error(f"--compare: no such file(s): {', '.join(missing)}")
    args.multiples = (1, 2, 4, 8)
    if args.quick:
        args.train_len, args.steps, args.eval_rows, args.seeds = 2, 3, 4, args.seeds[:1]
        args.multiples = (1, 2)
    args.overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            p.error(f"--set expects SECTION.FIELD=VALUE, got {item!r}")
        args.overrides[key] = value
    unknown = {t for t in args.tasks.split(",") if task_base(t) not in STATE_TRACKING_TASKS}
    if unknown:
        p.error(f"unknown task(s) {sorted(unknown)}; choose from {', '.join(STATE_TRACKING_TASKS)} "
                "(a variant: NAME:KEY=VALUE;KEY=VALUE, e.g. cycle:size=3)")
    if args.keep == "best" and args.val_every <= 0:
        p.error("--keep best needs --val-every N > 0 (the validations to choose from)")
    if set(args.models.split(",")) - set(ALL_MODELS):
        p.error(f"--models: choose from {', '.join(ALL_MODELS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    config = load_config(PRESET_DIR / f"{args.preset}.yaml", args.overrides)
    recipe = Recipe(train_len=args.train_len, steps=args.steps, batch_size=args.batch_size or config.train.batch_size,
                    grad_passes=args.grad_passes, curriculum=args.curriculum, eval_rows=args.eval_rows,
                    multiples=args.multiples, center_loss=args.center_loss, val_every=args.val_every,
                    keep=args.keep)
    if not args.summary_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        for task in args.tasks.split(","):
            for seed in args.seeds:
                fbt_compute = None
                for kind in args.models.split(","):
                    if (task, seed, kind) in done_keys(out):
                        continue
                    steps = args.steps
                    if kind == "baseline_compute":
                        fbt = [r for r in load_records(out)
                               if (r["task"], r["seed"], r["model"]) == (task, seed, "fbt")]
                        if not fbt:
                            print(f"skip baseline_compute {task} seed {seed}: needs the fbt run first", file=sys.stderr)
                            continue
                        fbt_compute = fbt[0]["train"]["mean_passes"]
                        steps = round(args.steps * fbt_compute)
                    modes = ("exact", "plain") if kind == "fbt" else ("plain",)
                    grade_last = functools.partial(evaluate, task=task, recipe=recipe, modes=modes)
                    model, info = train_model(task, kind, seed, config, recipe, steps, grade_last=grade_last)
                    last_step_eval = info.pop("last_step_eval", None)
                    record = {"task": task, "seed": seed, "model": kind, "train_len": args.train_len,
                              "grad_passes": args.grad_passes, "curriculum": args.curriculum,
                              **({"center_loss": args.center_loss} if args.center_loss else {}),
                              **({"val_every": args.val_every, "keep": args.keep} if args.val_every else {}),
                              "batch_size": recipe.batch_size, "overrides": args.overrides, "train": info,
                              "eval": evaluate(model, task, recipe, modes),
                              # the same run's last model, where --keep best kept an earlier one
                              **({"eval_last": last_step_eval} if last_step_eval else {})}
                    if kind == "fbt":
                        record["hold"] = evaluate_hold(model, task, recipe)
                    if args.save_models:
                        model.save_pretrained(Path(args.save_models) / out.stem / f"{task}_s{seed}_{kind}")
                    with out.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                    accs = {m: {k: round(accuracy(v), 3) for k, v in r.items()} for m, r in record["eval"].items()}
                    print(f"{task} seed {seed} {kind}: {info['train_seconds']} s, {accs}", file=sys.stderr, flush=True)
    print(summarise(out))
    if args.plot:
        print(f"\nplot: {plot(out, Path(args.plot))}")
    if args.val_plot:
        print(f"validation plot: {plot_validation(out, Path(args.val_plot))}")


if __name__ == "__main__":
    main()

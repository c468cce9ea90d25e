"""When does an S5 run reach extrapolation, and does it lose it? A sweep run with `along` (experiments/sweeps.py)
grades a checkpoint every N steps on the validation rows at 4x and 8x the training length; this reads those curves
beside the training loss, the validation loss the preset keeps its model by, and (with --runs-dir) the norm of the
state the exact recurrence feeds back.

    python -m experiments.state_tracking.along along_s5                      # the table, from the results file
    python -m experiments.state_tracking.along along_s5 --plot experiments/state_tracking/along_s5.png
    python -m experiments.state_tracking.along along_s5 --state-norm         # + the state's norm per checkpoint
    python -m experiments.state_tracking.along along_s5 --levers             # + three levers graded by fullband bench

The levers use the same runs, so each is paired with the preset's kept model seed by seed and row by row, at the
lengths the checkpoints are graded at along training (4x and 8x):
  keep8x  the checkpoint with the best validation score at 8x (ties: the later one), graded on the test rows;
  swa     the mean of the weights of the checkpoints of the LR decay (the sweep's decay fraction), graded on the
          validation and the test rows;
  tail    the mean of the weights of the last two checkpoints (an EMA's window at the end of the decay), graded
          on the validation and the test rows.

Per seed: the step each run first reaches >= 0.99 at 8x on the validation rows, its best 8x score and step, the
score at the end of training, the kept model's step (the preset's keep_best: lowest validation loss at 1..16
moves) and its 8x score on the test rows, and the checkpoint that the validation rows at 8x would have kept.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from experiments.plotting import pyplot, save
from experiments.state_tracking.tasks import encode_batch, load_run_model
from experiments.stats import fmt
from experiments.sweeps import ROOT, SWEEPS
from fullband.config import load_config
from fullband.data.synthetic import Example
from fullband.data.tokenizers import ByteTokenizer
from fullband.generation import sequential_forward
from fullband.loading import preset_path

RESULTS = Path(__file__).resolve().parent / "results"


def summary(record: dict, length: str) -> dict:
    """One run's along-training figures at `length` moves (a key of its `along` curves)."""
    curve = [(point["step"], point["val"][length]) for point in record["along"]]
    best_step, best = max(curve, key=lambda p: (p[1], p[0]))  # ties: the later checkpoint
    reached = next((step for step, acc in curve if acc >= 0.99), None)
    # the largest fall from a score already reached to a later one: a run that reached and lost extrapolation
    running, fall = 0.0, 0.0
    for _, acc in curve:
        running = max(running, acc)
        fall = max(fall, running - acc)
    return {"seed": record["seed"], "reached": reached, "best": best, "best_step": best_step, "last": curve[-1][1],
            "fall": fall, "kept_step": record["kept_step"],
            "kept_test": record["lengths"][length]["fused:exact"]["accuracy"],
            "kept_val": record["val_lengths"][length]["fused:exact"]["accuracy"]}


def state_norms(run: Path, val_file: Path, rows: int) -> list[dict]:
    """Per checkpoint of `run`: the mean norm of the state fed back at the last prompt position of the first
    `rows` validation rows of `val_file` under the exact recurrence, and that position's mean over the row."""
    lines = [json.loads(line) for line in val_file.read_text().splitlines() if line.strip()][:rows]
    ids, _ = encode_batch([Example(r["prompt"], r["answer"]) for r in lines], ByteTokenizer())
    out = []
    for checkpoint in checkpoints_of(run):
        model = load_run_model(checkpoint / "model")
        with torch.no_grad():
            _, hidden = sequential_forward(model, ids)
        norms = hidden.double().norm(dim=-1)  # (B, T)
        prompt_end = len(ByteTokenizer().encode(lines[0]["prompt"]))  # the bos shifts by one: state after the prompt
        out.append({"step": int(checkpoint.name.split("_")[1]), "end": round(norms[:, prompt_end].mean().item(), 4),
                    "mean": round(norms[:, 1:prompt_end + 1].mean().item(), 4)})
    return out


def checkpoints_of(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def bench(model: Path, files: list[str], out: Path) -> dict[str, float]:
    """`fullband bench` of `model` in fused:exact on the jsonl files: {file: accuracy}."""
    tasks = [item for path in files for item in ("--task", f"jsonl:{path}")]
    subprocess.run([sys.executable, "-m", "fullband", "bench", str(model), *tasks, "--modes", "fused:exact",
                    "--fused-max-passes", "1024", "--fused-tol", "0", "--out", str(out), "--no-progress", "--no-plots"],
                   check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    results = json.loads((out / "results.json").read_text())["results"]
    return {path: results[f"jsonl:{path}"]["fused:exact"]["0.0"]["accuracy"] for path in files}


def average(checkpoints: list[Path], out: Path) -> Path:
    """A model directory whose weights are the mean of the checkpoints' (the last one's config and settings)."""
    shutil.copytree(checkpoints[-1] / "model", out, dirs_exist_ok=True)
    weights = [load_file(c / "model" / "model.safetensors") for c in checkpoints]
    mean = {k: torch.stack([w[k].double() for w in weights]).mean(0).to(v.dtype) for k, v in weights[-1].items()}
    save_file(mean, out / "model.safetensors", metadata={"format": "pt", "library": "fullband"})
    return out


def decay_fraction(sweep) -> float:
    """The last fraction of the steps over which a sweep's learning rate decays: its override, else the preset's."""
    preset = load_config(preset_path(sweep.preset)).train.decay_fraction
    return float(sweep.overrides.get("train.decay_fraction", preset))


def levers(record: dict, run: Path, along: list[str], fraction: float) -> dict:
    """The three levers of one run, graded on the test (and validation) rows the runner graded the kept model on,
    at the along-training lengths."""
    data = run.with_name(run.name + ".data")
    tests = [str(data / f"test{n}.jsonl") for n in along]
    vals = [str(data / f"val{n}.jsonl") for n in along]
    top = along[-1]
    step = max(record["along"], key=lambda p: (p["val"][top], p["step"]))["step"]
    chosen = run / "checkpoints" / f"step_{step:08d}"
    keep8x = bench(chosen / "model", tests, run / "levers" / "keep8x")
    graded = {"seed": record["seed"], "keep8x_step": step, "keep8x": {n: keep8x[t] for n, t in zip(along, tests)}}
    checkpoints = checkpoints_of(run)
    decay = [c for c in checkpoints if int(c.name.split("_")[1]) >= (1 - fraction) * record["steps"]]
    for name, averaged in (("swa", decay), ("tail", checkpoints[-2:])):
        scores = bench(average(averaged, run / "levers" / f"{name}_model"), tests + vals, run / "levers" / name)
        graded |= {f"{name}_steps": [int(c.name.split("_")[1]) for c in averaged],
                   name: {n: scores[t] for n, t in zip(along, tests)},
                   f"{name}_val": {n: scores[v] for n, v in zip(along, vals)}}
    return graded


def paired(name: str, pairs: list[tuple[float, float]]) -> str:
    ours = [a for a, _ in pairs]
    return (f"{name} {fmt(ours)}, − the kept model {fmt([a - b for a, b in pairs], '+.3f')}, ≥ 0.99 in "
            f"{sum(a >= 0.99 for a in ours)} of {len(ours)}, worst {min(ours):.3f}")


def plot(records: list[dict], lengths: list[str], norms: dict[int, list[dict]], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        raise SystemExit("--plot needs matplotlib (pip install -e '.[plots]')")
    n = len(records)
    cols = 5
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), sharex=True, sharey=True, squeeze=False)
    for ax, record in zip(axes.flat, records):
        steps = [p["step"] for p in record["along"]]
        for length, style in zip(lengths, ("-", "-")):
            ax.plot(steps, [p["val"][length] for p in record["along"]], style, marker=".", ms=3,
                    label=f"{int(length) // 16}x (val)")
        ax.axvline(record["kept_step"], color="grey", ls=":", lw=1)
        ax.set_title(f"seed {record['seed']}: kept {record['kept_step']}, test 8x "
                     f"{record['lengths'][lengths[-1]]['fused:exact']['accuracy']:.2f}", fontsize=8)
        ax.set_ylim(-0.02, 1.02)
        loss = ax.twinx()
        loss.semilogy(*zip(*record["train_curve"]), color="black", alpha=0.25, lw=0.6)
        loss.set_ylim(1e-4, 3)
        if record["seed"] in norms:
            norm = ax.twinx()
            norm.plot([p["step"] for p in norms[record["seed"]]], [p["end"] for p in norms[record["seed"]]],
                      color="tab:red", lw=0.8, alpha=0.7)
            norm.set_yticks([])
        loss.tick_params(labelsize=6)
    for ax in axes.flat[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower right")
    fig.supxlabel("step (dotted: the model keep_best kept; grey: training loss, log scale, right"
                  + ("; red: the state's norm after the prompt at 8x, own scale)" if norms else ")"), fontsize=8)
    fig.supylabel("exact-match accuracy, validation rows")
    fig.tight_layout()
    print(f"plot: {save(fig, out, 130)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="a sweep run with `along` (experiments/state_tracking/results/NAME.json)")
    parser.add_argument("--task", default="s5")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs", help="where the sweep's runs are")
    parser.add_argument("--state-norm", action="store_true",
                        help="measure the state's norm on each kept checkpoint (needs the runs), written to "
                             "results/NAME_state.jsonl")
    parser.add_argument("--levers", action="store_true",
                        help="grade keep8x, swa and tail (needs the runs), written to results/NAME_levers.jsonl")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    sweep = SWEEPS[args.name]
    records = sorted((r for r in json.loads((args.results / f"{sweep.into or args.name}.json").read_text())
                      if r["task"] == args.task and "along" in r), key=lambda r: r["seed"])
    if not records:
        raise SystemExit(f"no run of {args.task} with along-training grades in {args.name}: run it first "
                         f"(python -m experiments.run {args.name})")
    lengths = [str(m * sweep.moves) for m in sweep.along_lengths]
    top = lengths[-1]
    rows = [summary(r, top) for r in records]
    print(f"{args.name}: {len(rows)} seeds, validation rows at {top} moves ({sweep.along_lengths[-1]}x), a checkpoint "
          f"every {sweep.along} steps\n")
    print("| seed | first step >= 0.99 (val) | best val (step) | val at the end | largest fall | kept step | "
          "kept model: val / test |")
    print("|---|---|---|---|---|---|---|")
    for s in rows:
        print(f"| {s['seed']} | {s['reached'] or 'never'} | {s['best']:.3f} ({s['best_step']}) | {s['last']:.3f} | "
              f"{s['fall']:.3f} | {s['kept_step']} | {s['kept_val']:.3f} / {s['kept_test']:.3f} |")
    print(f"\nseeds that reach >= 0.99 at some checkpoint: {sum(s['reached'] is not None for s in rows)} of "
          f"{len(rows)}; that end there: {sum(s['last'] >= 0.99 for s in rows)}; "
          f"best val {fmt([s['best'] for s in rows])}, "
          f"val at the end {fmt([s['last'] for s in rows])}, kept model test {fmt([s['kept_test'] for s in rows])}")
    last = records[0]["along"][-1]["step"]
    fraction = decay_fraction(sweep)
    decay = [p["step"] for p in records[0]["along"] if p["step"] >= (1 - fraction) * last]
    print(f"\nvalidation at {top} moves over the LR decay (the last {fraction:.0%} of the steps), per seed:\n")
    print("| seed | " + " | ".join(f"step {step}" for step in decay) + " |")
    print("|---|" + "---|" * len(decay))
    for record in records:
        at = {p["step"]: p["val"][top] for p in record["along"]}
        print(f"| {record['seed']} | " + " | ".join(f"{at[step]:.3f}" for step in decay) + " |")
    print("| mean [95% t] | " + " | ".join(fmt([{p["step"]: p["val"][top] for p in r["along"]}[step]
                                                 for r in records]) for step in decay) + " |")
    norms: dict[int, list[dict]] = {}
    if args.state_norm:
        out = args.results / f"{args.name}_state.jsonl"
        lines = []
        for record in records:
            run = args.runs_dir / args.name / f"{args.task}_s{record['seed']}"
            data = run.with_name(run.name + ".data")
            norms[record["seed"]] = state_norms(run, data / f"val{top}.jsonl", 64)
            lines.append(json.dumps({"seed": record["seed"], "state_norm": norms[record["seed"]]}) + "\n")
        out.write_text("".join(lines))
        print(f"state norms: {out}")
    elif (args.results / f"{args.name}_state.jsonl").is_file():
        for line in (args.results / f"{args.name}_state.jsonl").read_text().splitlines():
            entry = json.loads(line)
            norms[entry["seed"]] = entry["state_norm"]
    if args.levers:
        out = args.results / f"{args.name}_levers.jsonl"
        graded = [levers(r, args.runs_dir / args.name / f"{args.task}_s{r['seed']}", lengths, decay_fraction(sweep))
                  for r in records]
        out.write_text("".join(json.dumps(g) + "\n" for g in graded))
        print(f"levers: {out}")
    if (args.results / f"{args.name}_levers.jsonl").is_file():
        graded = {g["seed"]: g for g in map(json.loads, (args.results / f"{args.name}_levers.jsonl").read_text()
                                            .splitlines())}
        print(f"\nlevers at {top} moves, paired with the kept model on the same seeds and rows "
              "(mean [95% t interval]):")
        kept = {r["seed"]: r for r in records if r["seed"] in graded}
        test = lambda r: r["lengths"][top]["fused:exact"]["accuracy"]  # noqa: E731
        val = lambda r: r["val_lengths"][top]["fused:exact"]["accuracy"]  # noqa: E731
        print("- test rows, " + paired("keep8x", [(graded[s]["keep8x"][top], test(kept[s])) for s in kept]))
        for name in ("swa", "tail"):
            steps = ", ".join(map(str, graded[next(iter(kept))][f"{name}_steps"]))
            print("- validation rows, " + paired(f"{name} (steps {steps})",
                                                  [(graded[s][f"{name}_val"][top], val(kept[s])) for s in kept]))
            print("- test rows, " + paired(name, [(graded[s][name][top], test(kept[s])) for s in kept]))
    if args.plot:
        plot(records, lengths, norms, args.plot)


if __name__ == "__main__":
    main()

"""Why does the exact recurrence stop on S5? The states it carries, move by move, against those it
visits within the training length.

For a model trained on 1..L moves (the kept model of a run of `python -m experiments.run SWEEP`) and the
test rows of its 8× column (8·L moves), the top-layer state fed back after each move j (the exact recurrence) is
compared with the states after moves 1..L of `--fit-rows` other prompts. Per move j:

  answer      exact-match accuracy of the answer after the first j moves (` :` appended there): the
              accuracy-against-length curve at every length, not only at L, 2L, 4L, 8L
  probe       a linear probe fitted on the training-length states reads the true task state (e.g. which
              of S5's 120 permutations) from the state: is the state still written in the same code?
  novelty     distance to the nearest training-length state, over the median such distance among the
              training-length states themselves: ~1 inside the region training visits, larger outside
  novelty_ok  the same over the rows the probe still reads right: do states wander out of the trained
              region while still right (a drift), or stay inside it until they are wrong (a jump)?

    python -m experiments.state_tracking.state_drift --sweep len16_8000 --tasks s5,parity --seeds 0 2 --multiple 16
    python -m experiments.state_tracking.state_drift --sweep len16 --quick ...    # tiny, for the test suite

Prints a markdown table (mean [95% t interval] over seeds at moves L, 2L, 4L, 8L) and writes one JSON line per task and
seed with the whole curves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from experiments.plotting import pyplot, save
from experiments.state_tracking.tasks import (
    answer_correct,
    encode_batch,
    load_run_model,
    task_with_moves,
    write_analysis,
)
from experiments.stats import fmt
from experiments.sweeps import ROOT, SWEEPS, StateTrackingSweep
from fullband.data import ByteTokenizer, Example
from fullband.data.synthetic import SyntheticTask, synthetic_examples
from fullband.generation import sequential_forward
from fullband.model import FullBandLM
from fullband.tools.probe import fit_logistic


def states_after_moves(model: FullBandLM, task: SyntheticTask, examples: list[Example]
                       ) -> tuple[torch.Tensor, list[list[str]], torch.Tensor]:
    """The top-layer state fed back after each move (B, moves, D; float64) under the exact recurrence, the
    true task state after each move, and whether each full prompt is answered right."""
    ids, labels = encode_batch(examples, ByteTokenizer())
    logits, hidden = sequential_forward(model, ids)
    # targets: (prompt character index, state after that move); token = character + 1 (the bos).
    targets = [task.targets(ex) for ex in examples]
    pos = torch.tensor([[i + 1 for i, _ in t] for t in targets])
    h = hidden.double().gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
    return h, [[state for _, state in t] for t in targets], answer_correct(logits, labels)


class Novelty:
    """Distance from a state to its nearest reference state, over the median of the same distance among
    the distinct reference states themselves (leave-one-out): ~1 inside the region the training lengths
    visit, larger the further a state has moved out of it. (Prompts that share their first moves share
    those states exactly, hence the distinct ones.)"""

    def __init__(self, reference: torch.Tensor) -> None:
        self.reference = torch.unique(reference, dim=0)
        inside = self.distances(self.reference)
        inside.fill_diagonal_(float("inf"))
        self.scale = inside.min(1).values.median()

    def distances(self, h: torch.Tensor) -> torch.Tensor:
        # Not cdist's default matrix-product form (|a|² + |b|² − 2ab): it leaves rounding noise of ~1e-7 on
        # a state's distance to itself, which depends on the BLAS path and so on the machine.
        return torch.cdist(h, self.reference, compute_mode="donot_use_mm_for_euclid_dist")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.distances(h).min(1).values / self.scale


def per_move_curves(h: torch.Tensor, y: torch.Tensor, fit_h: torch.Tensor, fit_y: torch.Tensor,
                    classes: int) -> dict[str, list[float | None]]:
    """Per move j of the test states h (B, moves, D) with true states y (B, moves): the accuracy of a
    linear probe fitted on the training-length states (fit_h, fit_y) and the novelty of the states, over
    every row and over the rows the probe still reads right."""
    with torch.enable_grad():  # the callers run the model under no_grad
        probe = fit_logistic(fit_h, fit_y, classes)  # fullband.tools.probe.s logistic regression
    curve: dict[str, list[float | None]] = {"probe": [], "novelty": [], "novelty_ok": []}
    novelty = Novelty(fit_h)
    for j in range(h.shape[1]):
        right = probe(h[:, j]) == y[:, j]
        far = novelty(h[:, j])
        curve["probe"].append(round(right.double().mean().item(), 4))
        curve["novelty"].append(round(far.mean().item(), 3))
        curve["novelty_ok"].append(round(far[right].mean().item(), 3) if right.any() else None)
    return curve


@torch.no_grad()
def answer_curve(model: FullBandLM, task: SyntheticTask, examples: list[Example]) -> list[float]:
    """Exact-match accuracy of the final answer after the first j moves of each prompt, j = 1..moves."""
    name = examples[0].prompt.split(" ", 1)[0]
    moves = [ex.prompt.split(" ", 1)[1].removesuffix(" :") for ex in examples]
    states = [[state for _, state in task.targets(ex)] for ex in examples]
    if any(len(m) != len(st) for m, st in zip(moves, states)):
        raise SystemExit(f"{name}: answer_curve needs one character per move (the state-tracking tasks' format)")
    curve = []
    for j in range(1, len(states[0]) + 1):
        prefixes = [Example(f"{name} {m[:j]} :", " " + st[j - 1]) for m, st in zip(moves, states)]
        ids, labels = encode_batch(prefixes, ByteTokenizer())
        curve.append(round(answer_correct(sequential_forward(model, ids)[0], labels).double().mean().item(), 4))
    return curve


@torch.no_grad()
def drift_curves(model: FullBandLM, task: str, train_len: int, multiple: int, rows: int, fit_rows: int,
                 test_seed: int) -> dict:
    """Every curve of the module docstring on the test rows of `multiple` × `train_len` moves (the runner's:
    seed `test_seed` + moves); the probe and the novelty reference come from `fit_rows` other prompts of
    `train_len` moves."""
    test_task, fit_task = task_with_moves(task, multiple * train_len), task_with_moves(task, train_len)
    examples = synthetic_examples(test_task, rows, test_seed + multiple * train_len)
    h, states, answered = states_after_moves(model, test_task, examples)
    fit_h, fit_states, _ = states_after_moves(model, fit_task, synthetic_examples(fit_task, fit_rows, 20_000))
    names = sorted({s for row in states + fit_states for s in row})
    index = {s: i for i, s in enumerate(names)}
    y = torch.tensor([[index[s] for s in row] for row in states])
    fit_y = torch.tensor([[index[s] for s in row] for row in fit_states])
    curve = per_move_curves(h, y, fit_h.reshape(-1, h.shape[-1]), fit_y.reshape(-1), len(names))
    return {"moves": multiple * train_len, "rows": rows, "fit_rows": fit_rows, "states": len(names),
            "answer_accuracy": round(answered.double().mean().item(), 4),
            "answer": answer_curve(model, test_task, examples), **curve}


def mean_interval(values: list[float | None]) -> str:
    """Mean [95% t interval] over the seeds with a value (a curve past its last move has none)."""
    values = [v for v in values if v is not None]
    return fmt(values, ".2f") if values else "–"


def summarise(records: list[dict], train_len: int) -> str:
    lines = []
    for task in dict.fromkeys(r["task"] for r in records):
        rs = [r for r in records if r["task"] == task]
        label = ", ".join(dict.fromkeys(r["label"] for r in rs))
        marks = [m * train_len for m in (1, 2, 4, 8) if m * train_len <= rs[0]["moves"]]
        lines += [f"#### {task} ({label}; seeds {[r['seed'] for r in rs]}; {rs[0]['rows']} rows of "
                  f"{rs[0]['moves']} moves)", "",
                  "| after move | " + " | ".join(map(str, marks)) + " |", "|---|" + "---|" * len(marks)]
        for key, name in (("answer", "answer after j moves"), ("probe", "linear probe (fitted on moves ≤ L)"),
                          ("novelty", "novelty"), ("novelty_ok", "novelty, rows the probe reads right")):
            lines.append(f"| {name} | " + " | ".join(mean_interval([r[key][m - 1] for r in rs]) for m in marks) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> Path:
    plt = pyplot()
    if plt is None:
        raise SystemExit("the drift plot needs matplotlib (pip install 'fullband[plot]'), or pass --plot ''")

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    tasks = list(dict.fromkeys(r["task"] for r in records))
    for r in records:
        colour = colours[tasks.index(r["task"]) % len(colours)]
        x = range(1, r["moves"] + 1)
        label = f"{r['task']} seed {r['seed']}"
        for ax, key in zip(axes, ("answer", "probe", "novelty_ok")):
            ax.plot(x, [v if v is not None else float("nan") for v in r[key]], color=colour, alpha=0.8, label=label)
    titles = ("answer after j moves", "linear probe fitted on moves ≤ L", "novelty of rows the probe reads right")
    for ax, title in zip(axes, titles):
        ax.axvline(records[0]["train_len"], color="grey", ls=":", lw=1)
        ax.set_xlabel("move")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of rows")
    axes[1].set_ylabel("fraction of rows")
    axes[2].set_ylabel("nearest training-length state, relative")
    axes[0].legend(fontsize=7)
    return save(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", required=True, help="the sweep whose runs to read (experiments/sweeps.py)")
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs", help="the runner's --runs-dir (default runs/)")
    p.add_argument("--tasks", default="s5")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--multiple", type=int, default=8, help="prompts of multiple × L moves")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--fit-rows", type=int, default=1000, help="prompts of L moves for the probe and the reference")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="default experiments/state_tracking/results/state_drift_SWEEP.jsonl")
    p.add_argument("--plot", help="default experiments/state_tracking/state_drift_SWEEP.png ('' = none)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    args = p.parse_args(argv)
    sweep = SWEEPS.get(args.sweep)
    if not isinstance(sweep, StateTrackingSweep):
        p.error(f"--sweep {args.sweep!r}: not a state-tracking sweep of experiments/sweeps.py")
    here = Path(__file__).resolve().parent
    args.out = args.out or here / "results" / f"state_drift_{sweep.name}.jsonl"
    args.plot = str(here / f"state_drift_{sweep.name}.png") if args.plot is None else args.plot
    if args.quick:
        args.multiple, args.rows, args.fit_rows = 2, 4, 16
    torch.set_num_threads(args.threads)
    records = []
    for task in args.tasks.split(","):
        for seed in args.seeds:
            run = args.runs_dir / sweep.name / f"{task}_s{seed}"
            model_dir = run / "best" if (run / "best").is_dir() else run  # the kept model, as the runner grades
            if not (run / "config.yaml").is_file():
                print(f"skip {task} seed {seed}: no run {run}", file=sys.stderr)
                continue
            curves = drift_curves(load_run_model(model_dir), task, sweep.moves, args.multiple, args.rows,
                                  args.fit_rows, sweep.test_seed)
            records.append({"task": task, "seed": seed, "label": sweep.name, "model": str(model_dir),
                            "train_len": sweep.moves, **curves})
    write_analysis(records, args.out)
    print(summarise(records, sweep.moves))
    if args.plot:
        print(f"plot: {plot(records, Path(args.plot))}")


if __name__ == "__main__":
    main()

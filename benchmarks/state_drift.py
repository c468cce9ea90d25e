"""Why does the exact recurrence stop on S5? The states it carries, move by move, against the codebook it
learnt within the training length.

For a model trained on 1..L moves (weights kept by benchmarks/state_tracking.py) and held-out prompts of
8·L moves (the rows of its 8× column), the top-layer state fed back after each move j is compared with the
centroids of the states after moves 1..L, one centroid per true task state (e.g. each of S5's 120
permutations). Per move j:

  decode     the nearest centroid is the true state's (the state is still readable with the codebook
             of the training lengths; needs no probe training beyond averaging)
  drift      distance from the true state's centroid, over the median distance between centroids
             (0 = on the codebook; ~0.5 = half-way to another state)
  drift|ok   the same, over the rows still decoded right at j: does the state wander gradually (grows
             while decoding still succeeds) or jump between codebook points (stays flat until it fails)?

    python benchmarks/state_drift.py --runs runs/state_tracking_models/last_gate_init0.2_4000 --tasks s5
    python benchmarks/state_drift.py --runs DIR1 DIR2 --tasks s5,s3 --plot docs/state_drift.png
    python benchmarks/state_drift.py --quick ...          # tiny, for the test suite

Prints a markdown table (mean ± sd over seeds at moves L, 2L, 4L, 8L) and writes one JSON line per task and
seed with the whole curves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from fullband.data import ByteTokenizer
from fullband.data.synthetic import synthetic_examples
from fullband.generation import sequential_forward
from fullband.model import FullBandConfig, FullBandLM
from fullband.state_tracking import answer_correct, encode_batch, task_with_moves


def load_saved(path: Path) -> FullBandLM:
    """A model saved by benchmarks/state_tracking.py (--save-models), in eval mode."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: say which one
        raise SystemExit(f"{path}: not a model saved by benchmarks/state_tracking.py ({err})") from err
    model = FullBandLM(FullBandConfig.from_dict(saved["model_config"]))
    model.load_state_dict(saved["state_dict"])
    return model.eval()


def codebook_curves(h: torch.Tensor, y: torch.Tensor, train_len: int) -> dict:
    """Per-move decode / drift / drift_ok / known (module docstring) of states h (B, moves, D) whose true
    task states are y (B, moves, class ids), against the centroids of moves 1..train_len. A class never
    reached within train_len moves has no centroid; its rows are left out of that move's figures."""
    ref_h, ref_y = h[:, :train_len].reshape(-1, h.shape[-1]), y[:, :train_len].reshape(-1)
    classes = int(y.max()) + 1
    seen = torch.zeros(classes, dtype=torch.bool)
    seen[ref_y] = True
    centroids = torch.zeros(classes, h.shape[-1], dtype=h.dtype)
    centroids.index_add_(0, ref_y, ref_h)
    centroids[seen] /= torch.bincount(ref_y, minlength=classes)[seen, None].to(h.dtype)
    gaps = torch.cdist(centroids[seen], centroids[seen])
    scale = gaps[~torch.eye(int(seen.sum()), dtype=torch.bool)].median()
    known = seen[y]
    dist = torch.cdist(h.reshape(-1, h.shape[-1]), centroids[seen]).reshape(*y.shape, -1)
    decoded = seen.nonzero().squeeze(1)[dist.argmin(-1)]
    to_true = (h - centroids[y]).norm(dim=-1) / scale
    ok = (decoded == y) & known
    curve = {"decode": [], "drift": [], "drift_ok": [], "known": []}
    for j in range(y.shape[1]):
        k = known[:, j]
        curve["known"].append(round(k.double().mean().item(), 4))
        curve["decode"].append(round(ok[:, j][k].double().mean().item(), 4) if k.any() else None)
        curve["drift"].append(round(to_true[:, j][k].mean().item(), 4) if k.any() else None)
        curve["drift_ok"].append(round(to_true[:, j][ok[:, j]].mean().item(), 4) if ok[:, j].any() else None)
    return {"states_with_centroid": int(seen.sum()), "centroid_gap_median": round(scale.item(), 4), **curve}


@torch.no_grad()
def drift_curves(model: FullBandLM, task: str, train_len: int, multiple: int, rows: int) -> dict:
    """The per-move curves (module docstring) on the rows of the benchmark's `multiple`× column."""
    moves = multiple * train_len
    task_obj = task_with_moves(task, moves)
    examples = synthetic_examples(task_obj, rows, 10_000 + multiple)  # = state_tracking.evaluate's rows
    ids, labels = encode_batch(examples, ByteTokenizer())
    logits, hidden = sequential_forward(model, ids)
    answer = answer_correct(logits, labels)
    # targets: (prompt character index, state after that move); token = character + 1 (the bos).
    targets = [task_obj.targets(ex) for ex in examples]
    pos = torch.tensor([[i + 1 for i, _ in t] for t in targets])  # (B, moves)
    states = [[s for _, s in t] for t in targets]
    h = hidden.double().gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, moves, D)
    names = sorted({s for row in states for s in row})
    index = {s: i for i, s in enumerate(names)}
    y = torch.tensor([[index[s] for s in row] for row in states])  # (B, moves)
    curve = codebook_curves(h, y, train_len)
    return {"moves": moves, "rows": rows, "states": len(names),
            "answer_accuracy": round(answer.float().mean().item(), 4), **curve}


def mean_sd(values: list[float | None]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def summarise(records: list[dict], train_len: int) -> str:
    lines = []
    for task in dict.fromkeys(r["task"] for r in records):
        rs = [r for r in records if r["task"] == task]
        label = ", ".join(dict.fromkeys(r["label"] for r in rs))
        marks = [m * train_len for m in (1, 2, 4, 8) if m * train_len <= rs[0]["moves"]]
        lines += [f"#### {task} ({label}; seeds {[r['seed'] for r in rs]}; {rs[0]['rows']} rows of "
                  f"{rs[0]['moves']} moves)", "",
                  "| after move | " + " | ".join(map(str, marks)) + " |", "|---|" + "---|" * len(marks)]
        for key, name in (("decode", "decode (nearest centroid of moves ≤ L)"), ("drift", "drift"),
                          ("drift_ok", "drift, rows still decoded right")):
            lines.append(f"| {name} | " + " | ".join(mean_sd([r[key][m - 1] for r in rs]) for m in marks) + " |")
        lines.append(f"| answer after all {rs[0]['moves']} moves | " + " | ".join(
            [""] * (len(marks) - 1) + [mean_sd([r["answer_accuracy"] for r in rs])]) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    tasks = list(dict.fromkeys(r["task"] for r in records))
    for r in records:
        colour = colours[tasks.index(r["task"]) % len(colours)]
        x = range(1, r["moves"] + 1)
        label = f"{r['task']} seed {r['seed']}"
        axes[0].plot(x, [v if v is not None else float("nan") for v in r["decode"]], color=colour, alpha=0.8,
                     label=label)
        axes[1].plot(x, [v if v is not None else float("nan") for v in r["drift_ok"]], color=colour, alpha=0.8,
                     label=label)
    for ax, title in zip(axes, ("decoded with the codebook of moves ≤ L", "drift of rows still decoded right")):
        ax.axvline(records[0]["train_len"], color="grey", ls=":", lw=1)
        ax.set_xlabel("move")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of rows")
    axes[1].set_ylabel("distance to own centroid / median centroid gap")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, metavar="DIR",
                   help="directories of models saved by benchmarks/state_tracking.py (<task>_s<seed>_fbt.pt)")
    p.add_argument("--tasks", default="s5")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train-len", type=int, default=8, help="L of the saved models")
    p.add_argument("--multiple", type=int, default=8, help="prompts of multiple × L moves")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/state_drift.jsonl")
    p.add_argument("--plot", default="docs/state_drift.png")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    args = p.parse_args(argv)
    if args.quick:
        args.multiple, args.rows = 2, 8
    torch.set_num_threads(args.threads)
    records = []
    for task in args.tasks.split(","):
        for seed in args.seeds:
            name = f"{task}_s{seed}_fbt.pt"
            found = [Path(d) / name for d in args.runs if (Path(d) / name).is_file()]
            if not found:
                print(f"skip {task} seed {seed}: no {name} under {', '.join(args.runs)}", file=sys.stderr)
                continue
            model = load_saved(found[0])
            curves = drift_curves(model, task, args.train_len, args.multiple, args.rows)
            records.append({"task": task, "seed": seed, "label": found[0].parent.name, "model": str(found[0]),
                            "train_len": args.train_len, **curves})
    if not records:
        raise SystemExit("no saved model found; run benchmarks/state_tracking.py first "
                         "(it keeps them under --save-models)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(summarise(records, args.train_len))
    if args.plot:
        print(f"plot: {plot(records, Path(args.plot))}")


if __name__ == "__main__":
    main()

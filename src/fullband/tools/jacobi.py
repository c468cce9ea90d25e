"""``fullband jacobi``: how the Jacobi iteration of the feedback recurrence converges, pass by pass, against the exact
recurrence (docs/evaluation.md). Memory is that of one pass: only the previous pass's top states are kept."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fullband.architectures import refuse_arch
from fullband.bench.plots import PLOT_EXTRA, pyplot, save_figure
from fullband.cli_options import add_validation_data_options, model_dtype
from fullband.data.shards import IGNORE_INDEX, Batch
from fullband.errors import FullbandError
from fullband.eval import token_losses
from fullband.generation import sequential_forward
from fullband.loading import load_model_and_data
from fullband.model import FullBandLM, plain_positions, relative_change

NO_MATPLOTLIB = f"fullband jacobi draws jacobi.png with matplotlib: {PLOT_EXTRA}"


@dataclass
class JacobiCurve:
    """Per number of fused passes k (index k of every list): the diagnostics on positions >= k."""

    passes: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)  # mean next-token loss after k fused passes
    sequential_loss: list[float | None] = field(default_factory=list)  # the exact recurrence, same positions
    relative_change: list[float | None] = field(default_factory=list)  # mean ||h^k - h^(k-1)|| / ||h^(k-1)||
    relative_change_max: list[float | None] = field(default_factory=list)  # the largest such change
    sequential_gap: list[float | None] = field(default_factory=list)  # mean ||h^k - h_seq|| / ||h_seq||
    targets: list[int] = field(default_factory=list)  # scored targets behind each loss
    sequences: int = 0
    seq_len: int = 0


@torch.no_grad()
def jacobi_curve(model: FullBandLM, batches: Iterable[Batch], passes: int, sequential: bool = True) -> JacobiCurve:
    """The diagnostics for k = 0..min(passes, T - 1) over ``batches`` (positions >= k exist up to T - 1)."""
    if passes < 0:
        raise FullbandError(f"passes={passes} must be >= 0")
    was_training = model.training
    model.eval()
    sums: list[Counter[str]] = []  # per k, running sums over the batches (and the largest change)
    curve = JacobiCurve()
    for batch in batches:
        batch = batch.to(model.device)
        ids, targets = batch.input_ids, batch.targets
        B, T = ids.shape
        curve.sequences += B
        curve.seq_len = T
        valid = targets != IGNORE_INDEX
        seq_losses = seq_hidden = None
        if sequential:
            plain = plain_positions(ids, batch.plain_mask, segment_ids=batch.segment_ids)
            seq_logits, seq_hidden = sequential_forward(model, ids, plain_mask=plain, segment_ids=batch.segment_ids)
            seq_losses = token_losses(seq_logits, targets)
            del seq_logits
        last = min(passes, T - 1)
        while len(sums) <= last:
            sums.append(Counter())
        previous = None
        steps = model.iterate_passes(ids, last + 1, plain_mask=batch.plain_mask, segment_ids=batch.segment_ids)
        for k, out in enumerate(steps):
            losses = token_losses(out.logits, targets)
            s, mask = sums[k], valid[:, k:]
            s["targets"] += int(mask.sum())
            s["positions"] += B * (T - k)
            s["loss"] += float(losses[:, k:][mask].sum())
            if seq_losses is not None:
                s["seq_loss"] += float(seq_losses[:, k:][mask].sum())
                s["gap"] += float(relative_change(out.hidden[:, k:], seq_hidden[:, k:]).sum())
            if previous is not None:
                change = relative_change(out.hidden[:, k:], previous[:, k:])
                s["change"] += float(change.sum())
                s["change_max"] = max(s["change_max"], float(change.max()))
            previous = out.hidden
            del out, losses  # one pass's logits at a time
    model.train(was_training)
    for k, s in enumerate(sums):
        curve.passes.append(k)
        curve.targets.append(s["targets"])
        curve.loss.append(s["loss"] / s["targets"] if s["targets"] else None)
        curve.sequential_loss.append(s["seq_loss"] / s["targets"] if sequential and s["targets"] else None)
        curve.sequential_gap.append(s["gap"] / s["positions"] if sequential else None)
        curve.relative_change.append(s["change"] / s["positions"] if k > 0 else None)
        curve.relative_change_max.append(s["change_max"] if k > 0 else None)
    return curve


def plot_curve(curve: JacobiCurve, path: Path, title: str) -> None:
    plt = pyplot(NO_MATPLOTLIB)
    fig, (ax_loss, ax_change) = plt.subplots(1, 2, figsize=(11, 4))
    ks = curve.passes
    ax_loss.plot(ks, curve.loss, marker=".", label="fused(k) passes")
    if any(v is not None for v in curve.sequential_loss):
        ax_loss.plot(ks, curve.sequential_loss, linestyle="--", color="black", label="exact sequential")
    ax_loss.set_ylabel("loss on positions >= k")
    ax_change.plot(ks[1:], curve.relative_change[1:], marker=".", label="mean ||h(k) - h(k-1)|| / ||h(k-1)||")
    ax_change.plot(ks[1:], curve.relative_change_max[1:], marker=".", alpha=0.6, label="max over positions")
    if any(v is not None for v in curve.sequential_gap):
        ax_change.plot(ks, curve.sequential_gap, linestyle="--", label="mean ||h(k) - h_seq|| / ||h_seq||")
    ax_change.set_yscale("log")
    ax_change.set_ylabel("relative change on positions >= k")
    for ax in (ax_loss, ax_change):
        ax.set_xscale("symlog", linthresh=1)  # log-scaled pass axis that still shows k = 0
        ax.set_xlim(left=0)
        ax.set_xlabel("fused passes k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, 120)


def format_curve(curve: JacobiCurve) -> str:
    """A table at k = 0, 1, 2, 3, 5, 10, 20, 50, 100, ... and the last k."""
    n = len(curve.passes)
    marks = [0, 1, 2, 3] + [base * 10**e for e in range(6) for base in (5, 10, 20)]
    shown = sorted({k for k in marks if k < n} | {n - 1})
    fmt = lambda v: "" if v is None else f"{v:.4g}"
    lines = ["| k | loss | sequential | mean change | max change | gap to sequential |", "|---" * 6 + "|"]
    for k in shown:
        lines.append(f"| {k} | {fmt(curve.loss[k])} | {fmt(curve.sequential_loss[k])} | "
                     f"{fmt(curve.relative_change[k])} | {fmt(curve.relative_change_max[k])} | "
                     f"{fmt(curve.sequential_gap[k])} |")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("jacobi", help="loss and state change per fused pass, up to N passes (JSON + PNG)")
    add_validation_data_options(p, batches=2)
    p.add_argument("--passes", type=int, default=100, help="largest number of fused passes k (default: 100)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (jacobi.json, jacobi.png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    pyplot(NO_MATPLOTLIB)  # fail before the model and data are loaded
    model, dataset, model_dir, data_dir = load_model_and_data(args.checkpoint, args.data_dir, args.device,
                                                                  model_dtype(args))
    refuse_arch(model, "fullband jacobi")  # fused passes: what a recurrent baseline has none of
    seq_len = args.seq_len or min(model.config.max_seq_len, 256)
    if seq_len > model.config.max_seq_len:
        raise FullbandError(f"--seq-len {seq_len} exceeds the model's max_seq_len {model.config.max_seq_len}")
    if args.passes >= seq_len:
        print(f"note: positions >= k exist up to k = {seq_len - 1} with --seq-len {seq_len}; stopping there "
              "(every position is exact after seq_len - 1 passes)", file=sys.stderr)
    batches = dataset.split(args.split).eval_batches(seq_len, args.batch_size, args.batches)
    curve = jacobi_curve(model, batches, args.passes, sequential=not args.no_sequential)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"model": str(model_dir), "data_dir": str(data_dir), "split": args.split, **asdict(curve)}
    (out / "jacobi.json").write_text(json.dumps(record, indent=1) + "\n")
    plot_curve(curve, out / "jacobi.png", f"{model_dir} · {curve.sequences} sequences × {curve.seq_len} tokens")
    print(format_curve(curve))
    print(f"wrote {out / 'jacobi.json'} and {out / 'jacobi.png'}")

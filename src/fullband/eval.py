"""Validation: loss per decode mode, per number of fused passes, the exact sequential limit, and
the Jacobi convergence of the pass iteration (docs/method.md §8)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fullband.architectures import LanguageModel
from fullband.data.shards import IGNORE_INDEX, Batch
from fullband.generation import sequential_forward
from fullband.model import relative_change


@dataclass
class EvalResult:
    tokens: int = 0
    loss: dict[str, float] = field(default_factory=dict)  # "standard", "fused(1)", ..., "sequential"
    jacobi_delta: dict[str, float] = field(default_factory=dict)  # "k": mean ||h^(k) - h^(k-1)|| / ||h^(k-1)||
    sequential_gap: dict[str, float] = field(default_factory=dict)  # "k": mean ||h^(k) - h_seq|| / ||h_seq||

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "loss": self.loss, "jacobi_delta": self.jacobi_delta,
                "sequential_gap": self.sequential_gap}


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) next-token cross-entropy in float32, 0 where the target is not trained on."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(targets.shape)


@torch.no_grad()
def evaluate(model: LanguageModel, batches: Iterable[Batch], fused_passes: int = 3, sequential: bool = False,
             autocast: torch.autocast | None = None) -> EvalResult:
    """Teacher-forced validation over ``batches``: standard (one plain pass), fused(n) (after n extra fused passes
    over the whole sequence) and sequential (the exact recurrence, what soft decoding computes)."""
    # A model without feedback (a recurrent baseline) has one pass and no recurrence: its standard loss is all it has.
    passes = fused_passes + 1 if model.has_feedback else 1
    sequential = sequential and model.has_feedback
    autocast = autocast or torch.autocast("cpu", enabled=False)
    was_training = model.training
    model.eval()
    # Sums of the losses, of the Jacobi deltas and of the sequential gaps, divided by their counts at the end.
    sums, deltas, gaps = defaultdict(float), defaultdict(float), defaultdict(float)
    positions = scored = 0  # all positions (Jacobi / sequential gaps) and trained targets (losses)
    for batch in batches:
        ids = batch.input_ids.to(model.device)
        targets = batch.targets.to(model.device)
        plain = batch.plain_mask.to(model.device)
        segments = None if batch.segment_ids is None else batch.segment_ids.to(model.device)
        scored += int((targets != IGNORE_INDEX).sum())  # losses are means over the trained (unmasked) targets
        positions += targets.numel()
        states = []  # each pass's top states; its logits are scored and dropped as the pass comes out
        with autocast:
            for k, step in enumerate(model.iterate_passes(ids, passes, plain_mask=plain, segment_ids=segments)):
                sums["standard" if k == 0 else f"fused({k})"] += float(token_losses(step.logits, targets).sum())
                states.append(step.hidden)
        for k in range(1, len(states)):
            deltas[str(k + 1)] += float(relative_change(states[k], states[k - 1]).sum())
        if sequential:
            with autocast:
                logits, hidden = sequential_forward(model, ids, plain_mask=plain, segment_ids=segments)
            sums["sequential"] += float(token_losses(logits, targets).sum())
            for k, h in enumerate(states):
                gaps[str(k + 1)] += float(relative_change(h, hidden).sum())
    model.train(was_training)
    if positions == 0:
        return EvalResult()
    return EvalResult(tokens=scored, loss={name: total / max(scored, 1) for name, total in sums.items()},
                      jacobi_delta={k: v / positions for k, v in deltas.items()},
                      sequential_gap={k: v / positions for k, v in gaps.items()})


def format_eval_table(results: dict[str, EvalResult]) -> str:
    """Markdown table: one row per model, one column per decode mode."""
    columns: list[str] = []
    for result in results.values():
        columns += [c for c in result.loss if c not in columns]
    lines = ["| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, result in results.items():
        cells = [f"{result.loss[c]:.4f}" if c in result.loss else "" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

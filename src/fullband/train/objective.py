"""The training loss of docs/method.md §4 over the passes of ``iterate_passes``. Everything here is a function of
each pass's logits as the pass comes out, so a detached pass can be backpropagated (and freed) before the next runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fullband.data.shards import IGNORE_INDEX
from fullband.model import FullBandLM, plain_positions
from fullband.schedule import PASS_LOSSES


@dataclass(frozen=True)
class LossOptions:
    """How a training step's loss is formed from its passes: the train section's fields, read once by the trainer
    (``LossOptions.of``) and passed whole to the objective."""

    sequential: bool = False  # the exact recurrence token by token (train.exact_mode sequential): one pass
    pass_loss: str = "paper"  # which passes' losses are trained (``pass_weight``)
    later_pass_weight: float = 1.0  # λ of Eq. 12
    prefix_mixin: float = 0.0  # the share of each row that may stay plain in later passes
    detach: bool = False  # fed-back states carry no gradient into the pass that produced them
    grad_passes: int | None = None  # only the last g passes build a graph
    backward_scale: float | None = None  # with detach: backpropagate each pass right after it (one pass in memory)

    @classmethod
    def of(cls, train: Any, sequential: bool, per_pass_backward: bool) -> LossOptions:
        """The options of a ``TrainConfig``; ``per_pass_backward``: backpropagate detached passes one at a time."""
        return cls(sequential=sequential, pass_loss=train.pass_loss, later_pass_weight=train.later_pass_weight,
                   prefix_mixin=train.prefix_mixin, detach=train.detach_passes, grad_passes=train.grad_passes or None,
                   backward_scale=1.0 if per_pass_backward and train.detach_passes else None)


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # the sum of the passes' weighted terms (+ z-loss); detached after a per-pass backward
    pass_losses: list[torch.Tensor]  # the next-token loss of each pass, whatever its weight in ``loss``


def pass_weight(k: int, passes: int, pass_loss: str = "paper", later_pass_weight: float = 1.0) -> float:
    """The weight of pass k's (0-based) next-token loss in the loss of a K-pass step."""
    if pass_loss not in PASS_LOSSES:
        raise ValueError(f"pass_loss must be one of {', '.join(PASS_LOSSES)}, got {pass_loss!r}")
    paper = 1.0 if k == 0 else later_pass_weight / (passes - 1)
    last = 1.0 if k == passes - 1 else 0.0
    return {"paper": paper, "last": last, "paper+last": paper + last}[pass_loss]


def multipass_loss(
    model: FullBandLM,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    passes: int,
    *,
    later_pass_weight: float = 1.0,
    pass_loss: str = "paper",
    z_loss: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    backward_scale: float | None = None,
    detach: bool = False,
    label_count: torch.Tensor | None = None,
    plain_mask: torch.Tensor | None = None,
    bos_token_id: int | None = None,
    jitter: float | None = None,
    prefix_mixin: float = 0.0,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    segment_ids: torch.Tensor | None = None,
    grad_passes: int | None = None,
) -> ObjectiveOutput:
    """The loss of ``passes`` passes of ``model`` over ``input_ids`` against ``labels`` (B, T); the passes are shaped
    as in ``FullBandLM.iterate_passes`` and weighted by ``pass_weight`` (a pass of weight 0 is reported, not
    backpropagated). ``z_loss`` adds z_loss·mean(logsumexp²), averaged over the passes. ``backward_scale`` (needs
    ``detach``): backpropagate each pass's term right after it, so memory holds one pass instead of K; the returned
    loss is then detached. ``label_count``: what the means divide by (default: this batch's labels); the trainer
    passes the whole step's, so the micro-batches' losses sum to the step's mean however they are split."""
    weights = [pass_weight(k, passes, pass_loss, later_pass_weight) for k in range(passes)]  # checks pass_loss
    if backward_scale is not None and not detach:
        raise ValueError("backward_scale needs detach=True (without detach, passes share one graph)")
    terms, pass_losses = [], []
    steps = model.iterate_passes(input_ids, passes, plain_mask=plain_mask, bos_token_id=bos_token_id, jitter=jitter,
                                 prefix_mixin=prefix_mixin, detach=detach, generator=generator,
                                 segment_ids=segment_ids, grad_passes=grad_passes)
    for weight, step in zip(weights, steps):
        term, pass_ce = _pass_term(step.logits, labels, weight, z_loss / passes, ignore_index, label_count)
        if backward_scale is not None and term.requires_grad:
            # With detached states, pass k's graph is not needed after its own term: free it before the next pass.
            (backward_scale * term).backward()
            term, pass_ce = term.detach(), pass_ce.detach()
        del step  # hold no pass's outputs while the next pass runs
        terms.append(term)
        pass_losses.append(pass_ce)
    return ObjectiveOutput(loss=torch.stack(terms).sum(), pass_losses=pass_losses)


def _pass_term(
    logits: torch.Tensor, labels: torch.Tensor, weight: float, z_loss: float, ignore_index: int,
    label_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight × the pass's next-token loss + z_loss × mean(logsumexp²), the next-token loss) of one pass's
    (B, T, V) logits, each a sum over the valid labels divided by ``label_count`` (default: their number)."""
    # Mean over valid labels, written as sum / count so that a batch whose targets are all masked (e.g. a
    # window inside a long user turn) contributes 0 instead of NaN.
    valid = (labels != ignore_index).flatten()
    count = valid.sum().clamp_min(1) if label_count is None else label_count
    logits = logits.flatten(0, 1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: the loss in float32
    pass_ce = F.cross_entropy(logits, labels.flatten(), ignore_index=ignore_index, reduction="sum") / count
    # A pass without weight adds no graph: its loss is reported, not backpropagated.
    term = pass_ce * weight if weight > 0 else pass_ce.detach() * 0.0
    if z_loss > 0:
        term = term + z_loss * (logits.logsumexp(-1).pow(2) * valid).sum() / count
    return term, pass_ce


def sequential_loss(
    model: FullBandLM,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    z_loss: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    plain_mask: torch.Tensor | None = None,
    bos_token_id: int | None = None,
    segment_ids: torch.Tensor | None = None,
    prefix_mixin: float = 0.0,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    label_count: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """The next-token loss of the exact recurrence, token by token: with jitter 0, the loss and gradients of
    ``multipass_loss`` with ``pass_loss="last"`` and K >= the longest document, at the FLOPs of one pass (its
    z-loss is this one pass's, where the Jacobi objective averages over K). The arguments are ``multipass_loss``'s."""
    plain = plain_positions(input_ids, plain_mask, bos_token_id, segment_ids, prefix_mixin, generator)
    logits = model.recurrence(input_ids, plain, segment_ids=segment_ids).logits
    term, pass_ce = _pass_term(logits, labels, 1.0, z_loss, ignore_index, label_count)
    return ObjectiveOutput(loss=term, pass_losses=[pass_ce])


class MultipassObjective(nn.Module):
    """``multipass_loss`` (or with ``options.sequential``, ``sequential_loss``) as a module's ``forward``, so that
    DDP sees the loss (DDP hooks ``__call__``) and FSDP's hooks run around each pass of the wrapped model."""

    def __init__(self, model: FullBandLM, options: LossOptions = LossOptions()):
        super().__init__()
        self.model, self.options = model, options

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        passes: int,
        plain_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        z_loss: float = 0.0,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        label_count: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        o = self.options
        if o.sequential:
            # The plain positions of the K-pass Jacobi step it replaces: a K >= 2 step draws the mixin prefix.
            return sequential_loss(self.model, input_ids, labels, z_loss=z_loss, plain_mask=plain_mask,
                                   segment_ids=segment_ids, prefix_mixin=o.prefix_mixin if passes > 1 else 0.0,
                                   generator=generator, label_count=label_count)
        return multipass_loss(self.model, input_ids, labels, passes, later_pass_weight=o.later_pass_weight,
                              pass_loss=o.pass_loss, z_loss=z_loss, backward_scale=o.backward_scale, detach=o.detach,
                              label_count=label_count, plain_mask=plain_mask, prefix_mixin=o.prefix_mixin,
                              generator=generator, segment_ids=segment_ids, grad_passes=o.grad_passes)

"""The GRPO objective (Shao et al. 2024, DeepSeekMath) with DAPO's options (Yu et al. 2025), on per-token
log-probabilities of rollouts (``fullband.rl.rollout_logprobs``).

For a prompt, G rollouts o_1..o_G with rewards r_1..r_G get the group-relative advantage
A_i = (r_i - mean(r)) / (std(r) + 1e-4) (``scale="none"``: r_i - mean(r), Dr. GRPO), the same for each token of o_i.
Token t of o_i has the ratio ρ = exp(log π(o_i,t) - log π_old(o_i,t)) to the policy that sampled it, and the loss

    ℓ_i,t = -min(ρ·A_i, clip(ρ, 1 - clip_low, 1 + clip_high)·A_i) + β·KL_i,t,
    KL_i,t = exp(log π_ref - log π) - (log π_ref - log π) - 1      (the k3 estimator, always >= 0)

averaged per rollout then over rollouts (``aggregation="sequence"``, GRPO) or over all tokens of the batch
(``"token"``, DAPO's token-level loss: long rollouts weigh by their length). DAPO's asymmetric clipping is
``clip_high > clip_low`` (0.28 against 0.2 in the paper); its dynamic sampling drops the groups whose rewards are all
equal (``informative_groups``): their advantages are 0, so they only dilute the batch. These are the formulas of
TRL's ``GRPOTrainer`` (loss types "grpo" and "dapo"; tests/test_rl.py checks them against it).

Rollouts sampled by another engine (vLLM) come from a slightly different distribution than the trainer's π_old.
``importance_weights`` is TRL's correction for it (``vllm_importance_sampling_mode``): per token
w = exp(log π_old - log π_sampler), or per rollout w = exp(Σ_t (log π_old - log π_sampler)) for every token of it;
"truncate" caps w at ``cap``, "mask" sets a w above ``cap`` to 0. ``grpo_loss`` multiplies each token's clipped
term by w before the KL term is added, as TRL does (tests/test_rl_vllm.py checks them against it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["AGGREGATIONS", "IS_CORRECTIONS", "REWARD_SCALES", "GRPOLoss", "grpo_loss", "group_advantages",
           "importance_weights", "informative_groups", "pad_rows"]

AGGREGATIONS = ("sequence", "token")
REWARD_SCALES = ("group", "none")
IS_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IS_CAP = 3.0  # TRL's vllm_importance_sampling_clip_max
STD_EPS = 1e-4  # TRL's: a group whose rewards barely differ does not get huge advantages


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one per rollout), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}: the rollouts of a "
                         "prompt must be consecutive, group_size of them per prompt")
    return rewards.view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """(N,) rewards of N / group_size prompts' consecutive rollouts -> (N,) advantages: the reward minus its group's
    mean, divided (``scale="group"``) by the group's standard deviation (unbiased, as TRL) + 1e-4."""
    if scale not in REWARD_SCALES:
        raise ValueError(f"unknown reward scale {scale!r}; choose one of {', '.join(REWARD_SCALES)}")
    groups = _groups(rewards, group_size).to(torch.float64)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale == "group":
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
        centred = centred / (std + STD_EPS)
    return centred.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N / group_size,) bool: the groups whose rewards are not all equal (DAPO's dynamic sampling keeps these)."""
    groups = _groups(rewards, group_size)
    return (groups != groups[:, :1]).any(dim=1)


def pad_rows(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged 1-D rows -> ((B, L) right-padded with 0, (B, L) bool mask of the real entries)."""
    if not rows:
        raise ValueError("no rows to pad")
    L = max(len(r) for r in rows)
    padded = torch.stack([torch.nn.functional.pad(r, (0, L - len(r))) for r in rows])
    mask = torch.arange(L, device=padded.device) < torch.tensor([len(r) for r in rows], device=padded.device)[:, None]
    return padded, mask


def importance_weights(old_logprobs: Sequence[torch.Tensor], sampling_logprobs: Sequence[torch.Tensor],
                       correction: str, cap: float = IS_CAP) -> torch.Tensor:
    """The importance weights of rollouts sampled by another engine (module doc): ``old_logprobs`` the trainer's
    log-probabilities of the sampled tokens (π_old), ``sampling_logprobs`` the sampler's, one 1-D tensor per rollout
    each. Returns (N, L) per-token weights (right-padded with 1) for the token corrections, (N, 1) per-rollout
    weights for the sequence ones, and for ``"none"`` the raw per-token ratios (what a correction would start
    from: the loss leaves them out)."""
    if correction not in IS_CORRECTIONS:
        raise ValueError(f"unknown importance-sampling correction {correction!r}; choose one of "
                         f"{', '.join(IS_CORRECTIONS)}")
    if len(old_logprobs) != len(sampling_logprobs) or any(
            len(o) != len(s) for o, s in zip(old_logprobs, sampling_logprobs)):
        raise ValueError("old_logprobs and sampling_logprobs must have one row per rollout, of equal lengths")
    old, mask = pad_rows([o.detach() for o in old_logprobs])
    sampling, _ = pad_rows([s.detach().to(old.dtype) for s in sampling_logprobs])
    log_ratio = (old - sampling) * mask
    if correction.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if correction.endswith("truncate"):
        return torch.clamp(ratio, max=cap)
    if correction.endswith("mask"):
        return ratio.masked_fill(ratio > cap, 0.0)
    return ratio


@dataclass
class GRPOLoss:
    loss: torch.Tensor  # the scalar to backpropagate
    kl: float | None  # mean per-token k3 KL to the reference (None without one)
    clip_fraction: float  # share of tokens whose ratio was clipped (where clipping changes the gradient)
    ratio_mean: float  # mean per-token ratio π / π_old (1 on the first update of a batch of rollouts)


def grpo_loss(
    logprobs: Sequence[torch.Tensor],
    old_logprobs: Sequence[torch.Tensor],
    advantages: torch.Tensor,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    aggregation: str = "sequence",
    is_weights: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> GRPOLoss:
    """The clipped GRPO loss (module doc) of ragged rollouts: ``logprobs`` (differentiable, one 1-D tensor per
    rollout), ``old_logprobs`` those of the sampling policy (no gradient), ``advantages`` (N,), ``ref_logprobs``
    those of the reference model (needed when ``kl_coef`` > 0), ``is_weights`` the importance weights of
    another engine's rollouts (``importance_weights``: (N, L) or (N, 1)), None for none.

    ``normalizer``: these rollouts are a micro-batch of a larger batch, and the loss is their share of its loss:
    their sum (of rollout means for "sequence", of token terms for "token") divided by ``normalizer``, the whole
    batch's rollout count ("sequence") or token count ("token"), so the micro-batches' losses (and gradients) add
    up to the batch's. None: these rollouts are the whole batch. The metrics are always these rollouts' own."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; choose one of {', '.join(AGGREGATIONS)}")
    if not (clip_low >= 0 and clip_high >= 0):
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low} and {clip_high}")
    if len(old_logprobs) != len(logprobs) or advantages.shape != (len(logprobs),):
        raise ValueError(f"{len(logprobs)} rollouts, {len(old_logprobs)} old log-probability rows and advantages of "
                         f"shape {tuple(advantages.shape)}: give one of each per rollout")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference model's log-probabilities)")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0 (the whole batch's rollout or token count), got {normalizer!r}")
    new, mask = pad_rows(logprobs)
    old, _ = pad_rows([o.detach().to(new.dtype) for o in old_logprobs])
    if old.shape != new.shape:
        raise ValueError("old_logprobs rows must have the lengths of the logprobs rows")
    if is_weights is not None and tuple(is_weights.shape) not in {tuple(new.shape), (new.shape[0], 1)}:
        raise ValueError(f"is_weights of shape {tuple(is_weights.shape)} for {tuple(new.shape)} padded rollouts: "
                         "give one weight per token (N, L) or per rollout (N, 1)")
    adv = advantages.to(device=new.device, dtype=new.dtype)[:, None]
    ratio = torch.exp(new - old)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(device=new.device, dtype=new.dtype)
    kl = None
    if ref_logprobs is not None:
        ref, _ = pad_rows([r.detach().to(new.dtype) for r in ref_logprobs])
        per_token_kl = torch.exp(ref - new) - (ref - new) - 1
        kl = float((per_token_kl.detach() * mask).sum() / mask.sum())
        if kl_coef:
            per_token = per_token + kl_coef * per_token_kl
    weights = mask.to(new.dtype)
    if aggregation == "sequence":
        per_rollout = (per_token * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        loss = per_rollout.mean() if normalizer is None else per_rollout.sum() / normalizer
    else:
        loss = (per_token * weights).sum() / (weights.sum().clamp(min=1) if normalizer is None else normalizer)
    was_clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
    # Counted exactly (not a float32 mean): the token-weighted mean of micro-batches' fractions is then the batch's.
    return GRPOLoss(loss=loss, kl=kl, clip_fraction=int((was_clipped & mask).sum()) / int(mask.sum()),
                    ratio_mean=float((ratio.detach() * weights).sum() / weights.sum()))

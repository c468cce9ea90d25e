"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from fullband.config import TrainConfig


def build_optimizers(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW for everything, or Muon for the 2-D matrices of the blocks and the fusion and AdamW for the rest; weight
    decay on matrices only. Each param group records its peak lr in ``initial_lr`` for the schedule."""
    matrices, others = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_hidden_matrix = param.ndim == 2 and not name.startswith("embed") and not name.startswith("lm_head")
        (matrices if is_hidden_matrix else others).append(param)
    adam_kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.adam_eps}
    if cfg.optimizer == "muon":
        muon = torch.optim.Muon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
        adam = torch.optim.AdamW(others, weight_decay=0.0, **adam_kwargs)
        optimizers = [muon, adam]
    else:
        decay = matrices + [p for p in others if p.ndim == 2]  # embeddings decay too
        no_decay = [p for p in others if p.ndim != 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizers = [torch.optim.AdamW([g for g in groups if g["params"]], **adam_kwargs)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


# wsd's decay: the fraction of the peak left at progress p in (0, 1] of the decay (train.decay_shape)
DECAY_SHAPES = {"linear": lambda p: 1 - p, "1-sqrt": lambda p: 1 - math.sqrt(p), "1-square": lambda p: 1 - p**2}


def lr_multiplier(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """Multiplier on the peak lr for 0-based ``step``: linear warmup, then wsd / cosine / constant."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.lr_schedule == "constant":
        return 1.0
    if cfg.lr_schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = _decay_start(total_steps, cfg)
    if step < decay_start:
        return 1.0
    progress = (step - decay_start + 1) / max(1, total_steps - decay_start)
    return floor + (1 - floor) * DECAY_SHAPES[cfg.decay_shape](progress)


def _decay_start(total_steps: int, cfg: TrainConfig) -> int:
    """First step of the wsd decay phase (the last ``decay_fraction`` of the steps)."""
    return total_steps - int(round(cfg.decay_fraction * total_steps))


def in_cooldown(step: int, total_steps: int, cfg: TrainConfig) -> bool:
    return cfg.lr_schedule == "wsd" and step >= _decay_start(total_steps, cfg)


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> float:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
    return optimizers[-1].param_groups[0]["lr"]

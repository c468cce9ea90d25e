"""Starting a run from another model's weights (``--init-from``): what happens to the fusion weights and
to a vocabulary that the fine-tuning tokenizer extends (fullband's chat tokens)."""

from __future__ import annotations

from pathlib import Path

import torch

from fullband.errors import ConfigError
from fullband.loading import trained_with_feedback

INIT_FUSION_CHOICES = ("auto", "keep", "reset")


def keeps_fusion(choice: str, model_dir: Path) -> bool:
    """train.init_fusion: "keep" the source's fusion weights (fine-tuning an FBT, e.g. instruction tuning),
    "reset" them (mid-training a standard checkpoint: the paper introduces feedback late), or "auto":
    keep them if the source was trained with feedback."""
    if choice not in INIT_FUSION_CHOICES:
        raise ConfigError(f"train.init_fusion={choice!r}: allowed values are {', '.join(INIT_FUSION_CHOICES)}")
    return choice == "keep" or (choice == "auto" and trained_with_feedback(model_dir))


def grow_vocabulary(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Embedding (and untied output) rows for tokens the source model does not have, e.g. chat tokens added
    for instruction tuning: each new row is the mean of the existing rows, so a new token starts as an
    average token instead of a random direction the tied output layer would favour or ignore arbitrarily."""
    grown = dict(state)
    for name in ("embed.weight", "lm_head.weight"):
        weight = state.get(name)
        if weight is None or weight.shape[0] >= vocab_size:
            continue
        extra = weight.float().mean(dim=0, keepdim=True).to(weight.dtype).expand(vocab_size - weight.shape[0], -1)
        grown[name] = torch.cat([weight, extra])
    return grown

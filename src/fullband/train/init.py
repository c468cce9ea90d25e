"""Starting a run from another model's weights (``--init-from``): its config, its fusion weights kept or fresh, and
a vocabulary that the fine-tuning tokenizer extends (fullband's chat tokens)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fullband.architectures import FBT, arch_of
from fullband.data import PreparedDataset, load_tokenizer
from fullband.errors import CheckpointError, ConfigError, DataError, FullbandError
from fullband.model import FullBandConfig, FullBandLM
from fullband.storage import ModelDir


def keeps_fusion(choice: str, model_dir: ModelDir) -> bool:
    """Whether train.init_fusion (checked by the config) keeps the source's fusion weights: "keep", or "auto" where
    the source was trained with feedback (its stored decode settings are not standard)."""
    return choice == "keep" or (choice == "auto" and model_dir.decode.mode != "standard")


def grow_vocabulary(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Embedding (and untied output) rows for tokens the source model does not have (chat tokens): each the mean of
    the existing rows, so a new token starts as an average token, not a random direction."""
    grown = dict(state)
    for name in ("embed.weight", "lm_head.weight"):
        weight = state.get(name)
        if weight is None or weight.shape[0] >= vocab_size:
            continue
        extra = weight.float().mean(dim=0, keepdim=True).to(weight.dtype).expand(vocab_size - weight.shape[0], -1)
        grown[name] = torch.cat([weight, extra])
    return grown


# Fields a mid-training run may set differently from the checkpoint it starts from.
FEEDBACK_FIELDS = ("fusion", "fusion_init", "feedback_source", "feedback_jitter")


def init_config(model_dir: ModelDir, model_cfg: Any, dataset: PreparedDataset, keep_fusion: bool,
                data_dir: Path) -> FullBandConfig:
    """The config of a run that starts from ``model_dir``'s weights: the source's, with this run's jitter (and,
    when the fusion starts fresh, this run's fusion fields), and room for the tokens the data's tokenizer adds."""
    other = next((arch for arch in (arch_of(model_cfg), arch_of(model_dir.config)) if arch != FBT), None)
    if other is not None:
        raise ConfigError("--init-from continues a transformer's weights (mid-training, fine-tuning); a "
                          f"recurrent baseline (model.arch {other}) trains from scratch here: drop --init-from")
    base = model_dir.config.to_dict()
    # Kept fusion weights keep their kind; only the training jitter comes from this run's config.
    base.update({k: getattr(model_cfg, k) for k in (("feedback_jitter",) if keep_fusion else FEEDBACK_FIELDS)})
    if tokenizer_extends(model_dir, dataset, data_dir):
        base["vocab_size"] = max(base["vocab_size"], dataset.vocab_size)  # e.g. chat tokens added
    return FullBandConfig.from_dict(base)


def tokenizer_extends(model_dir: ModelDir, dataset: PreparedDataset, data_dir: Path) -> bool:
    """Whether the data's tokenizer extends the model's (chat tokens added); raises if it is another one."""
    tokenizer_dir = model_dir.tokenizer
    if tokenizer_dir is None:
        return False
    try:
        theirs = load_tokenizer(tokenizer_dir).fingerprint()
    except FullbandError:
        return False  # a tokenizer format fullband cannot read: the vocabulary-size check still applies
    if theirs == dataset.tokenizer.base_fingerprint:
        return True
    if theirs != dataset.tokenizer.fingerprint():
        raise DataError(
            f"tokenizer mismatch: {model_dir.path} was trained with the tokenizer in {tokenizer_dir}, but "
            f"the data in {data_dir} was prepared with another one. Prepare the data with "
            f"--data.tokenizer {tokenizer_dir} (and a fresh --data-dir)."
        )
    return False


def load_init_weights(model: FullBandLM, model_dir: ModelDir, keep_fusion: bool, seed: int,
                      log: Callable[[str], None]) -> None:
    """``model_dir``'s weights into ``model``: the fusion's too when kept, else the fusion freshly initialised (the
    paper introduces feedback late in training)."""
    state = grow_vocabulary(model_dir.read_weights(), model.config.vocab_size)
    if not keep_fusion:
        state = {k: v for k, v in state.items() if not k.startswith("fusion.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if keep_fusion or not k.startswith("fusion.")]
    if missing or unexpected:
        raise CheckpointError(
            f"--init-from {model_dir.path}: weights do not fit: missing {missing}, unexpected {unexpected}"
        )
    if keep_fusion:
        log(f"initialised from {model_dir.path}, fusion weights included (train.init_fusion)")
        return
    torch.manual_seed(seed + 1)
    model.reset_fusion_parameters()
    log(f"initialised from {model_dir.path}; fusion weights freshly initialised")

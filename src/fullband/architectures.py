"""The registry of model kinds (``model.arch``): which config and class a run's model section or a model
directory's config.json names. The full-bandwidth transformer is ``fbt`` (``fullband.model``); the recurrent
baselines register from ``fullband.baselines``. Everything that builds or loads a model by its config goes
through here, so a baseline's checkpoint loads as what it is at every door, and a door built on the
transformer's KV cache or feedback refuses the others by name (``refuse_arch``).

A kind's class offers what the trainer, the decode loop, bench and storage call: ``forward``, ``prefill``,
``iterate_passes``, ``new_cache``, ``save_pretrained``, ``from_weights``, ``has_feedback`` (whether soft and fused
decoding, Jacobi passes and the exact schedule apply), ``no_feedback`` (the refusal when they do not) and
``config`` with ``vocab_size``, ``n_layers`` and ``max_seq_len``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fullband.baselines import MODELS as BASELINES
from fullband.baselines import BaselineConfig, RecurrentCache, RecurrentLM
from fullband.errors import FullbandError
from fullband.kv_cache import KVCache
from fullband.model import CONFIG_NAME, WEIGHTS_NAME, FullBandConfig, FullBandLM, read_config_file, read_decode_defaults
from fullband.storage import dcp_dir_of, read_model_weights

FBT = "fbt"
LanguageModel = FullBandLM | RecurrentLM
ModelConfig = FullBandConfig | BaselineConfig
ModelCache = KVCache | RecurrentCache  # what new_cache returns
CLASSES: dict[str, type[LanguageModel]] = {FBT: FullBandLM, **BASELINES}


def config_class(arch: str) -> type[ModelConfig]:
    """The config dataclass of ``arch`` (ValueError naming the known kinds for another)."""
    if arch not in CLASSES:
        raise ValueError(f"model.arch={arch!r}: allowed values: {', '.join(CLASSES)}")
    return FullBandConfig if arch == FBT else BaselineConfig


def model_class(arch: str) -> type[LanguageModel]:
    config_class(arch)
    return CLASSES[arch]


def arch_of(config: ModelConfig) -> str:
    return config.arch if isinstance(config, BaselineConfig) else FBT


def config_fields(arch: str, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config.json or a run's model section) as the fields of ``arch``'s config. Files written while
    every kind shared one config record ``arch`` and ``householder_steps: null`` for a transformer too; those two
    carry nothing for it."""
    fields = dict(data)
    if arch == FBT:
        fields.pop("arch", None)
        if fields.get("householder_steps", 0) is None:
            del fields["householder_steps"]
    else:
        fields["arch"] = arch
    return fields


def config_from_dict(data: Any, source: str) -> ModelConfig:
    """The config a config.json's contents describe, of the class its ``arch`` names (``fbt`` when none)."""
    arch = data.get("arch", FBT) if isinstance(data, dict) else None
    if arch not in CLASSES:
        raise ValueError(f"{source} names arch {arch!r}; this version of fullband knows {', '.join(CLASSES)}")
    return config_class(arch).from_dict(config_fields(arch, data))


def build_model(config: ModelConfig) -> LanguageModel:
    """A freshly initialised model of ``config``'s kind."""
    return CLASSES[arch_of(config)](config)


def stored_arch(directory: str | os.PathLike) -> str:
    """The arch a model directory's config.json records ("fbt" when it names none)."""
    try:
        return json.loads((Path(directory) / CONFIG_NAME).read_text()).get("arch", FBT)
    except (OSError, ValueError, AttributeError):
        return FBT  # loading then reports what is wrong with the directory


def load_pretrained(
    directory: str | os.PathLike, device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> LanguageModel:
    """``save_pretrained``'s directory, or a DCP checkpoint's ``model/`` (its shards consolidated in this process),
    back as the class its config records. config.json is read once, the weights' headers are checked against their
    sizes before they are read, and the model is built on the meta device around the weights (no random
    initialisation to overwrite)."""
    directory = Path(directory)
    config = config_from_dict(read_config_file(directory), str(directory / CONFIG_NAME))
    if dcp_dir_of(directory) is None and not (directory / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{directory} is not a fullband model directory: {WEIGHTS_NAME} is missing")
    model = CLASSES[arch_of(config)].from_weights(config, read_model_weights(directory), device, dtype,
                                                  source=str(directory))
    model.decode_defaults = read_decode_defaults(directory)
    return model


def refuse_arch(model: LanguageModel, door: str) -> None:
    """For the doors built on the transformer's KV cache or feedback only: a clear error naming the arch."""
    if not isinstance(model, FullBandLM):
        raise FullbandError(f"{door} supports model.arch fbt only; this model is arch {arch_of(model.config)!r} "
                            "(use fullband generate or fullband bench with it)")

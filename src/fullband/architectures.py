"""The registry of model kinds (``model.arch``): the full-bandwidth transformer ``fbt`` and the recurrent baselines.
Everything that builds or loads a model by its config goes through here, so a baseline loads as what it is at every
door, and a door built on the transformer's KV cache or feedback refuses the others by name (``refuse_arch``)."""

from __future__ import annotations

from typing import Any

from fullband.baselines import MODELS as BASELINES
from fullband.baselines import BaselineConfig, RecurrentCache, RecurrentLM
from fullband.errors import FullbandError
from fullband.kv_cache import KVCache
from fullband.model import FullBandConfig, FullBandLM

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


def config_from_dict(data: Any, source: str) -> ModelConfig:
    """The config a config.json's contents describe, of the class its ``arch`` names (``fbt`` when none)."""
    arch = data.get("arch", FBT) if isinstance(data, dict) else None
    if arch not in CLASSES:
        raise ValueError(f"{source} names arch {arch!r}; this version of fullband knows {', '.join(CLASSES)}")
    return config_class(arch).from_dict(data)


def build_model(config: ModelConfig) -> LanguageModel:
    """A freshly initialised model of ``config``'s kind."""
    return CLASSES[arch_of(config)](config)


def refuse_arch(model: LanguageModel, door: str) -> None:
    """For the doors built on the transformer's KV cache or feedback only: a clear error naming the arch."""
    if not isinstance(model, FullBandLM):
        raise FullbandError(f"{door} supports model.arch fbt only; this model is arch {arch_of(model.config)!r} "
                            "(use fullband generate or fullband bench with it)")

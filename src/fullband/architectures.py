"""The model kinds of ``model.arch`` (FullBandConfig.arch): which class a config builds and a model directory
loads. Everything that builds or loads a model by its config goes through here, so an LSTM or DeltaProduct run's
checkpoint loads as what it is at every door."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fullband.deltaproduct import DeltaProductLM
from fullband.errors import FullbandError
from fullband.model import CONFIG_NAME, DECODE_DEFAULTS_NAME, WEIGHTS_NAME, FullBandConfig, FullBandLM
from fullband.recurrent import LSTMLM
from fullband.storage import dcp_dir_of, read_model_weights

LanguageModel = FullBandLM | LSTMLM | DeltaProductLM
CLASSES: dict[str, type[LanguageModel]] = {"fbt": FullBandLM, "lstm": LSTMLM, "deltaproduct": DeltaProductLM}


def build_model(config: FullBandConfig) -> LanguageModel:
    """A freshly initialised model of ``config.arch``."""
    return CLASSES[config.arch](config)


def stored_arch(directory: str | os.PathLike) -> str:
    """The arch a model directory's config.json records ("fbt" when it names none)."""
    try:
        return json.loads((Path(directory) / CONFIG_NAME).read_text()).get("arch", "fbt")
    except (OSError, ValueError, AttributeError):
        return "fbt"  # FullBandLM.from_pretrained then reports what is wrong with the directory


def load_pretrained(
    directory: str | os.PathLike, device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> LanguageModel:
    """``save_pretrained``'s directory, or a DCP checkpoint's ``model/`` (its shards consolidated in this process),
    back as the class its config records. config.json is read once, the weights' headers are checked against their
    sizes before they are read, and the model is built on the meta device around the weights (no random
    initialisation to overwrite)."""
    directory = Path(directory)
    config_file = directory / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} is not a fullband model directory: {CONFIG_NAME} is missing "
                                "(expected config.json and model.safetensors written by save_pretrained)")
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file} is unreadable: {exc}") from None
    arch = data.get("arch", "fbt") if isinstance(data, dict) else None
    if arch not in CLASSES:
        raise ValueError(f"{config_file} names arch {arch!r}; this version of fullband knows {', '.join(CLASSES)}")
    config = FullBandConfig.from_dict(data)
    if dcp_dir_of(directory) is None and not (directory / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{directory} is not a fullband model directory: {WEIGHTS_NAME} is missing")
    model = CLASSES[arch].from_weights(config, read_model_weights(directory), device, dtype, source=str(directory))
    defaults = directory / DECODE_DEFAULTS_NAME
    if defaults.is_file():
        try:
            model.decode_defaults = json.loads(defaults.read_text())
        except ValueError as exc:
            raise ValueError(f"{defaults} is unreadable: {exc}") from None
    return model


def refuse_arch(model: LanguageModel, door: str) -> None:
    """For the doors built on the transformer's KV cache or feedback only: a clear error naming the arch."""
    if model.config.arch != "fbt":
        raise FullbandError(f"{door} supports model.arch fbt only; this model is arch {model.config.arch!r} "
                         "(use fullband generate or fullband bench with it)")

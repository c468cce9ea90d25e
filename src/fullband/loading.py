"""A model with its tokenizer, presets, and the dataset a checkpoint was trained on: the inference doors' side of
``fullband.storage.ModelDir``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fullband.architectures import LanguageModel
from fullband.data import PreparedDataset, Tokenizer, load_tokenizer, open_dataset
from fullband.errors import FullbandError
from fullband.storage import ModelDir

PRESET_DIR = Path(__file__).parent / "configs"


def preset_path(name: str | Path) -> Path:
    """A YAML path as given, or the bundled preset of that name (``cpu``, ``paper-1b``, ...)."""
    path = Path(name)
    if not path.exists() and (PRESET_DIR / f"{name}.yaml").is_file():
        return PRESET_DIR / f"{name}.yaml"
    return path


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


DTYPES = ("float32", "bfloat16", "float16", "float64")  # what --dtype and lm-eval's dtype= take


def load_model(model: str | os.PathLike | ModelDir, device: str | None = None, dtype: torch.dtype | None = None
               ) -> tuple[LanguageModel, Tokenizer]:
    """(model in eval mode, its tokenizer) from any path ``ModelDir.open`` takes, or an opened ``ModelDir``; in
    ``dtype``, default the one its weights are stored in. An export loads back into fullband's own model, so
    every decode mode behaves exactly as for the original."""
    model_dir = model if isinstance(model, ModelDir) else ModelDir.open(model)
    if model_dir.tokenizer is None:
        raise FullbandError(f"no tokenizer saved with {model_dir.path} (expected {model_dir.path / 'tokenizer'})")
    return model_dir.load(device or default_device(), dtype), load_tokenizer(model_dir.tokenizer)


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a prompt, with the tokenizer's BOS token first when it has one."""
    ids = tokenizer.encode(text)
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids


def default_data_dir(model_dir: ModelDir) -> Path:
    """The dataset a training checkpoint (or a run's best model) was trained on, as recorded in its trainer
    state (best.json), else RUN/data."""
    recorded = None
    for state in ("trainer_state.json", "best.json"):
        try:
            recorded = recorded or json.loads((model_dir.path.parent / state).read_text()).get("data_dir")
        except (OSError, ValueError, AttributeError):
            pass
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    return model_dir.run.data if model_dir.run is not None else model_dir.path / "data"


def load_model_and_data(checkpoint: str | Path, data_dir: str | Path | None = None, device: str | None = None,
                        dtype: torch.dtype | None = None) -> tuple[LanguageModel, PreparedDataset, Path, Path]:
    """A checkpoint and the prepared dataset to evaluate it on (by default the one it was trained on),
    refused when the data was tokenized differently. Returns (model, dataset, model_dir, data_dir)."""
    model_dir = ModelDir.open(checkpoint)
    data_dir = Path(data_dir) if data_dir else default_data_dir(model_dir)
    dataset = open_dataset(data_dir)
    if (model_dir.tokenizer is not None
            and load_tokenizer(model_dir.tokenizer).fingerprint() != dataset.tokenizer.fingerprint()):
        raise FullbandError(f"the data in {data_dir} was prepared with another tokenizer than {model_dir.path}'s")
    return model_dir.load(device or default_device(), dtype), dataset, model_dir.path, data_dir

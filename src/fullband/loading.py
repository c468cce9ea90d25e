"""Finding things on disk: presets, models with their tokenizers, the dataset a checkpoint was trained on.

Shared by the command line, the demo, the evaluation tools and the server, so that "a run directory, a
checkpoint or a model directory" means the same everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from fullband.errors import FullbandError

if TYPE_CHECKING:
    import torch

    from fullband.data import Tokenizer
    from fullband.model import FullBandLM

PRESET_DIR = Path(__file__).parent / "configs"


def preset_path(name: str | Path) -> Path:
    """A YAML path as given, or the bundled preset of that name (``cpu``, ``paper-1b``, ...)."""
    path = Path(name)
    if not path.exists() and (PRESET_DIR / f"{name}.yaml").is_file():
        return PRESET_DIR / f"{name}.yaml"
    return path


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    path: str | Path, device: str | None = None, dtype: torch.dtype | None = None
) -> tuple[FullBandLM, Tokenizer]:
    """A run directory (its newest valid checkpoint), a checkpoint or a model directory -> (model in
    eval mode, its tokenizer)."""
    from fullband.data import load_tokenizer
    from fullband.model import FullBandLM
    from fullband.train.checkpoint import find_tokenizer_dir, resolve_model_dir

    model_dir = resolve_model_dir(path)
    tokenizer_dir = find_tokenizer_dir(model_dir)
    if tokenizer_dir is None:
        raise FullbandError(f"no tokenizer saved with {model_dir} (expected {model_dir / 'tokenizer'})")
    model = FullBandLM.from_pretrained(model_dir, device=device or default_device(), dtype=dtype)
    return model.eval(), load_tokenizer(tokenizer_dir)


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a prompt, with the tokenizer's BOS token first when it has one."""
    ids = tokenizer.encode(text)
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids


def default_data_dir(model_dir: Path) -> Path:
    """The dataset a training checkpoint was trained on (recorded in its trainer state), else RUN/data."""
    try:
        recorded = json.loads((model_dir.parent / "trainer_state.json").read_text()).get("data_dir")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    return model_dir.parent.parent.parent / "data"

"""Finding things on disk: presets, models with their tokenizers, the dataset a checkpoint was trained on.

Shared by the command line, the demo, the evaluation tools and the server, so that "a run directory, a
checkpoint or a model directory" means the same everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fullband.architectures import LanguageModel, config_from_dict, load_pretrained
from fullband.data import PreparedDataset, Tokenizer, load_tokenizer, open_dataset
from fullband.decoding import DecodeSettings
from fullband.errors import ConfigError, FullbandError
from fullband.model import DECODE_DEFAULTS_NAME, DEFAULT_FUSED_MAX_PASSES, FullBandLM
from fullband.schedule import PassSchedule
from fullband.storage import RunDir, find_tokenizer_dir, read_safetensors, resolve_model_dir

if TYPE_CHECKING:
    import torch


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
) -> tuple[LanguageModel, Tokenizer]:
    """(model in eval mode, its tokenizer) from a run directory (its newest valid checkpoint), a
    checkpoint, a model directory, or a Hugging Face export written by ``fullband export-hf`` (loaded
    back into fullband's own model, so every decode mode behaves exactly as for the original)."""

    exported = _exported_config(Path(path))
    if exported is not None:
        return _load_hf_export(Path(path), exported, device or default_device(), dtype)
    model_dir = resolve_model_dir(path)
    tokenizer_dir = find_tokenizer_dir(model_dir)
    if tokenizer_dir is None:
        raise FullbandError(f"no tokenizer saved with {model_dir} (expected {model_dir / 'tokenizer'})")
    model = load_pretrained(model_dir, device=device or default_device(), dtype=dtype)
    fill_decode_defaults(model, model_dir)
    return model.eval(), load_tokenizer(tokenizer_dir)


def fill_decode_defaults(model: LanguageModel, model_dir: Path) -> None:
    """A run's model saved before decode settings were stored with the weights gets the settings its run's
    train.schedule implies (as the trainer now stores them); a model of no run keeps standard."""
    if not model.decode_defaults:
        settings = run_decode_settings(RunDir.of(model_dir), model.config.max_seq_len)
        if settings is not None:
            settings.store_in(model)


def run_decode_settings(run: RunDir | None, max_seq_len: int) -> DecodeSettings | None:
    """The decode settings a run's train.schedule implies (None: no run, or a schedule fullband does not know)."""
    schedule = run.config_section("train").get("schedule") if run is not None else None
    if schedule is None:
        return None
    try:
        return DecodeSettings.trained_with(PassSchedule.parse(schedule), max_seq_len)
    except ConfigError:
        return None  # a schedule fullband does not know: standard, the safe mode for any model


def trained_with_feedback(model_dir: Path) -> bool:
    """Whether the model in ``model_dir`` was trained with feedback: the decode settings stored with it (or, for a
    model saved before they were stored, those its run implies) decode in a feedback mode. The one answer every
    door and ``train.init_fusion auto`` read; a model of no run without stored settings (a conversion) has none."""
    if (model_dir / DECODE_DEFAULTS_NAME).is_file():
        stored = DecodeSettings.from_dict(json.loads((model_dir / DECODE_DEFAULTS_NAME).read_text()),
                                          str(model_dir / DECODE_DEFAULTS_NAME))
    else:
        stored = run_decode_settings(RunDir.of(model_dir), DEFAULT_FUSED_MAX_PASSES)
    return stored is not None and stored.mode != "standard"


def run_dir_of(path: str | Path) -> Path | None:
    """The training run a run directory, checkpoint (RUN/checkpoints/STEP/model) or best model (RUN/best/model,
    ``train.keep_best``) belongs to, else None."""
    if _exported_config(Path(path)) is not None:
        return None
    run = RunDir.of(resolve_model_dir(path))
    return run.path if run is not None else None


def run_config_section(run_dir: Path | None, section: str) -> dict[str, Any]:
    """One section of the config.yaml of the run the model was trained in ({} if unknown or unreadable)."""
    return RunDir(run_dir).config_section(section) if run_dir is not None else {}


def _exported_config(path: Path) -> dict | None:
    """An ``export-hf`` directory's config.json (the fullband config under "fullband", the decode defaults
    at the top level), or None for anything else."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise FullbandError(f"{config_file} is unreadable: {exc}") from None
    if data.get("model_type") == "fullband" and isinstance(data.get("fullband"), dict):
        return data
    return None


def _load_hf_export(path: Path, hf_config: dict, device: str, dtype: torch.dtype | None
                    ) -> tuple[FullBandLM, Tokenizer]:
    # The export's weights are the model's own tensors under the "model." prefix (sharded or not).
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FullbandError(f"{path} has a fullband config.json but no model.safetensors")
    if not (path / "tokenizer.json").is_file():
        raise FullbandError(f"{path} holds no tokenizer.json: re-export it with this version of fullband "
                            "(`fullband export-hf`), or load the model directory it was exported from")
    state = {}
    for name in files:
        state.update(read_safetensors(path / name))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    stored = next(iter(state.values())).dtype
    try:
        config = config_from_dict(hf_config["fullband"], f"{path / 'config.json'}")
        model = FullBandLM.from_weights(config, state, device, dtype or stored, source=str(path))
    except ValueError as exc:
        raise FullbandError(str(exc)) from None
    # The export's decode defaults (its generate()'s) are this model's: the same settings at every door.
    DecodeSettings.from_dict(hf_config, f"{path / 'config.json'}").store_in(model)
    return model.eval(), load_tokenizer(path)


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a prompt, with the tokenizer's BOS token first when it has one."""
    ids = tokenizer.encode(text)
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids


def default_data_dir(model_dir: Path) -> Path:
    """The dataset a training checkpoint (or a run's best model) was trained on, as recorded in its trainer
    state (best.json), else RUN/data."""
    recorded = None
    for state in ("trainer_state.json", "best.json"):
        try:
            recorded = recorded or json.loads((model_dir.parent / state).read_text()).get("data_dir")
        except (OSError, ValueError, AttributeError):
            pass
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    run = RunDir.of(model_dir)
    return run.data if run is not None else model_dir / "data"


def load_model_and_data(
    checkpoint: str | Path, data_dir: str | Path | None = None, device: str | None = None
) -> tuple[LanguageModel, PreparedDataset, Path, Path]:
    """A checkpoint and the prepared dataset to evaluate it on (by default the one it was trained on),
    refused when the data was tokenized differently. Returns (model, dataset, model_dir, data_dir)."""

    model_dir = resolve_model_dir(checkpoint)
    data_dir = Path(data_dir) if data_dir else default_data_dir(model_dir)
    dataset = open_dataset(data_dir)
    tokenizer_dir = find_tokenizer_dir(model_dir)
    if tokenizer_dir is not None and load_tokenizer(tokenizer_dir).fingerprint() != dataset.tokenizer.fingerprint():
        raise FullbandError(f"the data in {data_dir} was prepared with another tokenizer than {model_dir}'s")
    model = load_pretrained(model_dir, device=device or default_device())
    return model, dataset, model_dir, data_dir

"""Model directories and training checkpoints on disk: finding, verifying, opening and writing them. Every door
that opens a model goes through ``ModelDir``; the layouts are in docs/checkpoints.md."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fullband.architectures import LanguageModel, ModelConfig, arch_of, config_from_dict, model_class
from fullband.decoding import DECODE_SETTINGS_NAME, DecodeSettings
from fullband.errors import CheckpointError
from fullband.files import file_problem
from fullband.model import CONFIG_NAME, WEIGHTS_NAME, write_weights

MANIFEST = "manifest.json"
PREFIX = "step_"
BEST = "best"
DCP_DIR = "dcp"  # a DCP checkpoint's shards, beside its model/ directory
MODEL_KEY = "model"  # the model's entry in a DCP checkpoint's state dict ({"model": ..., "optimizer": ...})


@dataclass(frozen=True)
class RunDir:
    """A training run's directory, the one place its layout is spelled out (docs/checkpoints.md)."""

    path: Path
    CONFIG: ClassVar[str] = "config.yaml"

    @classmethod
    def of(cls, model_dir: str | os.PathLike) -> RunDir | None:
        """The run a checkpoint's (RUN/checkpoints/STEP/model) or best model's (RUN/best/model) model directory
        belongs to, else None (a model directory of no run: a conversion, a save_pretrained copy, an export)."""
        model_dir = Path(model_dir)
        if model_dir.name != MODEL_KEY or len(model_dir.parents) < 3:
            return None
        if model_dir.parents[1].name == "checkpoints":
            return cls(model_dir.parents[2])
        if model_dir.parent.name == BEST and (model_dir.parents[1] / cls.CONFIG).is_file():
            return cls(model_dir.parents[1])
        return None

    @property
    def config_file(self) -> Path:
        return self.path / self.CONFIG

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def best(self) -> Path:
        return self.path / BEST

    @property
    def tokenizer(self) -> Path:
        return self.path / "tokenizer"

    @property
    def data(self) -> Path:
        return self.path / "data"

    def config_section(self, section: str) -> dict[str, Any]:
        """One section of the run's config.yaml ({} if it is missing or unreadable)."""
        try:
            values = (yaml.safe_load(self.config_file.read_text()) or {}).get(section) or {}
        except (OSError, yaml.YAMLError, AttributeError):
            return {}
        return values if isinstance(values, dict) else {}


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoint directories (renamed into place), oldest first."""
    root = RunDir(Path(run_dir)).checkpoints
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def verify_checkpoint(path: Path, hashes: bool = True) -> None:
    """Raise CheckpointError unless every file in the manifest is present with its size and (``hashes``) its sha256;
    without hashes no file is read, as loading a model for inference wants."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it was not completely written")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({exc})") from None
    for name, record in files.items():
        problem = file_problem(path / name, record, hashes, name)
        if problem:
            raise CheckpointError(f"checkpoint {path}: {problem}")


def latest_valid_checkpoint(run_dir: Path, hashes: bool = True) -> Path | None:
    """The newest checkpoint that verifies (``verify_checkpoint``); corrupt ones are reported on stderr and
    skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path, hashes)
            return path
        except CheckpointError as exc:
            print(f"warning: skipping {exc}", file=sys.stderr)
    return None


def read_best(run_dir: Path) -> dict[str, Any] | None:
    """best.json of ``RUN/best/`` if it is complete (verified), else None."""
    path = RunDir(Path(run_dir)).best
    if not path.is_dir():
        return None
    try:
        verify_checkpoint(path)
        return json.loads((path / "best.json").read_text())
    except (CheckpointError, OSError, json.JSONDecodeError):
        return None


def verify(path: str | os.PathLike) -> list[Path]:
    """``fullband verify``: the sha256 of every file of every checkpoint of a run directory (and of ``best/``), or of
    one checkpoint. Returns the checkpoints that verify; raises CheckpointError naming every one that does not."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / MANIFEST).is_file() or (path / "model" / "config.json").is_file():
        checkpoints = [path]
    else:
        best = RunDir(path).best
        checkpoints = list_checkpoints(path) + ([best] if best.is_dir() else [])
        if not checkpoints:
            raise CheckpointError(f"{path} is neither a checkpoint (manifest.json) nor a run directory with "
                                  "checkpoints/ or best/")
    good, bad = [], []
    for checkpoint in checkpoints:
        try:
            verify_checkpoint(checkpoint)
            good.append(checkpoint)
        except CheckpointError as exc:
            bad.append(str(exc))
    if bad:
        raise CheckpointError("\n".join(bad))
    return good


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a truncated or damaged one is refused with its name and the reason."""
    try:
        return load_file(str(file))
    except SafetensorError as exc:
        raise CheckpointError(f"{file} is unreadable or truncated: {exc}") from None


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """Without DCP's warning that it assumes a single process, which is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def checkpoint_format(path: Path) -> str:
    """'dcp' for a checkpoint whose weights and optimizer state are DCP shards, else 'full'."""
    return "dcp" if (Path(path) / DCP_DIR).is_dir() else "full"


def read_dcp_model(shards: Path) -> dict[str, torch.Tensor]:
    """The ``model.*`` entries of a DCP checkpoint's shards as full tensors on the CPU, consolidated in this process
    whatever the world size that wrote them (no process group needed, the optimizer state is not read)."""
    try:
        reader = FileSystemReader(str(shards))
        entries = reader.read_metadata().state_dict_metadata
        prefix = MODEL_KEY + "."
        # Empty tensors of the global shapes, filled by DCP from whichever shards hold their pieces.
        state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in entries.items()
                 if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
        if not state:
            raise CheckpointError(f"{shards} holds no model weights (no '{prefix}*' entries)")
        with single_process_dcp():
            dcp_load(state, storage_reader=reader, no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # DCP raises CheckpointException, OSError, pickle errors for damaged shards
        raise CheckpointError(f"cannot read the model weights from the DCP shards in {shards}: {exc}") from None
    return {key.removeprefix(prefix): tensor for key, tensor in state.items()}


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from None


@dataclass(frozen=True)
class ModelDir:
    """A model on disk, opened once from whatever path a user gives (a run directory, checkpoint, ``best/``, model
    directory, DCP checkpoint or ``export-hf`` directory): what every door needs before the weights, which
    ``read_weights`` and ``load`` read."""

    path: Path  # the directory holding config.json
    config: ModelConfig
    decode: DecodeSettings  # stored with the weights; standard where none are (a fresh or converted model)
    tokenizer: Path | None  # MODEL/tokenizer, else the run's tokenizer/; an export holds its own tokenizer.json
    run: RunDir | None  # the training run of a checkpoint or best/ model
    weight_files: tuple[Path, ...]  # safetensors files (an export's may be sharded); none in a DCP checkpoint
    shards: Path | None = None  # a DCP checkpoint's shards, which hold its weights
    prefix: str = ""  # the weights' name prefix in the files ("model." in an export)

    @classmethod
    def open(cls, path: str | os.PathLike, hashes: bool = False) -> ModelDir:
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"{path} does not exist")
        if not (path / CONFIG_NAME).is_file():
            path = _model_dir_in(path, hashes)
        data = read_json(path / CONFIG_NAME)
        if not isinstance(data, dict):
            raise CheckpointError(f"{path / CONFIG_NAME}: expected a JSON object")
        if data.get("model_type") == "fullband" and isinstance(data.get("fullband"), dict):
            return cls._export(path, data)
        shards = path.parent / DCP_DIR
        if (path / WEIGHTS_NAME).is_file() or path.name != MODEL_KEY or not (shards / ".metadata").is_file():
            shards = None
        if shards is None and not (path / WEIGHTS_NAME).is_file():
            raise CheckpointError(f"{path} is not a fullband model directory: {WEIGHTS_NAME} is missing")
        decode_file = path / DECODE_SETTINGS_NAME
        decode = (DecodeSettings.from_dict(read_json(decode_file), str(decode_file)) if decode_file.is_file()
                  else DecodeSettings())
        run = RunDir.of(path)
        tokenizer = next((d for d in (path / "tokenizer", run.tokenizer if run else None) if d and d.is_dir()), None)
        return cls(path, _config(data, path), decode, tokenizer, run,
                   () if shards is not None else (path / WEIGHTS_NAME,), shards)

    @classmethod
    def _export(cls, path: Path, data: dict[str, Any]) -> ModelDir:
        """An ``export-hf`` directory: the fullband config under "fullband", the decode settings in its
        generation_config.json (``DecodeSettings.of_export``), the weights under the "model." prefix, sharded or not."""
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = tuple(path / name for name in sorted(set(read_json(index)["weight_map"].values())))
        elif (path / WEIGHTS_NAME).is_file():
            files = (path / WEIGHTS_NAME,)
        else:
            raise CheckpointError(f"{path} has a fullband config.json but no {WEIGHTS_NAME}")
        if not (path / "tokenizer.json").is_file():
            raise CheckpointError(f"{path} holds no tokenizer.json: re-export it with this version of fullband "
                                  "(`fullband export-hf`), or load the model directory it was exported from")
        generation = read_json(path / DECODE_SETTINGS_NAME) if (path / DECODE_SETTINGS_NAME).is_file() else {}
        decode = DecodeSettings.of_export(generation, data, f"{path}'s decode settings")
        return cls(path, _config(data["fullband"], path), decode, path, None, files, prefix="model.")

    def read_weights(self) -> dict[str, torch.Tensor]:
        """The model's full tensors on the CPU, by their names in the model."""
        if self.shards is not None:
            return read_dcp_model(self.shards)
        state = {}
        for file in self.weight_files:
            state.update(read_safetensors(file))
        return {key.removeprefix(self.prefix): value for key, value in state.items()} if self.prefix else state

    def load(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> LanguageModel:
        """The model, in eval mode, on ``device`` (default: the CPU) in ``dtype`` (default: the dtype its weights
        are stored in), with its stored decode settings; built on the meta device around the weights."""
        state = self.read_weights()
        stored = next((v.dtype for v in state.values() if v.is_floating_point()), None)
        try:
            model = model_class(arch_of(self.config)).from_weights(self.config, state, device, dtype or stored,
                                                                   source=str(self.path))
        except ValueError as exc:  # weights that do not match the config
            raise CheckpointError(str(exc)) from None
        model.decode_settings = self.decode
        return model.eval()


def _model_dir_in(path: Path, hashes: bool) -> Path:
    """The model directory of a checkpoint (or best/) or of a run directory's newest valid checkpoint."""
    if (path / MODEL_KEY / CONFIG_NAME).is_file():
        verify_checkpoint(path, hashes)
        return path / MODEL_KEY
    if RunDir(path).checkpoints.is_dir():
        latest = latest_valid_checkpoint(path, hashes)
        if latest is None:
            raise CheckpointError(f"run directory {path} has no complete checkpoint")
        return latest / MODEL_KEY
    raise CheckpointError(f"{path} is neither a model directory (config.json + model.safetensors), a checkpoint "
                          "(model/ + manifest.json) nor a run directory (checkpoints/)")


def _config(data: Any, path: Path) -> ModelConfig:
    try:
        return config_from_dict(data, str(path / CONFIG_NAME))
    except ValueError as exc:  # a field or value this version of fullband does not know
        raise CheckpointError(f"{path / CONFIG_NAME}: {exc}") from None


def load_pretrained(path: str | os.PathLike, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None) -> LanguageModel:
    """The model alone: ``ModelDir.open(path).load(device, dtype)``."""
    return ModelDir.open(path).load(device, dtype)


def consolidate(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the model of ``source`` (a run directory, checkpoint or model directory, DCP or full) to ``out``
    as a plain model directory: config.json, model.safetensors, generation_config.json and tokenizer/."""
    model_dir, out = ModelDir.open(source, hashes=True), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not an empty directory: choose another --out")
    write_model_dir(out, model_dir.read_weights(), model_dir.config, model_dir.decode, model_dir.tokenizer)
    return out


def write_model_dir(directory: Path, weights: dict[str, torch.Tensor] | None, config: ModelConfig,
                    decode: DecodeSettings, tokenizer: Path | None) -> None:
    """A model directory: the weights (None: a DCP checkpoint's, in its shards), config.json, the decode settings
    and a copy of the tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    if weights is not None:
        write_weights(weights, directory)
    config.save(directory / CONFIG_NAME)
    decode.save(directory)
    if tokenizer is not None:
        shutil.copytree(tokenizer, directory / "tokenizer")

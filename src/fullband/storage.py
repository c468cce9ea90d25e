"""Model directories and training checkpoints on disk: finding, verifying and reading them. Everything that
loads a model (``fullband generate``/``chat``/``serve``/``bench``, the Hugging Face export, lm-eval) goes
through here; only the trainer writes (``fullband.train.checkpoint``), so this module sits below both.

Layout of ``RUN/checkpoints/step_00000100/``::

    model/config.json, model/model.safetensors, model/generation_config.json, model/tokenizer/
                              (a loadable model directory, with the decode settings the run implies)
    optimizer.pt, rng.pt      (tensors and plain values only: loaded with weights_only=True)
    trainer_state.json        (step, tokens, loader position, counters)
    manifest.json             (written last: every file's size and sha256)

A DCP checkpoint (``train.checkpoint_format: dcp``) has the same layout but for the weights and optimizer state,
which every rank wrote as its own shards with ``torch.distributed.checkpoint``, beside the model directory::

    model/config.json, model/generation_config.json, model/tokenizer/   (no model.safetensors)
    dcp/.metadata, dcp/__0_0.distcp, dcp/__1_0.distcp, ...             ({"model": ..., "optimizer": ...})
    rng.pt, trainer_state.json, manifest.json                            (manifest.json: "format": "dcp")

Its ``model/`` is still a model directory every door resolves: ``read_model_weights`` consolidates the model's
tensors from the shards in one process (no process group, no optimizer state read).

With ``train.keep_best``, ``RUN/best/`` holds the model of the best validation so far the same way
(model/, best.json, manifest.json): ``fullband bench RUN/best`` loads it.
"""

from __future__ import annotations

import contextlib
import hashlib
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

from fullband.errors import CheckpointError
from fullband.model import CONFIG_NAME, DECODE_DEFAULTS_NAME, WEIGHTS_NAME, write_weights

MANIFEST = "manifest.json"
PREFIX = "step_"
BEST = "best"
DCP_DIR = "dcp"  # a DCP checkpoint's shards, beside its model/ directory
MODEL_KEY = "model"  # the model's entry in a DCP checkpoint's state dict ({"model": ..., "optimizer": ...})


@dataclass(frozen=True)
class RunDir:
    """A training run's directory, the one place its layout is spelled out: ``config.yaml`` (the run's config),
    ``checkpoints/step_N/`` (each with ``model/``), ``best/`` (``train.keep_best``'s model), ``tokenizer/`` and the
    prepared ``data/``."""

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


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoint directories (renamed into place), oldest first."""
    root = RunDir(Path(run_dir)).checkpoints
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def verify_checkpoint(path: Path, hashes: bool = True) -> None:
    """Raise CheckpointError unless every file in the manifest is present with its size and (``hashes``) its
    sha256. Without hashes the check reads no file's contents: what loading a model for inference needs, where
    hashing a large run's optimizer state would cost seconds before the first token (``fullband verify`` hashes)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it was not completely written")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({exc})") from None
    for name, meta in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        if file.stat().st_size != meta["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} has {file.stat().st_size} bytes, the manifest says {meta['bytes']} "
                "(truncated or overwritten)"
            )
        if hashes and sha256_of(file) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its sha256 (corrupt)")


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


def resolve_model_dir(path: str | os.PathLike, hashes: bool = False) -> Path:
    """Accept a model directory, a training checkpoint, or a run directory (its newest valid
    checkpoint) and return the model directory (config.json + model.safetensors) inside. A checkpoint is checked
    against its manifest (every file present with its size; with ``hashes`` also its sha256, as training does)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / "config.json").is_file() and ((path / "model.safetensors").is_file() or dcp_dir_of(path)):
        return path
    if (path / "model" / "config.json").is_file():
        verify_checkpoint(path, hashes)
        return path / "model"
    if RunDir(path).checkpoints.is_dir():
        latest = latest_valid_checkpoint(path, hashes)
        if latest is None:
            raise CheckpointError(f"run directory {path} has no complete checkpoint")
        return latest / "model"
    raise CheckpointError(
        f"{path} is neither a model directory (config.json + model.safetensors), a checkpoint "
        "(model/ + manifest.json) nor a run directory (checkpoints/)"
    )


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
    """The tensors of a safetensors file. safetensors checks the header against the file's size before it reads a
    tensor; a truncated or damaged file is refused with its name and safetensors' reason."""
    try:
        return load_file(str(file))
    except SafetensorError as exc:
        raise CheckpointError(f"{file} is unreadable or truncated: {exc}") from None


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """DCP warns at every save or load without a process group that it assumes a single process: here that
    is the intent (a one-process run, a front door consolidating a checkpoint), so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def checkpoint_format(path: Path) -> str:
    """'dcp' for a checkpoint whose weights and optimizer state are DCP shards, else 'full'."""
    return "dcp" if (Path(path) / DCP_DIR).is_dir() else "full"


def dcp_dir_of(model_dir: Path) -> Path | None:
    """The shards holding the weights of a DCP checkpoint's ``model/`` directory (``../dcp``), else None."""
    model_dir = Path(model_dir)
    shards = model_dir.parent / DCP_DIR
    if model_dir.name == "model" and not (model_dir / WEIGHTS_NAME).is_file() and (shards / ".metadata").is_file():
        return shards
    return None


def read_model_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors on the CPU: ``model.safetensors``, or for a DCP checkpoint's ``model/`` the
    ``model.*`` entries of its shards, consolidated in this process whatever the world size that wrote them
    (no process group needed, the optimizer state is not read)."""
    model_dir = Path(model_dir)
    shards = dcp_dir_of(model_dir)
    if shards is None:
        return read_safetensors(model_dir / WEIGHTS_NAME)
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


def consolidate(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the model of ``source`` (a run directory, checkpoint or model directory, DCP or full) to ``out``
    as a plain model directory: config.json, model.safetensors, generation_config.json and tokenizer/."""
    model_dir, out = resolve_model_dir(source, hashes=True), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not an empty directory: choose another --out")
    weights = read_model_weights(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_weights(weights, out)
    for name in (CONFIG_NAME, DECODE_DEFAULTS_NAME):
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    tokenizer = find_tokenizer_dir(model_dir)
    if tokenizer is not None:
        shutil.copytree(tokenizer, out / "tokenizer")
    return out


def find_tokenizer_dir(model_dir: Path) -> Path | None:
    """The tokenizer saved with a model: MODEL/tokenizer, else its run's tokenizer/."""
    run = RunDir.of(model_dir)
    for candidate in (model_dir / "tokenizer", run.tokenizer if run is not None else None):
        if candidate is not None and candidate.is_dir():
            return candidate
    return None

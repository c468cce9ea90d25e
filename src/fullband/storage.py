"""Model directories and training checkpoints on disk: finding, verifying and reading them. Everything that
loads a model (``fullband generate``/``chat``/``serve``/``bench``, the Hugging Face export, lm-eval) goes
through here; only the trainer writes (``fullband.train.checkpoint``), so this module sits below both.

Layout of ``RUN/checkpoints/step_00000100/``::

    model/config.json, model/model.safetensors, model/generation_config.json, model/tokenizer/
                              (a loadable model directory, with the decode settings the run implies)
    optimizer.pt, rng.pt      (tensors and plain values only: loaded with weights_only=True)
    trainer_state.json        (step, tokens, loader position, counters)
    manifest.json             (written last: every file's size and sha256)

With ``train.keep_best``, ``RUN/best/`` holds the model of the best validation so far the same way
(model/, best.json, manifest.json): ``fullband bench RUN/best`` loads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from fullband.errors import CheckpointError

MANIFEST = "manifest.json"
PREFIX = "step_"
BEST = "best"


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoint directories (renamed into place), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError unless every file in the manifest is present with its size and sha256."""
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
        if sha256_of(file) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its sha256 (corrupt)")


def latest_valid_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that verifies; corrupt ones are reported on stderr and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as exc:
            print(f"warning: skipping {exc}", file=sys.stderr)
    return None


def read_best(run_dir: Path) -> dict[str, Any] | None:
    """best.json of ``RUN/best/`` if it is complete (verified), else None."""
    path = run_dir / BEST
    if not path.is_dir():
        return None
    try:
        verify_checkpoint(path)
        return json.loads((path / "best.json").read_text())
    except (CheckpointError, OSError, json.JSONDecodeError):
        return None


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """Accept a model directory, a training checkpoint, or a run directory (its newest valid
    checkpoint) and return the model directory (config.json + model.safetensors) inside."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    if (path / "model" / "config.json").is_file():
        verify_checkpoint(path)
        return path / "model"
    if (path / "checkpoints").is_dir():
        latest = latest_valid_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"run directory {path} has no complete checkpoint")
        return latest / "model"
    raise CheckpointError(
        f"{path} is neither a model directory (config.json + model.safetensors), a checkpoint "
        "(model/ + manifest.json) nor a run directory (checkpoints/)"
    )


def find_tokenizer_dir(model_dir: Path) -> Path | None:
    """The tokenizer saved with a model: MODEL/tokenizer, else the run's tokenizer/ two levels up."""
    for candidate in (model_dir / "tokenizer", model_dir.parent.parent.parent / "tokenizer"):
        if candidate.is_dir():
            return candidate
    return None

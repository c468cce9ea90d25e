"""Training checkpoints: written to a temporary directory and renamed into place, with a manifest of
sizes and sha256 sums written last, so a half-written checkpoint is never mistaken for a whole one.

Layout of ``RUN/checkpoints/step_00000100/``::

    model/config.json, model/model.safetensors, model/tokenizer/   (a loadable model directory)
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
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from fullband.errors import CheckpointError
from fullband.model import ordinary_file_mode

MANIFEST = "manifest.json"
PREFIX = "step_"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def write_checkpoint(
    run_dir: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    model_config: Any,
    tokenizer_dir: Path | None,
    optimizer_state: Any,
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the ``keep`` newest ones."""
    root = run_dir / "checkpoints"
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}"
    _write_model_dir(tmp, model_state, model_config, tokenizer_dir)
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    _seal(tmp, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_model_dir(tmp: Path, model_state: dict[str, torch.Tensor], model_config: Any,
                     tokenizer_dir: Path | None) -> None:
    """A fresh ``tmp/model/``: weights, config and tokenizer, a loadable model directory."""
    from safetensors.torch import save_file

    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "model").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model_state.items()}, str(tmp / "model" / "model.safetensors"),
              metadata={"format": "pt", "library": "fullband"})
    os.chmod(tmp / "model" / "model.safetensors", ordinary_file_mode())  # safetensors writes mode 0600
    model_config.save(tmp / "model" / "config.json")
    if tokenizer_dir is not None:
        shutil.copytree(tokenizer_dir, tmp / "model" / "tokenizer")


def _seal(tmp: Path, step: int) -> None:
    """The manifest, written last, then everything flushed to disk: only now may ``tmp`` be renamed."""
    files = {
        str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=2))
    _fsync_tree(tmp)


BEST = "best"


def write_best(run_dir: Path, model_state: dict[str, torch.Tensor], model_config: Any, tokenizer_dir: Path | None,
               record: dict[str, Any]) -> Path:
    """Replace ``RUN/best/`` (the model of the best validation so far: model/, best.json with its step and
    loss, manifest.json) atomically; a crash leaves the previous best or none, never a mixture."""
    final, tmp, old = run_dir / BEST, run_dir / f".tmp-{BEST}", run_dir / f".old-{BEST}"
    _write_model_dir(tmp, model_state, model_config, tokenizer_dir)
    (tmp / "best.json").write_text(json.dumps(record, indent=2))
    _seal(tmp, record["step"])
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


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
        if _sha256(file) != meta["sha256"]:
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


def _load_tensors(file: Path) -> Any:
    """torch.load with weights_only=True (tensors and plain containers, never arbitrary objects)."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:  # UnpicklingError for disallowed globals, RuntimeError for damaged archives
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        reason = next((line for line in lines if "Unsupported global" in line), lines[0]).split(" Please use")[0]
        raise CheckpointError(
            f"refusing to load {file}: it is not a plain tensor file that loads with weights_only=True "
            f"({reason}). fullband never unpickles arbitrary objects; the checkpoint was not written by "
            "fullband or was tampered with."
        ) from None


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load the non-model parts of a verified checkpoint (no pickle: weights_only=True)."""
    try:
        trainer_state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: trainer_state.json is unreadable ({exc})") from None
    return {
        "optimizer": _load_tensors(path / "optimizer.pt"),
        "rng": _load_tensors(path / "rng.pt"),
        "trainer_state": trainer_state,
    }


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

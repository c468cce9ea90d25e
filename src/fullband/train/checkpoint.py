"""Writing training checkpoints (and reading back their optimizer and RNG state), full or DCP: written to a temporary
directory and renamed into place, with a manifest of sizes and sha256 sums written last, so a half-written
checkpoint is never mistaken for a whole one. The layout, and finding and verifying checkpoints and model
directories, are in ``fullband.storage``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from fullband.decoding import DecodeSettings
from fullband.errors import CheckpointError
from fullband.model import write_weights
from fullband.storage import (
    BEST,
    DCP_DIR,
    MANIFEST,
    PREFIX,
    RunDir,
    checkpoint_format,
    list_checkpoints,
    sha256_of,
    single_process_dcp,
)


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
    decode: DecodeSettings,
    tokenizer_dir: Path | None,
    optimizer_state: Any,
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the ``keep`` newest ones."""
    root = RunDir(run_dir).checkpoints
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}"
    _write_model_dir(tmp, model_state, model_config, decode, tokenizer_dir)
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


def write_dcp_checkpoint(
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    model_config: Any,
    decode: DecodeSettings,
    tokenizer_dir: Path | None,
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Write checkpoint ``step`` in DCP format: every rank calls this with its own (possibly sharded)
    ``state`` = {"model": ..., "optimizer": ...} and writes its own shards, nothing is gathered. Atomic as
    ``write_checkpoint``: rank 0 seals the temporary directory (manifest written last, with the sha256 each
    rank computed of its own shards) and renames it into place once every rank has written."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    root = RunDir(run_dir).checkpoints
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}"
    if rank == 0:
        _write_model_dir(tmp, None, model_config, decode, tokenizer_dir)
        (tmp / DCP_DIR).mkdir()
        torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    if distributed:
        dist.barrier()  # the fresh temporary directory exists before any rank writes into it
    with contextlib.nullcontext() if distributed else single_process_dcp():
        dcp.save(state, storage_writer=FileSystemWriter(str(tmp / DCP_DIR)), no_dist=not distributed)
    # Each rank hashes the shards it wrote (files __RANK_*.distcp), in parallel; rank 0 hashes the rest.
    mine = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
            for p in sorted((tmp / DCP_DIR).glob(f"__{rank}_*"))}
    gathered = [None] * dist.get_world_size() if distributed else [mine]
    if distributed:
        dist.all_gather_object(gathered, mine)
    if rank == 0:
        _seal(tmp, step, known={name: meta for part in gathered for name, meta in part.items()}, fmt="dcp")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if distributed:
        dist.barrier()  # no rank goes on (or exits) before the checkpoint is in place
    return final


def _write_model_dir(tmp: Path, model_state: dict[str, torch.Tensor] | None, model_config: Any,
                     decode: DecodeSettings, tokenizer_dir: Path | None) -> None:
    """A fresh ``tmp/model/``: weights (unless ``model_state`` is None: a DCP checkpoint's are in its shards),
    config, decode settings and tokenizer."""
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "model").mkdir(parents=True)
    if model_state is not None:
        write_weights(model_state, tmp / "model")
    model_config.save(tmp / "model" / "config.json")
    decode.save(tmp / "model")
    if tokenizer_dir is not None:
        shutil.copytree(tokenizer_dir, tmp / "model" / "tokenizer")


def _seal(tmp: Path, step: int, known: dict[str, dict[str, Any]] | None = None, fmt: str = "full") -> None:
    """The manifest, written last, then everything flushed to disk: only now may ``tmp`` be renamed.
    ``known``: sizes and sums already computed (by the rank that wrote those files)."""
    known = known or {}
    files = {}
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            name = str(path.relative_to(tmp))
            files[name] = known.get(name) or {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "format": fmt, "files": files}, indent=2))
    _fsync_tree(tmp)


def write_best(run_dir: Path, model_state: dict[str, torch.Tensor], model_config: Any, decode: DecodeSettings,
               tokenizer_dir: Path | None, record: dict[str, Any]) -> Path:
    """Replace ``RUN/best/`` (the model of the best validation so far: model/, best.json with its step and
    loss, manifest.json) atomically; a crash leaves the previous best or none, never a mixture."""
    final, tmp, old = run_dir / BEST, run_dir / f".tmp-{BEST}", run_dir / f".old-{BEST}"
    _write_model_dir(tmp, model_state, model_config, decode, tokenizer_dir)
    (tmp / "best.json").write_text(json.dumps(record, indent=2))
    _seal(tmp, record["step"])
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


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
        # A DCP checkpoint's optimizer state is in its shards (read by the trainer with the model's).
        "optimizer": None if checkpoint_format(path) == "dcp" else _load_tensors(path / "optimizer.pt"),
        "rng": _load_tensors(path / "rng.pt"),
        "trainer_state": trainer_state,
    }

"""Writing training checkpoints (and reading back their optimizer and RNG state), full or DCP: written to a temporary
directory and renamed into place, with a manifest of sizes and sha256 sums written last, so a half-written
checkpoint is never mistaken for a whole one. Finding and verifying them is ``fullband.storage``'s."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fullband.decoding import DecodeSettings
from fullband.errors import CheckpointError
from fullband.files import file_record, fsync_tree
from fullband.model import WEIGHTS_NAME
from fullband.storage import (
    BEST,
    DCP_DIR,
    MANIFEST,
    MODEL_KEY,
    PREFIX,
    RunDir,
    checkpoint_format,
    latest_valid_checkpoint,
    list_checkpoints,
    read_safetensors,
    single_process_dcp,
    write_model_dir,
)

# The whole (unsharded) state on the CPU: what a full checkpoint or RUN/best holds.
FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


def write_checkpoint(run_dir: Path, step: int, model_state: dict[str, torch.Tensor] | None, model_config: Any,
                     decode: DecodeSettings, tokenizer_dir: Path | None, optimizer_state: Any,
                     trainer_state: dict[str, Any], keep: int, shards: dict[str, Any] | None = None) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the ``keep`` newest ones. With ``shards`` (this rank's
    {"model": ..., "optimizer": ...}) it is a DCP checkpoint: every rank writes and hashes its own shards, rank 0
    seals the directory."""
    distributed = shards is not None and dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    root = RunDir(run_dir).checkpoints
    final, tmp = root / f"{PREFIX}{step:08d}", root / f".tmp-{PREFIX}{step:08d}"
    if rank == 0:
        _write_model_dir(tmp, model_state, model_config, decode, tokenizer_dir)
        if shards is None:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    known = {}
    if shards is not None:
        if rank == 0:
            (tmp / DCP_DIR).mkdir()
        if distributed:
            dist.barrier()  # the fresh temporary directory exists before any rank writes into it
        with contextlib.nullcontext() if distributed else single_process_dcp():
            dcp.save(shards, storage_writer=FileSystemWriter(str(tmp / DCP_DIR)), no_dist=not distributed)
        # Each rank hashes the shards it wrote (files __RANK_*.distcp), in parallel; rank 0 hashes the rest.
        mine = {str(p.relative_to(tmp)): file_record(p)
                for p in sorted((tmp / DCP_DIR).glob(f"__{rank}_*"))}
        gathered = [None] * dist.get_world_size() if distributed else [mine]
        if distributed:
            dist.all_gather_object(gathered, mine)
        known = {name: meta for part in gathered for name, meta in part.items()}
    if rank == 0:
        _seal(tmp, step, known, fmt="full" if shards is None else "dcp")
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
    """A fresh ``tmp`` holding the model directory ``tmp/model/``."""
    if tmp.exists():
        shutil.rmtree(tmp)
    write_model_dir(tmp / MODEL_KEY, model_state, model_config, decode, tokenizer_dir)


def _seal(tmp: Path, step: int, known: dict[str, dict[str, Any]] | None = None, fmt: str = "full") -> None:
    """The manifest, written last, then everything flushed to disk: only now may ``tmp`` be renamed.
    ``known``: sizes and sums already computed (by the rank that wrote those files)."""
    known = known or {}
    files = {}
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            name = str(path.relative_to(tmp))
            files[name] = known.get(name) or file_record(path)
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "format": fmt, "files": files}, indent=2))
    fsync_tree(tmp)


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


@dataclass
class CheckpointManager:
    """A run's checkpoints as the trainer uses them, whatever the world size and sharding that wrote them. Every rank
    calls each method (the state dicts are collectives under FSDP); only rank 0 writes whole files."""

    out_dir: Path
    format: str  # "full" or "dcp": the format written; either is read
    model_config: Any
    decode: DecodeSettings
    tokenizer_dir: Path
    keep: int
    world_size: int
    is_main: bool
    log: Callable[[str], None]

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def save(self, model: nn.Module, optimizers: list, trainer_state: dict[str, Any]) -> None:
        """RUN/checkpoints/step_N with the model, optimizer state, RNG and ``trainer_state`` (its "step" names it)."""
        files = (self.model_config, self.decode, self.tokenizer_dir)
        step = trainer_state["step"]
        if self.format == "dcp":
            # Every rank writes its own shards: no rank ever holds the whole model or optimizer state.
            model_state, optimizer_state = get_state_dict(model, optimizers)
            shards = {MODEL_KEY: model_state, "optimizer": optimizer_state}
            path = write_checkpoint(self.out_dir, step, None, *files, None, trainer_state, self.keep, shards)
        else:
            model_state, optimizer_state = get_state_dict(model, optimizers, options=FULL_ON_CPU)
            path = write_checkpoint(self.out_dir, step, model_state, *files, optimizer_state, trainer_state,
                                    self.keep) if self.is_main else None
            self._barrier()
        self.log(f"checkpoint {path}")  # rank 0's

    def save_best(self, model: nn.Module, record: dict[str, Any]) -> None:
        """RUN/best: the model with ``record`` (its step and validation loss) as best.json."""
        model_state = get_model_state_dict(model, options=FULL_ON_CPU)  # a collective under FSDP
        if self.is_main:
            write_best(self.out_dir, model_state, self.model_config, self.decode, self.tokenizer_dir, record)
        self._barrier()

    def resume(self, model: nn.Module, optimizers: list) -> dict[str, Any] | None:
        """Load the newest valid checkpoint into ``model`` and ``optimizers`` (and torch's RNG); its trainer state,
        or None when there is none to resume from."""
        # Rank 0 verifies (the sha256 of every file) and tells the others which checkpoint: every rank
        # verifying would read a sharded checkpoint's every shard once per rank.
        found = [latest_valid_checkpoint(self.out_dir) if self.is_main else None]
        if self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        checkpoint = found[0]
        if checkpoint is None:
            self.log(f"--resume: no complete checkpoint in {self.out_dir}; starting from step 0")
            return None
        saved = self.load(model, optimizers, checkpoint)
        self.log(f"resumed from {checkpoint} at step {saved['step']}")
        return saved

    def load(self, model: nn.Module, optimizers: list, checkpoint: Path) -> dict[str, Any]:
        parts = read_checkpoint(checkpoint)
        full = checkpoint_format(checkpoint) == "full"
        if full:
            model_state, optimizer_state = read_safetensors(checkpoint / "model" / WEIGHTS_NAME), parts["optimizer"]
            saved = set(optimizer_state.get("state", {}))
        else:
            model_state, optimizer_state, saved = self._read_dcp_state(model, optimizers, checkpoint)
        set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=full))
        # strict=False: parameters that never had a gradient (the fusion weights during the 1-pass phase)
        # have no optimizer state yet, exactly as in an uninterrupted run.
        set_optimizer_state_dict(model, optimizers, optimizer_state,
                                 options=StateDictOptions(full_state_dict=full, strict=False))
        # set_optimizer_state_dict first initialises every parameter's state with a zero-gradient step;
        # drop that state again where the checkpoint had none, or those parameters' first real update
        # would see a step count of 2 (Adam bias correction) and the run would not match an uninterrupted one.
        for name, param in model.named_parameters():
            if name not in saved:
                for opt in optimizers:
                    opt.state.pop(param, None)
        torch.set_rng_state(parts["rng"]["torch"])
        return parts["trainer_state"]

    @staticmethod
    def _read_dcp_state(model: nn.Module, optimizers: list, checkpoint: Path) -> tuple[dict, dict, set[str]]:
        """The model and optimizer state of a DCP checkpoint, read into this run's sharding, and the names of the
        parameters that have optimizer state in it."""
        shards = checkpoint / DCP_DIR
        model_state, optimizer_state = get_state_dict(model, optimizers)
        entries = FileSystemReader(str(shards)).read_metadata().state_dict_metadata
        # The template holds freshly initialised state for every parameter; read only the parameters the
        # checkpoint has state for (DCP refuses to load entries a checkpoint lacks).
        saved = {name for name, per_param in optimizer_state["state"].items()
                 if all(f"optimizer.state.{name}.{key}" in entries for key in per_param)}
        optimizer_state["state"] = {k: v for k, v in optimizer_state["state"].items() if k in saved}
        state = {MODEL_KEY: model_state, "optimizer": optimizer_state}
        try:
            with contextlib.nullcontext() if dist.is_initialized() else single_process_dcp():
                dcp.load(state, checkpoint_id=str(shards), no_dist=not dist.is_initialized())
        except Exception as exc:  # DCP wraps a rank's failure (a damaged shard, missing entries) in its own error
            raise CheckpointError(f"checkpoint {checkpoint}: cannot read its DCP shards ({exc})") from None
        return state[MODEL_KEY], state["optimizer"], saved

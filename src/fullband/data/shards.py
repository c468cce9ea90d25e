"""Prepared datasets: token shards on disk, document start offsets, loss masks and a manifest that commits them
(the layout is in docs/data.md)."""

from __future__ import annotations

import array
import contextlib
import hashlib
import itertools
import json
import logging
import multiprocessing
import multiprocessing.context
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fullband.data.chat import encode_record
from fullband.data.config import DATA_FORMAT_VERSION, DataConfig
from fullband.data.sources import (
    SPLITS,
    SplitStats,
    Unit,
    byte_cap,
    cut_at_cap,
    describe_source,
    document_bytes,
    isolates_documents,
    iter_documents,
    plan_units,
    resolve_format,
    split_of,
    unit_documents,
)
from fullband.data.tokenizers import Tokenizer, build_tokenizer, load_tokenizer
from fullband.errors import ConfigError, DataError
from fullband.files import file_problem, file_record, fsync_close, fsync_write

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
DEFAULT_SHARD_TOKENS = 64 * 2**20
IGNORE_INDEX = -100  # a target that is not trained on (FullBandLM.multipass's ignore_index)
_ENCODE_BATCH_BYTES = 4 * 2**20  # text handed to the tokenizer at once: big enough for batch speed
# Input per work unit: big enough that per-unit costs (a process hand-off, a few files) vanish, small enough
# that a 2-core laptop and a 64-core server both get many units, and that a resume loses little.
DEFAULT_UNIT_BYTES = 64 * 2**20
UNITS_DIR = "units"  # work in progress: plan.json and one directory per finished unit; removed at the end
PLAN = "plan.json"
UNIT_RECORD = "unit.json"
_COPY_CHUNK = 2**24  # items copied at once when stitching units into shards


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 - 1 else np.uint32)


# --- Writing -------------------------------------------------------------------------------------

class _ShardWriter:
    """Appends tokens to <split>_NNN.bin files of at most `shard_tokens` tokens each."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.total = 0
        self._file = None
        self._hash = None
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None:
                name = f"{self.split}_{len(self.shards):03d}.bin"
                self._file = open(self.directory / name, "wb")
                self._hash, self._count = hashlib.sha256(), 0
                self.shards.append({"file": name})
            take = min(len(tokens), self.shard_tokens - self._count)
            data = tokens[:take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += take
            self.total += take
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        fsync_close(self._file)
        self.shards[-1].update(tokens=self._count, bytes=self._count * self.dtype.itemsize,
                               sha256=self._hash.hexdigest())
        self._file = None

    def close(self) -> list[dict]:
        if self._file is not None:
            self._close_shard()
        return self.shards


# --- Work units: tokenized one by one (in parallel), stitched in order --------------------------------

class _UnitPiece:
    """One split's output of one work unit: framed tokens, the offset and UTF-8 size of every document (the sizes
    let the stitcher apply max_train_bytes where a sequential pass would) and, for records, the loss mask."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, records: bool) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self.tokens = open(directory / f"{split}.bin", "wb")
        self.mask = open(directory / f"{split}_mask.bin", "wb") if records else None
        # Compact (8 bytes a document): a unit of short documents has hundreds of thousands of them.
        self.starts = array.array("q")
        self.sizes = array.array("q")
        self.skipped_at: list[int] = []  # documents before each unreadable file (counted up to a byte cap)
        self.total = 0
        self._batch: list[str] = []
        self._batch_chars = 0

    def add_text(self, tok: Tokenizer, text: str) -> None:
        self._batch.append(text)
        self.sizes.append(len(text.encode("utf-8")))
        self._batch_chars += len(text)
        if self._batch_chars >= _ENCODE_BATCH_BYTES:
            self._flush(tok)

    def add_record(self, tok: Tokenizer, record: dict) -> None:
        ids, mask = encode_record(tok, record)
        self.starts.append(self.total)
        self.sizes.append(document_bytes(record))
        self._write(np.asarray(ids, dtype=np.int64))
        self.mask.write(np.asarray(mask, dtype=np.uint8).tobytes())

    def skip(self) -> None:
        self.skipped_at.append(len(self.sizes))

    def _flush(self, tok: Tokenizer) -> None:
        if not self._batch:
            return
        framed, offsets = frame_texts(tok, self._batch, self.dtype)
        self.starts.extend((offsets + self.total).tolist())
        self._write(framed)
        self._batch, self._batch_chars = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        self.tokens.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.total += len(tokens)

    def close(self, tok: Tokenizer) -> dict:
        self._flush(tok)
        for f in [self.tokens] + ([self.mask] if self.mask else []):
            fsync_close(f)
        np.save(self.directory / f"{self.split}_docs.npy", np.asarray(self.starts, dtype=np.int64))
        np.save(self.directory / f"{self.split}_bytes.npy", np.asarray(self.sizes, dtype=np.int64))
        names = [self.split + suffix for suffix in _PIECE_SUFFIXES if (self.directory / (self.split + suffix)).exists()]
        return {"tokens": self.total, "documents": len(self.sizes), "text_bytes": sum(self.sizes),
                "skipped_at": self.skipped_at,
                "files": {name: file_record(self.directory / name) for name in names}}


_PIECE_SUFFIXES = (".bin", "_mask.bin", "_docs.npy", "_bytes.npy")


def frame_texts(tok: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The documents encoded and framed as [bos] + tokens + [eos], back to back, and each one's offset."""
    encoded = tok.encode_batch(texts)
    lengths = np.array([len(ids) + 2 for ids in encoded], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    framed = np.empty(int(lengths.sum()), dtype=dtype)
    framed[offsets] = tok.bos_id
    framed[offsets + lengths - 1] = tok.eos_id
    for off, ids in zip(offsets, encoded):
        framed[off + 1 : off + 1 + len(ids)] = ids
    return framed, offsets


def tokenize_unit(cfg: DataConfig, unit: Unit, fmt: str, tok: Tokenizer, unit_dir: Path) -> dict:
    """Tokenize one work unit into `unit_dir` (both splits) and return its record (unit.json), through a temporary
    directory renamed into place once everything is on disk: a unit directory that exists is finished."""
    tmp = unit_dir.with_name(unit_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = token_dtype(tok.vocab_size)
    pieces = {split: _UnitPiece(tmp, split, dtype, records=fmt != "text") for split in SPLITS}
    for doc_id, doc, doc_split in unit_documents(cfg, unit, fmt):
        piece = pieces[doc_split or split_of(doc_id, cfg.val_fraction)]
        if doc is None:
            piece.skip()
        elif isinstance(doc, dict):
            piece.add_record(tok, doc)
        elif doc:
            piece.add_text(tok, doc)
    info = {"unit": unit, "splits": {split: piece.close(tok) for split, piece in pieces.items()}}
    fsync_write(tmp / UNIT_RECORD, (json.dumps(info) + "\n").encode())
    shutil.rmtree(unit_dir, ignore_errors=True)
    os.replace(tmp, unit_dir)
    return info


def _verified_unit(unit_dir: Path, unit: Unit) -> dict | None:
    """The record of a finished unit whose files are all present with their recorded size and sha256."""
    try:
        info = json.loads((unit_dir / UNIT_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(info, dict) or info.get("unit") != unit:
        return None
    files = [(name, entry) for piece in info["splits"].values() for name, entry in piece["files"].items()]
    return None if any(file_problem(unit_dir / name, entry) for name, entry in files) else info


# The tokenizer of a worker process, loaded by its first task: an error loading it reaches the parent through that
# task, where a failing pool initializer would only be restarted, forever.
_WORKER_TOKENIZER: Tokenizer | None = None


def _worker_init() -> None:
    # One process per core: the Rust tokenizer's own thread pool would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _unit_task(task: tuple[dict, Unit, str, str, str]) -> dict:
    global _WORKER_TOKENIZER
    cfg, unit, fmt, unit_dir, tok_dir = task
    if _WORKER_TOKENIZER is None:
        _WORKER_TOKENIZER = load_tokenizer(tok_dir)
    return tokenize_unit(DataConfig.from_dict(cfg), unit, fmt, _WORKER_TOKENIZER, Path(unit_dir))


def _process_context() -> multiprocessing.context.BaseContext:
    """forkserver where there is one (workers fork from a clean server that imported this module once: no
    locks or threads inherited from the caller, e.g. a trained BPE tokenizer's), else spawn."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")


def _tokenize_units(cfg: DataConfig, units: list[Unit], fmt: str, out_dir: Path, workers: int,
                    done: dict[int, dict], tok: Tokenizer) -> list[dict]:
    """The records of the units in order: finished ones from `done`, the others tokenized (by `workers`
    processes), up to the unit where both splits reach their byte cap, if they have one."""
    units_dir = out_dir / UNITS_DIR
    caps = {split: byte_cap(cfg, split) for split in SPLITS}
    seen = dict.fromkeys(SPLITS, 0)
    tok_dir = str(out_dir / TOKENIZER_DIR)
    tasks = ((cfg.to_dict(), units[i], fmt, str(units_dir / _unit_name(i)), tok_dir)
             for i in range(len(units)) if i not in done)
    infos: list[dict] = []
    pool = _process_context().Pool(workers, initializer=_worker_init) if workers > 1 and len(units) > 1 else None
    finished = False
    try:
        # imap keeps unit order; a single process reads the units itself, with the tokenizer in memory.
        results = pool.imap(_unit_task, tasks) if pool else (
            tokenize_unit(cfg, unit, fmt, tok, Path(unit_dir)) for _, unit, _, unit_dir, _ in tasks)
        for i in range(len(units)):
            if all(caps[s] is not None and seen[s] >= caps[s] for s in SPLITS):
                break  # the rest of the corpus is past both caps: not read at all
            infos.append(done[i] if i in done else next(results))
            for split in SPLITS:
                seen[split] += infos[-1]["splits"][split]["text_bytes"]
            log.info("unit %d/%d %s", i + 1, len(units), "kept" if i in done else "tokenized")
        finished = len(infos) == len(units)
    finally:
        if pool is not None:
            # Workers that are done exit on their own (their libraries clean up); after an error, or with
            # units still running past a byte cap, they are stopped.
            if finished:
                pool.close()
            else:
                pool.terminate()
            pool.join()
    return infos


def _cap_cut(sizes: np.ndarray, used: int, cap: int | None, records: bool) -> int | None:
    """Index of the document of a unit at which `iter_documents` stops for the byte cap, or None. A text
    stops at the document that reaches the cap (it is cut), a record at the one that would exceed it."""
    if cap is None:
        return None
    cut = int(np.searchsorted(used + np.cumsum(sizes), cap, side="right" if records else "left"))
    return cut if cut < len(sizes) else None


def _nth_document(cfg: DataConfig, unit: Unit, fmt: str, split: str, n: int) -> str:
    """The n-th non-empty document of `split` in a unit (the one a byte cap cuts), read again."""
    docs = ((doc_id, doc) for doc_id, doc, doc_split in unit_documents(cfg, unit, fmt, only=split)
            if doc and (doc_split or split_of(doc_id, cfg.val_fraction)) == split)
    return next(itertools.islice(docs, n, None))[1]


def _copy_prefix(src: Path, dtype: np.dtype, count: int, sink: Callable[[np.ndarray], object]) -> None:
    """Stream the first `count` items of a unit file into `sink`, a bounded chunk at a time."""
    with open(src, "rb") as f:
        while count > 0:
            chunk = np.fromfile(f, dtype=dtype, count=min(count, _COPY_CHUNK))
            if not len(chunk):
                raise DataError(f"{src} ended early; delete {src.parent} and re-run `fullband prepare`.")
            sink(chunk)
            count -= len(chunk)


def _assemble_split(cfg: DataConfig, split: str, fmt: str, tok: Tokenizer, units: list[Unit], infos: list[dict],
                    out_dir: Path, shard_tokens: int) -> dict:
    """Concatenate the units' pieces of one split, in unit order, into shards of shard_tokens tokens (the
    layout a sequential pass writes), applying the byte cap where `iter_documents` would."""
    stats = SplitStats()
    writer = _ShardWriter(out_dir, split, token_dtype(tok.vocab_size), shard_tokens)
    starts: list[np.ndarray] = []
    records, cap = fmt != "text", byte_cap(cfg, split)
    mask_file = f"{split}_mask.bin"
    with open(out_dir / mask_file, "wb") if records else contextlib.nullcontext() as mask:
        for index, info in enumerate(infos):
            piece, unit_dir = info["splits"][split], out_dir / UNITS_DIR / _unit_name(index)
            sizes = np.load(unit_dir / f"{split}_bytes.npy")
            local = np.load(unit_dir / f"{split}_docs.npy")
            cut = _cap_cut(sizes, stats.text_bytes, cap, records)
            keep = len(sizes) if cut is None else cut
            count = piece["tokens"] if cut is None else int(local[cut])
            starts.append(local[:keep] + writer.total)
            _copy_prefix(unit_dir / f"{split}.bin", writer.dtype, count, writer.write)
            if mask is not None:
                _copy_prefix(unit_dir / mask_file, np.dtype(np.uint8), count, lambda m: mask.write(m.tobytes()))
            stats.documents += keep
            stats.text_bytes += int(sizes[:keep].sum())
            stats.skipped_files += sum(1 for k in piece["skipped_at"] if k <= keep)
            if cut is None:
                continue
            if not records:  # the text that reaches the cap is cut to fit
                data = _nth_document(cfg, units[index], fmt, split, cut).encode("utf-8")
                text = cut_at_cap(data, cap - stats.text_bytes, cfg.source.startswith("synthetic:"))
                if text:
                    framed, _ = frame_texts(tok, [text], writer.dtype)
                    starts.append(np.array([writer.total], dtype=np.int64))
                    writer.write(framed)
                    stats.documents += 1
                    stats.text_bytes += len(text.encode("utf-8"))
            break
        if mask is not None:
            fsync_close(mask)
    shards = writer.close()
    if stats.documents == 0:
        raise DataError(
            f"The {split} split of data.source {cfg.source!r} is empty: no non-empty document "
            f"({stats.skipped_files} unreadable files skipped). "
            + ("With few documents, the hash split by val_fraction can leave one split empty: add more "
               "documents or raise data.val_fraction."
               if split == "val" else "Check that the source holds text and that data.text_field is right.")
        )
    doc_starts = np.concatenate(starts)
    docs_file = f"{split}_docs.npy"
    np.save(out_dir / docs_file, doc_starts)
    log.info("%s: %d documents, %d tokens, %d shard(s), %d files skipped", split, stats.documents,
             writer.total, len(shards), stats.skipped_files)
    extra = {"loss_mask": {"file": mask_file, **file_record(out_dir / mask_file)}} if records else {}
    return {
        **extra,
        "tokens": writer.total,
        "documents": stats.documents,
        "text_bytes": stats.text_bytes,
        "skipped_files": stats.skipped_files,
        "shards": shards,
        "doc_starts": {"file": docs_file, **file_record(out_dir / docs_file)},
    }


def _unit_name(index: int) -> str:
    return f"u{index:06d}"


def _remove_outputs(out_dir: Path, keep_work: bool = False) -> None:
    """Delete what a previous prepare wrote (only our own file names); `keep_work`: not the tokenizer and the
    finished work units, which a resumed prepare reuses."""
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for split in SPLITS:
        for p in [*out_dir.glob(f"{split}_[0-9][0-9][0-9].bin"), out_dir / f"{split}_docs.npy",
                  out_dir / f"{split}_mask.bin"]:
            p.unlink(missing_ok=True)
    (out_dir / (MANIFEST + ".tmp")).unlink(missing_ok=True)
    if not keep_work:
        shutil.rmtree(out_dir / TOKENIZER_DIR, ignore_errors=True)
        shutil.rmtree(out_dir / UNITS_DIR, ignore_errors=True)
    for tmp in (out_dir / UNITS_DIR).glob("*.tmp"):  # units a killed worker left half-written
        shutil.rmtree(tmp, ignore_errors=True)


def _resumable(out_dir: Path, plan: dict) -> tuple[Tokenizer | None, dict[int, dict]]:
    """The tokenizer and verified finished units of an interrupted prepare of the same plan, if any."""
    try:
        old = json.loads((out_dir / UNITS_DIR / PLAN).read_text())
        tok = load_tokenizer(out_dir / TOKENIZER_DIR)
    except (OSError, json.JSONDecodeError, DataError):
        return None, {}
    if {k: v for k, v in old.items() if k != "tokenizer"} != plan or old.get("tokenizer") != tok.fingerprint():
        log.info("%s holds work units of another plan (config or corpus changed): starting over", out_dir)
        return None, {}
    done = {}
    for i, unit in enumerate(plan["units"]):
        info = _verified_unit(out_dir / UNITS_DIR / _unit_name(i), unit)
        if info is not None:
            done[i] = info
    return tok, done


def prepare_dataset(cfg: DataConfig, out_dir: str | Path, *, overwrite: bool = False,
                    shard_tokens: int = DEFAULT_SHARD_TOKENS, workers: int = 1,
                    unit_bytes: int = DEFAULT_UNIT_BYTES) -> PreparedDataset:
    """Tokenize the corpus of `cfg` into `out_dir`, or reuse it if it was already prepared from `cfg` (a dataset of
    another config is never silently replaced; `overwrite` rebuilds). Work units of about `unit_bytes`, tokenized
    by `workers` processes and stitched in order: the same bytes for any `workers`; an interrupted prepare keeps
    the finished units that verify. One process only (rank 0) in a distributed job."""
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens={shard_tokens} must be positive.")
    if workers < 1:
        raise ConfigError(f"workers={workers} must be at least 1 (the number of tokenizing processes).")
    out_dir = Path(out_dir)
    fingerprint = cfg.fingerprint()
    if (out_dir / MANIFEST).is_file() and not overwrite:
        existing = _read_manifest(out_dir)
        if existing.get("data_fingerprint") == fingerprint:
            log.info("reusing prepared dataset %s", out_dir)
            return open_dataset(out_dir, verify=False)
        old = existing.get("data_config", {})
        changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in cfg.to_dict().items() if old.get(k) != v]
        raise DataError(
            f"{out_dir} already holds a dataset prepared from a different data config "
            f"({'; '.join(changed) or 'same fields, older format version'}). Use another output "
            "directory, or pass overwrite (--overwrite) to replace it."
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_outputs(out_dir, keep_work=not overwrite)

    log.info("preparing %s from %s (tokenizer %s, %d worker(s))", out_dir, cfg.source, cfg.tokenizer, workers)
    fmt = resolve_format(cfg)
    units = plan_units(cfg, unit_bytes)
    plan = {"data_fingerprint": fingerprint, "format": fmt, "units": units}
    tok, done = _resumable(out_dir, plan)
    if tok is None:
        _remove_outputs(out_dir)
        tok = build_tokenizer(cfg, _training_texts(cfg, fmt), chat=fmt == "chat")
        tok.save(out_dir / TOKENIZER_DIR)
        (out_dir / UNITS_DIR).mkdir()
        fsync_write(out_dir / UNITS_DIR / PLAN, json.dumps({**plan, "tokenizer": tok.fingerprint()}).encode())
    else:
        log.info("resuming: %d of %d work units finished and verified", len(done), len(units))
    infos = _tokenize_units(cfg, units, fmt, out_dir, workers, done, tok)
    splits = {split: _assemble_split(cfg, split, fmt, tok, units, infos, out_dir, shard_tokens) for split in SPLITS}
    manifest = {
        "format": "fullband-dataset",
        "version": DATA_FORMAT_VERSION,
        "data_config": cfg.to_dict(),
        "data_fingerprint": fingerprint,
        "source": describe_source(cfg),
        "record_format": fmt,
        "isolate_documents": isolates_documents(cfg, fmt),
        "tokenizer": {"kind": tok.kind, "fingerprint": tok.fingerprint(), "vocab_size": tok.vocab_size,
                      "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id, "dir": TOKENIZER_DIR},
        "dtype": token_dtype(tok.vocab_size).name,
        "splits": splits,
    }
    # The manifest is the commit point: a crash at any moment leaves either no manifest or a complete dataset.
    tmp = out_dir / (MANIFEST + ".tmp")
    fsync_write(tmp, (json.dumps(manifest, indent=2) + "\n").encode())
    os.replace(tmp, out_dir / MANIFEST)
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    shutil.rmtree(out_dir / UNITS_DIR, ignore_errors=True)  # committed: the work units are no longer needed
    return PreparedDataset(out_dir, manifest, tok)


def _training_texts(cfg: DataConfig, fmt: str) -> Iterator[str]:
    """The training text a BPE tokenizer learns from: documents, or every string of each record."""
    for _, doc in iter_documents(cfg, "train", fmt=fmt):
        if isinstance(doc, str):
            yield doc
        elif "messages" in doc:
            yield from (m["role"] + "\n" + m["content"] for m in doc["messages"])
        else:
            yield doc["prompt"] + doc["answer"]


# --- Reading -------------------------------------------------------------------------------------

def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path / MANIFEST} is unreadable ({e}). Re-run `fullband prepare` with "
                        "overwrite to rebuild the dataset.") from e
    if manifest.get("format") != "fullband-dataset" or manifest.get("version") != DATA_FORMAT_VERSION:
        raise DataError(
            f"{path / MANIFEST} is not a fullband dataset manifest of format version {DATA_FORMAT_VERSION} "
            f"(found format {manifest.get('format')!r}, version {manifest.get('version')!r}). Re-run "
            "`fullband prepare` with overwrite to rebuild it with this version."
        )
    return manifest


@dataclass
class Batch:
    """input_ids, targets: (B, T) int64, targets IGNORE_INDEX where a token is not trained on; plain_mask: (B, T),
    True at position 0 and every document start; segment_ids: one id per packed document where documents are
    isolated (``FullBandLM.forward``), else None."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    plain_mask: torch.Tensor
    segment_ids: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(*(None if t is None else t.to(device, non_blocking=non_blocking)
                       for t in (self.input_ids, self.targets, self.plain_mask, self.segment_ids)))


def check_split_length(split: TokenSplit, seq_len: int) -> None:
    if seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be at least 1.")
    if len(split) < seq_len + 1:
        raise DataError(
            f"The {split.name} split has only {len(split)} tokens, but seq_len={seq_len} needs at least "
            f"{seq_len + 1} (one window of seq_len + 1). Use a shorter seq_len or more data "
            "(e.g. raise data.max_train_bytes, data.val_fraction or the number of synthetic examples)."
        )


def make_batch(split: TokenSplit, starts: np.ndarray, seq_len: int) -> Batch:
    """The batch whose row i is the window of seq_len + 1 tokens beginning at token starts[i]. Targets the loss mask
    excludes are IGNORE_INDEX, and with isolated documents those of a document the window does not hold whole
    (unless it starts it: a document longer than a window) and those that cross into the next document."""
    rows = np.stack([split.tokens(int(s), int(s) + seq_len + 1) for s in starts]) if len(starts) else \
        np.zeros((0, seq_len + 1), dtype=np.int64)
    plain = np.zeros((len(starts), seq_len), dtype=bool)
    plain[:, 0] = True
    ds = split.doc_starts
    for i, s in enumerate(starts):
        lo, hi = np.searchsorted(ds, [s, s + seq_len], side="left")
        plain[i, ds[lo:hi] - s] = True
    targets = rows[:, 1:].copy()
    segment_ids = None
    if len(starts) and (split.loss_mask is not None or split.isolate):
        positions = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len + 1)
        if split.loss_mask is not None:
            targets[np.asarray(split.loss_mask[positions[:, 1:]]) == 0] = IGNORE_INDEX
        if split.isolate:
            docs = np.searchsorted(ds, positions, side="right") - 1
            doc_start = ds[docs[:, 1:]]
            doc_end = np.append(ds, len(split))[docs[:, 1:] + 1]
            whole = (doc_start >= positions[:, :1]) & (doc_end <= positions[:, -1:] + 1)
            targets[~(whole | (doc_start == positions[:, :1])) | (docs[:, 1:] != docs[:, :-1])] = IGNORE_INDEX
            segment_ids = torch.from_numpy(docs[:, :-1] - docs[:, :1])
    rows_t = torch.from_numpy(rows)
    return Batch(rows_t[:, :-1].contiguous(), torch.from_numpy(targets), torch.from_numpy(plain), segment_ids)


class TokenSplit:
    """One split's token stream (memory-mapped shards seen as one array), its document starts and, for
    record formats, its loss mask (1 = a training target; None: every token is) and document isolation."""

    def __init__(self, name: str, shards: list[np.ndarray], doc_starts: np.ndarray,
                 loss_mask: np.ndarray | None = None, isolate: bool = False) -> None:
        self.name = name
        self.shards = shards
        self.shard_offsets = np.cumsum([0] + [len(s) for s in shards])
        self.doc_starts = doc_starts
        self.loss_mask = loss_mask
        self.isolate = isolate

    def __len__(self) -> int:
        return int(self.shard_offsets[-1])

    @property
    def num_documents(self) -> int:
        return len(self.doc_starts)

    def window_starts(self, seq_len: int) -> np.ndarray:
        """First tokens of the training windows (seq_len + 1 tokens each): at stride seq_len, or with isolated
        documents, whole documents packed greedily, each window starting at the first document the previous one
        cannot hold entirely."""
        check_split_length(self, seq_len)
        if not self.isolate:
            return np.arange((len(self) - 1) // seq_len, dtype=np.int64) * seq_len
        ds, last = self.doc_starts, len(self) - seq_len - 1
        ends = np.append(ds[1:], len(self))
        starts, index = [], 0
        while index < len(ds) and ds[index] <= last:
            start = int(ds[index])
            starts.append(start)
            # The window holds tokens start .. start + seq_len; `reach` documents start inside it, and the
            # last of them, if it runs past the window's end, starts the next window.
            reach = int(np.searchsorted(ds, start + seq_len, side="right"))
            cut = ends[reach - 1] > start + seq_len + 1
            index = max(reach - 1 if cut else reach, index + 1)
        return np.asarray(starts, dtype=np.int64)

    def cut_documents(self, seq_len: int) -> tuple[int, int, int]:
        """What windows of seq_len + 1 tokens cut, with isolated documents: (documents longer than a window, those of
        them with no trained target inside their window, the longest document's length)."""
        if not self.isolate or not len(self.doc_starts):
            return 0, 0, 0
        lengths = np.diff(np.append(self.doc_starts, len(self)))
        long = self.doc_starts[lengths > seq_len + 1]
        untrained = 0
        if self.loss_mask is not None:
            targets = np.arange(1, seq_len + 1)  # a window's targets: its tokens 1 .. seq_len
            for first in range(0, len(long), 4096):
                positions = long[first : first + 4096, None] + targets
                untrained += int((np.asarray(self.loss_mask[positions]) == 0).all(axis=1).sum())
        return len(long), untrained, int(lengths.max())

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as int64, read across shard boundaries."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"token range [{start}, {stop}) outside split of {len(self)} tokens")
        k = int(np.searchsorted(self.shard_offsets, start, side="right")) - 1
        pieces = []
        while start < stop:
            lo = start - int(self.shard_offsets[k])
            hi = min(stop, int(self.shard_offsets[k + 1])) - int(self.shard_offsets[k])
            pieces.append(self.shards[k][lo:hi])
            start += hi - lo
            k += 1
        return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)

    def eval_batches(self, seq_len: int, batch_size: int, max_batches: int | None = None,
                     rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        """Validation batches over the windows in order. With several ranks each batch is shared out as in
        TokenLoader, the last cut to a multiple of world_size so every rank runs the same steps (FSDP's lockstep)."""
        check_split_length(self, seq_len)
        if batch_size < 1 or batch_size % world_size or not 0 <= rank < world_size:
            raise ConfigError(
                f"eval batch_size={batch_size} must be a positive multiple of world_size={world_size} "
                f"(and 0 <= rank={rank} < world_size)."
            )
        starts = self.window_starts(seq_len)
        n_windows = len(starts)
        if max_batches is not None:
            n_windows = min(n_windows, max_batches * batch_size)
        for first in range(0, n_windows, batch_size):
            count = min(batch_size, n_windows - first)
            count -= count % world_size
            if count == 0:
                break
            yield make_batch(self, starts[first : first + count][rank::world_size], seq_len)


@dataclass
class PreparedDataset:
    """A prepared dataset directory: its manifest, tokenizer and splits ("train", "val")."""

    path: Path
    manifest: dict
    tokenizer: Tokenizer
    _splits: dict[str, TokenSplit] = field(default_factory=dict, repr=False)

    @property
    def config(self) -> DataConfig:
        return DataConfig.from_dict(self.manifest["data_config"])

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def split(self, name: str) -> TokenSplit:
        if name not in self.manifest["splits"]:
            raise DataError(f"Dataset {self.path} has no split {name!r}; it has "
                            f"{', '.join(self.manifest['splits'])}.")
        if name not in self._splits:
            info = self.manifest["splits"][name]
            dtype = np.dtype(self.manifest["dtype"])
            shards = [np.memmap(self.path / s["file"], dtype=dtype, mode="r") for s in info["shards"]]
            doc_starts = np.load(self.path / info["doc_starts"]["file"])
            mask = info.get("loss_mask")
            loss_mask = np.memmap(self.path / mask["file"], dtype=np.uint8, mode="r") if mask else None
            self._splits[name] = TokenSplit(name, shards, doc_starts, loss_mask,
                                            bool(self.manifest.get("isolate_documents")))
        return self._splits[name]


def open_dataset(path: str | Path, verify: bool = True) -> PreparedDataset:
    """Open a prepared dataset, every file checked for its size and, with `verify`, its sha256."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        if path.is_dir() and (any(path.glob("*_[0-9][0-9][0-9].bin")) or (path / TOKENIZER_DIR).exists()):
            raise DataError(
                f"{path} is an incomplete dataset: it has token shards but no {MANIFEST} (preparation was "
                "interrupted). Re-run `fullband prepare` with the same output directory to finish it."
            )
        raise DataError(
            f"No prepared dataset at {path} (no {MANIFEST}). Run `fullband prepare` to create it, or "
            "check the path."
        )
    manifest = _read_manifest(path)
    for name, info in manifest["splits"].items():
        for entry in [*info["shards"], info["doc_starts"], *([info["loss_mask"]] if "loss_mask" in info else [])]:
            problem = file_problem(path / entry["file"], entry, verify)
            if problem:
                raise DataError(f"Dataset {path}, {name} split: {problem} (in the manifest). The directory was "
                                "modified after preparation; re-run `fullband prepare` with overwrite (or restore "
                                "the file).")
    tok = load_tokenizer(path / manifest["tokenizer"]["dir"])
    if tok.fingerprint() != manifest["tokenizer"]["fingerprint"]:
        raise DataError(f"The tokenizer in {path / TOKENIZER_DIR} is not the one the dataset was prepared "
                        "with (fingerprint differs). Re-run `fullband prepare` with overwrite.")
    return PreparedDataset(path, manifest, tok)

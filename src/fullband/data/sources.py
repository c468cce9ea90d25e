"""Document sources: every ``DataConfig.source`` becomes a deterministic stream of (doc_id, text or record), and
each document goes to train or val by a stable hash of its id (docs/data.md)."""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import importlib
import io
import itertools
import json
import os
import platform
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fullband.data.config import DataConfig
from fullband.data.synthetic import Example, SyntheticTask, get_task, synthetic_examples
from fullband.errors import ConfigError, DataError

SPLITS = ("train", "val")
# File kinds by name ending; compressed JSON Lines are streamed (read in one pass, never whole).
FILE_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
# Directories of the standard library that are not ordinary library code: tests (some with
# deliberately broken encodings or syntax), third-party packages and build leftovers.
_STDLIB_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_VAL_SPLIT_NAMES = ("validation", "valid", "val")

CHAT_ROLES = ("system", "user", "assistant")
# A document: a text, or a record of the chat / prompt_answer formats (see the module docstring).
Document = str | dict
# A raw source yields (doc_id, document, split). document None = an unreadable file that was skipped;
# split None = let the id hash decide.
RawDoc = tuple[str, Document | None, str | None]


@dataclass
class SplitStats:
    documents: int = 0
    text_bytes: int = 0
    skipped_files: int = 0


def split_of(doc_id: str, val_fraction: float) -> str:
    """'val' for a stable val_fraction share of ids, 'train' for the rest."""
    h = int.from_bytes(hashlib.sha1(doc_id.encode("utf-8")).digest()[:8], "big")
    return "val" if h / 2**64 < val_fraction else "train"


def byte_cap(cfg: DataConfig, split: str) -> int | None:
    """Bytes of text a split may use: max_train_bytes for train, the val_fraction share of it for val. Synthetic
    val sets are never capped: they must stay `synthetic_val_set`, on which accuracy is measured."""
    if cfg.max_train_bytes is None or (split == "val" and cfg.source.startswith("synthetic:")):
        return None
    if split == "train":
        return cfg.max_train_bytes
    return max(1, round(cfg.max_train_bytes * cfg.val_fraction / (1 - cfg.val_fraction)))


def resolve_format(cfg: DataConfig) -> str:
    """data.format with "auto" resolved: chat if the source's first record has `messages`, prompt_answer
    if it has `prompt` and `answer`, else text. Text-only sources (pystdlib, .txt) and synthetic tasks
    resolve to text."""
    if cfg.format != "auto":
        if cfg.format != "text" and (cfg.source == "pystdlib" or _all_text_files(cfg)):
            raise ConfigError(
                f"data.format={cfg.format!r} needs records (.jsonl, .parquet, `datasets` or synthetic:<task> "
                f"for prompt_answer), but data.source {cfg.source!r} is plain text. Use data.format text."
            )
        if cfg.format == "chat" and cfg.source.startswith("synthetic:"):
            raise ConfigError("synthetic tasks have no conversations: use data.format prompt_answer or text, or "
                              "write chat records with scripts/make_chat_data.py.")
        return cfg.format
    if cfg.source == "pystdlib" or cfg.source.startswith("synthetic:") or _all_text_files(cfg):
        return "text"
    keys = _first_record_keys(cfg)
    if "messages" in keys:
        return "chat"
    if {"prompt", "answer"} <= keys:
        return "prompt_answer"
    return "text"


def isolates_documents(cfg: DataConfig, fmt: str) -> bool:
    """Whether packed documents are kept from attending to each other (data.isolate_documents)."""
    return cfg.isolate_documents if cfg.isolate_documents is not None else fmt != "text"


def document_bytes(doc: Document) -> int:
    """UTF-8 size of a document's text (a record's: all its strings), for the byte cap and statistics."""
    if isinstance(doc, str):
        return len(doc.encode("utf-8"))
    if "messages" in doc:
        return sum(len(m["content"].encode("utf-8")) for m in doc["messages"])
    return len(doc["prompt"].encode("utf-8")) + len(doc["answer"].encode("utf-8"))


def iter_documents(cfg: DataConfig, split: str, stats: SplitStats | None = None,
                   fmt: str | None = None) -> Iterator[tuple[str, Document]]:
    """The non-empty (doc_id, document) pairs of one split, in a fixed order, up to `max_train_bytes`: the text that
    crosses it is cut there (`cut_at_cap`), a record dropped. `stats` is filled in as the iterator is consumed;
    `fmt`: the resolved data.format (default: `resolve_format(cfg)`)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}")
    fmt = fmt or resolve_format(cfg)
    stats = stats if stats is not None else SplitStats()
    cap = byte_cap(cfg, split)
    synthetic = cfg.source.startswith("synthetic:")
    for doc_id, doc, doc_split in _raw_documents(cfg, split, fmt):
        if (doc_split or split_of(doc_id, cfg.val_fraction)) != split:
            continue
        if doc is None:
            stats.skipped_files += 1
            continue
        if not doc:
            continue
        size, room = document_bytes(doc), None if cap is None else cap - stats.text_bytes
        if room is not None and size > room and isinstance(doc, dict):
            return
        last = room is not None and size >= room and isinstance(doc, str)
        if last:
            doc = cut_at_cap(doc.encode("utf-8"), room, synthetic)
            size = len(doc.encode("utf-8"))
        if doc:
            stats.documents += 1
            stats.text_bytes += size
            yield doc_id, doc
        if last:
            return


def cut_at_cap(data: bytes, room: int, synthetic: bool) -> str:
    """The text (UTF-8 `data`) that reaches the byte cap, cut to its `room` bytes on a character boundary; ""
    for a synthetic example that does not fit whole, as half an example teaches nothing."""
    return "" if synthetic and len(data) > room else data[:room].decode("utf-8", errors="ignore")


def describe_source(cfg: DataConfig) -> dict:
    """What the source resolved to, for the manifest (helps to tell datasets apart later)."""
    if cfg.source == "pystdlib":
        return {"kind": "pystdlib", "root": sysconfig.get_paths()["stdlib"], "python": platform.python_version()}
    if cfg.source.startswith("synthetic:"):
        return {"kind": "synthetic", "task": cfg.source.removeprefix("synthetic:")}
    if cfg.source.startswith("hf:"):
        return {"kind": "hf", "name": cfg.source.removeprefix("hf:")}
    return {"kind": "files", "paths": [str(p) for p in _resolve_paths(cfg.source)]}


def _raw_documents(cfg: DataConfig, split: str, fmt: str) -> Iterator[RawDoc]:
    # The same work units as a parallel prepare reads, one after the other, so the two cannot disagree.
    for unit in plan_units(cfg):
        yield from unit_documents(cfg, unit, fmt, only=split)


def _all_text_files(cfg: DataConfig) -> bool:
    if cfg.source == "pystdlib" or cfg.source.startswith(("synthetic:", "hf:")):
        return False
    return all(file_kind(p) == ".txt" for p in _resolve_paths(cfg.source))


def _first_record_keys(cfg: DataConfig) -> set[str]:
    """The field names of the source's first record (a .jsonl line, a Parquet or `datasets` schema)."""
    if cfg.source.startswith("hf:"):
        with _hf_errors(cfg.source):
            dd = _hf_stream(cfg)
            return set(next(iter(dd[next(iter(dd.keys()))]), {}))
    for path in _resolve_paths(cfg.source):
        if path.is_dir():
            return set(_saved_parts(path)[0][2].column_names or [])
        if file_kind(path) == ".parquet":
            return set(_parquet_file(path).schema_arrow.names)
        if file_kind(path) != ".txt":
            for _, record in _jsonl_records(path):
                return set(record) if isinstance(record, dict) else set()
    return set()


def structured_record(record: object, fmt: str, where: str) -> dict:
    """A chat / prompt_answer record checked and reduced to the fields that are used."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is not a JSON object; data.format={fmt} needs objects.")
    if fmt == "prompt_answer":
        for key in ("prompt", "answer"):
            if not isinstance(record.get(key), str):
                raise DataError(
                    f"{where}: data.format=prompt_answer needs string fields 'prompt' and 'answer'; "
                    f"{key!r} is {type(record.get(key)).__name__}. Fix the record or choose another data.format."
                )
        return {"prompt": record["prompt"], "answer": record["answer"]}
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: data.format=chat needs a non-empty list 'messages' of "
                        '{"role": ..., "content": ...} objects (the OpenAI format).')
    clean = check_messages(messages, where)
    if not any(m["role"] == "assistant" for m in clean):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing would be trained on; "
                        "remove it or add the assistant's answer.")
    return {"messages": clean}


def check_messages(messages: object, where: str = "") -> list[dict]:
    """OpenAI-style messages reduced to role and content; DataError (with what to fix, after `where`, the
    record's place) otherwise."""
    at = f"{where}: " if where else ""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f'{at}messages must be a non-empty list of {{"role": ..., "content": ...}} objects')
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{at}message {i} must be an object with 'role' in {', '.join(CHAT_ROLES)} and a "
                            f"string 'content', got {m!r:.200}.")
        clean.append({"role": m["role"], "content": m["content"]})
    return clean


# --- Work units ----------------------------------------------------------------------------------
# A source is cut into work units: deterministic pieces in document order (groups of small files, a byte
# range of a big .jsonl, row groups of a Parquet file, row ranges of a `datasets` split). Each unit is read
# on its own, so `fullband prepare --workers N` tokenizes units in parallel and stitches their outputs in
# unit order. Units depend only on the corpus (file names, sizes, metadata) and unit_bytes, never on N.

# A JSON-serialisable description of one unit ("kind" plus what locates it); the resume plan stores them.
Unit = dict


def plan_units(cfg: DataConfig, unit_bytes: int | None = None) -> list[Unit]:
    """The work units of `cfg.source` in document order, each of about `unit_bytes` of input (None: one
    unit per file or `datasets` split). Reads only names, sizes and metadata, except that a .jsonl file
    larger than a unit is scanned once for line starts (its ids are line numbers)."""
    if unit_bytes is not None and unit_bytes < 1:
        raise ConfigError(f"unit_bytes={unit_bytes} must be positive.")
    if cfg.source == "pystdlib":
        root, files = pystdlib_files()
        if not files:
            raise DataError(
                f"Found no .py files in the Python standard library at {root}; this interpreter ships "
                "without its library sources. Use another data.source (e.g. a path to .txt files)."
            )
        sizes = [(root / f).stat().st_size for f in files]
        return [{"kind": "pystdlib", "files": group} for group in _group_by_size(files, sizes, unit_bytes)]
    if cfg.source.startswith("synthetic:"):
        return [{"kind": "synthetic"}]  # generated from seeds: small, and val must be drawn before train
    if cfg.source.startswith("hf:"):
        return [{"kind": "hf"}]  # a stream has no random access: read start to end as one unit
    return _file_units(cfg.source, unit_bytes)


def unit_documents(cfg: DataConfig, unit: Unit, fmt: str, only: str | None = None) -> Iterator[RawDoc]:
    """The raw documents of one work unit in order; `only` (a split name) may skip, without reading them,
    whole-file documents of the other split."""

    def wanted(doc_id: str) -> bool:
        return only is None or split_of(doc_id, cfg.val_fraction) == only

    kind = unit["kind"]
    if kind == "pystdlib":
        yield from _pystdlib_documents(unit["files"], wanted)
    elif kind == "synthetic":
        for split in [only] if only else SPLITS:
            yield from _synthetic_documents(cfg, split, fmt)
    elif kind == "hf":
        yield from _hf_documents(cfg, fmt)
    elif kind == "single_txt":
        yield from _single_text_documents(Path(unit["path"]), cfg.val_fraction)
    elif kind == "txt_files":
        for path, rel in zip(map(Path, unit["paths"]), unit["rels"]):
            if fmt != "text":
                raise DataError(f"{path} is plain text, but data.format={fmt} needs records (.jsonl, .parquet or "
                                "`datasets`); remove it from data.source or use data.format text.")
            if wanted(rel):
                yield rel, _decode(path.read_bytes(), path), None
    elif kind == "jsonl":
        yield from _jsonl_documents(Path(unit["path"]), unit["rel"], cfg.text_field, fmt,
                                    unit["start"], unit["stop"], unit["line"])
    elif kind == "parquet":
        yield from _parquet_documents(Path(unit["path"]), unit["rel"], cfg.text_field, fmt,
                                      range(*unit["row_groups"]), unit["first_row"])
    elif kind == "saved":
        yield from _saved_dataset_documents(unit, cfg.text_field, fmt)
    else:
        raise ValueError(f"unknown work unit kind {kind!r}")


def _group_by_size(items: list, sizes: list[int], unit_bytes: int | None) -> list[list]:
    """Consecutive items grouped so that each group but the last holds at least unit_bytes."""
    if unit_bytes is None:
        return [items] if items else []
    groups: list[list] = [[]]
    total = 0
    for item, size in zip(items, sizes):
        if total >= unit_bytes:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += size
    return groups if groups[0] else []


# --- Python standard library ---------------------------------------------------------------------

def pystdlib_files() -> tuple[Path, list[str]]:
    """The stdlib root and its *.py files (relative posix paths, sorted), excluding tests and packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        rel = Path(dirpath).relative_to(root)
        files += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return root, sorted(files)


def _pystdlib_documents(files: list[str], wanted: Callable[[str], bool]) -> Iterator[RawDoc]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for rel in filter(wanted, files):
        try:
            yield rel, (root / rel).read_bytes().decode("utf-8"), None
        except (UnicodeDecodeError, OSError):
            yield rel, None, None


# --- Synthetic tasks -----------------------------------------------------------------------------

def synthetic_seed(seed: int, split: str) -> int:
    """Independent example seeds for the train and val splits, derived from DataConfig.seed."""
    return int.from_bytes(hashlib.sha256(f"fullband-synthetic:{seed}:{split}".encode()).digest()[:8], "big")


def synthetic_val_set(cfg: DataConfig) -> tuple[SyntheticTask, list[Example]]:
    """The task of a synthetic source and its validation examples (exactly the val split's documents),
    for measuring accuracy by generation."""
    if not cfg.source.startswith("synthetic:"):
        raise ConfigError(f"data.source {cfg.source!r} is not a synthetic task (synthetic:<task>).")
    task = get_task(cfg.source.removeprefix("synthetic:"))
    return task, synthetic_examples(task, cfg.synthetic_val_examples, synthetic_seed(cfg.seed, "val"))


def _synthetic_documents(cfg: DataConfig, split: str, fmt: str) -> Iterator[RawDoc]:
    def document(ex: Example) -> Document:
        # prompt_answer keeps Example.text's trailing newline in the answer, so both formats hold the same tokens.
        return ex.text if fmt == "text" else {"prompt": ex.prompt, "answer": ex.text[len(ex.prompt):]}

    task, val = synthetic_val_set(cfg)
    if split == "val":
        for i, ex in enumerate(val):
            yield f"val:{i}", document(ex), "val"
        return
    # Short tasks repeat examples; keep validation prompts out of training so accuracy is held-out.
    held_out = {ex.prompt for ex in val}
    train = synthetic_examples(task, cfg.synthetic_train_examples, synthetic_seed(cfg.seed, "train"))
    for i, ex in enumerate(train):
        if ex.prompt not in held_out:
            yield f"train:{i}", document(ex), "train"


# --- Local files ---------------------------------------------------------------------------------

def file_kind(path: Path) -> str | None:
    """The entry of FILE_SUFFIXES that `path`'s name ends with (None: not a supported file)."""
    return next((suffix for suffix in FILE_SUFFIXES if path.name.endswith(suffix)), None)


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _resolve_paths(source: str) -> list[Path]:
    """Files and save_to_disk directories named by a comma-separated list of paths/globs/dirs."""
    out: list[Path] = []
    for part in (p.strip() for p in source.split(",")):
        if not part:
            continue
        part = os.path.expanduser(part)
        if glob.has_magic(part):
            matches = sorted(Path(m) for m in glob.glob(part, recursive=True))
            matches = [m for m in matches if m.is_file() or _is_saved_dataset(m)]
            if not matches:
                raise DataError(
                    f"The glob {part!r} in data.source matches no files. Check the pattern (quote it "
                    "in the shell so it is not expanded early; use ** for subdirectories)."
                )
            out += matches
            continue
        path = Path(part)
        if not path.exists():
            raise DataError(
                f"data.source path {part!r} does not exist. Give an existing file, directory or glob "
                "(or 'pystdlib', 'synthetic:<task>', 'hf:<name>')."
            )
        if path.is_dir() and not _is_saved_dataset(path):
            found = sorted(p for p in path.rglob("*") if p.is_file() and file_kind(p))
            if not found:
                raise DataError(
                    f"Directory {part!r} in data.source contains no {', '.join(FILE_SUFFIXES)} files and is "
                    "not a `datasets` save_to_disk directory. Point data.source at your text files."
                )
            out += found
        else:
            out.append(path)
    for p in out:
        if p.is_file() and not file_kind(p):
            raise DataError(
                f"Unsupported file type {p} in data.source: supported are {', '.join(FILE_SUFFIXES)} "
                "(plain text, JSON Lines plain or gzip/zstd-compressed, Parquet) and `datasets` save_to_disk "
                "directories."
            )
    return list(dict.fromkeys(p.resolve() for p in out))


def _file_units(source: str, unit_bytes: int | None) -> list[Unit]:
    paths = _resolve_paths(source)
    if len(paths) == 1 and file_kind(paths[0]) == ".txt":
        return [{"kind": "single_txt", "path": str(paths[0])}]
    # Ids are relative to the files' common directory, so moving the corpus keeps the split.
    base = Path(os.path.commonpath([str(p) for p in paths]))
    if len(paths) == 1:
        base = base.parent
    units: list[Unit] = []
    for texts, run in itertools.groupby(paths, key=lambda p: file_kind(p) == ".txt"):
        run = list(run)
        if texts:  # a run of consecutive .txt files, grouped into units by size
            units += [{"kind": "txt_files", "paths": [str(p) for p in group],
                       "rels": [p.relative_to(base).as_posix() for p in group]}
                      for group in _group_by_size(run, [p.stat().st_size for p in run], unit_bytes)]
            continue
        for path in run:
            rel, kind = path.relative_to(base).as_posix(), file_kind(path)
            if path.is_dir():
                units += _saved_dataset_units(path, rel, unit_bytes)
            elif kind == ".parquet":
                units += _parquet_units(path, rel, unit_bytes)
            else:
                # Compressed streams cannot be entered in the middle: one unit per file.
                ranges = _jsonl_ranges(path, unit_bytes) if kind == ".jsonl" else [(0, None, 1)]
                units += [{"kind": "jsonl", "path": str(path), "rel": rel, "start": start, "stop": stop,
                           "line": line} for start, stop, line in ranges]
    return units


def _jsonl_ranges(path: Path, unit_bytes: int | None) -> list[tuple[int, int | None, int]]:
    """(start byte, stop byte, line number at start) of the units of a .jsonl file: each starts at the
    first line start at or after the previous start + unit_bytes."""
    size = path.stat().st_size
    if unit_bytes is None or size <= unit_bytes:
        return [(0, None, 1)]
    ranges, start, line = [], 0, 1
    with open(path, "rb") as f:
        while start < size:
            # Up to the first newline at or after byte start + unit_bytes - 1: the next start is a line start.
            f.seek(start + unit_bytes - 1)
            f.readline()
            stop = f.tell()
            ranges.append((start, stop if stop < size else None, line))  # the last unit reads to the end
            f.seek(start)
            line += sum(chunk.count(b"\n") for chunk in _chunks(f, stop - start))
            start = stop
    return ranges


def _chunks(f: io.BufferedIOBase, n: int, size: int = 2**24) -> Iterator[bytes]:
    """The next ``n`` bytes of ``f``, ``size`` at a time."""
    while n > 0:
        chunk = f.read(min(size, n))
        if not chunk:
            return
        n -= len(chunk)
        yield chunk


def _single_text_documents(path: Path, val_fraction: float) -> Iterator[RawDoc]:
    """One plain-text file (a novel, a code dump) is split by position, as nanoGPT does: the first
    1 - val_fraction of its lines train, the rest validate. A hash of one id would put it all in one split."""
    lines = _decode(path.read_bytes(), path).splitlines(keepends=True)
    cut = round(len(lines) * (1 - val_fraction))
    yield f"{path.name}#train", "".join(lines[:cut]), "train"
    yield f"{path.name}#val", "".join(lines[cut:]), "val"


def _decode(data: bytes, path: Path, line: int | None = None, offset: int = 0) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"{path}:{line}" if line is not None else str(path)
        raise DataError(
            f"{where} is not valid UTF-8 (byte offset {offset + e.start} of the "
            f"{'decompressed ' if file_kind(path) in ('.jsonl.gz', '.jsonl.zst') else ''}file). Convert "
            "the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove it from data.source."
        ) from None


def _open_jsonl(path: Path) -> io.BufferedIOBase:
    """A .jsonl file for reading bytes, decompressed on the fly if it is .jsonl.gz or .jsonl.zst."""
    kind = file_kind(path)
    if kind == ".jsonl.gz":
        return gzip.open(path, "rb")
    if kind == ".jsonl.zst":
        zstandard = _import_data_package("zstandard", f"Reading {path}")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _read_errors(path: Path) -> tuple[type[Exception], ...]:
    """What a damaged file raises while it is read (gzip: OSError/EOFError; zstd: its own error)."""
    if file_kind(path) == ".jsonl.zst":
        import zstandard

        return OSError, EOFError, zstandard.ZstdError
    return OSError, EOFError


def _jsonl_records(path: Path, start: int = 0, stop: int | None = None,
                   first_line: int = 1) -> Iterator[tuple[int, object]]:
    """(line number, JSON value) of the non-blank lines [start, stop) (bytes; every line starting before stop)
    of a JSON Lines file."""
    offset = start
    try:
        with _open_jsonl(path) as f:
            if start:  # only plain .jsonl units start inside a file; compressed streams cannot seek
                f.seek(start)
            for lineno, raw in enumerate(f, start=first_line):
                if stop is not None and offset >= stop:
                    break
                line = _decode(raw, path, lineno, offset).strip()
                offset += len(raw)
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno} is not valid JSON ({e.msg}). Each line of a .jsonl file "
                                    "must be one JSON object.") from None
                yield lineno, record
    except _read_errors(path) as e:
        raise DataError(f"{path} could not be read after byte {offset} ({type(e).__name__}: {e}): the file is "
                        "truncated, corrupt or not what its name says. Re-download it or remove it from "
                        "data.source.") from e


def _jsonl_documents(path: Path, rel: str, field: str, fmt: str, start: int, stop: int | None,
                     first_line: int) -> Iterator[RawDoc]:
    for lineno, record in _jsonl_records(path, start, stop, first_line):
        if fmt != "text":
            yield f"{rel}:{lineno}", structured_record(record, fmt, f"{path}:{lineno}"), None
            continue
        if not isinstance(record, dict) or field not in record:
            raise DataError(
                f"{path}:{lineno} has no field {field!r}. Set --data.text_field to the key holding "
                "the text, or fix that line."
            )
        if not isinstance(record[field], str):
            raise DataError(f"{path}:{lineno}: field {field!r} is {type(record[field]).__name__}, not a string.")
        yield f"{rel}:{lineno}", record[field], None


def _parquet_file(path: Path):
    pq = _import_data_package("pyarrow.parquet", f"Reading {path}")
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e}). Re-download it or "
                        "remove it from data.source.") from e


def _parquet_units(path: Path, rel: str, unit_bytes: int | None) -> list[Unit]:
    """Runs of whole row groups of about unit_bytes (uncompressed) each."""
    meta = _parquet_file(path).metadata
    sizes = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
    units, first_row = [], 0
    for group in _group_by_size(list(range(meta.num_row_groups)), sizes, unit_bytes):
        units.append({"kind": "parquet", "path": str(path), "rel": rel, "row_groups": [group[0], group[-1] + 1],
                      "first_row": first_row})
        first_row += sum(meta.row_group(i).num_rows for i in group)
    return units


def _parquet_documents(path: Path, rel: str, field: str, fmt: str, row_groups: range,
                       first_row: int) -> Iterator[RawDoc]:
    pf = _parquet_file(path)
    columns = _used_columns(pf.schema_arrow.names, str(path), field, fmt)
    rows = (row for batch in pf.iter_batches(row_groups=row_groups, columns=columns) for row in batch.to_pylist())
    yield from _table_documents(rows, str(path), field, fmt, f"{rel}:", None, first_row)


# --- Tables: Parquet files and `datasets` ------------------------------------------------------------

def _used_columns(columns: list[str], origin: str, field: str, fmt: str) -> list[str]:
    """The columns a document is made of in data.format `fmt`; DataError if the table lacks one."""
    used = {"text": [field], "chat": ["messages"], "prompt_answer": ["prompt", "answer"]}[fmt]
    missing = [c for c in used if c not in columns]
    if missing:
        raise DataError(
            f"{origin} has no column {', '.join(map(repr, missing))} (columns: {', '.join(columns)}). "
            + ("Set --data.text_field to the column holding the text." if fmt == "text" else
               f"data.format={fmt} needs the column(s) {', '.join(used)}.")
        )
    return used


def _table_documents(rows: Iterable[dict], origin: str, field: str, fmt: str, id_prefix: str, split: str | None,
                     first: int = 0) -> Iterator[RawDoc]:
    """The documents of a table's rows; `first`: the number of its first row in the whole table."""
    for i, record in enumerate(rows, start=first):
        if fmt != "text":
            yield f"{id_prefix}{i}", structured_record(record, fmt, f"{origin} row {i}"), split
            continue
        text = record.get(field)
        if text is not None and not isinstance(text, str):
            raise DataError(f"{origin} row {i}: column {field!r} holds {type(text).__name__}, not text.")
        yield f"{id_prefix}{i}", text or "", split


def _import_data_package(module: str, what: str):
    """An optional dependency of fullband[data] (datasets, pyarrow, zstandard), imported on first use."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what} needs the `{module.split('.')[0]}` package, which is not installed. Run: "
                        "pip install 'fullband[data]'.") from None


def _dataset_documents(ds, origin: str, field: str, fmt: str, id_prefix: str, split: str | None,
                       first: int = 0) -> Iterator[RawDoc]:
    """The documents of a `datasets` Dataset (or a stream of one, whose columns may be unknown)."""
    if ds.column_names is not None:
        ds = ds.select_columns(_used_columns(ds.column_names, origin, field, fmt))  # decode only those
    yield from _table_documents(ds, origin, field, fmt, id_prefix, split, first)


def _dict_splits(names: list[str], origin: str) -> list[tuple[str, str | None]]:
    """(split name, the fullband split it goes to: None = decided by the id hash) of a DatasetDict: its
    train split (or only split), plus its validation split if it has one."""
    train = "train" if "train" in names else names[0] if len(names) == 1 else None
    if train is None:
        raise DataError(f"{origin} has splits {', '.join(names)} but none called 'train'; "
                        "save the split to use with save_to_disk, or name it 'train'.")
    val = next((n for n in _VAL_SPLIT_NAMES if n in names), None)
    return [(train, "train"), (val, "val")] if val else [(train, None)]


def _saved_parts(path: Path) -> list[tuple[str | None, str | None, object]]:
    """(split name, fullband split as in `_dict_splits`, Dataset) of the splits of a save_to_disk directory
    that are used; a single Dataset is one part without a name."""
    datasets = _import_data_package("datasets", f"Loading the save_to_disk directory {path}")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"Could not load {path} with datasets.load_from_disk ({e}). Is it a complete "
                        "save_to_disk directory?") from e
    if isinstance(ds, datasets.DatasetDict):
        return [(name, split, ds[name]) for name, split in _dict_splits(list(ds.keys()), str(path))]
    return [(None, None, ds)]


def _saved_dataset_units(path: Path, rel: str, unit_bytes: int | None) -> list[Unit]:
    """Row ranges of about unit_bytes (by the split's average row size) of a save_to_disk directory."""
    units = []
    for name, split, d in _saved_parts(path):
        rows = d.num_rows if unit_bytes is None else max(1, unit_bytes * d.num_rows // max(1, d.data.nbytes))
        units += [{"kind": "saved", "path": str(path), "rel": rel, "split_name": name, "split": split,
                   "start": start, "stop": min(start + rows, d.num_rows)} for start in range(0, d.num_rows, rows)]
    return units


def _saved_dataset_documents(unit: Unit, field: str, fmt: str) -> Iterator[RawDoc]:
    path, name, rel = Path(unit["path"]), unit["split_name"], unit["rel"]
    ds = next(d for part, _, d in _saved_parts(path) if part == name)
    origin, prefix = (f"{path} [{name}]", f"{rel}:{name}:") if name is not None else (str(path), f"{rel}:")
    rows = ds.select(range(unit["start"], unit["stop"]))
    yield from _dataset_documents(rows, origin, field, fmt, prefix, unit["split"], first=unit["start"])


def _hf_stream(cfg: DataConfig):
    """The DatasetDict of an hf: source, streamed: only as much is read as is used, which matters with
    max_train_bytes on big corpora."""
    name, _, config = cfg.source.removeprefix("hf:").partition(":")
    datasets = _import_data_package("datasets", f"data.source {cfg.source!r}")
    return datasets.load_dataset(name, config or None, streaming=True)


@contextlib.contextmanager
def _hf_errors(source: str) -> Iterator[None]:
    """Loading and streaming an hf: source's failures (no network, a wrong name) as a DataError that says why."""
    try:
        yield
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"Could not load the Hugging Face dataset {source.removeprefix('hf:')!r} ({type(e).__name__}: {e}). "
            "hf: sources need network access to the Hugging Face Hub (or a warm cache) and a correct name/config. "
            "Offline, download it elsewhere, save it with save_to_disk and pass that directory instead."
        ) from e


def _hf_documents(cfg: DataConfig, fmt: str) -> Iterator[RawDoc]:
    origin = f"Hugging Face dataset {cfg.source.removeprefix('hf:')!r}"
    with _hf_errors(cfg.source):
        dd = _hf_stream(cfg)
        for name, split in _dict_splits(list(dd.keys()), origin):
            yield from _dataset_documents(dd[name], f"{origin} [{name}]", cfg.text_field, fmt, f"{name}:", split)

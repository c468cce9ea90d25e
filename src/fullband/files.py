"""Files recorded by their size and sha256 (a checkpoint's manifest, a prepared dataset's) and written durably: the
one check and the one fsync for training checkpoints and prepared data alike."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import IO, Any


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """The size and sha256 of a written file, as manifests record them."""
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def file_problem(path: Path, record: dict[str, Any], hashes: bool = True, name: str | None = None) -> str | None:
    """What is wrong with a file against its record: missing, another size, or (with ``hashes``) another sha256;
    None: nothing. ``name``: how the message names it (default: the file's name)."""
    name = name or path.name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{name} has {size} bytes, the manifest says {record['bytes']} (truncated or replaced)"
    if hashes and sha256_of(path) != record["sha256"]:
        return f"{name} does not match its sha256 (corrupt)"
    return None


def fsync_close(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


def fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(directory: Path) -> None:
    """Every file under ``directory`` flushed to disk (before the directory is renamed into place)."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())

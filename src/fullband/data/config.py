"""DataConfig: everything that determines the token streams of a prepared dataset."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from fullband.data.synthetic import get_task
from fullband.errors import ConfigError

# Bump when the way documents become tokens changes, so old prepared datasets are not reused.
# 2: per-token loss masks, record formats (chat, prompt_answer) and isolated documents.
DATA_FORMAT_VERSION = 2

BYTE_VOCAB_SIZE = 259  # 256 bytes + <bos>, <eos>, <pad>

_FIELD_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "int | None": (int, type(None)),
                "bool | None": (bool, type(None))}
# How a record becomes a training document: "text" (one text field, every token a target), "chat"
# (OpenAI-style `messages`, loss on assistant turns) or "prompt_answer" (loss on the answer).
RECORD_FORMATS = ("auto", "text", "chat", "prompt_answer")


def described(default: Any, help: str) -> Any:
    """A dataclass field with its help text (``fullband train --help`` shows it); a list or dict default is
    copied for each instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes tokens."""

    source: str = described(
        "pystdlib",
        "'pystdlib' (the Python standard library of this interpreter), 'synthetic:<task>', comma-separated "
        "paths/globs of .txt/.jsonl/.jsonl.gz/.jsonl.zst/.parquet files or directories (a directory written by "
        "datasets' save_to_disk is loaded as such), or 'hf:<name>[:<config>]'",
    )
    text_field: str = described("text", "the field/column holding the text in .jsonl, .parquet and datasets sources")
    tokenizer: str = described(
        "byte", "'byte', 'bpe' (trained on the training text) or a local Hugging Face tokenizer directory")
    bpe_vocab_size: int = described(2048, "vocabulary size of the 'bpe' tokenizer")
    val_fraction: float = described(0.05, "share of documents held out for validation (by a hash of the document id)")
    max_train_bytes: int | None = described(
        None,
        "use at most this many bytes of training text (and a proportional amount of validation text; None = all); "
        "documents are taken in their fixed order, so the cap is deterministic",
    )
    synthetic_train_examples: int = described(20000, "training examples of a synthetic:<task> source")
    synthetic_val_examples: int = described(500, "validation examples of a synthetic:<task> source")
    seed: int = described(0, "seed of the synthetic data generator")
    format: str = described(
        "auto",
        "record format: 'text', 'chat' (records with `messages`: [{role: system|user|assistant, content: ...}], "
        "loss on assistant turns including their end-of-turn token), 'prompt_answer' (records with `prompt` and "
        "`answer`, loss on the answer and the end-of-document token) or 'auto': chat if the first record has "
        "`messages`, prompt_answer if it has `prompt` and `answer`, else text (synthetic tasks: text)",
    )
    isolate_documents: bool | None = described(
        None,
        "packed documents do not attend to each other (block-diagonal causal mask, positions restarting per "
        "document); None = true for chat and prompt_answer, false for text",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value, allowed = getattr(self, f.name), _FIELD_TYPES[str(f.type)]
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise ConfigError(
                    f"data.{f.name}={value!r} has the wrong type: expected {f.type}."
                )
        if not self.source.strip():
            raise ConfigError(
                "data.source is empty. Use 'pystdlib', 'synthetic:<task>', a path or glob of "
                ".txt/.jsonl(.gz/.zst)/.parquet files, a save_to_disk directory, or 'hf:<name>[:<config>]'."
            )
        if self.source.startswith("synthetic:"):

            get_task(self.source.removeprefix("synthetic:"))
        if self.source.startswith("hf:") and not self.source.removeprefix("hf:").split(":")[0]:
            raise ConfigError(
                f"data.source {self.source!r} names no dataset; write it as hf:<name> or "
                "hf:<name>:<config>, e.g. hf:roneneldan/TinyStories."
            )
        if self.format not in RECORD_FORMATS:
            raise ConfigError(
                f"data.format={self.format!r} is not a record format; use one of {', '.join(RECORD_FORMATS)} "
                "(auto: detected from the first record's keys)."
            )
        if not self.text_field:
            raise ConfigError("data.text_field is empty; give the name of the column holding the text.")
        if not self.tokenizer:
            raise ConfigError(
                "data.tokenizer is empty; use 'byte', 'bpe' or the path of a local Hugging Face "
                "tokenizer directory (one containing tokenizer.json)."
            )
        if not BYTE_VOCAB_SIZE <= self.bpe_vocab_size <= 2**31 - 1:
            raise ConfigError(
                f"data.bpe_vocab_size={self.bpe_vocab_size} is out of range: a byte-level BPE needs at "
                f"least {BYTE_VOCAB_SIZE} entries (256 bytes and 3 special tokens)."
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(
                f"data.val_fraction={self.val_fraction} must be strictly between 0 and 1 "
                "(the share of documents held out for validation, e.g. 0.05)."
            )
        if self.max_train_bytes is not None and self.max_train_bytes <= 0:
            raise ConfigError(
                f"data.max_train_bytes={self.max_train_bytes} must be a positive number of bytes, "
                "or unset (None) to use all the text."
            )
        for name in ("synthetic_train_examples", "synthetic_val_examples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name}={getattr(self, name)} must be at least 1.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(
                f"Unknown data config field(s) {', '.join(unknown)}. "
                f"Known fields: {', '.join(sorted(known))}."
            )
        return cls(**d)

    def fingerprint(self) -> str:
        """sha256 of every field plus the data format version; not of the corpus (after editing it, prepare with
        overwrite)."""
        blob = json.dumps({"format_version": DATA_FORMAT_VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

"""Data: sources -> tokenizer -> prepared token shards -> deterministic, resumable batches."""

from fullband.data.config import DataConfig
from fullband.data.loader import TokenLoader
from fullband.data.shards import Batch, PreparedDataset, TokenSplit, open_dataset, prepare_dataset
from fullband.data.sources import synthetic_val_set
from fullband.data.synthetic import SYNTHETIC_TASKS, Example, SyntheticTask, get_task, synthetic_examples
from fullband.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
)

__all__ = [
    "DataConfig",
    "prepare_dataset",
    "open_dataset",
    "PreparedDataset",
    "TokenSplit",
    "TokenLoader",
    "Batch",
    "Tokenizer",
    "ByteTokenizer",
    "BPETokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "build_tokenizer",
    "SYNTHETIC_TASKS",
    "SyntheticTask",
    "Example",
    "get_task",
    "synthetic_examples",
    "synthetic_val_set",
]

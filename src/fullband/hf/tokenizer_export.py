"""Hugging Face tokenizer files for fullband's own tokenizers (byte and BPE), so that an export loads with
``AutoTokenizer`` and encodes, decodes and applies its chat template exactly as fullband (docs/huggingface.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend
from tokenizers import processors

from fullband.data.chat import BUILTIN_CHAT_TEMPLATE
from fullband.data.tokenizers import (
    CHAT_TOKENS,
    MARKER,
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)


def saved_tokenizer(directory: Path) -> Tokenizer | None:
    """The tokenizer fullband saved in ``directory`` (with its marker), or None (none there, or Hugging Face
    files copied as they are, e.g. by `fullband convert`)."""
    return load_tokenizer(directory) if (directory / MARKER).is_file() else None


def _own_or_builtin_chat(tokenizer: Tokenizer | None) -> bool:
    """Whether the export writes or amends the Hugging Face tokenizer files: a byte or BPE tokenizer, or a
    Hugging Face one extended with the built-in chat tokens."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.chat_template is None and tokenizer.has_chat_tokens
    return isinstance(tokenizer, (ByteTokenizer, BPETokenizer))


def generation_ids(tokenizer: Tokenizer | None) -> dict[str, Any]:
    """Entries for generation_config.json: bos/eos/pad ids of fullband's byte and BPE tokenizers, with <|im_end|>
    among the eos ids where the tokenizer has the built-in chat tokens; empty for other tokenizers."""
    if not _own_or_builtin_chat(tokenizer):
        return {}
    eos: Any = tokenizer.eos_id
    if tokenizer.has_chat_tokens:
        eos = [tokenizer.eos_id, tokenizer.token_to_id(CHAT_TOKENS[1])]
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_id}


def write_tokenizer_files(tokenizer: Tokenizer | None, dst: Path, max_length: int) -> None:
    """After the tokenizer directory's files were copied to ``dst``: write tokenizer.json, tokenizer_config.json
    and special_tokens_map.json for a byte or BPE tokenizer, or add the built-in chat template to an extended
    Hugging Face tokenizer's config."""
    if not _own_or_builtin_chat(tokenizer):
        return
    config_path = dst / "tokenizer_config.json"
    if isinstance(tokenizer, HFTokenizer):
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    else:
        backend = Backend.from_str(tokenizer._tok.to_str())
        bos, eos, pad = (tokenizer.id_to_token(i) for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id))
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)]
        )
        backend.save(str(dst / "tokenizer.json"))
        special: dict[str, Any] = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
        if tokenizer.has_chat_tokens:
            special["additional_special_tokens"] = list(CHAT_TOKENS)
        (dst / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "model_max_length": max_length,
            "padding_side": "left",  # decoder-only generation pads on the left
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": tokenizer._tok.encode_special_tokens,
        }
    if tokenizer.has_chat_tokens:
        config["chat_template"] = BUILTIN_CHAT_TEMPLATE
        config["additional_special_tokens"] = list(CHAT_TOKENS)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

"""Hugging Face tokenizer files for fullband's own tokenizers (byte and BPE), so that an exported model
loads with ``AutoTokenizer`` / ``pipeline("text-generation")`` and encodes and decodes exactly as fullband.

- byte: a byte-level BPE without merges whose 256 symbols are the bytes (ids 0..255, in byte order),
  special tokens after them. Plain byte tokenizers read special-token strings as bytes, so the export
  sets ``split_special_tokens``; the chat extension recognises them (see ``ByteTokenizer``), so it does not.
- bpe: the tokenizer's own ``tokenizer.json``.

Both get a post-processor that puts ``<bos>`` first, as ``fullband.loading.encode_prompt`` does, so that
``tokenizer(text)`` gives the ids a fullband prompt has (``add_special_tokens=False``: ``Tokenizer.encode``).
A tokenizer with fullband's chat tokens gets the built-in chat template and ``<|im_end|>`` as a stop token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fullband.data.chat import BUILTIN_CHAT_TEMPLATE
from fullband.data.tokenizers import (
    BPE_SPECIAL_TOKENS,
    CHAT_TOKENS,
    MARKER,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
)


def fullband_tokenizer(directory: Path) -> Tokenizer | None:
    """The byte or BPE tokenizer saved in ``directory`` by fullband, or None (none there, or a Hugging
    Face tokenizer, whose own files are exported as they are)."""
    if not (directory / MARKER).is_file():
        return None
    tokenizer = load_tokenizer(directory)
    return tokenizer if isinstance(tokenizer, (ByteTokenizer, BPETokenizer)) else None


def generation_ids(tokenizer: Tokenizer) -> dict[str, Any]:
    """bos/eos/pad ids for generation_config.json; eos includes the end-of-turn token of chat tokenizers,
    so that generation stops at the end of an assistant turn."""
    eos: Any = tokenizer.eos_id
    if tokenizer.has_chat_tokens:
        eos = [tokenizer.eos_id, tokenizer.token_to_id(CHAT_TOKENS[1])]
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_id}


def _bytes_to_unicode() -> dict[int, str]:
    """The printable character GPT-2's byte-level pre-tokenizer uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_backend(tokenizer: ByteTokenizer):
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    backend = HFTok(models.BPE(vocab=vocab, merges=[]))
    # No regex split: without merges every byte is its own token anyway.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    names = [*BPE_SPECIAL_TOKENS, *(CHAT_TOKENS if tokenizer.chat else ())]
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    for name in names:
        if backend.token_to_id(name) != tokenizer.token_to_id(name):
            raise AssertionError(f"byte tokenizer export: {name} got id {backend.token_to_id(name)}")
    return backend


def write_hf_tokenizer(tokenizer: Tokenizer, dst: Path, max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for a fullband byte or BPE
    tokenizer into ``dst``."""
    from tokenizers import processors

    if isinstance(tokenizer, ByteTokenizer):
        backend = _byte_backend(tokenizer)
        split_special = not tokenizer.chat
    elif isinstance(tokenizer, BPETokenizer):
        from tokenizers import Tokenizer as HFTok

        backend = HFTok.from_str(tokenizer._tok.to_str())
        split_special = False
    else:
        raise TypeError(f"write_hf_tokenizer handles fullband's byte and bpe tokenizers, not {tokenizer.kind!r}")
    bos, eos, pad = (tokenizer.id_to_token(i) for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)]
    )
    dst.mkdir(parents=True, exist_ok=True)
    backend.save(str(dst / "tokenizer.json"))
    special = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": max_length,
        "padding_side": "left",  # decoder-only generation pads on the left
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": split_special,
    }
    if tokenizer.has_chat_tokens:
        config["chat_template"] = BUILTIN_CHAT_TEMPLATE
        config["additional_special_tokens"] = list(CHAT_TOKENS)
        special["additional_special_tokens"] = list(CHAT_TOKENS)
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (dst / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

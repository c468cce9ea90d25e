"""Tokenizers: raw bytes, a byte-level BPE trained on the corpus, or a local Hugging Face tokenizer; each a
``tokenizers.Tokenizer`` saved with a marker of its kind and special ids, so ``load_tokenizer(dir)`` gives back the
tokenizer that prepared a dataset. ``with_chat_tokens()`` remembers the fingerprint it extends
(``base_fingerprint``), so a model can be fine-tuned on chat data."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from fullband.data.config import DataConfig
from fullband.errors import DataError

MARKER = "fullband_tokenizer.json"
BPE_SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
# The built-in chat template's turn delimiters (ChatML names, so tools that know ChatML recognise them).
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


class Tokenizer:
    """A `tokenizers.Tokenizer` (``_tok``) with fullband's framing ids. `encode` never adds special tokens:
    documents are framed by the caller."""

    kind: str
    # Fingerprint of the tokenizer this one extends with CHAT_TOKENS (None: not an extension).
    base_fingerprint: str | None = None
    # A Jinja chat template that came with the tokenizer (Hugging Face tokenizers); None: built-in template.
    chat_template: str | None = None

    def __init__(self, tok: Backend, bos_id: int, eos_id: int, pad_id: int) -> None:
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and the (start, end) character span of each token in ``text``."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode many documents at once (used by dataset preparation, where speed matters)."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the ids; special tokens are dropped."""
        # Our framing tokens need not be registered as special in tokenizer.json, so drop them by id.
        framing = {self.bos_id, self.eos_id, self.pad_id}
        return self._tok.decode([int(i) for i in ids if int(i) not in framing], skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token given by its string (e.g. a special token), or None if it has none."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The string of a token id (special tokens by name), or None if out of range."""
        return self._tok.id_to_token(token_id)

    @property
    def has_chat_tokens(self) -> bool:
        return all(self.token_to_id(t) is not None for t in CHAT_TOKENS)

    def with_chat_tokens(self) -> Tokenizer:
        """This tokenizer extended with CHAT_TOKENS as special tokens with appended ids (itself if it has them
        or its own chat template)."""
        if self.chat_template is not None or self.has_chat_tokens:
            return self
        extended = copy.copy(self)
        extended._tok = Backend.from_str(self._tok.to_str())
        extended._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
        extended.vocab_size = extended._tok.get_vocab_size(with_added_tokens=True)
        extended.base_fingerprint = self.fingerprint()
        return extended

    def _serialized(self) -> bytes:
        """Everything that determines the mapping text <-> ids, as bytes."""
        specials = f"|bos={self.bos_id}|eos={self.eos_id}|pad={self.pad_id}"
        return (self._tok.to_str() + specials).encode()

    def _save_files(self, directory: Path) -> None:
        self._tok.save(str(directory / "tokenizer.json"))

    def fingerprint(self) -> str:
        return hashlib.sha256(self._serialized()).hexdigest()

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._save_files(directory)
        marker = {"kind": self.kind, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                  "eos_id": self.eos_id, "pad_id": self.pad_id, "fingerprint": self.fingerprint()}
        if self.base_fingerprint is not None:
            marker["base_fingerprint"] = self.base_fingerprint
        if isinstance(self, ByteTokenizer) and self.chat:
            marker["chat_tokens"] = True
        (directory / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _byte_chars() -> list[str]:
    """The printable character GPT-2's byte-level pre-tokenizer uses for each byte, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def _byte_backend(chat: bool) -> Backend:
    """The byte tokenizer as a `tokenizers.Tokenizer`: a byte-level BPE without merges whose 256 symbols are
    the bytes (ids 0..255, in byte order), then <bos>, <eos>, <pad> and, with ``chat``, CHAT_TOKENS."""
    backend = Backend(models.BPE(vocab={char: b for b, char in enumerate(_byte_chars())}, merges=[]))
    # No regex split: without merges every byte is its own token anyway.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    names = [*BPE_SPECIAL_TOKENS, *(CHAT_TOKENS if chat else ())]
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    # The plain byte tokenizer reads special-token strings as bytes; the chat extension recognises them.
    backend.encode_special_tokens = not chat
    return backend


_BYTE_SERIALIZED = b"fullband-byte-tokenizer-v1"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255; <bos>=256, <eos>=257, <pad>=258. With ``chat=True`` <|im_start|>=259 and
    <|im_end|>=260 are added and the five special tokens' strings are recognised in text, as a Hugging Face
    tokenizer does; the plain byte tokenizer reads every string as bytes."""

    kind = "byte"

    def __init__(self, chat: bool = False) -> None:
        backend = _byte_backend(chat)
        super().__init__(backend, *(backend.token_to_id(t) for t in BPE_SPECIAL_TOKENS))
        self.chat = chat
        names = (*BPE_SPECIAL_TOKENS, *(CHAT_TOKENS if chat else ()))
        self._specials = {name: backend.token_to_id(name) for name in names}
        self._split = re.compile("(" + "|".join(map(re.escape, self._specials)) + ")")
        if chat:
            self.base_fingerprint = hashlib.sha256(_BYTE_SERIALIZED).hexdigest()

    # Bytes need no tokenizer: encoding them through `tokenizers` is ~130x slower on a 50 MB corpus (and ~8x for
    # the chat extension's text), so encode, decode and id_to_token work on the bytes; the backend serves the
    # offsets, the streaming decoder and the HF export.
    def encode(self, text: str) -> list[int]:
        if not self.chat:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            # re.split with one group alternates text (even i) and the special token that ended it (odd i).
            ids += [self._specials[piece]] if i % 2 else list(piece.encode("utf-8"))
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self.chat:
            return [np.asarray(self.encode(t), dtype=np.int64) for t in texts]
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        # A model can emit a byte sequence that is not valid UTF-8; show it rather than fail.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str | None:
        return bytes([token_id]).decode("latin-1") if 0 <= token_id < 256 else super().id_to_token(token_id)

    def with_chat_tokens(self) -> ByteTokenizer:
        return self if self.chat else ByteTokenizer(chat=True)

    def _serialized(self) -> bytes:
        return _BYTE_SERIALIZED + (b"+chat" if self.chat else b"")

    def _save_files(self, directory: Path) -> None:
        pass


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) trained on the corpus; <bos>, <eos>, <pad> are ids 0, 1, 2."""

    kind = "bpe"

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        tok = Backend(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(BPE_SPECIAL_TOKENS),
            # Every byte gets a token even if the training text lacks it, so any text is encodable.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok, *(tok.token_to_id(t) for t in BPE_SPECIAL_TOKENS))


# Names models commonly use for end-of-text, tried in order when a tokenizer dir does not say.
_EOS_FALLBACKS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
_HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class HFTokenizer(Tokenizer):
    """Any local Hugging Face tokenizer directory that contains tokenizer.json. Special tokens come from
    tokenizer_config.json, then special_tokens_map.json; without an eos, the first common end-of-text token in the
    vocabulary; a missing bos or pad is eos (as in GPT-2)."""

    kind = "hf"

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            raise DataError(
                f"Tokenizer directory {directory} has no tokenizer.json. data.tokenizer must be 'byte', "
                "'bpe' or a local Hugging Face tokenizer directory containing tokenizer.json (only "
                "'fast' tokenizers are supported; save one with AutoTokenizer.save_pretrained)."
            )
        self.directory = directory
        try:
            tok = Backend.from_file(str(directory / "tokenizer.json"))
        except Exception as e:
            raise DataError(
                f"Could not read {directory / 'tokenizer.json'} as a Hugging Face tokenizer ({e}). "
                "Check that the file is complete and was written by a compatible `tokenizers` version."
            ) from e
        configs = [_read_config(directory / fname) for fname in _HF_CONFIG_FILES]
        self.chat_template = _chat_template(directory, configs[0])
        # The first config naming a role's token wins; an eos not in the vocabulary falls back as a missing one.
        ids = {role: next((tok.token_to_id(name) for config in configs
                           if (name := _token_content(config.get(f"{role}_token"))) is not None), None)
               for role in ("bos", "eos", "pad")}
        if ids["eos"] is None:
            ids["eos"] = next((i for i in map(tok.token_to_id, _EOS_FALLBACKS) if i is not None), None)
        if ids["eos"] is None:
            raise DataError(
                f"Tokenizer {directory} names no end-of-text token and none of {', '.join(_EOS_FALLBACKS)} "
                "is in its vocabulary. Add \"eos_token\": \"<your end token>\" to tokenizer_config.json."
            )
        super().__init__(tok, *(ids[role] if ids[role] is not None else ids["eos"] for role in ("bos", "eos", "pad")))

    def _save_files(self, directory: Path) -> None:
        same = directory.resolve() == self.directory.resolve()
        if same and self.base_fingerprint is None:
            return
        self._tok.save(str(directory / "tokenizer.json"))
        for fname in (*_HF_CONFIG_FILES, _CHAT_TEMPLATE_FILE):
            if not same and (self.directory / fname).is_file():
                shutil.copyfile(self.directory / fname, directory / fname)


_CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}); fix or remove it.") from None
    return config if isinstance(config, dict) else {}


def _chat_template(directory: Path, config: dict) -> str | None:
    """The tokenizer's own chat template: chat_template.jinja, else tokenizer_config.json's chat_template
    (a string, or a list of named templates of which "default" is used)."""
    if (directory / _CHAT_TEMPLATE_FILE).is_file():
        return (directory / _CHAT_TEMPLATE_FILE).read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_content(value: object) -> str | None:
    # Special tokens appear either as plain strings or as AddedToken dicts {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Reload a tokenizer saved by `Tokenizer.save` (or any Hugging Face tokenizer directory)."""
    directory = Path(directory)
    marker_path = directory / MARKER
    if not marker_path.is_file():
        if (directory / "tokenizer.json").is_file():
            return HFTokenizer(directory)
        raise DataError(
            f"No tokenizer found in {directory}: expected {MARKER} (written by fullband) or a Hugging "
            "Face tokenizer.json. Re-run `fullband prepare`, or point at a directory holding a tokenizer."
        )
    try:
        marker = json.loads(marker_path.read_text())
        kind = marker["kind"]
    except (json.JSONDecodeError, KeyError) as e:
        raise DataError(f"{marker_path} is corrupt ({e}); re-run `fullband prepare` to rewrite it.") from e
    if kind == "byte":
        tok: Tokenizer = ByteTokenizer(chat=bool(marker.get("chat_tokens")))
    elif kind == "bpe":
        backend = Backend.from_file(str(directory / "tokenizer.json"))
        tok = BPETokenizer(backend, marker["bos_id"], marker["eos_id"], marker["pad_id"])
    elif kind == "hf":
        tok = HFTokenizer(directory)
    else:
        raise DataError(f"{marker_path} names an unknown tokenizer kind {kind!r} (expected byte, bpe or hf).")
    if marker.get("fingerprint") not in (None, tok.fingerprint()):
        raise DataError(
            f"The tokenizer in {directory} does not match its {MARKER} (fingerprint differs): its files "
            "were changed after it was saved. Re-run `fullband prepare` with overwrite."
        )
    tok.base_fingerprint = marker.get("base_fingerprint", tok.base_fingerprint)
    return tok


def build_tokenizer(cfg: DataConfig, train_texts: Iterable[str], chat: bool = False) -> Tokenizer:
    """The tokenizer `cfg.tokenizer` asks for; only "bpe" reads (trains on) the texts. ``chat``: extended
    for the built-in chat template (unless it has its own). A directory saved by fullband (a model's or
    dataset's tokenizer/) is loaded as what it is, so fine-tuning data matches the model's tokenizer."""
    path = Path(cfg.tokenizer).expanduser()
    if cfg.tokenizer == "byte":
        tok: Tokenizer = ByteTokenizer()
    elif cfg.tokenizer == "bpe":
        tok = BPETokenizer.train(train_texts, cfg.bpe_vocab_size)
    elif path.is_dir():
        tok = load_tokenizer(path) if (path / MARKER).is_file() else HFTokenizer(path)
    else:
        raise DataError(
            f"data.tokenizer={cfg.tokenizer!r} is neither 'byte', 'bpe' nor an existing directory. "
            "Give a local Hugging Face tokenizer directory (containing tokenizer.json); downloading "
            "tokenizers by name is not supported, save one with AutoTokenizer.save_pretrained first."
        )
    return tok.with_chat_tokens() if chat else tok

"""Streaming detokenization (``fullband.detokenize``): the streamed text equals decoding every id at once, for
byte-level and BPE tokenizers with characters split over several ids, and the work per token stays bounded (the
ids decoded at once, by the decode stream or by ``decode``, do not grow with the answer), in the class and through
``fullband generate --stream`` and ``fullband chat``."""

from __future__ import annotations

import random

import pytest
from conftest import make_model

from fullband import chat_cli, cli
from fullband.cli import main
from fullband.data.chat import apply_chat_template, end_of_turn_ids
from fullband.data.tokenizers import BPETokenizer, ByteTokenizer, HFTokenizer
from fullband.detokenize import StreamingDetokenizer
from fullband.generation import generate
from fullband.loading import encode_prompt

TEXT = "the cat sat on the mat. café — naïve coöperation 😀 日本語のテキスト "
# Ids decoded at once: the last released piece and the ids waiting after it (each at most a character's 4 bytes
# and one more, when ids that are not UTF-8 are released before an incomplete tail).
LONGEST_WINDOW = 10


@pytest.fixture
def stepped(monkeypatch) -> list[int]:
    """How many ids the decode stream decodes at each step: those of its last released piece and those after."""
    sizes: list[int] = []
    step = StreamingDetokenizer._step

    def counted(self, token):
        sizes.append(len(self._context) + len(self._waiting) + 1)
        return step(self, token)

    monkeypatch.setattr(StreamingDetokenizer, "_step", counted)
    return sizes


class CountingByteTokenizer(ByteTokenizer):
    """A byte tokenizer that records how many ids each ``decode`` call gets."""

    def __init__(self, chat: bool = False):
        super().__init__(chat=chat)
        self.decoded: list[int] = []

    def decode(self, ids):
        self.decoded.append(len(ids))
        return super().decode(ids)


def tokenizers() -> dict:
    return {"byte": ByteTokenizer(), "bpe": BPETokenizer.train([TEXT * 20], vocab_size=300)}


def stream(tokenizer, ids: list[int]) -> tuple[list[str], StreamingDetokenizer]:
    text = StreamingDetokenizer(tokenizer)
    pieces = [text.add(token) for token in ids]
    pieces.append(text.flush())
    return pieces, text


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_streamed_text_equals_decoding_everything(kind):
    tokenizer = tokenizers()[kind]
    encoded = tokenizer.encode(TEXT * 3)
    pieces, text = stream(tokenizer, encoded)
    assert "".join(pieces) == text.text == TEXT * 3
    assert all("\ufffd" not in piece for piece in pieces)  # a split character appears whole, never as U+FFFD
    if kind == "byte":  # a 4-byte character: nothing until its last byte
        emoji = list("😀".encode())
        assert [StreamingDetokenizer(tokenizer).add(b) for b in emoji[:3]] == ["", "", ""]
    # Random ids: lone continuation bytes and cut characters that are not valid UTF-8 at all.
    rng = random.Random(0)
    pool = sorted(set(encoded)) + ([0x80, 0xBF, 0xC3, 0xE2, 0xF0, 0xFF] if kind == "byte" else [])
    for _ in range(200):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        pieces, text = stream(tokenizer, ids)
        assert "".join(pieces) == text.text == tokenizer.decode(ids), ids


@pytest.mark.parametrize("text", ["utf-8", "not utf-8"])
def test_the_work_per_token_does_not_grow_with_the_answer(text, stepped):
    tokenizer = CountingByteTokenizer()
    if text == "utf-8":
        ids = tokenizer.encode(TEXT * 40)  # ~2,800 ids, a quarter of them in multi-byte characters
    else:  # lead and continuation bytes only: the text ends in U+FFFD after every id
        rng = random.Random(1)
        ids = [rng.choice([0x80, 0x9F, 0xBF, 0xC3, 0xE2, 0xF0, 0xFF]) for _ in range(2000)]
    pieces, _ = stream(tokenizer, ids)
    work = tokenizer.decoded + stepped
    assert "".join(pieces) == tokenizer.decode(ids)
    assert max(work) <= LONGEST_WINDOW and sum(work) <= 4 * LONGEST_WINDOW * len(ids), (max(work), sum(work))


def test_a_decoder_that_rewrites_released_text_does_not_break_the_stream(tmp_path):
    """A SentencePiece-style byte-fallback decoder gives U+FFFD for every byte token of a run that is not UTF-8,
    also for a byte it decoded before ("A"); that text was released, and the stream goes on after it."""
    from tokenizers import Tokenizer, decoders, models

    backend = Tokenizer(models.BPE({"</s>": 0, "c": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}, [],
                                   byte_fallback=True))
    backend.decoder = decoders.ByteFallback()
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path)
    ids = [2 + 0x41, 2 + 0xF0, 2 + 0x80, 1, 2 + 0x41]
    assert tokenizer.decode(ids) == "\ufffd\ufffd\ufffdcA"
    pieces, text = stream(tokenizer, ids)
    assert pieces == ["A", "", "", "\ufffd\ufffdc", "A", ""] and text.text == "A\ufffd\ufffdcA"


@pytest.fixture
def counted(monkeypatch, stepped):
    """``fullband generate`` and ``chat`` with a tiny random byte-level model and a counting tokenizer and stream."""
    tokenizer = CountingByteTokenizer(chat=True)
    model = make_model(seed=3, vocab_size=tokenizer.vocab_size, max_seq_len=128)
    for module in (cli, chat_cli):
        monkeypatch.setattr(module, "load_model", lambda *args: (model, tokenizer))
    return model, tokenizer, stepped


def test_fullband_generate_streams_incrementally(counted, capsys):
    model, tokenizer, stepped = counted
    # A bias towards the lead bytes of 2- to 4-byte characters: the random model then emits split characters and
    # bytes that are not UTF-8; the streamed output equals decoding all ids at once all the same.
    bias = {0xC3: 3, 0xE2: 3, 0xF0: 3}
    # at least 60 tokens (eos masked until then), whichever the seed draws
    flags = ["--max-new-tokens", "80", "--device", "cpu", "--temperature", "1", "--seed", "1", "--min-tokens", "60"]
    for token, value in bias.items():
        flags += ["--logit-bias", f"{token}={value}"]
    assert main(["generate", "m", "--prompt", "é:", "--stream", *flags]) == 0
    tokens = generate(model, [encode_prompt(tokenizer, "é:")], 80, temperature=1.0, seed=1,
                      eos_token_id=tokenizer.eos_id, logit_bias=bias, min_tokens=60)[0].tolist()
    answer = tokens[: tokens.index(tokenizer.eos_id)] if tokenizer.eos_id in tokens else tokens
    assert len(answer) > 40 and any(t >= 0x80 for t in answer)
    assert capsys.readouterr().out == "é:" + tokenizer.decode(answer) + "\n"
    assert max(tokenizer.decoded[:-1] + stepped) <= LONGEST_WINDOW  # the last decode is the reference's


def test_fullband_chat_streams_incrementally(counted, capsys):
    model, tokenizer, stepped = counted
    assert main(["chat", "m", "--message", "héllo", "--max-new-tokens", "60", "--device", "cpu"]) == 0
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": "héllo"}])
    ends = end_of_turn_ids(tokenizer)
    tokens = generate(model, [prompt], 60, stop_token_ids=ends)[0].tolist()
    answer = next((tokens[:i] for i, t in enumerate(tokens) if t in ends), tokens)
    assert len(answer) > 30
    assert capsys.readouterr().out.endswith("assistant> " + tokenizer.decode(answer) + "\n")
    assert max(tokenizer.decoded[:-1] + stepped) <= LONGEST_WINDOW


def test_an_id_the_tokenizer_cannot_decode_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot decode token id 8589934592"):
        StreamingDetokenizer(ByteTokenizer()).add(2**33)

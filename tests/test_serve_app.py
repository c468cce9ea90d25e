"""The API app in-process (FastAPI's TestClient), for behaviour that needs a specially built model."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import make_model
from fastapi.testclient import TestClient

from fullband.data import load_tokenizer
from fullband.data.tokenizers import BPETokenizer, ByteTokenizer
from fullband.engine import Engine, Event
from fullband.serve.app import Choice, create_app


def test_end_of_text_stops_unless_ignore_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # eos is id 0, and a model whose final norm has zero gain gives all-zero logits, so greedy decoding
    # (argmax: the first of equal values) produces eos at every step.
    backend = Tokenizer(models.WordLevel({"</s>": 0, "<s>": 1, **{f"w{i}": i + 2 for i in range(62)}},
                                         unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tokenizer = load_tokenizer(tmp_path)
    model = make_model(seed=0)
    with torch.no_grad():
        model.norm.weight.zero_()
    with TestClient(create_app(Engine(model), tokenizer, "m")) as client:
        body = {"model": "m", "prompt": "w1 w2", "max_tokens": 5, "temperature": 0}
        out = client.post("/v1/completions", json=body).json()
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 1
        out = client.post("/v1/completions", json={**body, "ignore_eos": True}).json()
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 5
        assert client.get("/health").json()["completed"] == 2


@pytest.mark.parametrize("kind", ["byte", "bpe", "metaspace"])
def test_incremental_text_equals_decoding_everything(kind):
    """Streaming deltas (with and without stop strings) add up to the text of all ids at once, cut before the
    first stop string; random ids include bytes that are not valid UTF-8 on their own, and (metaspace, as in
    SentencePiece tokenizers) pieces whose leading space is dropped at the start of a text."""
    if kind == "byte":
        tokenizer = ByteTokenizer()
        pool = [*b"ab c\n", 0x80, 0x9F, 0xBF, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0xFF]
    elif kind == "metaspace":
        from tokenizers import Tokenizer, decoders, models

        pieces = ["<bos>", "<eos>", "<pad>", "\u2581the", "\u2581cat", "s", "\u2581sat", ".", "\u2581", "a"]
        backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<pad>"))
        backend.decoder = decoders.Metaspace()
        tokenizer = BPETokenizer(backend, 0, 1, 2)
        pool = list(range(3, len(pieces)))
    else:
        text = "the cat sat on the mat. café — naïve coöperation 😀 " * 20
        tokenizer = BPETokenizer.train([text], vocab_size=300)
        pool = list(range(3, tokenizer.vocab_size))
    rng = random.Random(0)
    for trial in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        full = tokenizer.decode(ids)
        stop = [] if trial % 3 == 0 else [full[rng.randrange(max(len(full), 1)):][:rng.randint(1, 3)] or "zz", "\u2603"]
        choice = Choice(tokenizer, stop)
        streamed = ""
        for token in ids:
            streamed += choice.add(Event(token=token))
            if choice.stopped:
                break
        streamed += choice.flush()
        cuts = [i for i in (full.find(s) for s in stop) if i >= 0]
        assert streamed == (full[: min(cuts)] if cuts else full), (ids, stop)
        assert choice.stopped == bool(cuts)

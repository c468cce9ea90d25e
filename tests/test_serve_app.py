"""The API app in-process (FastAPI's TestClient), for behaviour that needs a specially built model."""

from __future__ import annotations

import json

import torch
from conftest import make_model
from fastapi.testclient import TestClient

from fullband.data import load_tokenizer
from fullband.serve.app import create_app
from fullband.serve.engine import Engine


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

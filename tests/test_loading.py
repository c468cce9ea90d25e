"""``fullband.loading.load_model``: one loader for run, checkpoint and model directories and for
``export-hf`` directories, so every command (generate, chat, bench, probe, serve, lm-eval) accepts each."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from fullband.data import ByteTokenizer
from fullband.errors import FullbandError
from fullband.generation import generate
from fullband.loading import encode_prompt, load_model
from fullband.storage import ModelDir


def test_byte_tokenizer_export_loads_back_with_the_same_tokens_and_outputs(tmp_path):
    pytest.importorskip("transformers", reason="the export needs transformers (the hf extra)")
    from fullband.hf import export_hf

    model = make_model(seed=2, vocab_size=ByteTokenizer().vocab_size, max_seq_len=64)
    model.save_pretrained(tmp_path / "fb")
    ByteTokenizer().save(tmp_path / "fb" / "tokenizer")
    export_hf(tmp_path / "fb", tmp_path / "export")

    original, tok_a = load_model(tmp_path / "fb", device="cpu")
    exported, tok_b = load_model(tmp_path / "export", device="cpu")
    assert ModelDir.open(tmp_path / "export").run is None and not exported.training
    text = "héllo wörld\n\tdef f(): ✓"
    assert encode_prompt(tok_a, text) == encode_prompt(tok_b, text)
    assert tok_b.decode(tok_b.encode(text)) == text
    prompt = encode_prompt(tok_a, text)
    for mode in ("standard", "soft", "fused"):
        assert torch.equal(generate(original, [prompt], 6, mode=mode), generate(exported, [prompt], 6, mode=mode)), mode

    (tmp_path / "export" / "tokenizer.json").unlink()
    with pytest.raises(FullbandError, match="no tokenizer.json"):
        load_model(tmp_path / "export", device="cpu")

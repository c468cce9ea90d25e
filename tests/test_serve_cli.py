"""``fullband serve``'s command line and model loading (fullband directories and Hugging Face exports)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_model

from fullband.cli import build_parser, main
from fullband.errors import FullbandError
from fullband.loading import load_model


def _word_tokenizer(directory) -> None:
    """A tiny Hugging Face tokenizer (tokenizer.json + tokenizer_config.json), made without downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))


def test_serves_a_hugging_face_export(tmp_path):
    pytest.importorskip("transformers", reason="the export needs transformers (the hf extra)")
    from fullband.hf import export_hf

    model = make_model(seed=4, n_kv_heads=2, qk_norm=True, tie_embeddings=False)
    model.save_pretrained(tmp_path / "fb")
    _word_tokenizer(tmp_path / "fb" / "tokenizer")
    export = export_hf(tmp_path / "fb", tmp_path / "export")

    loaded, tokenizer = load_model(export, device="cpu")
    assert loaded.config == model.config and not loaded.training
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert tokenizer.encode("w1 w5 w60") == [4, 8, 63] and tokenizer.eos_id == 2

    # The fullband directory itself loads through the usual path, with the same weights.
    direct, _ = load_model(tmp_path / "fb", device="cpu")
    assert torch.equal(direct.embed.weight, loaded.embed.weight)

    (export / "tokenizer.json").unlink()
    with pytest.raises(FullbandError, match="no tokenizer.json"):
        load_model(export, device="cpu")


def test_command_line(tmp_path, capsys):
    args = build_parser().parse_args(["serve", "some/dir", "--decode-mode", "fused", "--fused-passes", "2",
                                      "--max-batch", "4", "--max-queue", "8", "--port", "9000"])
    assert (args.decode_mode, args.fused_passes, args.max_batch, args.max_queue, args.port, args.host) == (
        "fused", "2", 4, 8, 9000, "127.0.0.1")
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--max-batch", "0"]) == 2
    assert "--max-batch" in capsys.readouterr().err
    # Decode settings are checked by DecodeSettings, with the words every front door uses, before loading.
    assert main(["serve", str(tmp_path), "--decode-mode", "jacobi"]) == 2
    assert "unknown decode_mode 'jacobi'" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--fused-passes", "0"]) == 2
    assert "fused_passes must be an integer >= 1, 'auto' or 'exact', got '0'" in capsys.readouterr().err

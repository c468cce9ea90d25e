import json

import pytest

from fullband.data import BPETokenizer, ByteTokenizer, DataConfig, HFTokenizer, load_tokenizer
from fullband.data.tokenizers import build_tokenizer
from fullband.errors import ConfigError, DataError

TEXTS = ["def add(a, b):\n    return a + b\n", "Grüße, 世界! naïve café", "the quick brown fox " * 20]


def test_byte_tokenizer_round_trip_non_ascii(tmp_path):
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    # specials are dropped, invalid UTF-8 is replaced rather than raising
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, ByteTokenizer) and again.fingerprint() == tok.fingerprint()


def test_bpe_train_save_load_round_trip(tmp_path):
    tok = BPETokenizer.train(TEXTS * 5, vocab_size=300)
    assert tok.vocab_size <= 300
    assert [tok.bos_id, tok.eos_id, tok.pad_id] == [0, 1, 2]
    for text in TEXTS + ["unseen ✓ text \x00 with rare bytes"]:
        ids = tok.encode(text)
        assert tok.bos_id not in ids and tok.decode(ids) == text
    assert len(tok.encode(TEXTS[2])) < len(TEXTS[2].encode())  # merges were learned
    tok.save(tmp_path / "tok")
    again = load_tokenizer(tmp_path / "tok")
    assert isinstance(again, BPETokenizer)
    assert again.fingerprint() == tok.fingerprint()
    assert again.encode(TEXTS[1]) == tok.encode(TEXTS[1])
    assert [a.tolist() for a in again.encode_batch(TEXTS)] == [tok.encode(t) for t in TEXTS]


def _make_hf_dir(path, config: dict | None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4, "[PAD]": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_hf_tokenizer_dir_loads_special_tokens(tmp_path):
    d = _make_hf_dir(tmp_path / "hf", {"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                       "pad_token": "[PAD]"})
    tok = HFTokenizer(d)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (0, 1, 5, 6)
    assert tok.encode("hello world") == [3, 4]
    assert tok.decode([0, 3, 4, 1]) == "hello world"
    tok.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert isinstance(again, HFTokenizer) and again.fingerprint() == tok.fingerprint()
    # a plain HF directory without our marker also loads, and via DataConfig
    assert load_tokenizer(d).eos_id == 1
    assert build_tokenizer(DataConfig(tokenizer=str(d)), []).pad_id == 5


def test_hf_tokenizer_fallbacks_and_errors(tmp_path):
    tok = HFTokenizer(_make_hf_dir(tmp_path / "bare", None))
    assert tok.eos_id == 1 and tok.bos_id == 1 and tok.pad_id == 1  # </s> found; bos/pad fall back to eos
    with pytest.raises(DataError, match="tokenizer.json"):
        HFTokenizer(tmp_path)
    with pytest.raises(DataError, match="neither 'byte', 'bpe'"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "nope")), [])
    with pytest.raises(DataError, match="No tokenizer found"):
        load_tokenizer(tmp_path)


def test_data_config_validation():
    with pytest.raises(ConfigError, match="val_fraction"):
        DataConfig(val_fraction=1.5)
    with pytest.raises(ConfigError, match="bpe_vocab_size"):
        DataConfig(bpe_vocab_size=100)
    with pytest.raises(ConfigError, match="parity"):
        DataConfig(source="synthetic:nope")
    with pytest.raises(ConfigError, match="max_train_bytes"):
        DataConfig(max_train_bytes=0)
    with pytest.raises(ConfigError, match="wrong type"):
        DataConfig(seed="1")
    with pytest.raises(ConfigError, match="Unknown data config"):
        DataConfig.from_dict({"sorce": "x"})
    cfg = DataConfig(source="synthetic:addition:max_digits=4")
    assert DataConfig.from_dict(cfg.to_dict()).fingerprint() == cfg.fingerprint()
    assert DataConfig(seed=1).fingerprint() != DataConfig().fingerprint()

import json
import os

import numpy as np
import pytest

import fullband.data.shards as shards
from fullband.data import DataConfig, open_dataset, prepare_dataset, synthetic_examples
from fullband.data.sources import iter_documents, synthetic_seed
from fullband.errors import DataError


def _corpus(tmp_path, n=40):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(n):
        (d / f"f{i:02d}.txt").write_text(f"doc {i}: " + "ab€" * (i % 7 + 1) + "\n")
    return DataConfig(source=str(d), val_fraction=0.2)


def test_prepare_open_round_trip_multi_shard(tmp_path):
    cfg = _corpus(tmp_path)
    ds = prepare_dataset(cfg, tmp_path / "out", shard_tokens=97)
    again = open_dataset(tmp_path / "out")
    tok = again.tokenizer
    assert again.manifest == ds.manifest and again.config == cfg
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["data_fingerprint"] == cfg.fingerprint() and m["dtype"] == "uint16"
    assert m["tokenizer"]["kind"] == "byte" and m["tokenizer"]["vocab_size"] == 259
    for name in ("train", "val"):
        docs = [t for _, t in iter_documents(cfg, name)]
        split = again.split(name)
        info = m["splits"][name]
        assert len(info["shards"]) > 1 and all(s["tokens"] <= 97 for s in info["shards"])
        assert len(split) == info["tokens"] == sum(len(t.encode()) + 2 for t in docs)
        assert split.num_documents == info["documents"] == len(docs)
        bounds = [*split.doc_starts.tolist(), len(split)]
        for text, lo, hi in zip(docs, bounds, bounds[1:]):
            ids = split.tokens(lo, hi)  # often spans a shard boundary
            assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
            assert tok.decode(ids.tolist()) == text


def test_prepare_synthetic_and_bpe(tmp_path):
    cfg = DataConfig(source="synthetic:parity", tokenizer="bpe", bpe_vocab_size=300,
                     synthetic_train_examples=400, synthetic_val_examples=30)
    ds = prepare_dataset(cfg, tmp_path / "syn")
    assert ds.manifest["tokenizer"]["kind"] == "bpe" and ds.vocab_size <= 300
    val = ds.split("val")
    examples = synthetic_examples("parity", 30, synthetic_seed(0, "val"))
    first = val.tokens(0, int(val.doc_starts[1]))
    assert ds.tokenizer.decode(first.tolist()) == examples[0].text
    assert open_dataset(tmp_path / "syn").tokenizer.fingerprint() == ds.tokenizer.fingerprint()


def test_reuse_fast_path_and_fingerprint_mismatch(tmp_path, monkeypatch):
    cfg = _corpus(tmp_path)
    prepare_dataset(cfg, tmp_path / "out")
    shard = tmp_path / "out" / "train_000.bin"
    mtime = shard.stat().st_mtime_ns

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("reuse must not re-read the corpus")

    monkeypatch.setattr(shards, "iter_documents", no_tokenizing)
    again = prepare_dataset(DataConfig(**cfg.to_dict()), tmp_path / "out")
    assert shard.stat().st_mtime_ns == mtime and again.manifest["data_fingerprint"] == cfg.fingerprint()
    monkeypatch.undo()

    other = DataConfig(**{**cfg.to_dict(), "seed": 5})
    with pytest.raises(DataError, match="different data config"):
        prepare_dataset(other, tmp_path / "out")
    replaced = prepare_dataset(other, tmp_path / "out", overwrite=True)
    assert replaced.manifest["data_fingerprint"] == other.fingerprint()
    assert open_dataset(tmp_path / "out").manifest == replaced.manifest


def test_corruption_is_detected(tmp_path):
    cfg = _corpus(tmp_path)
    prepare_dataset(cfg, tmp_path / "out")
    out = tmp_path / "out"
    shard = out / "train_000.bin"
    data = shard.read_bytes()

    shard.write_bytes(data[:-2])
    with pytest.raises(DataError, match="truncated"):
        open_dataset(out, verify=False)

    flipped = bytearray(data)
    flipped[10] ^= 1
    shard.write_bytes(bytes(flipped))
    open_dataset(out, verify=False)  # sizes only: passes
    with pytest.raises(DataError, match="does not match its sha256"):
        open_dataset(out)

    shard.write_bytes(data)
    open_dataset(out)
    (out / "val_docs.npy").unlink()
    with pytest.raises(DataError, match="val_docs.npy is missing"):
        open_dataset(out)

    os.remove(out / "manifest.json")
    with pytest.raises(DataError, match="incomplete dataset"):
        open_dataset(out)
    with pytest.raises(DataError, match="No prepared dataset"):
        open_dataset(tmp_path / "nothing_here")
    # an interrupted directory is finished by preparing again
    assert open_dataset(prepare_dataset(cfg, out).path).manifest["splits"]["val"]["documents"] > 0
    # a damaged dataset with the same config is repaired by overwrite
    shard.write_bytes(data[:-2])
    with pytest.raises(DataError, match="truncated"):
        prepare_dataset(cfg, out)
    prepare_dataset(cfg, out, overwrite=True)
    open_dataset(out)


def test_token_dtype():
    assert shards.token_dtype(259) == np.uint16 and shards.token_dtype(65535) == np.uint16
    assert shards.token_dtype(151_000) == np.uint32


def test_pystdlib_prepare_is_fast_and_counts(tmp_path):
    ds = prepare_dataset(DataConfig(max_train_bytes=500_000), tmp_path / "py")
    m = ds.manifest["splits"]
    assert m["train"]["text_bytes"] <= 500_000 and m["train"]["documents"] > 10
    assert len(ds.split("train")) == m["train"]["text_bytes"] + 2 * m["train"]["documents"]
    assert ds.manifest["source"]["kind"] == "pystdlib"

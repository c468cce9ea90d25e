"""Corpus-scale `fullband prepare`: work units, parallel workers, resume, compressed and columnar formats.

The reference everywhere is `iter_documents`, the sequential reader (one unit per file), and a run with one
worker: any number of workers, any unit size and any interruption must give the same bytes."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import fullband.data.shards as shards
from fullband.cli import main
from fullband.data import DataConfig, open_dataset, prepare_dataset
from fullband.data.sources import iter_documents, plan_units
from fullband.errors import ConfigError, DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")
zstandard = pytest.importorskip("zstandard")


def _lines(n: int, tag: str, key: str = "text") -> list[str]:
    return [json.dumps({key: f"{tag} {i} " + "ünï" * (i % 5) + "x" * (i % 17), "id": i}) for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Every format at once: .txt files, a .jsonl big enough to be cut into byte ranges (with a blank line and
    an empty text), .jsonl.gz, .jsonl.zst, a Parquet file of many row groups and a save_to_disk directory."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "txt").mkdir()
    for i in range(7):
        (d / "txt" / f"t{i}.txt").write_text(f"text file {i}\n" + "€ab" * (i * 9 + 1))
    big = _lines(150, "big")
    big[40] = json.dumps({"text": ""})
    (d / "big.jsonl").write_text("\n".join(big[:90]) + "\n\n" + "\n".join(big[90:]) + "\n")
    with gzip.open(d / "g.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(_lines(40, "gz")) + "\n")
    (d / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(("\n".join(_lines(30, "zst")) + "\n").encode()))
    pq.write_table(pa.table({"text": [f"parquet ü {i} " * (i % 4 + 1) for i in range(60)]}), d / "rows.parquet",
                   row_group_size=7)
    datasets.Dataset.from_dict({"text": [f"saved {i} " + "s" * i for i in range(40)]}).save_to_disk(str(d / "saved"))
    return d


def _source(d: Path) -> str:
    return f"{d}/txt/*.txt,{d}/big.jsonl,{d}/*.jsonl.gz,{d}/*.jsonl.zst,{d}/rows.parquet,{d}/saved"


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _decoded(ds, split: str) -> list[str]:
    s = ds.split(split)
    bounds = [*s.doc_starts.tolist(), len(s)]
    return [ds.tokenizer.decode(s.tokens(lo, hi).tolist()) for lo, hi in zip(bounds, bounds[1:])]


def test_units_cover_every_format_and_keep_the_documents(corpus):
    cfg = DataConfig(source=_source(corpus), val_fraction=0.2)
    units = plan_units(cfg, 300)
    kinds = [u["kind"] for u in units]
    assert {"txt_files", "jsonl", "parquet", "saved"} <= set(kinds) and len(units) > 20
    big = [u for u in units if u["kind"] == "jsonl" and u["rel"] == "big.jsonl"]
    assert len(big) > 5 and big[0]["start"] == 0 and big[-1]["stop"] is None
    # a range starts at a line start and knows its line number: ids (and so the split) do not move
    text = (corpus / "big.jsonl").read_bytes()
    assert all(text[u["start"] - 1 : u["start"]] == b"\n" and text[: u["start"]].count(b"\n") + 1 == u["line"]
               for u in big[1:])
    assert plan_units(cfg, 300) == units  # deterministic
    assert len(plan_units(cfg)) == 6  # unit_bytes None: the .txt files, then one unit per file, as iter_documents
    docs = [t for _, t in iter_documents(cfg, "train")]
    assert any(t.startswith("zst 3 ") for t in docs) and any(t.startswith("gz 7 ") for t in docs)


def test_workers_and_unit_sizes_give_the_same_bytes(corpus, tmp_path):
    cfg = DataConfig(source=_source(corpus), val_fraction=0.2)
    one = prepare_dataset(cfg, tmp_path / "w1", workers=1, unit_bytes=300, shard_tokens=700)
    prepare_dataset(cfg, tmp_path / "w2", workers=2, unit_bytes=300, shard_tokens=700)
    reference = _files(tmp_path / "w1")
    assert len(one.manifest["splits"]["train"]["shards"]) > 3 and "units/plan.json" not in reference
    assert _files(tmp_path / "w2") == reference
    for split in ("train", "val"):
        assert _decoded(one, split) == [t for _, t in iter_documents(cfg, split)]
    # the command line, default unit size: a few big units, the same bytes again
    assert main(["prepare", "--data.source", _source(corpus), "--data.val_fraction", "0.2", "--out",
                 str(tmp_path / "cli"), "--workers", "2"]) == 0
    prepare_dataset(cfg, tmp_path / "default")
    assert _files(tmp_path / "cli") == _files(tmp_path / "default")
    assert _files(tmp_path / "cli")["train_docs.npy"] == reference["train_docs.npy"]


def test_byte_cap_cuts_where_the_sequential_reader_does(corpus, tmp_path):
    cfg = DataConfig(source=_source(corpus), val_fraction=0.2, max_train_bytes=2345)
    one = prepare_dataset(cfg, tmp_path / "w1", workers=1, unit_bytes=200)
    prepare_dataset(cfg, tmp_path / "w2", workers=2, unit_bytes=200)
    assert _files(tmp_path / "w2") == _files(tmp_path / "w1")
    for split in ("train", "val"):
        expected = [t for _, t in iter_documents(cfg, split)]
        assert _decoded(one, split) == expected
        assert one.manifest["splits"][split]["text_bytes"] == sum(len(t.encode()) for t in expected)
    assert one.manifest["splits"]["train"]["text_bytes"] == 2345  # the last text was cut to fit


def test_records_and_bpe_in_workers(tmp_path):
    d = tmp_path / "qa"
    d.mkdir()
    rows = [json.dumps({"prompt": f"q{i}: what is {i}+{i}?", "answer": f" {2 * i}"}) for i in range(120)]
    with gzip.open(d / "a.jsonl.gz", "wt") as f:
        f.write("\n".join(rows[:70]) + "\n")
    (d / "b.jsonl").write_text("\n".join(rows[70:]) + "\n")
    cfg = DataConfig(source=str(d), tokenizer="bpe", bpe_vocab_size=300, val_fraction=0.2, max_train_bytes=1500)
    one = prepare_dataset(cfg, tmp_path / "w1", unit_bytes=500)
    prepare_dataset(cfg, tmp_path / "w2", workers=2, unit_bytes=500)
    assert one.manifest["record_format"] == "prompt_answer" and "loss_mask" in one.manifest["splits"]["train"]
    assert _files(tmp_path / "w2") == _files(tmp_path / "w1")
    for split in ("train", "val"):
        assert one.split(split).num_documents == len(list(iter_documents(cfg, split)))
    mask = np.asarray(one.split("train").loss_mask)
    assert len(mask) == len(one.split("train")) and 0 < mask.sum() < len(mask)


def test_resume_keeps_verified_units_and_redoes_the_rest(corpus, tmp_path, monkeypatch):
    cfg = DataConfig(source=_source(corpus), val_fraction=0.2)
    prepare_dataset(cfg, tmp_path / "ref", unit_bytes=300)
    n_units = len(plan_units(cfg, 300))
    calls = []
    real = shards.tokenize_unit

    def killed_after_six(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 7:
            raise KeyboardInterrupt  # the process dies while the 7th unit is being written
        return real(*args, **kwargs)

    out = tmp_path / "out"
    monkeypatch.setattr(shards, "tokenize_unit", killed_after_six)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(cfg, out, unit_bytes=300)
    units = out / "units"
    assert sorted(p.name for p in units.iterdir()) == ["plan.json", *(f"u{i:06d}" for i in range(6))]
    with pytest.raises(DataError, match="incomplete dataset"):
        open_dataset(out)
    # damage two finished units (same size, one flipped byte; a truncated file) and leave a half-written one
    flipped = bytearray((units / "u000001" / "train.bin").read_bytes())
    flipped[3] ^= 1
    (units / "u000001" / "train.bin").write_bytes(bytes(flipped))
    (units / "u000004" / "train_docs.npy").write_bytes(b"")
    (units / "u000006.tmp").mkdir()
    (units / "u000006.tmp" / "train.bin").write_bytes(b"junk")

    calls.clear()
    monkeypatch.setattr(shards, "tokenize_unit", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    prepare_dataset(cfg, out, unit_bytes=300)
    assert len(calls) == n_units - 6 + 2  # units 0, 2, 3, 5 kept
    assert _files(out) == _files(tmp_path / "ref")

    # a finished unit of another config is not reused (the plan differs): everything is redone
    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(shards, "tokenize_unit", killed_after_six)
        calls.clear()
        prepare_dataset(cfg, tmp_path / "other", unit_bytes=300)
    calls.clear()
    monkeypatch.setattr(shards, "tokenize_unit", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    prepare_dataset(DataConfig(**{**cfg.to_dict(), "val_fraction": 0.3}), tmp_path / "other", unit_bytes=300)
    assert len(calls) == n_units


def test_resume_with_workers_after_a_partial_run(corpus, tmp_path, monkeypatch):
    cfg = DataConfig(source=_source(corpus), val_fraction=0.2)
    prepare_dataset(cfg, tmp_path / "ref", unit_bytes=300)
    real = shards.tokenize_unit
    calls = []

    def killed(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(shards, "tokenize_unit", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(cfg, tmp_path / "out", unit_bytes=300)
    monkeypatch.undo()
    prepare_dataset(cfg, tmp_path / "out", unit_bytes=300, workers=2)
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


def test_bad_input_is_named_with_what_to_do(tmp_path):
    good = "\n".join(_lines(20, "ok")) + "\n"
    gz = gzip.compress(good.encode())
    (tmp_path / "a.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    (tmp_path / "b.jsonl").write_text(good)
    with pytest.raises(DataError, match=r"a.jsonl.gz could not be read .* truncated, corrupt .* Re-download it"):
        prepare_dataset(DataConfig(source=f"{tmp_path}/*.jsonl*"), tmp_path / "out", workers=2, unit_bytes=100)
    (tmp_path / "a.jsonl.gz").unlink()
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        b'{"text": "fine"}\n{"body": "no text field"}\n'))
    with pytest.raises(DataError, match=r"c.jsonl.zst:2 has no field 'text'. Set --data.text_field"):
        prepare_dataset(DataConfig(source=f"{tmp_path}/*.jsonl*"), tmp_path / "out", workers=2, unit_bytes=100)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad.parquet is not a readable Parquet file"):
        list(iter_documents(DataConfig(source=str(tmp_path / "bad.parquet")), "train"))
    with pytest.raises(DataError, match=r"The glob .*\*.jsonl.zstd' in data.source matches no files"):
        plan_units(DataConfig(source=f"{tmp_path}/*.jsonl.zstd"))
    with pytest.raises(ConfigError, match="workers=0 must be at least 1"):
        prepare_dataset(DataConfig(source=str(tmp_path / "b.jsonl")), tmp_path / "out", workers=0)


def test_hf_source_streams_a_local_dataset_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "part.jsonl").write_text("\n".join(_lines(50, "hub")) + "\n")
    cfg = DataConfig(source=f"hf:{tmp_path / 'hub'}", val_fraction=0.2)
    assert plan_units(cfg) == [{"kind": "hf"}]
    train, val = list(iter_documents(cfg, "train")), list(iter_documents(cfg, "val"))
    assert sorted(train + val, key=lambda d: int(d[0][6:])) == [(f"train:{i}", json.loads(line)["text"])
                                                               for i, line in enumerate(_lines(50, "hub"))]
    one = prepare_dataset(cfg, tmp_path / "w1")
    assert _decoded(one, "train") == [t for _, t in train]

import json

import pytest

from fullband.data import DataConfig, prepare_dataset
from fullband.data.sources import SplitStats, iter_documents, pystdlib_files, split_of
from fullband.errors import DataError


def _docs(cfg, split):
    return list(iter_documents(cfg, split))


def test_pystdlib_source_many_files_deterministic_disjoint():
    root, files = pystdlib_files()
    assert len(files) > 300 and files == sorted(files)
    assert "os.py" in files and "json/__init__.py" in files
    assert not any(part in {"test", "tests", "idle_test", "site-packages"}
                   for f in files for part in f.split("/")[:-1])
    cfg = DataConfig(max_train_bytes=400_000)
    train, val = _docs(cfg, "train"), _docs(cfg, "val")
    assert train == _docs(cfg, "train")
    train_ids, val_ids = {d for d, _ in train}, {d for d, _ in val}
    assert train_ids and val_ids and not train_ids & val_ids
    assert all(split_of(d, 0.05) == "val" for d in val_ids)
    assert [d for d, _ in train] == sorted(train_ids)


def test_max_train_bytes_caps_deterministically():
    cfg = DataConfig(max_train_bytes=123_457)
    stats = SplitStats()
    docs = list(iter_documents(cfg, "train", stats))
    assert sum(len(t.encode()) for _, t in docs) == stats.text_bytes
    assert 123_457 - 4 <= stats.text_bytes <= 123_457  # last doc cut on a character boundary
    assert docs == _docs(cfg, "train")
    full = _docs(DataConfig(max_train_bytes=10**9), "train")
    assert [d for d, _ in docs] == [d for d, _ in full[: len(docs)]]
    assert docs[-1][1] == full[len(docs) - 1][1][: len(docs[-1][1])]
    val_bytes = sum(len(t.encode()) for _, t in _docs(cfg, "val"))
    assert 0 < val_bytes <= round(123_457 * 0.05 / 0.95)


def _write_txt_corpus(d, n=60):
    d.mkdir()
    for i in range(n):
        (d / f"doc{i:03d}.txt").write_text(f"document number {i}\nwith ünïcode {i * 7}\n")
    return d


def test_txt_files_and_globs(tmp_path):
    d = _write_txt_corpus(tmp_path / "corpus")
    cfg = DataConfig(source=str(d), val_fraction=0.2)
    train, val = _docs(cfg, "train"), _docs(cfg, "val")
    assert len(train) + len(val) == 60 and val and train
    assert {i for i, _ in train} | {i for i, _ in val} == {f"doc{i:03d}.txt" for i in range(60)}
    assert dict(train + val)["doc007.txt"] == "document number 7\nwith ünïcode 49\n"
    glob_cfg = DataConfig(source=str(d / "doc00*.txt") + "," + str(d / "doc05*.txt"), val_fraction=0.2)
    ids = [i for i, _ in _docs(glob_cfg, "train") + _docs(glob_cfg, "val")]
    assert sorted(ids) == [f"doc{i:03d}.txt" for i in [*range(10), *range(50, 60)]]


def test_single_txt_file_is_split_by_position(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("".join(f"line {i}\n" for i in range(100)))
    cfg = DataConfig(source=str(path), val_fraction=0.1)
    (train_id, train), = _docs(cfg, "train")
    (val_id, val), = _docs(cfg, "val")
    assert train == "".join(f"line {i}\n" for i in range(90))
    assert val == "".join(f"line {i}\n" for i in range(90, 100))
    assert (train_id, val_id) == ("input.txt#train", "input.txt#val")
    dataset = prepare_dataset(cfg, tmp_path / "out")
    assert len(dataset.split("val")) == len(val) + 2  # bytes + <bos> + <eos>


def test_jsonl_source(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(json.dumps({"body": f"row {i} text", "x": i}) for i in range(40)) + "\n\n")
    cfg = DataConfig(source=str(p), text_field="body", val_fraction=0.25)
    docs = _docs(cfg, "train") + _docs(cfg, "val")
    assert sorted(docs, key=lambda d: int(d[0].split(":")[1])) == [
        (f"data.jsonl:{i + 1}", f"row {i} text") for i in range(40)]


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(50)], "n": list(range(50))}), p,
                   row_group_size=16)
    cfg = DataConfig(source=str(p), val_fraction=0.3)
    docs = dict(_docs(cfg, "train") + _docs(cfg, "val"))
    assert docs == {f"data.parquet:{i}": f"parquet row {i}" for i in range(50)}
    with pytest.raises(DataError, match="no column 'body'"):
        _docs(DataConfig(source=str(p), text_field="body"), "train")


def test_save_to_disk_directory_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": [f"saved row {i}" for i in range(30)]})
    ds.save_to_disk(str(tmp_path / "single"))
    cfg = DataConfig(source=str(tmp_path / "single"), val_fraction=0.3)
    assert len(_docs(cfg, "train")) + len(_docs(cfg, "val")) == 30
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": [f"train {i}" for i in range(20)]}),
        "validation": datasets.Dataset.from_dict({"text": [f"val {i}" for i in range(5)]}),
    })
    dd.save_to_disk(str(tmp_path / "dict"))
    cfg = DataConfig(source=str(tmp_path / "dict"))
    assert [t for _, t in _docs(cfg, "val")] == [f"val {i}" for i in range(5)]  # its own val split kept
    assert [t for _, t in _docs(cfg, "train")] == [f"train {i}" for i in range(20)]
    ds_prep = prepare_dataset(cfg, tmp_path / "prep")
    assert ds_prep.manifest["splits"]["val"]["documents"] == 5


def test_source_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        _docs(DataConfig(source=str(tmp_path / "missing.txt")), "train")
    with pytest.raises(DataError, match="matches no files"):
        _docs(DataConfig(source=str(tmp_path / "*.txt")), "train")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf" + "é".encode("latin-1") + b" ok")
    with pytest.raises(DataError, match=r"latin1.txt is not valid UTF-8 \(byte offset 3"):
        _docs(DataConfig(source=str(bad)), "train")
    jl = tmp_path / "x.jsonl"
    jl.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    with pytest.raises(DataError, match=r"x.jsonl:2 has no field 'text'"):
        _docs(DataConfig(source=str(jl), val_fraction=0.01), "train")
    other = tmp_path / "notes.csv"
    other.write_text("a,b\n")
    with pytest.raises(DataError, match="Unsupported file type"):
        _docs(DataConfig(source=str(other)), "train")


def test_empty_corpus_errors(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "a.txt").write_text("")
    (d / "b.txt").write_text("")
    with pytest.raises(DataError, match="train split .* is empty"):
        prepare_dataset(DataConfig(source=str(d)), tmp_path / "out")
    # one document: the hash split leaves one side empty, which is reported, not a crash
    (d / "a.txt").write_text("just one document")
    with pytest.raises(DataError, match="split .* is empty"):
        prepare_dataset(DataConfig(source=str(d)), tmp_path / "out2")


def test_hf_source_offline_is_a_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="network access"):
        _docs(DataConfig(source="hf:fullband-test/definitely-not-a-dataset"), "train")

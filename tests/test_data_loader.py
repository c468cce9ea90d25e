import json

import numpy as np
import pytest
import torch

from fullband.data import DataConfig, TokenLoader, TokenSplit, prepare_dataset
from fullband.errors import ConfigError, DataError

SEQ = 16


def _counting_split(n=1000, doc_starts=(0, 5, 40, 41, 200, 999), shard_len=300):
    """A split whose token at position i is i, so a row reveals exactly which window it is."""
    tokens = np.arange(n, dtype=np.uint16)
    shards = [tokens[i : i + shard_len] for i in range(0, n, shard_len)]
    return TokenSplit("train", shards, np.array(doc_starts, dtype=np.int64))


def _batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def _equal(a, b):
    return all(torch.equal(getattr(x, f), getattr(y, f)) for x, y in zip(a, b)
               for f in ("input_ids", "targets", "plain_mask"))


def test_windows_targets_and_epoch_coverage():
    split = _counting_split()
    loader = TokenLoader(split, SEQ, batch_size=4, seed=1)
    n_windows = (1000 - 1) // SEQ
    assert loader.num_windows == n_windows
    seen = []
    for b in _batches(loader, 40):  # 160 rows: one full epoch of 62 windows and then some
        assert b.input_ids.dtype == torch.int64 and b.input_ids.shape == (4, SEQ)
        assert torch.equal(b.targets, b.input_ids + 1)
        assert torch.all(b.input_ids[:, 0] % SEQ == 0)
        seen += (b.input_ids[:, 0] // SEQ).tolist()
    assert sorted(seen[:n_windows]) == list(range(n_windows))
    assert sorted(seen[n_windows : 2 * n_windows]) == list(range(n_windows))
    assert seen[:n_windows] != seen[n_windows : 2 * n_windows]  # reshuffled per epoch
    assert loader.epoch == 2


def test_determinism_and_seed():
    split = _counting_split()
    a = _batches(TokenLoader(split, SEQ, 8, seed=3), 5)
    assert _equal(a, _batches(TokenLoader(split, SEQ, 8, seed=3), 5))
    assert not _equal(a, _batches(TokenLoader(split, SEQ, 8, seed=4), 5))


def test_resume_from_state_dict_is_identical():
    split = _counting_split()
    loader = TokenLoader(split, SEQ, 6, seed=2)
    _batches(loader, 13)  # crosses an epoch boundary mid-batch
    state = json.loads(json.dumps(loader.state_dict()))
    assert all(type(v) is int for v in state.values())
    expected = _batches(loader, 10)
    fresh = TokenLoader(split, SEQ, 6, seed=999)
    fresh.load_state_dict(state)
    assert _equal(expected, _batches(fresh, 10))
    with pytest.raises(DataError, match="seq_len"):
        TokenLoader(split, SEQ * 2, 6).load_state_dict(state)


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_sharding_matches_single_process(world_size):
    split = _counting_split()
    single = _batches(TokenLoader(split, SEQ, 8, seed=5), 12)
    ranks = [_batches(TokenLoader(split, SEQ, 8, seed=5, rank=r, world_size=world_size), 12)
             for r in range(world_size)]
    for step, full in enumerate(single):
        rebuilt = torch.empty_like(full.input_ids)
        for r in range(world_size):
            assert ranks[r][step].input_ids.shape == (8 // world_size, SEQ)
            rebuilt[r::world_size] = ranks[r][step].input_ids
        assert torch.equal(rebuilt, full.input_ids)
    with pytest.raises(ConfigError, match="multiple of world_size"):
        TokenLoader(split, SEQ, 6, world_size=4, rank=1)


def test_plain_mask_exactly_at_document_starts():
    split = _counting_split()
    starts = set(split.doc_starts.tolist())
    for b in _batches(TokenLoader(split, SEQ, 8), 10):
        for row, mask in zip(b.input_ids, b.plain_mask):
            expected = [j == 0 or int(row[j]) in starts for j in range(SEQ)]
            assert mask.tolist() == expected


def test_plain_mask_on_prepared_dataset(tmp_path):
    cfg = DataConfig(source="synthetic:registers", synthetic_train_examples=200, synthetic_val_examples=20)
    ds = prepare_dataset(cfg, tmp_path / "ds")
    bos = ds.tokenizer.bos_id
    b = TokenLoader(ds.split("train"), 128, 8).next_batch()
    assert b.plain_mask[:, 1:].any()
    assert torch.equal(b.plain_mask[:, 1:], b.input_ids[:, 1:] == bos)  # bos appears only at doc starts
    val = ds.split("val")
    batches = list(val.eval_batches(64, 4))
    assert sum(len(x.input_ids) for x in batches) == (len(val) - 1) // 64
    assert torch.equal(batches[0].input_ids[0], torch.from_numpy(val.tokens(0, 64)))


def test_eval_batches_sequential_and_sharded():
    split = _counting_split()
    batches = list(split.eval_batches(SEQ, 10, max_batches=3))
    starts = torch.cat([b.input_ids[:, 0] for b in batches]).tolist()
    assert starts == [i * SEQ for i in range(30)]
    full = list(split.eval_batches(SEQ, 10))
    assert sum(len(b.input_ids) for b in full) == 62 and len(full[-1].input_ids) == 2
    r0 = list(split.eval_batches(SEQ, 8, rank=0, world_size=4))
    r3 = list(split.eval_batches(SEQ, 8, rank=3, world_size=4))
    assert len(r0) == len(r3) and r3[0].input_ids[0, 0] == 3 * SEQ
    assert [len(b.input_ids) for b in r0] == [2] * 7 + [1]  # last batch cut to 60 -> 4 rows


def test_split_too_short_is_a_clear_error():
    split = _counting_split(n=10, doc_starts=(0,), shard_len=10)
    with pytest.raises(DataError, match=r"only 10 tokens, but seq_len=16 needs at least 17"):
        TokenLoader(split, SEQ, 2)
    with pytest.raises(DataError, match="only 10 tokens"):
        next(split.eval_batches(SEQ, 2))

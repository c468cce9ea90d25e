"""Each ``KVCache`` operation against a cache rebuilt from scratch: a cache prefilled directly with the rows
the operation should leave. Both must hold the same keys and values at each row's real positions (right-
aligned at the write position), the same mask and length, and give the same logits for the next tokens
(decode steps without an attention mask, as ``generate`` and the serving engine run them). float64, tiny
models: one with full attention, one with grouped-query heads and sliding windows (key distances matter)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from fullband.generation import left_pad
from fullband.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("single_thread")

ROOM = 6  # free positions a fresh cache keeps after its prompts


@pytest.fixture(params=["full", "window"])
def model(request):
    extra = dict(n_kv_heads=2, sliding_window=4, full_attention_every=2) if request.param == "window" else {}
    return make_model(seed=3, dtype=torch.float64, max_seq_len=48, **extra)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (n,), generator=g).tolist() for n in lengths]


def new_cache(model, rows: int, max_len: int) -> KVCache:
    return KVCache(model.config, rows, max_len, model.device, torch.float64)


@torch.no_grad()
def prefilled(model, rows: list[list[int]], max_len: int | None = None) -> KVCache:
    """A fresh cache holding ``rows``, left-padded as ``generate`` prefills them."""
    ids, mask = left_pad(rows)
    cache = new_cache(model, len(rows), max_len or ids.shape[1] + ROOM)
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def decode(model, cache: KVCache, rows: list[list[int]], steps: int = 3) -> torch.Tensor:
    """The logits of ``steps`` decode steps that feed fixed tokens; each row's positions go on from its length."""
    positions = torch.tensor([[len(r)] for r in rows])
    tokens = torch.arange(len(rows)).unsqueeze(1) + 5
    logits = []
    for step in range(steps):
        logits.append(model(tokens + step, position_ids=positions + step, past_key_values=cache,
                            use_cache=True).logits[:, -1])
    return torch.stack(logits, dim=1)


def assert_same(model, got: KVCache, want: KVCache, rows: list[list[int]]) -> None:
    """Same rows: each one's real columns end at the write position and hold the same keys and values."""
    assert got.batch_size == want.batch_size == len(rows)
    for cache in (got, want):
        for i, row in enumerate(rows):
            real = cache.key_mask[i].nonzero().squeeze(1).tolist()
            assert real == list(range(cache.length - len(row), cache.length)), (i, real)
    for layer in range(model.config.n_layers):
        for i, row in enumerate(rows):
            n = len(row)
            torch.testing.assert_close(got.keys(layer)[i, :, -n:], want.keys(layer)[i, :, -n:], rtol=0, atol=1e-12)
            torch.testing.assert_close(got.values(layer)[i, :, -n:], want.values(layer)[i, :, -n:], rtol=0,
                                       atol=1e-12)


def assert_same_decoding(model, got: KVCache, want: KVCache, rows: list[list[int]]) -> None:
    assert_same(model, got, want, rows)
    torch.testing.assert_close(decode(model, got, rows), decode(model, want, rows), rtol=0, atol=1e-10)


# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_allocate_update_advance_match_the_uncached_forward(model):
    ids = torch.tensor(prompts(9, 9, seed=1))
    cache = new_cache(model, 2, 12)
    assert (cache.length, cache.max_len, cache.batch_size, cache.has_padding) == (0, 12, 2, False)
    assert cache.keys(0).shape == (2, model.config.n_kv_heads, 0, model.config.resolved_head_dim)
    first = model(ids[:, :5], past_key_values=cache, use_cache=True).logits
    steps = [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(5, 9)]
    assert cache.length == 9 and cache.key_mask_through(9) is None  # no padding: attention needs no mask
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), model(ids).logits, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="overflow"):
        model(ids[:, :4], past_key_values=cache, use_cache=True)


def test_truncate_equals_a_cache_that_never_held_the_dropped_positions(model):
    rows = prompts(7, 3)
    cache = prefilled(model, rows)
    decode(model, cache, rows, steps=2)  # positions the rewind drops
    cache.truncate(7)
    assert cache.length == 7
    assert_same_decoding(model, cache, prefilled(model, rows), rows)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(cache.length + 1)


@torch.no_grad()
def test_truncate_forgets_the_padding_marks_of_the_dropped_columns(model):
    # Row 1 was left-padded over columns 0..3; rewritten without padding, those columns hold its tokens.
    cache = prefilled(model, prompts(7, 3))
    cache.truncate(0)
    rows = prompts(7, 7, seed=2)
    model(torch.tensor(rows), past_key_values=cache, use_cache=True)
    assert_same_decoding(model, cache, prefilled(model, rows), rows)


def test_select_rows_equals_a_cache_of_those_rows(model):
    rows = prompts(4, 9, 6)
    cache = prefilled(model, rows)
    cache.select_rows(torch.tensor([2, 0, 2]))
    kept = [rows[2], rows[0], rows[2]]
    assert_same_decoding(model, cache, prefilled(model, kept), kept)


@pytest.mark.parametrize(("lengths", "max_len"), [(((6, 6), (3, 3)), None), (((4, 4), (9, 9)), 20),
                                                  (((8, 5), (3, 6)), 16)], ids=["shorter", "longer", "ragged"])
def test_join_equals_a_cache_prefilled_with_all_rows(model, lengths, max_len):
    # "longer": the joining rows are longer than the batch's write position, so the batch moves right. Only
    # "ragged" has padding before the join: in the others the join alone makes some.
    first, second = prompts(*lengths[0], seed=4), prompts(*lengths[1], seed=5)
    cache = prefilled(model, first)
    capacity = cache.max_len
    cache.join(prefilled(model, second), max_len=max_len)
    rows = first + second
    assert cache.length == max(map(len, rows)) and cache.has_padding
    assert cache.max_len == (capacity if max_len is None else max_len)
    assert_same_decoding(model, cache, prefilled(model, rows), rows)


def test_join_into_an_empty_cache_with_a_given_capacity(model):
    rows = prompts(5, 5, seed=6)
    cache = new_cache(model, 0, 4)
    cache.join(prefilled(model, rows), max_len=20)
    assert (cache.length, cache.max_len) == (5, 20)
    assert not cache.has_padding  # equal lengths, nothing masked: decode steps keep the unmasked path
    assert_same_decoding(model, cache, prefilled(model, rows), rows)
    with pytest.raises(ValueError, match="cannot hold"):
        cache.join(prefilled(model, prompts(9)), max_len=8)


def test_join_refuses_a_cache_of_another_layout(model):
    other = make_model(seed=3, dtype=torch.float64, n_layers=3)
    with pytest.raises(ValueError, match="layout"):
        prefilled(model, prompts(3)).join(prefilled(other, prompts(3)))


def test_compact_drops_the_leading_padding_columns(model):
    rows = prompts(10, 4, 6, seed=7)
    cache = prefilled(model, rows)
    cache.select_rows(torch.tensor([1, 2]))  # the longest row leaves: 4 columns are padding for every row
    capacity = cache.max_len
    cache.compact()
    kept = rows[1:]
    assert (cache.length, cache.max_len) == (6, capacity)
    assert_same_decoding(model, cache, prefilled(model, kept), kept)


def test_compact_keeps_interior_padding_columns(model):
    # Dropping a column inside the rows would bring keys closer together: sliding windows would see more.
    rows = prompts(6, 6, seed=10)
    cache = prefilled(model, rows)
    cache.mask_keys(torch.zeros(2, 1, dtype=torch.bool), start=2)
    before = [cache.keys(layer).clone() for layer in range(model.config.n_layers)]
    cache.compact()
    assert cache.length == 6 and cache.key_mask[:, 2].tolist() == [False, False]
    assert all(torch.equal(cache.keys(layer), k) for layer, k in enumerate(before))


def test_grow_keeps_the_rows_and_makes_room(model):
    rows = prompts(6, 2, seed=8)
    cache = prefilled(model, rows, max_len=6)
    cache.grow(12)
    assert (cache.length, cache.max_len) == (6, 12)
    assert_same_decoding(model, cache, prefilled(model, rows, max_len=12), rows)
    with pytest.raises(ValueError, match="grow"):
        cache.grow(4)


@torch.no_grad()
def test_mask_keys_isolates_a_document_like_a_fresh_cache(model):
    # A row holding document A (3 tokens) masks A's keys before document B starts, as sequential_forward
    # does for packed documents: B then computes what it computes alone.
    a, b = prompts(3, 4, seed=9)
    cache = new_cache(model, 1, 7)
    model(torch.tensor([a]), past_key_values=cache, use_cache=True)
    assert cache.key_mask_through(3) is None
    cache.mask_keys(torch.zeros(1, 3, dtype=torch.bool), start=0)
    assert cache.has_padding and cache.key_mask_through(3).tolist() == [[False, False, False]]
    together = model(torch.tensor([b]), position_ids=torch.arange(4).unsqueeze(0), past_key_values=cache,
                     use_cache=True).logits
    alone = model(torch.tensor([b])).logits
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="does not fit"):
        cache.mask_keys(torch.ones(1, 2, dtype=torch.bool), start=6)

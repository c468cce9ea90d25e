"""fullband.stop_strings: where the first stop string starts, and a decode stream read until each row ends (at EOS,
a stop token or a stop string), as fullband bench and the lm-eval adapter read it."""

from __future__ import annotations

import torch

from fullband.stop_strings import first_stop, tokens_until_stop

EOS = 0


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i - 1) if i else "<eos>" for i in ids)  # 1 -> a, 2 -> b, ...


def stream(*steps: list[int], seen: list | None = None):
    for step in steps:
        if seen is not None:
            seen.append(step)
        yield torch.tensor(step)


def test_first_stop_is_the_earliest_non_empty_stop_at_or_after_start():
    assert first_stop("abcabc", ["c", "b"]) == 1
    assert first_stop("abcabc", ["b"], start=2) == 4
    assert first_stop("abc", ["", "x"]) is None  # an empty stop string never matches
    assert first_stop("abc", []) is None


def test_each_row_ends_at_eos_a_stop_token_or_a_stop_string():
    # row 0 ends at EOS (left out), row 1 at stop token 5 (kept), row 2 at the stop string "bc" (kept), row 3 never
    steps = [[1, 1, 2, 1], [0, 5, 3, 2], [4, 4, 4, 2], [4, 4, 4, 2]]
    rows = tokens_until_stop(stream(*steps), 4, EOS, decode, stops=["bc", ""], stop_ids={5})
    assert rows == [[1], [1, 5], [2, 3], [1, 2, 2, 2]]


def test_the_stream_is_dropped_once_every_row_has_ended():
    seen: list = []
    rows = tokens_until_stop(stream([1, 2], [0, 0], [3, 3], seen=seen), 2, EOS, decode)
    assert rows == [[1], [2]] and len(seen) == 2  # the third step was never computed
    assert tokens_until_stop(stream(), 2, EOS, decode) == [[], []]  # max_new_tokens 0: no step at all

"""Ending generated text at stop strings: where the first one starts in a text, and a batch's decode stream read
until each row ends. Shared by ``fullband bench`` and the lm-evaluation-harness adapter."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

import torch


def first_stop(text: str, stops: Iterable[str], start: int = 0) -> int | None:
    """Where the earliest of the (non-empty) ``stops`` begins in ``text`` at or after ``start``; None if none does."""
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def tokens_until_stop(
    stream: Iterable[torch.Tensor], rows: int, eos_id: int | None, detokenize: Callable[[list[int]], str],
    stops: Sequence[str] = (), stop_ids: Collection[int] = ()
) -> list[list[int]]:
    """Each row's tokens from ``stream`` (a (rows,) tensor of token ids per step, as ``generate_stream`` yields)
    until the row produces ``eos_id`` (left out) or ``stop_ids`` or text holding one of ``stops`` (kept in). A token
    of ``stop_ids`` ends its row without decoding it; a stop string is looked for in the decoded row. The stream is
    dropped once every row has ended, so no further step is computed."""
    stops = [s for s in stops if s]
    produced: list[list[int]] = [[] for _ in range(rows)]
    ended = [False] * rows
    for step in stream:
        for row, token in enumerate(step.tolist()):
            if ended[row]:
                continue
            if token == eos_id:
                ended[row] = True
                continue
            produced[row].append(token)
            if token in stop_ids or (stops and first_stop(detokenize(produced[row]), stops) is not None):
                ended[row] = True
        if all(ended):
            break
    return produced

"""The KV cache of cached decoding: every layer's keys and values for a batch, preallocated and written in place. All
rows share one write position (prompts left-padded, joining rows right-aligned at it); a key mask marks each row's
real columns. It imports nothing of the package: the Hugging Face export ships it beside ``model.py``."""

from __future__ import annotations

from typing import Protocol

import torch


class CacheLayout(Protocol):
    """What sizes a cache: a model config (``FullBandConfig`` has these fields)."""

    n_layers: int
    n_heads: int
    n_kv_heads: int | None  # None: as many as n_heads (plain multi-head attention)

    @property
    def resolved_head_dim(self) -> int: ...


class KVCache:
    """Keys and values of every layer for ``batch_size`` rows, preallocated to ``max_len`` positions."""

    def __init__(self, config: CacheLayout, batch_size: int, max_len: int, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        heads = config.n_kv_heads if config.n_kv_heads is not None else config.n_heads
        shape = (batch_size, heads, max_len, config.resolved_head_dim)
        self._k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self._v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self._key_mask = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self._has_padding = False  # whether any column before the write position is masked for some row
        self._length = 0  # positions written so far (advanced after a forward's last layer)

    @property
    def length(self) -> int:
        """The write position: columns ``[0, length)`` are written, for every row."""
        return self._length

    @property
    def max_len(self) -> int:
        return self._key_mask.shape[1]

    @property
    def batch_size(self) -> int:
        return self._key_mask.shape[0]

    @property
    def device(self) -> torch.device:
        return self._key_mask.device

    @property
    def has_padding(self) -> bool:
        """Whether some written column may be padding for some row (then attention needs the key mask)."""
        return self._has_padding

    def keys(self, layer: int) -> torch.Tensor:
        """(B, kv_heads, length, head_dim): the written keys of ``layer`` (a view)."""
        return self._k[layer][:, :, : self._length]

    def values(self, layer: int) -> torch.Tensor:
        """(B, kv_heads, length, head_dim): the written values of ``layer`` (a view)."""
        return self._v[layer][:, :, : self._length]

    @property
    def key_mask(self) -> torch.Tensor:
        """(B, length) bool: True where a written column holds the row's real token (a view)."""
        return self._key_mask[:, : self._length]

    def key_mask_through(self, end: int) -> torch.Tensor | None:
        """The (B, end) mask of the keys that queries writing up to column ``end`` attend to, or None when no
        written column is padding (attention then needs no mask)."""
        return self._key_mask[:, :end] if self._has_padding else None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's new keys and values (B, kv_heads, T, head_dim) at the write position and return
        all of that layer's keys and values through them. The write position moves once every layer has
        written (``advance``), so each layer writes at the same columns."""
        end = self._length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; writing up to {end} would overflow")
        self._k[layer][:, :, self._length : end] = k
        self._v[layer][:, :, self._length : end] = v
        return self._k[layer][:, :, :end], self._v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        """Commit ``n`` positions that every layer has written with ``update``."""
        if not 0 <= self._length + n <= self.max_len:
            raise ValueError(f"cannot advance a KVCache of length {self._length} by {n} (it holds {self.max_len})")
        self._length += n

    def mask_keys(self, mask: torch.Tensor, start: int | None = None) -> None:
        """Mark columns ``start .. start + W`` (default: from the write position) of each row real (True) or
        padding (False), from a (B, W) mask: left padding of a prompt, or the keys a query of an isolated
        document may see. A mark at or after the write position holds for the keys written there next."""
        start = self._length if start is None else start
        end = start + mask.shape[1]
        if start < 0 or end > self.max_len or mask.shape[0] != self.batch_size:
            raise ValueError(f"a ({mask.shape[0]}, {mask.shape[1]}) key mask from column {start} does not fit a "
                             f"KVCache of {self.batch_size} rows and {self.max_len} positions")
        mask = mask.to(device=self.device, dtype=torch.bool)
        self._key_mask[:, start:end] = mask
        # Once padding is known, no further check is needed: this keeps decode steps free of device syncs.
        if not self._has_padding and not bool(mask.all()):
            self._has_padding = True

    def truncate(self, length: int) -> None:
        """Rewind the write position to ``length`` (a fused prefill pass rewrites the prompt's columns;
        transformers' assisted decoding drops rejected tokens). The dropped columns count as real again."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a KVCache of length {self._length} to {length}")
        self._key_mask[:, length : self._length] = True
        self._length = length

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (or reorder, or repeat) batch rows by index, e.g. to drop finished sequences or for beam search."""
        index = index.to(self.device)
        self._k = [t.index_select(0, index) for t in self._k]
        self._v = [t.index_select(0, index) for t in self._v]
        self._key_mask = self._key_mask.index_select(0, index)

    def join(self, other: KVCache, max_len: int | None = None) -> None:
        """Append ``other``'s rows (freshly prefilled prompts), right-aligned at the write position, padding before
        them; a longer ``other`` moves the rows already here right. ``max_len``: the capacity afterwards (default:
        the current one, or the new length if that is more)."""
        if self._layout() != other._layout():
            raise ValueError(f"cannot join a KV cache of layout {other._layout()} (layers, kv heads, head_dim) "
                             f"to one of layout {self._layout()}")
        length = max(self._length, other._length)
        capacity = max(self.max_len, length) if max_len is None else max_len
        if capacity < length:
            raise ValueError(f"a KVCache of {capacity} positions cannot hold the {length} joined ones")
        shift, offset = length - self._length, length - other._length
        rows = self.batch_size

        def placed(own: torch.Tensor, new: torch.Tensor, dim: int, fill: float | bool) -> torch.Tensor:
            out = _filled(own, rows + new.shape[0], dim, capacity, fill)
            out[:rows].narrow(dim, shift, self._length).copy_(own.narrow(dim, 0, self._length))
            out[rows:].narrow(dim, offset, other._length).copy_(new.narrow(dim, 0, other._length))
            return out

        self._k = [placed(a, b, 2, 0.0) for a, b in zip(self._k, other._k)]
        self._v = [placed(a, b, 2, 0.0) for a, b in zip(self._v, other._v)]
        mask = placed(self._key_mask, other._key_mask, 1, True)
        # A row has no token in the columns before its own: left of the moved rows, left of the joined ones.
        mask[:rows, :shift] = False
        mask[rows:, :offset] = False
        self._key_mask = mask
        self._has_padding = (self._has_padding or other._has_padding or (shift > 0 and rows > 0)
                             or (offset > 0 and other.batch_size > 0))
        self._length = length

    def _layout(self) -> tuple[int, int, int]:
        return len(self._k), self._k[0].shape[1], self._k[0].shape[3]

    def grow(self, max_len: int) -> None:
        """Make room for ``max_len`` positions in all (the written ones are kept)."""
        if max_len < self.max_len:
            raise ValueError(f"cannot grow a KVCache of {self.max_len} positions to {max_len}")
        self._move(0, max_len)

    def compact(self) -> None:
        """Drop the leading columns that are padding for every row (rows that left the batch leave them
        behind), moving the written ones to the front; the capacity stays. Interior padding columns stay,
        so keys keep their distances and sliding windows see what they saw."""
        used = self._key_mask[:, : self._length].any(dim=0).nonzero()
        first = int(used[0]) if len(used) else self._length
        if first:
            self._move(first, self.max_len)

    def _move(self, first: int, capacity: int) -> None:
        """Reallocate to ``capacity`` columns holding the written columns from ``first`` on, from column 0."""
        kept = self._length - first

        def moved(t: torch.Tensor, dim: int, fill: float | bool) -> torch.Tensor:
            new = _filled(t, t.shape[0], dim, capacity, fill)
            new.narrow(dim, 0, kept).copy_(t.narrow(dim, first, kept))
            return new

        self._k = [moved(t, 2, 0.0) for t in self._k]
        self._v = [moved(t, 2, 0.0) for t in self._v]
        self._key_mask = moved(self._key_mask, 1, True)
        self._length = kept


def _filled(like: torch.Tensor, rows: int, dim: int, columns: int, fill: float | bool) -> torch.Tensor:
    """A tensor like ``like`` with ``rows`` rows and ``columns`` entries along ``dim``, all ``fill``."""
    shape = [rows, *like.shape[1:]]
    shape[dim] = columns
    return like.new_full(shape, fill)

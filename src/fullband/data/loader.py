"""TokenLoader: deterministic, resumable, rank-sharded batches of packed token windows. A step takes the next
``batch_size`` windows of one global order shuffled per (seed, epoch), rank r rows r::world_size, so the world size
can change on resume; a length curriculum's windows are drawn per (seed, step, micro-batch)."""

from __future__ import annotations

import numpy as np

from fullband.data.shards import Batch, TokenSplit, check_split_length, make_batch
from fullband.errors import ConfigError, DataError

# Keeps the curriculum's generator stream apart from the epoch orders', which are seeded by (seed, epoch).
_CURRICULUM_STREAM = 0x6C656E


def window_longest_documents(split: TokenSplit, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """Per window (first tokens ``starts``), the length of the longest document it trains, capped at seq_len + 1:
    those it holds whole, or its first if longer than the window (a cut one at its end is the next window's)."""
    doc_starts = split.doc_starts
    ends = np.append(doc_starts[1:], len(split))
    lengths = ends - doc_starts
    first = np.searchsorted(doc_starts, starts)  # windows of isolated documents start at a document start
    stop = np.searchsorted(ends, starts + seq_len + 1, side="right")  # documents first..stop-1 are whole
    # A window without a whole document starts with one longer than itself: capped at the window.
    longest = np.where(stop > first, 0, seq_len + 1).astype(np.int64)
    docs = np.arange(len(doc_starts))
    window = np.searchsorted(first, docs, side="right") - 1
    whole = (window >= 0) & (docs < stop[np.maximum(window, 0)])
    np.maximum.at(longest, window[whole], lengths[whole])
    return np.minimum(longest, seq_len + 1)


class TokenLoader:
    """Shuffled training batches of one split; `state_dict()` records the exact position."""

    def __init__(self, split: TokenSplit, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, curriculum_steps: int = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} and world_size={world_size} must satisfy 0 <= rank < world_size.")
        if batch_size < 1 or batch_size % world_size:
            raise ConfigError(
                f"batch_size={batch_size} (rows per step over all ranks) must be a positive multiple of "
                f"world_size={world_size}, so every rank gets the same number of rows; adjust batch_size."
            )
        check_split_length(split, seq_len)
        self.split, self.seq_len, self.batch_size = split, seq_len, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.curriculum_steps = curriculum_steps
        self._starts = split.window_starts(seq_len)
        self.num_windows = len(self._starts)
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.zeros(0, dtype=np.int64)
        self._longest: np.ndarray | None = None
        if curriculum_steps:
            # Windows sorted by their longest document: a step's eligible windows are a prefix of this order.
            self._by_length = np.argsort(self.longest_documents, kind="stable")
            self._sorted_lengths = self.longest_documents[self._by_length]

    @property
    def longest_documents(self) -> np.ndarray:
        """Per window, its longest trained document in tokens (capped at seq_len + 1); isolated documents only (the
        run config and the trainer refuse the options that need it on a text stream: RunConfig.refuse_text_stream)."""
        if self._longest is None:
            self._longest = window_longest_documents(self.split, self._starts, self.seq_len)
        return self._longest

    def curriculum_limit(self, step: int) -> int:
        """The longest document allowed at a curriculum step: linear from the shortest window's longest
        document at step 0 to the longest one at the curriculum's last step."""
        if not 0 <= step < self.curriculum_steps:
            raise ValueError(f"step {step} is outside the length curriculum's {self.curriculum_steps} steps")
        low, high = int(self._sorted_lengths[0]), int(self._sorted_lengths[-1])
        if self.curriculum_steps == 1:
            return high
        return low + round((high - low) * step / (self.curriculum_steps - 1))

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order, self._order_epoch = rng.permutation(self.num_windows), self.epoch
        return self._order

    def next_batch(self, step: int | None = None, micro: int = 0) -> Batch:
        """The rows of this rank for micro-batch ``micro`` of optimizer step ``step`` (0-based)."""
        return self.batch(self.next_windows(step, micro))

    def next_windows(self, step: int | None = None, micro: int = 0) -> np.ndarray:
        """The global batch's window indices (all ranks' rows) of a micro-batch; ``step`` is needed only
        during a length curriculum, whose windows depend on the step rather than on the loader's position."""
        if self.curriculum_steps:
            if step is None:
                raise ValueError("a TokenLoader with a length curriculum needs the step: next_windows(step, micro)")
            if step < self.curriculum_steps:
                return self._curriculum_windows(step, micro)
        # A step that runs past the end of an epoch continues into the next epoch's order, so every
        # batch is full and every window is still visited exactly once per epoch.
        windows = []
        need = self.batch_size
        while need:
            order = self._epoch_order()
            take = order[self.position : self.position + need]
            windows.append(take)
            need -= len(take)
            self.position += len(take)
            if self.position == self.num_windows:
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(windows)

    def _curriculum_windows(self, step: int, micro: int) -> np.ndarray:
        eligible = self._by_length[: np.searchsorted(self._sorted_lengths, self.curriculum_limit(step), side="right")]
        rng = np.random.default_rng([self.seed, step, micro, _CURRICULUM_STREAM])
        # Without replacement whenever the eligible windows suffice: early limits may admit only a few.
        return rng.choice(eligible, size=self.batch_size, replace=len(eligible) < self.batch_size)

    def batch(self, windows: np.ndarray) -> Batch:
        """This rank's rows (r::world_size) of the global batch of ``windows``."""
        return make_batch(self.split, self._starts[windows[self.rank :: self.world_size]], self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "seq_len": self.seq_len, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seq_len", "num_windows"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"Cannot resume the data loader: the saved state has {key}={state[key]} but this run "
                    f"has {key}={getattr(self, key)} (different seq_len or dataset). Resume with the same "
                    "seq_len and prepared dataset, or start a new run."
                )
        if not 0 <= state["position"] < self.num_windows or state["epoch"] < 0:
            raise DataError(f"Cannot resume the data loader: position {state['position']} / epoch "
                            f"{state['epoch']} are out of range for {self.num_windows} windows.")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])

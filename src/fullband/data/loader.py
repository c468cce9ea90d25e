"""TokenLoader: deterministic, resumable, rank-sharded batches of packed token windows.

The token stream of a split is cut into windows of seq_len + 1 tokens at stride seq_len (window i
starts at token i*seq_len; consecutive windows share one token so every token is a target once per
epoch). Each epoch visits every window once in an order shuffled by (seed, epoch). A step takes the
next `batch_size` windows of that global order and rank r keeps rows r::world_size, so the union of
all ranks' rows is exactly what a single process would see: the world size can change on resume.
Datasets with isolated documents (chat, prompt_answer) pack whole documents into windows instead
(``TokenSplit.window_starts``).
"""

from __future__ import annotations

import numpy as np

from fullband.data.shards import Batch, TokenSplit, check_split_length, make_batch
from fullband.errors import ConfigError, DataError


class TokenLoader:
    """Shuffled training batches of one split; `state_dict()` records the exact position."""

    def __init__(self, split: TokenSplit, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
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
        self._starts = split.window_starts(seq_len)
        self.num_windows = len(self._starts)
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order, self._order_epoch = rng.permutation(self.num_windows), self.epoch
        return self._order

    def next_batch(self) -> Batch:
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
        mine = np.concatenate(windows)[self.rank :: self.world_size]
        return make_batch(self.split, self._starts[mine], self.seq_len)

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

"""Validation during training (every ``train.eval_every`` steps and at the end, logged to eval.jsonl) and the kept
model (``train.keep_best``), rewritten whenever the chosen validation loss is the lowest so far."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

from fullband.config import EvalConfig
from fullband.data import PreparedDataset
from fullband.eval import EvalResult, evaluate
from fullband.train.checkpoint import CheckpointManager
from fullband.train.tracking import RunLog


class Validator:
    def __init__(self, dataset: PreparedDataset, eval_cfg: EvalConfig, seq_len: int, keep_best: str,
                 autocast: Any, is_main: bool, log: Callable[[str], None]):
        self.dataset, self.eval_cfg, self.seq_len, self.keep_best = dataset, eval_cfg, seq_len, keep_best
        self.autocast, self.is_main, self.log = autocast, is_main, log

    def evaluate(self, model: nn.Module, step: int, tokens: int, run_log: RunLog) -> EvalResult:
        """The validation split's losses per decode mode (and Jacobi diagnostics), logged."""
        e = self.eval_cfg
        batches = self.dataset.split("val").eval_batches(self.seq_len, e.batch_size, e.batches)
        result = evaluate(model, batches, e.fused_passes, sequential=e.sequential, autocast=self.autocast)
        run_log.log_eval({"step": step, "tokens": tokens, **result.to_dict()})
        if self.is_main:
            # 5 significant digits, not 4 decimals: an exact recurrence's loss of 1e-7 and one of 1e-4 differ in
            # how far a state-tracking recurrence extrapolates, and both read 0.0001 as decimals.
            losses = ", ".join(f"{k} {v:.5g}" for k, v in result.loss.items())
            self.log(f"eval @ step {step}: {losses}")
        return result

    def keep_if_best(self, model: nn.Module, result: EvalResult, step: int, best: dict | None,
                     checkpoints: CheckpointManager) -> dict | None:
        """train.keep_best: write RUN/best when this evaluation's loss is the lowest so far (or ties it); the best
        record after it."""
        name = self.keep_best
        loss = result.loss.get(name, math.nan)  # absent: an empty validation split
        if not name or not math.isfinite(loss) or (best is not None and loss > best["loss"]):
            return best
        record = {"step": step, "loss_name": name, "loss": loss, "data_dir": str(self.dataset.path.resolve())}
        checkpoints.save_best(model, record)
        return record

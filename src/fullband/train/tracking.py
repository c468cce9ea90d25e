"""Where a run's metrics go. The trainer hands every record to one ``RunLog``, which passes it to each sink, so
they all log the same things, on rank 0 only:

- OUT_DIR/metrics.jsonl (every step's record, as is) and OUT_DIR/eval.jsonl (every evaluation's);
- TensorBoard (``train.tensorboard``): their numbers as scalars in OUT_DIR/tensorboard;
- Weights & Biases (``train.wandb``): the same scalars, and the resolved run config. Without WANDB_API_KEY (and
  without WANDB_MODE) the run is offline, in OUT_DIR/wandb/offline-run-*, for ``wandb sync`` later.

Scalar names: ``train/<field>`` of a step's record (``train/pass_loss/<k>`` for its pass losses, ``train/skipped``
as 0 or 1) and ``val/<loss name>``, ``val/jacobi_delta/<k>``, ``val/sequential_gap/<k>`` of an evaluation.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from fullband.errors import ConfigError, FullbandError

# The step record's fields that are not scalars of their own.
NOT_SCALARS = ("step", "pass_losses")


def _finite_or_none(value):
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def train_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A step's record as named scalars."""
    scalars = {f"train/{k}": float(v) for k, v in record.items() if k not in NOT_SCALARS}
    scalars.update({f"train/pass_loss/{k}": v for k, v in enumerate(record.get("pass_losses", []), start=1)})
    return scalars


def eval_scalars(record: dict[str, Any]) -> dict[str, float]:
    """An evaluation's record (eval.jsonl) as named scalars."""
    scalars = {f"val/{name}": value for name, value in record["loss"].items()}
    for group in ("jacobi_delta", "sequential_gap"):
        scalars.update({f"val/{group}/{k}": value for k, value in record[group].items()})
    return scalars


class Sink(Protocol):
    def log_train(self, record: dict[str, Any]) -> None: ...

    def log_eval(self, record: dict[str, Any]) -> None: ...

    def close(self, failed: bool) -> None: ...


class JsonlSink:
    """metrics.jsonl and eval.jsonl; non-finite values become null, since strict JSON readers reject NaN."""

    def __init__(self, out_dir: Path):
        self.eval_path = out_dir / "eval.jsonl"
        self.metrics = open(out_dir / "metrics.jsonl", "a")

    def log_train(self, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps({k: _finite_or_none(v) for k, v in record.items()}) + "\n")
        self.metrics.flush()

    def log_eval(self, record: dict[str, Any]) -> None:
        with open(self.eval_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self, failed: bool) -> None:
        self.metrics.close()


class TensorBoardSink:
    def __init__(self, out_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "train.tensorboard needs the tensorboard package: pip install 'fullband[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def log_train(self, record: dict[str, Any]) -> None:
        for name, value in train_scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def log_eval(self, record: dict[str, Any]) -> None:
        for name, value in eval_scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per invocation of the trainer, its files in OUT_DIR/wandb."""

    def __init__(self, out_dir: Path, option: dict[str, Any], config: dict[str, Any], log) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("train.wandb needs the wandb package: pip install 'fullband[track]'") from None
        # No key and no explicit WANDB_MODE: log offline rather than ask for a login in the middle of a run.
        offline = "WANDB_API_KEY" not in os.environ and "WANDB_MODE" not in os.environ
        try:
            # A run of its own (reinit), even beside one the caller has open; console off: the metrics are
            # logged here, and capturing the console would wrap the process's streams.
            self.run = wandb.init(project=option["project"], name=option.get("name") or out_dir.resolve().name,
                                  tags=option.get("tags") or None, config=config, dir=str(out_dir),
                                  mode="offline" if offline else None, reinit="create_new",
                                  settings=wandb.Settings(console="off"))
        except Exception as exc:  # wandb reports a failed start (login, network) with its own error types
            raise FullbandError(f"train.wandb: W&B could not start the run ({exc}); set WANDB_MODE=offline to "
                                "log to OUT_DIR/wandb without a connection") from None
        if self.run.settings.mode == "offline":
            log(f"W&B run {self.run.name!r} is offline in {self.run.settings.sync_dir}; upload it with: wandb sync "
                f"{self.run.settings.sync_dir}")

    def log_train(self, record: dict[str, Any]) -> None:
        self.run.log(train_scalars(record), step=record["step"])

    def log_eval(self, record: dict[str, Any]) -> None:
        self.run.log(eval_scalars(record), step=record["step"])

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class RunLog:
    """The sinks of one run on this rank: none but rank 0's."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    @classmethod
    def open(cls, out_dir: Path, train_cfg, config: dict[str, Any], is_main: bool, log) -> RunLog:
        if not is_main:
            return cls([])
        sinks: list[Sink] = [JsonlSink(out_dir)]
        try:
            if train_cfg.tensorboard:
                sinks.append(TensorBoardSink(out_dir))
            if train_cfg.wandb:
                sinks.append(WandbSink(out_dir, train_cfg.wandb, config, log))
        except Exception:
            cls(sinks).close(failed=True)
            raise
        return cls(sinks)

    def log_train(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log_train(record)

    def log_eval(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log_eval(record)

    def close(self, failed: bool = False) -> None:
        for sink in self.sinks:
            sink.close(failed)

"""Where a run's metrics go: one ``RunLog`` writes metrics.jsonl and eval.jsonl and passes every record to
TensorBoard and Weights & Biases, on rank 0 only, so they all log the same things (names in docs/cli.md)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from fullband.errors import ConfigError, FullbandError

METRICS, EVALS = "metrics.jsonl", "eval.jsonl"
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


class ScalarSink:
    """A sink of named scalars: every record as ``train_scalars`` or ``eval_scalars`` names its numbers."""

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_train(self, record: dict[str, Any]) -> None:
        self.log_scalars(train_scalars(record), record["step"])

    def log_eval(self, record: dict[str, Any]) -> None:
        self.log_scalars(eval_scalars(record), record["step"])


class TensorBoardSink(ScalarSink):
    def __init__(self, out_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "train.tensorboard needs the tensorboard package: pip install 'fullband[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbSink(ScalarSink):
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

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class RunLog:
    """Where one run's records go on this rank (nowhere but on rank 0): metrics.jsonl (non-finite values as null),
    eval.jsonl and every scalar sink."""

    def __init__(self, out_dir: Path | None = None):
        self.out_dir, self.sinks = out_dir, []
        self.metrics = None if out_dir is None else open(out_dir / METRICS, "a")

    @classmethod
    def open(cls, out_dir: Path, train_cfg, config: dict[str, Any], is_main: bool, log) -> RunLog:
        if not is_main:
            return cls()
        run_log = cls(out_dir)
        try:
            if train_cfg.tensorboard:
                run_log.sinks.append(TensorBoardSink(out_dir))
            if train_cfg.wandb:
                run_log.sinks.append(WandbSink(out_dir, train_cfg.wandb, config, log))
        except Exception:
            run_log.close(failed=True)
            raise
        return run_log

    def log_train(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps({k: _finite_or_none(v) for k, v in record.items()}) + "\n")
            self.metrics.flush()
        for sink in self.sinks:
            sink.log_train(record)

    def log_eval(self, record: dict[str, Any]) -> None:
        if self.out_dir is not None:
            with open(self.out_dir / EVALS, "a") as f:
                f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.log_eval(record)

    def close(self, failed: bool = False) -> None:
        if self.metrics is not None:
            self.metrics.close()
        for sink in self.sinks:
            sink.close(failed)


def truncate_logs(out_dir: Path, step: int) -> None:
    """Drop the metrics.jsonl and eval.jsonl lines of steps after ``step``: a run resumed from the checkpoint of
    ``step`` (or started again at 0) writes them again."""
    for path in (out_dir / METRICS, out_dir / EVALS):
        if path.is_file():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in kept))

"""The training loop (docs/method.md §4-5) on one CPU, one GPU or many under torchrun (DDP or FSDP2), with atomic
checkpoints and exact resume: randomness comes from (seed, step, micro-batch, global row), not a global RNG, so it
does not depend on the rank a row lands on or on an interruption."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fullband.architectures import LanguageModel, build_model
from fullband.config import RESUMABLE_CHANGES, RunConfig, build_config, checkpoint_interval, read_sections
from fullband.data import Batch, PreparedDataset, TokenLoader, TokenSplit, open_dataset, prepare_dataset
from fullband.data.shards import IGNORE_INDEX
from fullband.decoding import DecodeSettings
from fullband.errors import CheckpointError, ConfigError, DataError, FullbandError
from fullband.eval import EvalResult
from fullband.loading import default_device
from fullband.model import FullBandConfig, FullBandLM
from fullband.schedule import PassSchedule
from fullband.storage import PREFIX as CHECKPOINT_PREFIX
from fullband.storage import (
    ModelDir,
    RunDir,
    list_checkpoints,
    read_best,
    verify_checkpoint,
)
from fullband.train.checkpoint import CheckpointManager
from fullband.train.init import init_config, keeps_fusion, load_init_weights
from fullband.train.objective import LossOptions, MultipassObjective
from fullband.train.optim import build_optimizers, in_cooldown, lr_multiplier, set_lr
from fullband.train.teardown import destroy_process_groups, prepare_process_group
from fullband.train.tracking import EVALS, RunLog, truncate_logs
from fullband.train.validation import Validator


class TrainingDiverged(FullbandError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    tokens: int
    compute_tokens: int  # token-equivalent compute: sum over steps of tokens × passes computed (_passes_computed)
    skipped_steps: int
    finished: bool  # False when stopped by train.stop_after_steps
    final_eval: EvalResult | None
    best: dict | None = None  # train.keep_best: {"step", "loss_name", "loss", "data_dir"} of OUT_DIR/best


@dataclass
class TrainState:
    """The counters of a run, saved in each checkpoint's trainer_state.json (with the loader's position)."""

    step: int = 0
    tokens: int = 0
    compute_tokens: int = 0  # token-equivalent compute: sum over steps of tokens × passes computed
    skipped_steps: int = 0
    consecutive_bad_steps: int = 0

    @classmethod
    def of(cls, saved: dict[str, Any]) -> TrainState:
        """The counters of a checkpoint's trainer_state.json."""
        return cls(**{f.name: saved[f.name] for f in fields(cls)})


def _row_seed(seed: int, step: int, micro: int, row: int) -> int:
    return (((seed * 1_000_003 + step) * 1_009 + micro) * 1_000_033 + row) % (2**63 - 1)


class Trainer:
    def __init__(self, config: RunConfig, out_dir: str | os.PathLike, data_dir: str | os.PathLike | None = None,
                 resume: bool = False, init_from: str | os.PathLike | ModelDir | None = None):
        self.cfg = config
        self.out_dir = Path(out_dir)
        self.data_dir = Path(data_dir) if data_dir else self.out_dir / "data"
        self.resume = resume
        self.init_from = init_from or None
        self._setup_distributed()
        self.train_cfg = t = config.train
        self.tokens_per_step = t.batch_size * t.grad_accum * t.seq_len
        self.total_steps = max(1, math.ceil(t.tokens / self.tokens_per_step))

    # ---- setup -----------------------------------------------------------------------------------

    def _setup_distributed(self) -> None:
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = default_device() if self.cfg.train.device == "auto" else self.cfg.train.device
        if device == "cuda" and self.world_size > 1:
            device = f"cuda:{local_rank}"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._owns_process_group = False
        if self.world_size > 1 and not dist.is_initialized():
            prepare_process_group()
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            self._owns_process_group = True
        self.is_main = self.rank == 0

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _log(self, message: str) -> None:
        if self.is_main:
            print(message, file=sys.stderr, flush=True)

    def _check_out_dir(self) -> None:
        if not self.resume and list_checkpoints(self.out_dir):
            raise ConfigError(
                f"{self.out_dir} already holds checkpoints of a run. Pass --resume to continue it, or "
                "choose another --out-dir."
            )
        if self.resume and not (self.out_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume: {self.out_dir} holds no run (config.yaml is missing)")

    def _check_resume_config(self) -> None:
        """The resolved config (model vocabulary from the tokenizer etc.) must match the saved run's."""
        saved = self.out_dir / "config.yaml"
        before = build_config(read_sections(saved), source=str(saved)).flat()
        now = self.cfg.flat()
        changed = sorted(k for k in now if k not in RESUMABLE_CHANGES and before.get(k) != now[k])
        if changed:
            details = "; ".join(f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in changed)
            raise ConfigError(
                f"--resume: {self.out_dir} was trained with a different config ({details}). Resume with the "
                "run's own config (OUT_DIR/config.yaml), or start a new run in another --out-dir."
            )

    def _prepare_data(self) -> PreparedDataset:
        if self.is_main:
            prepare_dataset(self.cfg.data, self.data_dir)
        self._barrier()
        dataset = open_dataset(self.data_dir, verify=self.is_main)
        if dataset.manifest.get("data_fingerprint") != self.cfg.data.fingerprint():
            raise DataError(
                f"the prepared dataset in {self.data_dir} was made from another data config; point --data-dir "
                "at a fresh directory or prepare it again with this config"
            )
        return dataset

    def _build_model(self, dataset: PreparedDataset) -> LanguageModel:
        model_cfg = self.cfg.model
        if self.init_from is not None:
            model_dir = self.init_from if isinstance(self.init_from, ModelDir) else ModelDir.open(
                self.init_from, hashes=True)  # weights to train on: hashed
            self._keep_fusion = keeps_fusion(self.train_cfg.init_fusion, model_dir)
            model_cfg = init_config(model_dir, model_cfg, dataset, self._keep_fusion, self.data_dir)
        elif model_cfg.vocab_size != dataset.vocab_size:
            # A model trained from scratch takes its vocabulary from the tokenizer.
            model_cfg = FullBandConfig.from_dict({**model_cfg.to_dict(), "vocab_size": dataset.vocab_size})
        if dataset.vocab_size > model_cfg.vocab_size:
            raise DataError(
                f"the data's tokenizer has {dataset.vocab_size} tokens but the model's vocabulary has "
                f"{model_cfg.vocab_size}: prepare the data with the checkpoint's tokenizer"
            )
        self.cfg.model = model_cfg
        self.cfg.validate()  # again: --init-from brings the source's model config (its max_seq_len, n_layers)
        torch.manual_seed(self.train_cfg.seed)
        model = build_model(model_cfg)
        if self.init_from is not None:
            load_init_weights(model, model_dir, self._keep_fusion, self.train_cfg.seed, self._log)
        return model.to(self.device)

    def _check_cut_documents(self, split: TokenSplit, seq_len: int) -> None:
        """Records longer than a window lose their ends: say so, and refuse when nothing would be trained."""
        long, untrained, longest = split.cut_documents(seq_len)
        if not long:
            return
        fix = (f"Raise train.seq_len to at least {longest - 1} (and model.max_seq_len with it) to train every "
               "record whole, or shorten the records")
        if untrained == split.num_documents:
            raise DataError(
                f"every training record is longer than a window of train.seq_len + 1 = {seq_len + 1} tokens and has "
                f"no trained target inside it (the longest has {longest:,} tokens): nothing would be trained. {fix}."
            )
        lost = (f"; {untrained:,} of them have no trained target there (e.g. a prompt/answer record whose answer "
                "lies past the cut) and are never trained") if untrained else ""
        self._log(f"warning: {long:,} of {split.num_documents:,} training records are longer than a window of "
                  f"train.seq_len + 1 = {seq_len + 1} tokens (the longest has {longest:,}); each is trained only on "
                  f"its first {seq_len + 1} tokens{lost}. {fix}.")

    def _wrap(self, model: LanguageModel) -> nn.Module:
        # Checkpointing is decided inside FullBandLM.forward, so it is set before compile traces the forward and
        # before fully_shard (torchtitan's order: AC, compile, FSDP); FSDP2's hooks skip the recomputation's
        # unshard, which the pre-backward hook has done.
        if isinstance(model, FullBandLM):
            model.set_activation_checkpointing(
                checkpoint_interval(self.train_cfg.activation_checkpointing))
        if self.train_cfg.compile:
            model.compile()
        if self.train_cfg.compile_recurrence and self.sequential:  # the exact schedule: a transformer's
            # Sequential training's token steps, a chunk of positions per compiled call: set on the raw model, which
            # the objective (and DDP around it) calls. Evaluation runs without gradients, so uncompiled.
            try:
                model.compile_recurrence(self.train_cfg.compile_recurrence)
            except ValueError as exc:
                raise ConfigError(f"train.compile_recurrence={self.train_cfg.compile_recurrence} cannot run this "
                                  f"model's token steps ({exc}): set train.compile_recurrence 0") from None
            self._log(f"train.compile_recurrence {self.train_cfg.compile_recurrence}: "
                      f"{model.compiled_steps.describe()}")
        objective: nn.Module = MultipassObjective(model, self.loss_options)
        if self.world_size > 1:
            if self.train_cfg.parallel == "fsdp":
                from torch.distributed.fsdp import fully_shard

                for block in model.layers:
                    fully_shard(block)
                fully_shard(model)
            else:
                from torch.nn.parallel import DistributedDataParallel

                # K = 1 steps leave the fusion weights unused; every rank draws the same K.
                objective = DistributedDataParallel(
                    objective, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                    find_unused_parameters=True,
                )
        return objective

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        try:
            result = self._run()
            self._barrier()  # every rank is done with the last collective before the group goes away
            return result
        finally:
            # Destroy the process group for real while Python is alive: a group that survives into interpreter
            # shutdown can abort the process there (SIGABRT; see fullband.train.teardown).
            self._release()
            if self._owns_process_group and dist.is_initialized():
                destroy_process_groups()

    def _release(self) -> None:
        """Drop what _setup built: FSDP's sharded weights (and the optimizer states over them) hold the process
        group through their device mesh, and a group still referred to is not destroyed."""
        for name in ("objective", "model", "optimizers", "loader", "dataset"):
            if hasattr(self, name):
                delattr(self, name)

    def _run(self) -> TrainResult:
        self._check_out_dir()
        dataset = self._prepare_data()
        model = self._build_model(dataset)
        if self.resume:
            self._check_resume_config()
            finished = self._finished_run()
            if finished is not None:
                return finished
        self._write_run_files(dataset)
        self._setup(dataset, model)
        return self._train()

    def _write_run_files(self, dataset: PreparedDataset) -> None:
        """OUT_DIR/config.yaml and OUT_DIR/tokenizer, there before the first checkpoint (and for --resume)."""
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.cfg.save(self.out_dir / "config.yaml")
            if not (self.out_dir / "tokenizer").exists():
                shutil.copytree(dataset.path / "tokenizer", self.out_dir / "tokenizer")

    def _setup(self, dataset: PreparedDataset, model: LanguageModel) -> None:
        """What the loop needs: the wrapped objective, optimizers, schedule and loader, and the counters, loader
        position and best model of the checkpoint a resumed run starts from."""
        t = self.train_cfg
        self.dataset, self.model = dataset, model
        self.schedule = PassSchedule.parse(t.schedule)
        # train.exact_mode applies to the exact schedule only (other schedules have no exact pass)
        self.sequential = self.schedule.exact and t.exact_mode == "sequential"
        # Detached passes are backpropagated one at a time (memory of one pass, not K). DDP and FSDP
        # synchronise gradients once per backward, so distributed runs keep one backward per micro-batch.
        self.loss_options = LossOptions.of(t, self.sequential, per_pass_backward=self.world_size == 1)
        self.objective = self._wrap(model)
        self.optimizers = build_optimizers(model, t)
        split = dataset.split("train")
        if not split.isolate:
            self.cfg.refuse_text_stream(f"the dataset in {dataset.path} (record format "
                                        f"{dataset.manifest.get('record_format')!r})")
        self._check_cut_documents(split, t.seq_len)
        curriculum_steps = round(t.length_curriculum * self.total_steps)
        self.loader = TokenLoader(split, t.seq_len, t.batch_size, t.seed, self.rank, self.world_size, curriculum_steps)
        bfloat16 = t.dtype == "bfloat16" or (t.dtype == "auto" and self.device.type == "cuda")
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if bfloat16 else contextlib.nullcontext()
        # How the saved model decodes by default, implied by the schedule it was trained with (a user changes it
        # when exporting, serving or calling).
        decode = DecodeSettings.trained_with(self.schedule, self.cfg.model.max_seq_len)
        # The format written; resuming reads either, whatever world size wrote it (DCP reshards).
        checkpoint_format = t.checkpoint_format if t.checkpoint_format != "auto" else (
            "dcp" if t.parallel == "fsdp" else "full")
        self.checkpoints = CheckpointManager(self.out_dir, checkpoint_format, self.cfg.model, decode,
                                             dataset.path / "tokenizer", t.keep_checkpoints, self.world_size,
                                             self.is_main, self._log)
        self.validator = Validator(dataset, self.cfg.eval, t.seq_len, t.keep_best, self.autocast, self.is_main,
                                   self._log)
        saved = self.checkpoints.resume(self.model, self.optimizers) if self.resume else None
        self.state = TrainState.of(saved) if saved is not None else TrainState()
        if saved is not None:
            self.loader.load_state_dict(saved["loader"])
        if self.is_main:
            # Lines logged after the checkpoint we resume from (or by an attempt that died before its first one).
            truncate_logs(self.out_dir, self.state.step)
        # The best model so far; one chosen after the checkpoint we resume from is chosen again, identically.
        self.best = read_best(self.out_dir) if t.keep_best else None
        if self.best is not None and self.best["step"] > self.state.step:
            self.best = None
        if t.keep_best and self.best is None and self.is_main:
            shutil.rmtree(self.out_dir / "best", ignore_errors=True)

    def _train(self) -> TrainResult:
        """The loop: optimizer steps until the token budget (or train.stop_after_steps) is reached, with metrics,
        evaluations and checkpoints between them, then the final evaluation."""
        t, state = self.train_cfg, self.state
        run_log = RunLog.open(self.out_dir, t, self.cfg.to_dict(), self.is_main, self._log)
        progress = self._progress(self.total_steps, state.step)
        self.model.train()
        started, start_step = time.perf_counter(), state.step
        final_eval = None
        failed = True
        try:
            if self.cfg.eval.at_start and state.step == 0:
                self._evaluate_and_keep_best(run_log)
                started = time.perf_counter()  # tokens_per_s counts training steps only
            while state.step < self.total_steps:
                record = self.train_step()
                record["elapsed_s"] = round(time.perf_counter() - started, 3)
                record["tokens_per_s"] = round(
                    (state.step - start_step) * self.tokens_per_step / (time.perf_counter() - started), 1)
                run_log.log_train(record)
                self._report_progress(progress, record)
                if state.consecutive_bad_steps >= t.max_bad_steps:
                    raise TrainingDiverged(
                        f"{state.consecutive_bad_steps} consecutive steps had a non-finite loss or gradient (last at "
                        f"step {state.step}); stopping. The last good checkpoint in {self.out_dir / 'checkpoints'} is "
                        "intact: lower train.lr, raise train.warmup_steps or enable train.z_loss, then --resume."
                    )
                if t.eval_every and state.step % t.eval_every == 0 and state.step < self.total_steps:
                    self._evaluate_and_keep_best(run_log)
                stop_now = t.stop_after_steps and state.step - start_step >= t.stop_after_steps
                if (t.ckpt_every and state.step % t.ckpt_every == 0) or state.step == self.total_steps or stop_now:
                    self._checkpoint()
                if stop_now:
                    break
            if state.step == self.total_steps:
                final_eval = self._evaluate_and_keep_best(run_log)
                if self.best is not None:
                    self._log(f"best validation {self.best['loss_name']} loss {self.best['loss']:.5g} at step "
                              f"{self.best['step']}: {self.out_dir / 'best'}")
            failed = False
        finally:
            if progress is not None:
                progress.close()
            run_log.close(failed)
        return self._result(state, final_eval, self.best)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step (skipped where the loss or gradient is not finite); its metrics.jsonl record."""
        t, state = self.train_cfg, self.state
        step = state.step
        # Every micro-batch's windows are drawn first: an exact step's K must fit all of them. Each rank sees the
        # global batch's windows, so all ranks agree on K without communicating.
        windows = [self.loader.next_windows(step, micro) for micro in range(t.grad_accum)]
        passes = self._passes_for_step(step, windows)
        lr = set_lr(self.optimizers, lr_multiplier(step, self.total_steps, t))
        z_loss = t.z_loss if (not t.z_loss_cooldown_only or in_cooldown(step, self.total_steps, t)) else 0.0
        # [loss, pass 1 loss, ..., pass K loss], summed on the device and read once per step, not per pass. The
        # sequential exact mode computes one pass, the exact recurrence: [loss, its loss].
        loss_sums = torch.zeros(1 + self._passes_computed(passes), dtype=torch.float64, device=self.device)
        batches = [self.loader.batch(micro_windows).to(self.device) for micro_windows in windows]
        label_count = self._step_label_count(batches)
        for micro, batch in enumerate(batches):
            generators = self._row_generators(step, micro, passes)
            losses = self.forward_backward_step(batch, passes, z_loss, generators, sync=micro + 1 == t.grad_accum,
                                                label_count=label_count)
            loss_sums += losses * self.world_size
        grad_norm = self._clip(self.model)
        values = self._all_mean(torch.cat([loss_sums.cpu(), torch.tensor([grad_norm], dtype=torch.float64)]))
        loss, grad_norm = values[0], values[-1]
        good = math.isfinite(loss) and math.isfinite(grad_norm)
        if good:
            for opt in self.optimizers:
                opt.step()
            state.consecutive_bad_steps = 0
        else:
            state.skipped_steps += 1
            state.consecutive_bad_steps += 1
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens += self.tokens_per_step
        state.compute_tokens += self.tokens_per_step * self._passes_computed(passes)
        return {"step": state.step, "tokens": state.tokens, "compute_tokens": state.compute_tokens, "loss": loss,
                "passes": passes, "pass_losses": values[1:-1], "lr": lr, "grad_norm": grad_norm, "skipped": not good}

    def forward_backward_step(
        self, batch: Batch, passes: int, z_loss: float, generators: list[torch.Generator] | None, sync: bool,
        label_count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One micro-batch's forward and backward. Its losses are divided by ``label_count`` (the step's labels on
        every rank) and backpropagated × world size, as DDP and FSDP average over ranks: the step's gradient is that
        of its mean over all its labels. DDP synchronises only when ``sync``. Returns [loss, pass losses...]."""
        no_sync = not sync and hasattr(self.objective, "no_sync")
        with self.objective.no_sync() if no_sync else contextlib.nullcontext():
            with self.autocast:
                out = self.objective(batch.input_ids, batch.targets, passes, batch.plain_mask, batch.segment_ids,
                                     z_loss, generators, label_count)
            loss, pass_losses = out.loss, out.pass_losses
            del out  # hold no pass's outputs through the backward
            if self.loss_options.backward_scale is None:
                (loss * self.world_size).backward()
        return torch.stack([v.detach().double() for v in (loss, *pass_losses)])

    def _step_label_count(self, batches: list[Batch]) -> torch.Tensor:
        """The labels (targets not ignored) of a step's micro-batches on every rank, at least 1: what the step's
        loss is the mean over. One all-reduce of a scalar per step in a distributed run."""
        count = sum((batch.targets != IGNORE_INDEX).sum() for batch in batches)
        if self.world_size > 1:
            dist.all_reduce(count)
        return count.clamp_min(1)

    def _passes_computed(self, passes: int) -> int:
        """Passes over the step's tokens that a K-pass step computes: K, or with the sequential exact mode one
        (T token steps with cached keys: the FLOPs of one pass)."""
        return 1 if self.sequential else passes

    def _passes_for_step(self, step: int, windows: list[np.ndarray]) -> int:
        if self.schedule.exact:
            # A whole window of seq_len + 1 tokens has only seq_len input positions.
            longest = int(self.loader.longest_documents[np.concatenate(windows)].max())
            return min(self.train_cfg.seq_len, longest)
        return self.schedule.passes_for_step(step, self.total_steps, self.train_cfg.seed)

    def _row_generators(self, step: int, micro: int, passes: int) -> list[torch.Generator] | None:
        """One generator per row of this rank's micro-batch, seeded by the row's global index (see _row_seed)."""
        if passes == 1:
            return None  # a 1-pass step draws no prefix length and no jitter
        seed = self.train_cfg.seed
        return [torch.Generator(device=self.device).manual_seed(_row_seed(seed, step, micro, row))
                for row in range(self.rank, self.train_cfg.batch_size, self.world_size)]

    def _report_progress(self, progress, record: dict[str, Any]) -> None:
        step, loss, passes = record["step"], record["loss"], record["passes"]
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.4f}", K=passes, tok_s=f"{record['tokens_per_s']:.0f}")
        elif self.is_main and (step % self.train_cfg.log_every == 0 or step == self.total_steps):
            self._log(f"step {step}/{self.total_steps} | loss {loss:.4f} | K {passes} | lr {record['lr']:.2e} | "
                      f"{record['tokens_per_s']:.0f} tok/s")

    def _evaluate_and_keep_best(self, run_log: RunLog) -> EvalResult:
        result = self.validator.evaluate(self.model, self.state.step, self.state.tokens, run_log)
        self.best = self.validator.keep_if_best(self.model, result, self.state.step, self.best, self.checkpoints)
        return result

    def _checkpoint(self) -> None:
        state = {**asdict(self.state), "loader": self.loader.state_dict(),
                 "data_dir": str(self.dataset.path.resolve())}
        self.checkpoints.save(self.model, self.optimizers, state)

    def _finished_run(self) -> TrainResult | None:
        """The summary of a run that already trained its whole token budget and evaluated at its end, else None:
        resuming it changes nothing (one whose final evaluation was interrupted is not finished)."""
        total_steps = self.total_steps
        checkpoint = RunDir(self.out_dir).checkpoints / f"{CHECKPOINT_PREFIX}{total_steps:08d}"
        evals = self.out_dir / EVALS
        if not checkpoint.is_dir() or not evals.is_file():
            return None
        final = [r for r in map(json.loads, filter(None, evals.read_text().splitlines())) if r["step"] == total_steps]
        if not final:
            return None
        try:
            verify_checkpoint(checkpoint)  # sha256 of every file: only once the run otherwise looks finished
        except CheckpointError:
            return None  # the normal resume path reports it and falls back to an older checkpoint
        state = TrainState.of(json.loads((checkpoint / "trainer_state.json").read_text()))
        self._log(
            f"{self.out_dir} is already complete: step {total_steps} of {total_steps} is checkpointed and "
            "evaluated (eval.jsonl); nothing to do, nothing was changed."
        )
        evaluation = EvalResult(**{k: final[-1][k] for k in ("tokens", "loss", "jacobi_delta", "sequential_gap")})
        return self._result(state, evaluation, read_best(self.out_dir) if self.train_cfg.keep_best else None)

    def _result(self, state: TrainState, final_eval: EvalResult | None, best: dict | None) -> TrainResult:
        return TrainResult(self.out_dir, state.step, state.tokens, state.compute_tokens, state.skipped_steps,
                           state.step == self.total_steps, final_eval, best)

    # ---- pieces of the loop ----------------------------------------------------------------------

    def _clip(self, model: nn.Module) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.train_cfg.grad_clip if self.train_cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2 returns a DTensor
            norm = norm.full_tensor()
        return float(norm)

    def _all_mean(self, values: torch.Tensor) -> list[float]:
        if self.world_size > 1:
            values = values.to(self.device)
            dist.all_reduce(values)
            values = values / self.world_size
        return values.tolist()

    def _progress(self, total_steps: int, initial: int):
        if not (self.train_cfg.progress and self.is_main):
            return None
        from tqdm import tqdm

        return tqdm(total=total_steps, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)


def train(config: RunConfig, out_dir: str | os.PathLike, data_dir: str | os.PathLike | None = None,
          resume: bool = False, init_from: str | os.PathLike | ModelDir | None = None) -> TrainResult:
    """Train (or resume, or mid-train from ``init_from``) and return a summary."""
    return Trainer(config, out_dir, data_dir, resume, init_from).run()

"""The GRPO loop of ``fullband rl``: rollouts in the model's decode mode, verifiable rewards, the clipped loss on the
log-probabilities of the mode that sampled (``rollout_logprobs``), checkpoints that resume bitwise, metrics.

One step: draw ``prompts_per_step`` records, sample ``group_size`` rollouts of each with ``generate`` (temperature
``temperature``, the rollout decode settings) until the end token or the stop (a newline for line answers), reward
them (a rollout cut at ``max_new_tokens`` gets ``truncated_reward``), and compute group-relative advantages. With
``dynamic_sampling`` the groups whose rewards are all equal are dropped and up to ``refill_rounds`` more draws of
records refill the batch. A batch whose advantages are all zero makes no optimizer step (AdamW's momentum alone would
still move the weights); otherwise ``updates_per_step`` optimizer steps on the clipped loss, at the learning rate of
the schedule (warm-up, then constant, cosine or linear decay), each on the gradient of all the rollouts, scored
``micro_batch`` at a time with their gradients accumulated where memory cannot hold the logits of all of them. Every
random draw (records, sampling, refills) comes from a generator seeded by (seed, step), and the model, optimizer and
step are checkpointed, so a run stopped after any checkpoint and resumed computes what the uninterrupted run
computes.

The model stays in eval mode throughout: fullband's forward has no dropout and draws no noise outside training's
Jacobi passes, so the probabilities recomputed for the update are those the sampler used (ratio 1 on the first
update, as the objective assumes).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import sys
import time
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from fullband.bench.runner import stop_token_ids
from fullband.bench.tasks import read_jsonl_records
from fullband.config import coerce
from fullband.data.chat import apply_chat_template, end_of_turn_ids
from fullband.data.config import described
from fullband.decoding import DecodeSettings
from fullband.errors import ConfigError, DataError, FullbandError
from fullband.generation import generate
from fullband.loading import encode_prompt, load_model
from fullband.model import FullBandLM
from fullband.rl.grpo import (
    AGGREGATIONS,
    IS_CAP,
    IS_CORRECTIONS,
    REWARD_SCALES,
    group_advantages,
    grpo_loss,
    importance_weights,
    informative_groups,
    pad_rows,
)
from fullband.rl.logprobs import rollout_logprobs, rollout_logprobs_and_entropies
from fullband.rl.rewards import REWARD_KINDS, ExactMatchReward, RewardFunction, make_reward
from fullband.storage import ModelDir, latest_valid_checkpoint
from fullband.train.checkpoint import read_checkpoint, write_checkpoint
from fullband.train.tracking import RunLog

if typing.TYPE_CHECKING:
    from fullband.vllm.rollouts import VLLMRollouts

CONFIG_NAME = "config.yaml"  # OUT_DIR/config.yaml: {"rl": the RLConfig}, as fullband train saves its own
LR_SCHEDULES = ("constant", "cosine", "linear")
STOPS = ("auto", "newline", "eos")
ROLLOUT_ENGINES = ("fullband", "vllm")
VLLM_EXPORT_DIR = "vllm_policy"  # OUT_DIR/vllm_policy: the export vLLM starts from, removed at the end of the run


@dataclass
class RLConfig:
    model: str = described("", "run directory, checkpoint or model directory (with its tokenizer) to start from")
    data: str = described("", "training records: JSONL of {\"prompt\": ..., \"answer\": ...}")
    val_data: str = described("", "held-out records (same format) for the greedy accuracy in eval.jsonl ('' = none)")
    reward: str = described("exact", f"reward function: {REWARD_KINDS} (fullband.rl.rewards)")
    chat: bool = described(False, "apply the model's chat template to each record's prompt as one user message and "
                           "end a rollout at the template's end of turn, as fullband chat and fullband serve's chat "
                           "completions do; the reward grades the reply before it (rollouts and evaluation alike)")
    allow_unsandboxed: bool = described(False, "code reward: run programs under the resource-limit guard where "
                                        "bubblewrap cannot run (not a security boundary)")
    decode_mode: str = described("", "rollout decode mode (standard, soft, fused:N, fused:auto, fused:exact); '' = "
                                 "the model's stored setting; checkpoints store it")
    score_mode: str = described("", "ablation only: the decode mode whose log-probabilities the loss uses ('' = the "
                                "rollout mode, the right one); 'standard' is what a trainer that ignores the mode "
                                "computes")
    steps: int = described(100, "RL steps; each samples new rollouts and makes updates_per_step optimizer updates")
    prompts_per_step: int = described(8, "records drawn per step")
    group_size: int = described(8, "rollouts per record (the G of GRPO)")
    max_new_tokens: int = described(16, "longest rollout, in tokens; leave room for the answer and its end (a "
                                    "rollout that reaches it unended gets truncated_reward)")
    stop: str = described("auto", "what ends a rollout besides the end token (with rl.chat, the end of turn): "
                          "'newline' (a token holding a newline; the reward grades the text before it), 'eos' (the "
                          "end token only), 'auto' (newline for the exact reward without rl.chat, whose answers are "
                          "one line, as fullband bench's jsonl tasks stop; eos else)")
    truncated_reward: float | None = described(0.0, "reward of a rollout that reaches max_new_tokens without "
                                               "ending, whatever its text: an answer must end to count (null: graded "
                                               "by the reward like any other, as TRL does)")
    mask_truncated_completions: bool = described(False, "leave the rollouts that reach max_new_tokens without "
                                                 "ending out of the loss (TRL's option), beside truncated_reward")
    temperature: float = described(1.0, "sampling temperature of the rollouts (the log-probabilities use the same)")
    rollout_engine: str = described("fullband", "what samples the rollouts: 'fullband' (fullband's generate) or "
                                    "'vllm' (vLLM in this process through the fullband.vllm plugin, the weights "
                                    "synced every step; standard, soft, fused:N and fused:exact)")
    is_correction: str = described("none", "rollout_engine vllm: importance-sampling correction of the mismatch "
                                   f"between vLLM's and the trainer's probabilities, TRL's modes: "
                                   f"{', '.join(IS_CORRECTIONS)}")
    is_clip_max: float = described(IS_CAP, "is_correction: the cap C of the weights (truncate: min(w, C); mask: "
                                   "w above C is 0)")
    updates_per_step: int = described(1, "optimizer updates on each step's rollouts (μ; > 1 makes the clip matter)")
    micro_batch: int = described(0, "rollouts scored per forward and backward, their gradients accumulated into each "
                                 "update's one optimizer step (0 = all of the step's rollouts at once): less memory "
                                 "for more time; the loss and its gradient differ only in float rounding")
    lr: float = described(1e-4, "AdamW peak learning rate")
    lr_schedule: str = described("constant", f"after the warm-up: {', '.join(LR_SCHEDULES)} (decaying to "
                                 "min_lr_ratio·lr at the last step)")
    warmup_steps: int = described(0, "linear learning-rate warm-up steps")
    min_lr_ratio: float = described(0.0, "cosine and linear: the last step's learning rate as a fraction of lr")
    weight_decay: float = described(0.0, "AdamW weight decay")
    grad_clip: float = described(1.0, "clip the gradient norm to this (0 = off)")
    clip_low: float = described(0.2, "ratio clip below: 1 - clip_low")
    clip_high: float = described(0.2, "ratio clip above: 1 + clip_high (DAPO: 0.28, above clip_low)")
    kl_coef: float = described(0.0, "weight β of the k3 KL to the starting model (0 = no reference model)")
    loss_aggregation: str = described("sequence", "'sequence' (GRPO: mean per rollout, then over rollouts) or 'token' "
                                      "(DAPO: mean over all tokens)")
    scale_rewards: str = described("group", "'group': advantages divided by the group's reward std; 'none' (Dr. GRPO)")
    dynamic_sampling: bool = described(False, "DAPO: drop the groups whose rewards are all equal (no signal) and "
                                       "refill the batch from more records (refill_rounds)")
    refill_rounds: int = described(2, "dynamic_sampling: at most this many more draws of prompts_per_step records "
                                   "per step while fewer than prompts_per_step groups have a signal (0 = drop only)")
    seed: int = described(0, "seed of the record draws and the rollouts' sampling")
    device: str = described("auto", "'auto' (cuda if available), 'cpu', 'cuda', ...")
    eval_every: int = described(0, "greedy accuracy on val_data every N steps, and before the first (0 = at the end "
                                "only)")
    eval_prompts: int = described(200, "held-out records graded per evaluation (the first N of val_data)")
    eval_batch_size: int = described(64, "prompts per generate call in evaluation")
    ckpt_every: int = described(0, "write a checkpoint every N steps (0 = at the end only)")
    keep_checkpoints: int = described(2, "how many most recent checkpoints to keep")
    stop_after_steps: int = described(0, "stop (with a checkpoint) after this many steps of this invocation (0 = run "
                                       "to the end); for preemptible jobs and resume tests")
    progress: bool = described(True, "show a progress bar with reward and accuracy")
    log_every: int = described(10, "print a line every N steps when there is no progress bar")
    tensorboard: bool = described(False, "also write TensorBoard events to OUT_DIR/tensorboard")
    wandb: dict = described({}, "W&B logging: {project: P, name: N, tags: [...]}; {} = off")

    def validate(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "updates_per_step",
                     "eval_prompts", "eval_batch_size", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "ckpt_every", "stop_after_steps", "weight_decay", "grad_clip", "kl_coef",
                     "clip_low", "clip_high", "warmup_steps", "refill_rounds", "micro_batch"):
            if getattr(self, name) < 0:
                raise ConfigError(f"rl.{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0 or not self.temperature > 0:
            raise ConfigError(f"rl.lr and rl.temperature must be > 0, got {self.lr} and {self.temperature}")
        if self.loss_aggregation not in AGGREGATIONS:
            raise ConfigError(f"rl.loss_aggregation must be one of {', '.join(AGGREGATIONS)}, "
                              f"got {self.loss_aggregation!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"rl.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"rl.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.stop not in STOPS:
            raise ConfigError(f"rl.stop must be one of {', '.join(STOPS)}, got {self.stop!r}")
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ConfigError(f"rl.rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}, "
                              f"got {self.rollout_engine!r}")
        if self.is_correction not in IS_CORRECTIONS:
            raise ConfigError(f"rl.is_correction must be one of {', '.join(IS_CORRECTIONS)}, "
                              f"got {self.is_correction!r}")
        if self.is_correction != "none" and self.rollout_engine != "vllm":
            raise ConfigError(f"rl.is_correction {self.is_correction} corrects for vLLM's rollouts; with "
                              "rl.rollout_engine fullband the sampler is the trainer's model (every weight is 1): "
                              "set rl.rollout_engine vllm or leave rl.is_correction none")
        if not self.is_clip_max > 0:
            raise ConfigError(f"rl.is_clip_max must be > 0, got {self.is_clip_max}")
        if self.scale_rewards not in REWARD_SCALES:
            raise ConfigError(f"rl.scale_rewards must be one of {', '.join(REWARD_SCALES)}, got {self.scale_rewards!r}")
        if self.group_size < 2:
            raise ConfigError("rl.group_size must be >= 2: GRPO's advantages compare a prompt's rollouts")
        if not self.model:
            raise ConfigError("give the model to start from (fullband rl MODEL, or rl.model)")
        if not self.data:
            raise ConfigError("give the training records with --rl.data FILE.jsonl "
                              "({\"prompt\": ..., \"answer\": ...})")
        if self.wandb and not isinstance(self.wandb.get("project"), str):
            raise ConfigError("rl.wandb needs a project: e.g. --rl.wandb '{project: fullband}'; {} turns W&B off")
        for label in (self.decode_mode, self.score_mode):
            if label:
                DecodeSettings().with_label(label)  # the same message as every other door


# Fields that may differ between a run and its resumption: they change logging and pacing, not the computation.
# Not micro_batch: it changes the float rounding of the loss, so the weights would not be the uninterrupted run's.
RESUMABLE = {"device", "eval_every", "eval_prompts", "eval_batch_size", "ckpt_every", "keep_checkpoints",
             "stop_after_steps", "progress", "log_every", "tensorboard", "wandb", "val_data", "steps"}


def rl_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(RLConfig))


def build_rl_config(raw: dict[str, Any] | None, overrides: dict[str, Any] | None = None,
                    source: str = "config") -> RLConfig:
    """An RLConfig from a YAML mapping (``{"rl": {field: value}}``) and ``rl.field`` command-line strings."""
    raw = raw or {}
    if not isinstance(raw, dict) or set(raw) - {"rl"}:
        raise ConfigError(f"{source}: the top level must be one section, rl: {{field: value, ...}}")
    section = raw.get("rl") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: section 'rl' must be a mapping of field: value")
    types = typing.get_type_hints(RLConfig)
    values: dict[str, Any] = {}
    given = [(k, v, False) for k, v in section.items()]
    given += [(k.removeprefix("rl."), v, True) for k, v in (overrides or {}).items()]
    for key, value, from_cli in given:
        if key not in types:
            where = f"--rl.{key}" if from_cli else f"{source}: rl.{key}"
            raise ConfigError(f"{where}: unknown option; the rl options are {', '.join(sorted(types))}")
        values[key] = coerce(value, types[key], f"rl.{key}", from_cli)
    config = RLConfig(**values)
    config.validate()
    return config


def read_records(path: str | Path) -> list[dict[str, str]]:
    """JSONL records with a "prompt" and an "answer" (the answer as text), as ``fullband bench`` reads them."""
    return [{"prompt": r["prompt"], "answer": str(r["answer"])} for r in read_jsonl_records(path)]


def lr_multiplier(step: int, cfg: RLConfig) -> float:
    """The learning rate of 0-based ``step`` as a fraction of ``cfg.lr``: a linear warm-up over ``warmup_steps``,
    then constant, or a cosine or linear decay that reaches ``min_lr_ratio`` at the last step. A function of the step
    alone, so a resumed run needs no scheduler state."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def resolve_stop(stop: str, reward: RewardFunction, chat: bool = False) -> str:
    """``rl.stop`` with 'auto' decided: 'newline' for the exact reward (it grades the first line, and fullband bench's
    jsonl tasks stop at a newline), 'eos' for every other reward (code and worked answers span lines) and for chat
    prompts (a reply ends at its end of turn, as in fullband chat)."""
    if stop != "auto":
        return stop
    return "newline" if isinstance(reward, ExactMatchReward) and not chat else "eos"


def end_token_ids(tokenizer: Any, stop: str, chat: bool = False) -> set[int]:
    """The tokens that end a rollout: the tokenizer's end token, with ``chat`` the chat template's end-of-turn tokens
    (``end_of_turn_ids``, where fullband chat and the server stop), and with ``stop`` 'newline' every token whose
    text holds a newline (as fullband bench stops a one-line answer)."""
    turn = set(end_of_turn_ids(tokenizer)) if chat else set()
    return {tokenizer.eos_id} | turn | (stop_token_ids(tokenizer, ("\n",)) if stop == "newline" else set())


def prompt_ids(tokenizer: Any, text: str, chat: bool = False) -> list[int]:
    """A record's prompt as token ids, for the rollouts and the held-out evaluation alike: with ``chat`` the chat
    template applied to it as one user message, opening the assistant's turn (``apply_chat_template``, as fullband
    chat and the server encode a conversation); else its text after the BOS token (as fullband bench encodes it)."""
    if chat:
        return apply_chat_template(tokenizer, [{"role": "user", "content": text}])
    return encode_prompt(tokenizer, text)


def check_chat(tokenizer: Any, model: str) -> None:
    """Refuse rl.chat, before any rollout, for a tokenizer that cannot format a conversation."""
    try:
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
        end_of_turn_ids(tokenizer)
    except DataError as exc:
        raise ConfigError(f"rl.chat true needs a chat template, and the tokenizer of {model} cannot format a chat: "
                          f"{exc} Or leave rl.chat false: the prompts are then encoded as plain text, as fullband "
                          "bench encodes them.") from None


def cut_at_end(row: Sequence[int], end_ids: set[int]) -> list[int]:
    """A generated row up to and including its first end token (generate repeats it after the end)."""
    out = []
    for token in row:
        out.append(int(token))
        if token in end_ids:
            break
    return out


@dataclass
class Completions:
    """Generated rows cut at their end: the token ids the loss scores (with the end token), the text the reward
    grades (before the end token, and with the newline stop before the newline) and whether the row ended before
    the token cap."""

    tokens: list[list[int]]
    texts: list[str]
    ended: list[bool]


def finish(rows: Sequence[Sequence[int]], tokenizer: Any, stop: str, end_ids: set[int]) -> Completions:
    tokens = [cut_at_end(row, end_ids) for row in rows]
    texts = [tokenizer.decode([t for t in row if t != tokenizer.eos_id]) for row in tokens]
    if stop == "newline":
        texts = [text.split("\n", 1)[0] for text in texts]
    return Completions(tokens, texts, [row[-1] in end_ids for row in tokens])


def step_seed(seed: int, step: int, purpose: str) -> int:
    """A 63-bit seed for one purpose of one step: the same on a resumed run as on the uninterrupted one."""
    return random.Random(f"{purpose}:{seed}:{step}").getrandbits(63)


def greedy_accuracy(model: FullBandLM, tokenizer: Any, records: Sequence[dict[str, str]], reward: RewardFunction,
                    decode: DecodeSettings, max_new_tokens: int, stop: str = "auto", must_end: bool = True,
                    batch_size: int = 64, chat: bool = False) -> float:
    """The share of ``records`` whose greedy completion (``decode``, at most ``max_new_tokens``, ended as ``stop``
    says: ``rl.stop``) is correct by the reward: the held-out accuracy of ``fullband rl``'s eval.jsonl. With
    ``must_end`` (``rl.truncated_reward`` set) an answer that does not end in the budget is wrong, as for the
    rollouts' reward. ``chat``: ``rl.chat`` (the prompts in the chat template, replies ended at the end of turn)."""
    stop = resolve_stop(stop, reward, chat)
    end_ids = end_token_ids(tokenizer, stop, chat)
    correct = 0
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        prompts = [prompt_ids(tokenizer, r["prompt"], chat) for r in chunk]
        with torch.no_grad():
            rows = generate(model, prompts, max_new_tokens, decode=decode, eos_token_id=tokenizer.eos_id,
                            stop_token_ids=sorted(end_ids))
        done = finish(rows.tolist(), tokenizer, stop, end_ids)
        graded = reward(done.texts, [r["answer"] for r in chunk])
        correct += sum((ended or not must_end) and r >= reward.correct_at for r, ended in zip(graded, done.ended))
    return correct / len(records)


@dataclass
class Rollouts:
    """Rollouts in consecutive groups (group_size per record): prompt ids (repeated per rollout), completion ids (cut
    after their end token), rewards (N,), and per rollout (bool, N): correct by the reward, ended before the cap.
    ``sampling_logprobs``: the sampler's log-probability of each completion token when another engine (vLLM)
    sampled them, None when fullband's own generate did (the trainer's are then the sampler's)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    rewards: torch.Tensor
    correct: torch.Tensor
    ended: torch.Tensor
    sampling_logprobs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, index: Iterable[int]) -> Rollouts:
        index = list(index)
        sampling = None if self.sampling_logprobs is None else [self.sampling_logprobs[i] for i in index]
        return Rollouts([self.prompts[i] for i in index], [self.completions[i] for i in index], self.rewards[index],
                        self.correct[index], self.ended[index], sampling)

    @staticmethod
    def cat(parts: Sequence[Rollouts]) -> Rollouts:
        sampling = None
        if all(p.sampling_logprobs is not None for p in parts):
            sampling = [s for part in parts for s in part.sampling_logprobs]
        return Rollouts([p for part in parts for p in part.prompts], [c for part in parts for c in part.completions],
                        torch.cat([p.rewards for p in parts]), torch.cat([p.correct for p in parts]),
                        torch.cat([p.ended for p in parts]), sampling)


SAMPLING_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                    "sampling/importance_sampling_ratio/max")


def micro_batches(count: int, size: int) -> list[slice]:
    """``count`` rollouts in consecutive micro-batches of ``size`` (rl.micro_batch; 0: one of all of them)."""
    size = size or count
    return [slice(start, start + size) for start in range(0, count, size)]


def sampling_metrics(trainer_logprobs: Sequence[torch.Tensor], sampling_logprobs: Sequence[torch.Tensor],
                     ratios: torch.Tensor) -> dict[str, float]:
    """TRL's metrics of the sampler's mismatch, under TRL's names (``SAMPLING_METRICS``): |trainer - sampler|
    log-probability over the completion tokens (mean, max) and the importance weights (``importance_weights``:
    per token over the completion tokens, per rollout for the sequence corrections; min, mean, max)."""
    trainer, mask = pad_rows(trainer_logprobs)
    sampler, _ = pad_rows([s.to(trainer.dtype) for s in sampling_logprobs])
    delta = (trainer - sampler).abs()[mask]
    weights = ratios.flatten() if ratios.shape[1] == 1 else ratios[mask]
    values = (delta.mean(), delta.max(), weights.min(), weights.mean(), weights.max())
    return {name: float(value) for name, value in zip(SAMPLING_METRICS, values)}


@dataclass
class RLResult:
    steps: int
    final_accuracy: float | None  # greedy accuracy on val_data at the end (None without val_data)
    out_dir: Path


class RLTrainer:
    def __init__(self, cfg: RLConfig, out_dir: str | Path, resume: bool = False, reward: RewardFunction | None = None):
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.records = read_records(cfg.data)
        self.val_records = read_records(cfg.val_data)[: cfg.eval_prompts] if cfg.val_data else []
        self.reward = reward or make_reward(cfg.reward, cfg.allow_unsandboxed)
        source = ModelDir.open(cfg.model)
        self.source = source.path
        self.tokenizer_dir = source.tokenizer if source.tokenizer != source.path else None  # not an export's
        if self.tokenizer_dir is None:
            raise FullbandError(f"{source.path} has no tokenizer directory saved with it; RL checkpoints copy it: "
                                "start from a run, checkpoint or model directory written by fullband or `fullband "
                                "convert` (for a Hugging Face export, the directory it was exported from)")
        self.step = 0
        checkpoint = latest_valid_checkpoint(self.out_dir) if resume else None
        if resume and checkpoint is None and any((self.out_dir / "checkpoints").glob("*")):
            raise FullbandError(f"{self.out_dir} has no complete checkpoint to resume from")
        self.model, self.tokenizer = load_model(checkpoint if checkpoint is not None else source, device)
        if not isinstance(self.model, FullBandLM):
            raise FullbandError(f"fullband rl trains FullBandLM models (model.arch fbt); {cfg.model} holds a "
                                f"{type(self.model).__name__}")
        if cfg.chat:
            check_chat(self.tokenizer, cfg.model)
        stored = DecodeSettings.of(self.model)
        self.decode = stored.with_label(cfg.decode_mode) if cfg.decode_mode else stored
        self.model.decode_settings = self.decode  # checkpoints decode as the rollouts did
        self.score_decode = self.decode.with_label(cfg.score_mode) if cfg.score_mode else self.decode
        # The reference of the KL term is the starting model, also on a resumed run.
        self.reference = None
        if cfg.kl_coef > 0:
            self.reference = source.load(device) if checkpoint is not None else copy.deepcopy(self.model)
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.99),
                                           weight_decay=cfg.weight_decay)
        if checkpoint is not None:
            state = read_checkpoint(checkpoint)
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["trainer_state"]["step"])
        self.stop = resolve_stop(cfg.stop, self.reward, cfg.chat)
        self.end_ids = end_token_ids(self.tokenizer, self.stop, cfg.chat)
        self.draws_per_step = 1 + (cfg.refill_rounds if cfg.dynamic_sampling else 0)
        self.vllm: VLLMRollouts | None = None  # rl.rollout_engine vllm: started by the first step, shut by close()

    # ---- one step ---------------------------------------------------------------------------------

    def draw_records(self, step: int, draw: int) -> list[dict[str, str]]:
        """The records of one draw of a step (draw 0, then the refills). The step's draws are one sample from one
        generator seeded by (seed, step), so they do not repeat a record while the data has enough."""
        rng = random.Random(step_seed(self.cfg.seed, step, "records"))
        count, total = self.cfg.prompts_per_step, self.cfg.prompts_per_step * self.draws_per_step
        picks = rng.sample(range(len(self.records)), total) if total <= len(self.records) else [
            rng.randrange(len(self.records)) for _ in range(total)]
        return [self.records[i] for i in picks[draw * count : (draw + 1) * count]]

    def encode(self, records: Sequence[dict[str, str]]) -> list[list[int]]:
        prompts = [prompt_ids(self.tokenizer, r["prompt"], self.cfg.chat) for r in records]
        room = self.model.config.max_seq_len - self.cfg.max_new_tokens
        for prompt, record in zip(prompts, records):
            if len(prompt) > room:
                raise FullbandError(f"the prompt {record['prompt'][:40]!r}... has {len(prompt)} tokens; with "
                                    f"rl.max_new_tokens {self.cfg.max_new_tokens} the model's max_seq_len "
                                    f"{self.model.config.max_seq_len} leaves room for {room}")
        return prompts

    def vllm_engine(self) -> VLLMRollouts:
        """The vLLM engine of rl.rollout_engine vllm, started on first use."""
        if self.vllm is None:
            from fullband.vllm.rollouts import VLLMRollouts  # vLLM is optional: imported only when asked for

            self.vllm = VLLMRollouts(self.model, self.source, self.out_dir / VLLM_EXPORT_DIR, self.decode)
        return self.vllm

    def close(self) -> None:
        """Shut the vLLM engine down (if one was started)."""
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None

    def rollouts(self, step: int, draw: int) -> Rollouts:
        """Draw ``draw`` of ``step``: its records' rollouts, rewarded; one cut at max_new_tokens without its end gets
        truncated_reward (unless that is None)."""
        cfg, G = self.cfg, self.cfg.group_size
        records = self.draw_records(step, draw)
        prompts = [p for p in self.encode(records) for _ in range(G)]
        sampling_logprobs = None
        if cfg.rollout_engine == "vllm":
            # One seed per rollout: vLLM draws each request from its own generator, whatever it is batched with.
            seeds = [step_seed(cfg.seed, step, f"rollouts:{draw}:{row}") for row in range(len(prompts))]
            rows, sampling_logprobs = self.vllm_engine().sample(prompts, cfg.max_new_tokens, cfg.temperature,
                                                                sorted(self.end_ids), seeds)
        else:
            with torch.no_grad():
                rows = generate(self.model, prompts, cfg.max_new_tokens, decode=self.decode,
                                temperature=cfg.temperature, seed=step_seed(cfg.seed, step, f"rollouts:{draw}"),
                                eos_token_id=self.tokenizer.eos_id, stop_token_ids=sorted(self.end_ids)).tolist()
        done = finish(rows, self.tokenizer, self.stop, self.end_ids)
        if sampling_logprobs is not None:  # vLLM stops at the end token already; the cut keeps what finish keeps
            sampling_logprobs = [logprobs[: len(row)] for logprobs, row in zip(sampling_logprobs, done.tokens)]
        graded = self.reward(done.texts, [r["answer"] for r in records for _ in range(G)])
        ended = torch.tensor(done.ended)
        rewards = torch.tensor(graded, dtype=torch.float32)
        correct = rewards >= self.reward.correct_at
        if cfg.truncated_reward is not None:
            rewards = torch.where(ended, rewards, cfg.truncated_reward)
            correct &= ended
        return Rollouts(prompts, done.tokens, rewards, correct, ended, sampling_logprobs)

    def sample_batch(self, step: int) -> tuple[Rollouts, Rollouts, int]:
        """(every rollout the step sampled, the ones the loss uses, the draws made). Without dynamic sampling both
        are the one draw; with it the loss keeps the groups whose rewards differ, from up to 1 + refill_rounds
        draws, at most prompts_per_step of them."""
        G, wanted = self.cfg.group_size, self.cfg.prompts_per_step * self.cfg.group_size
        if self.cfg.rollout_engine == "vllm":
            self.vllm_engine().load_policy(self.model, step)
        sampled, kept = [], []
        for draw in range(self.draws_per_step):
            batch = self.rollouts(step, draw)
            sampled.append(batch)
            if not self.cfg.dynamic_sampling:
                return batch, batch, 1
            informative = informative_groups(batch.rewards, G)
            kept.append(batch.rows(i for i in range(len(batch)) if informative[i // G]))
            if sum(map(len, kept)) >= wanted:
                break
        kept_rows = Rollouts.cat(kept)
        return Rollouts.cat(sampled), kept_rows.rows(range(min(wanted, len(kept_rows)))), len(sampled)

    def train_step(self, step: int) -> dict[str, Any]:
        cfg, G = self.cfg, self.cfg.group_size
        start = time.perf_counter()
        sampled, batch, draws = self.sample_batch(step)
        rollout_s = time.perf_counter() - start
        lr = cfg.lr * lr_multiplier(step, cfg)
        record: dict[str, Any] = {
            "step": step + 1,
            "lr": lr,
            "reward": float(sampled.rewards.mean()),
            "accuracy": float(sampled.correct.float().mean()),
            "completion_tokens": sum(map(len, sampled.completions)) / len(sampled),
            "truncated_fraction": float((~sampled.ended).float().mean()),
            "frac_reward_zero_std": float((~informative_groups(sampled.rewards, G)).float().mean()),
            "draws": draws,
            "groups_kept": len(batch) // G,
        }
        advantages = group_advantages(batch.rewards, G, cfg.scale_rewards) if len(batch) else torch.zeros(0)
        rows = [i for i in range(len(batch)) if batch.ended[i] or not cfg.mask_truncated_completions]
        prompts = [batch.prompts[i] for i in rows]
        completions = [batch.completions[i] for i in rows]
        advantages = advantages[rows]
        sampling = None if batch.sampling_logprobs is None else [batch.sampling_logprobs[i] for i in rows]
        # NaN where nothing was updated (metrics.jsonl writes null; TensorBoard takes it as a float).
        out = dict(loss=math.nan, kl=math.nan, clip_fraction=math.nan, entropy=math.nan, grad_norm=math.nan)
        if sampling is not None:
            out.update(dict.fromkeys(SAMPLING_METRICS, math.nan))
        scoring_s = backward_s = optimizer_s = 0.0
        # No signal, no step: AdamW would still move the weights by its momentum and decay its moments.
        skipped = not bool(advantages.any())
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            chunks = micro_batches(len(prompts), cfg.micro_batch)
            t0 = time.perf_counter()
            old = ref = None
            with torch.no_grad():
                # With one update per step the policy is the sampler: its log-probabilities, detached, are the old
                # ones (as TRL does); only several updates need them computed before the first.
                if cfg.updates_per_step > 1:
                    old = self.chunked_logprobs(self.model, prompts, completions, chunks)
                if self.reference is not None:
                    ref = self.chunked_logprobs(self.reference, prompts, completions, chunks)
            scoring_s = time.perf_counter() - t0
            tokens = sum(map(len, completions))
            # Each micro-batch's loss is its share of the whole batch's (grpo_loss's normalizer), so their gradients
            # add up to the batch's; a token mean over the batch (the metrics) is the token-weighted mean of theirs.
            normalizer = None  # one micro-batch is the whole batch: grpo_loss's own mean, rounded as before
            if len(chunks) > 1:
                normalizer = len(prompts) if cfg.loss_aggregation == "sequence" else tokens
            chunk_is_weights: list[torch.Tensor | None] = [None] * len(chunks)
            trainer_logprobs: list[torch.Tensor] = []
            for update in range(cfg.updates_per_step):
                self.optimizer.zero_grad(set_to_none=True)
                loss_sum = kl_sum = clipped_sum = entropy_sum = 0.0
                for index, part in enumerate(chunks):
                    t0 = time.perf_counter()
                    new, entropies = rollout_logprobs_and_entropies(self.model, prompts[part], completions[part],
                                                                    self.score_decode, cfg.temperature)
                    chunk_old = old[part] if old is not None else [n.detach() for n in new]
                    if update == 0 and sampling is not None:
                        # TRL's weights: the trainer's log-probabilities before any update against vLLM's, fixed
                        # for the step's updates (a rollout's weights depend on it alone: chunking keeps them).
                        trainer_logprobs += chunk_old
                        if cfg.is_correction != "none":
                            chunk_is_weights[index] = importance_weights(chunk_old, sampling[part],
                                                                         cfg.is_correction, cfg.is_clip_max)
                    loss = grpo_loss(new, chunk_old, advantages[part], None if ref is None else ref[part],
                                     cfg.clip_low, cfg.clip_high, cfg.kl_coef, cfg.loss_aggregation,
                                     chunk_is_weights[index], normalizer)
                    chunk_tokens = sum(map(len, new))
                    if update == 0:  # the entropy of the policy that sampled
                        entropy_sum += float(torch.cat(entropies).sum())
                    t1 = time.perf_counter()
                    loss.loss.backward()  # frees this micro-batch's graph before the next is scored
                    scoring_s, backward_s = scoring_s + t1 - t0, backward_s + time.perf_counter() - t1
                    loss_sum += float(loss.loss.detach())
                    clipped_sum += loss.clip_fraction * chunk_tokens
                    kl_sum += 0.0 if loss.kl is None else loss.kl * chunk_tokens
                t0 = time.perf_counter()
                if cfg.grad_clip > 0:
                    out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
                self.optimizer.step()
                optimizer_s += time.perf_counter() - t0
                if update == 0:
                    out["entropy"] = entropy_sum / tokens
                    if sampling is not None:  # TRL's mismatch metrics, over the whole batch
                        ratios = importance_weights(trainer_logprobs, sampling, cfg.is_correction, cfg.is_clip_max)
                        out.update(sampling_metrics(trainer_logprobs, sampling, ratios))
            out.update(loss=loss_sum, clip_fraction=clipped_sum / tokens,
                       kl=math.nan if ref is None else kl_sum / tokens)
        record.update(skipped=skipped, **out, rollout_s=rollout_s, scoring_s=scoring_s, backward_s=backward_s,
                      optimizer_s=optimizer_s, step_s=time.perf_counter() - start)
        return record

    def chunked_logprobs(self, model: FullBandLM, prompts: list[list[int]], completions: list[list[int]],
                         chunks: Sequence[slice]) -> list[torch.Tensor]:
        """``rollout_logprobs`` of the rollouts in the scoring mode, a micro-batch (``chunks``) per call."""
        return [logprobs for part in chunks for logprobs in rollout_logprobs(
            model, prompts[part], completions[part], self.score_decode, self.cfg.temperature)]

    # ---- evaluation -------------------------------------------------------------------------------

    def evaluate(self) -> float | None:
        """Greedy accuracy on the held-out records in the rollout decode mode (None without val_data)."""
        if not self.val_records:
            return None
        return greedy_accuracy(self.model, self.tokenizer, self.val_records, self.reward, self.decode,
                               self.cfg.max_new_tokens, self.stop, self.cfg.truncated_reward is not None,
                               self.cfg.eval_batch_size, self.cfg.chat)

    # ---- the run ----------------------------------------------------------------------------------

    def checkpoint(self) -> None:
        write_checkpoint(self.out_dir, self.step, self.model.state_dict(), self.model.config, self.decode,
                         self.tokenizer_dir, self.optimizer.state_dict(),
                         {"step": self.step, "source": str(self.cfg.model)}, self.cfg.keep_checkpoints)

    def run(self) -> RLResult:
        cfg = self.cfg
        log = RunLog.open(self.out_dir, cfg, dataclasses.asdict(cfg), True, lambda text: print(text, file=sys.stderr))
        progress = None
        if cfg.progress:
            from tqdm import tqdm

            progress = tqdm(total=cfg.steps, initial=self.step, desc="rl", unit="step", dynamic_ncols=True,
                            file=sys.stderr)
        failed = True
        accuracy = None
        try:
            if cfg.eval_every and self.step == 0:
                self._log_eval(log, self.evaluate())
            ran = 0
            while self.step < cfg.steps:
                record = self.train_step(self.step)
                self.step += 1
                ran += 1
                log.log_train(record)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(reward=f"{record['reward']:.3f}", acc=f"{record['accuracy']:.3f}")
                elif self.step % cfg.log_every == 0:
                    print(f"step {self.step}: reward {record['reward']:.3f} accuracy {record['accuracy']:.3f} "
                          f"loss {record['loss']}", file=sys.stderr)
                stopping = cfg.stop_after_steps and ran >= cfg.stop_after_steps
                if self.step == cfg.steps or stopping or (cfg.ckpt_every and self.step % cfg.ckpt_every == 0):
                    self.checkpoint()
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    self._log_eval(log, self.evaluate())
                if stopping:
                    break
            if self.step == cfg.steps:
                accuracy = self.evaluate()
                self._log_eval(log, accuracy)
            failed = False
        finally:
            self.close()
            if progress is not None:
                progress.close()
            log.close(failed)
        return RLResult(self.step, accuracy, self.out_dir)

    def _log_eval(self, log: RunLog, accuracy: float | None) -> None:
        if accuracy is None:
            return
        # eval.jsonl's own record: RunLog.log_eval's scalars are those of fullband train's validation.
        with open(self.out_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, "accuracy": accuracy, "prompts": len(self.val_records),
                                "decode": self.decode.label}) + "\n")


def save_config(cfg: RLConfig, out_dir: Path) -> None:
    (out_dir / CONFIG_NAME).write_text(yaml.safe_dump({"rl": dataclasses.asdict(cfg)}, sort_keys=False))


def resumed_config(out_dir: Path, overrides: dict[str, Any]) -> RLConfig:
    """The saved config of a run in ``out_dir`` with ``overrides`` applied, refused when one of them would change the
    computation (a resumed run must compute what the uninterrupted one computes)."""
    path = out_dir / CONFIG_NAME
    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the saved config {path}: {exc}") from None
    base = build_rl_config(saved, source=str(path))
    cfg = build_rl_config(saved, overrides, source=str(path))
    # A decaying learning rate is a function of rl.steps: more steps would change the rate of the steps already run.
    resumable = RESUMABLE - {"steps"} if base.lr_schedule != "constant" else RESUMABLE
    changed = sorted(f.name for f in rl_fields() if getattr(cfg, f.name) != getattr(base, f.name)
                     and f.name not in resumable)
    if changed:
        raise ConfigError(f"--resume cannot change {', '.join('rl.' + c for c in changed)}: the resumed run would not "
                          f"compute what the run in {out_dir} computes; start a new --out-dir instead")
    return cfg


def run_rl(cfg: RLConfig, out_dir: str | Path, resume: bool = False,
           reward: RewardFunction | None = None) -> RLResult:
    """Run (or with ``resume`` continue) GRPO as ``cfg`` says, writing OUT_DIR/config.yaml, checkpoints/,
    metrics.jsonl and eval.jsonl. ``reward``: a reward function object instead of ``cfg.reward``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = RLTrainer(cfg, out, resume, reward)
    save_config(cfg, out)
    return trainer.run()

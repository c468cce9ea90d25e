"""Typed run configuration: model, data, train and eval sections, loaded from YAML and overridden
on the command line as ``--section.field value``. Every field's help text lives in its metadata, so
the CLI's help is derived from these dataclasses."""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fullband.architectures import FBT, ModelConfig, arch_of, config_class, model_class
from fullband.baselines import BASELINE_ARCH_HELP, BASELINE_FIELD_HELP, BaselineConfig
from fullband.data.config import DataConfig, described
from fullband.errors import ConfigError
from fullband.model import FullBandConfig
from fullband.schedule import EXACT, EXACT_MODES, PASS_LOSSES, PassSchedule


@dataclass
class TrainConfig:
    seed: int = described(0, "seed for initialisation, data order, pass-count draws, prefix mixin and jitter")
    device: str = described("auto", "'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: str = described("auto", "'auto' (bf16 autocast on CUDA, float32 on CPU), 'float32' or 'bfloat16'")
    seq_len: int = described(256, "tokens per training sequence (must be <= model.max_seq_len)")
    batch_size: int = described(16, "sequences per micro-batch, summed over all ranks")
    grad_accum: int = described(1, "micro-batches per optimizer step")
    tokens: int = described(2_000_000, "token budget: the run stops after ceil(tokens / tokens per step) steps")
    schedule: Any = described(
        "paper",
        "pass schedule over the fraction of the token budget: 'paper' (75% 1-pass, then K=2 w.p. 0.88 "
        "and K=3 w.p. 0.12: 75/22/3 overall), 'paper-100b' (75% 1-pass, 25% 3-pass), 'feedback-from-start' "
        "(K=2 w.p. 0.88, K=3 w.p. 0.12 from the first step; not the paper's), 'standard' (always 1 pass: the "
        "baseline), 'fixed:K', 'exact' (K = the longest document packed in the step's batch, at most "
        "seq_len: every document ends in the exact recurrence; isolated-document data only), or a list of phases "
        "[{until: 0.75, passes: {1: 1.0}}, ...]",
    )
    length_curriculum: float = described(
        0.0,
        "short documents first: over this fraction of the steps, batches come only from windows whose longest "
        "document fits a limit growing linearly from the shortest to the longest such document; then the shuffled "
        "epochs. 0 = off; isolated-document data only (chat, prompt_answer)",
    )
    exact_mode: str = described(
        "jacobi",
        "how schedule exact computes the exact recurrence: 'jacobi' (K passes over all positions, K = the longest "
        "document) or 'sequential' (token by token with backpropagation through the steps: the FLOPs of one pass; "
        "with schedule exact it needs pass_loss last, model.feedback_jitter 0, grad_passes 0, detach_passes false, "
        "compile false, parallel ddp; see docs/method.md §5). Other schedules have no exact pass: there it has no "
        "effect, so a preset's baseline can override train.schedule alone",
    )
    compile_recurrence: int = described(
        0,
        "positions of the exact recurrence's token steps per compiled call (train.exact_mode sequential): 0 = off "
        "(one kernel call per operation), 8 = the state-tracking preset; needs a sliding window on every layer and "
        "plain attention (no qk_norm, attn_output_gate, grouped-query heads or qkv_bias); the first steps compile "
        "(~2-3 min on a CPU). Results equal the uncompiled steps' up to rounding. Where the token steps do not run "
        "(another schedule, or exact_mode jacobi) it has no effect, so a preset's baseline can override "
        "train.schedule or train.exact_mode alone",
    )
    later_pass_weight: float = described(1.0, "λ in L = L1 + λ·mean(L2..LK) (Eq. 12)")
    pass_loss: str = described(
        "paper",
        "which passes carry the loss: 'paper' (Eq. 12, L1 + λ·mean(L2..LK)), 'last' (LK only: with schedule "
        "exact, the exact recurrence) or 'paper+last' (Eq. 12 + LK); the last two are beyond the paper",
    )
    prefix_mixin: float = described(1.0, "later passes keep a prefix p ~ U[0, f·T) of each sequence plain; 0 = off")
    detach_passes: bool = described(
        False,
        "detach the fed-back states between passes; each pass is then backpropagated as soon as it ends, "
        "so activations of one pass are held, not K (single process; not the paper's default)",
    )
    grad_passes: int = described(
        0,
        "backpropagate through the last N passes of a step only, the earlier ones run without a graph "
        "(T2MLR-style: K up to the sequence length at the memory of N passes); 0 = all passes",
    )
    optimizer: str = described(
        "adamw", "'adamw', or 'muon' (torch.optim.Muon for 2-D hidden matrices, AdamW for the rest)")
    lr: float = described(3e-3, "peak learning rate (AdamW)")
    muon_lr: float = described(2e-2, "peak learning rate of Muon for matrix parameters")
    weight_decay: float = described(0.1, "decoupled weight decay on matrix parameters")
    beta1: float = described(0.9, "AdamW beta1")
    beta2: float = described(0.95, "AdamW beta2")
    adam_eps: float = described(
        1e-8,
        "AdamW epsilon. At a loss near 0 the gradients shrink below it only if it is large enough; with a tiny "
        "epsilon Adam still takes full-size steps on their noise",
    )
    lr_schedule: str = described("wsd", "'wsd' (warmup-stable-decay), 'cosine' or 'constant' (after warmup)")
    warmup_steps: int = described(20, "linear warmup steps")
    decay_fraction: float = described(0.25, "wsd: the last fraction of steps decays to min_lr_ratio·lr")
    decay_shape: str = described(
        "linear",
        "wsd: the decay's shape over its progress p in [0, 1]: 'linear' (1 - p), '1-sqrt' (1 - sqrt(p): more of the "
        "decay's steps at a low rate, Hägele et al. 2024) or '1-square' (1 - p^2: more of them at a high rate)",
    )
    min_lr_ratio: float = described(0.0, "final learning rate as a fraction of the peak")
    grad_clip: float = described(1.0, "clip the global gradient norm to this value; 0 = off")
    z_loss: float = described(0.0, "z-loss coefficient (the paper: 1e-5 in the cooldown)")
    z_loss_cooldown_only: bool = described(True, "apply z-loss only in the wsd decay phase, as the paper does")
    compile: bool = described(False, "torch.compile the model")
    activation_checkpointing: str = described(
        "none",
        "recompute transformer blocks in the backward instead of keeping their activations: 'none', 'full' (every "
        "block: activations of ~one block per pass plus each block's input, for ~one more forward of compute) or "
        "'selective:N' (every N-th block, torchtitan's layer-selective AC); results are unchanged",
    )
    parallel: str = described("ddp", "under torchrun with several processes: 'ddp' or 'fsdp' (FSDP2 fully_shard)")
    log_every: int = described(10, "print a progress line every N steps (metrics.jsonl gets every step)")
    progress: bool = described(True, "show a progress bar")
    tensorboard: bool = described(False, "also write TensorBoard events to OUT_DIR/tensorboard")
    wandb: dict = described(
        {},
        "also log to Weights & Biases (rank 0; what metrics.jsonl, eval.jsonl and TensorBoard get, and this config): "
        "{project: P, name: N, tags: [T, ...]}, name default OUT_DIR's name; offline in OUT_DIR/wandb (wandb sync "
        "uploads it) unless WANDB_API_KEY or WANDB_MODE is set; {} = off. Needs fullband[track]",
    )
    eval_every: int = described(0, "evaluate on the validation split every N steps (0 = only at the end)")
    ckpt_every: int = described(0, "write a checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = described(2, "how many most recent checkpoints to keep")
    checkpoint_format: str = described(
        "auto",
        "'dcp': every rank writes its own shards of the weights and optimizer state (torch.distributed.checkpoint, "
        "no gather; resumable at another world size); 'full': rank 0 gathers them into model.safetensors + "
        "optimizer.pt; 'auto': dcp when parallel is fsdp, else full",
    )
    keep_best: str = described(
        "",
        "keep the model of the lowest validation loss of this name ('standard', 'fused(N)' or 'sequential') in "
        "OUT_DIR/best (needs eval_every; the last one on ties); '' = off",
    )
    max_bad_steps: int = described(5, "stop after this many consecutive steps with a NaN/inf loss")
    stop_after_steps: int = described(
        0, "stop (with a checkpoint) after this many steps in this invocation; 0 = run to the end"
    )
    init_fusion: str = described(
        "auto",
        "with --init-from: 'keep' the source's fusion weights (fine-tuning an FBT), 'reset' them (mid-training a "
        "standard model), or 'auto' (keep them if the source's run trained with feedback)",
    )


@dataclass
class EvalConfig:
    batches: int = described(8, "validation batches per evaluation")
    batch_size: int = described(8, "sequences per validation batch")
    fused_passes: int = described(3, "report fused(1..n): validation loss after n extra fused passes (model.arch fbt; "
                              "the recurrent baselines report standard only)")
    sequential: bool = described(True, "also report the exact sequential recurrence (what soft decoding computes; "
                                "model.arch fbt)")
    at_start: bool = described(
        False, "also evaluate before the first step (step 0 in eval.jsonl): where a mid-training run starts from"
    )


# The model section's class is that of its model.arch (fullband.architectures): FullBandConfig unless it names another.
SECTIONS: dict[str, type] = {"model": FullBandConfig, "data": DataConfig, "train": TrainConfig, "eval": EvalConfig}
MODEL_CONFIGS = (FullBandConfig, BaselineConfig)

# Fields that may differ between a run and its resumption: they change logging, not the computation.
RESUMABLE_CHANGES = {
    "train.device", "train.progress", "train.log_every", "train.tensorboard", "train.wandb", "train.eval_every",
    "train.ckpt_every", "train.keep_checkpoints", "train.checkpoint_format", "train.stop_after_steps",
    "train.max_bad_steps",
    "train.compile", "train.compile_recurrence", "train.activation_checkpointing",
    "eval.batches", "eval.batch_size", "eval.fused_passes",
    "eval.sequential", "eval.at_start",
}


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=FullBandConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def flat(self) -> dict[str, Any]:
        return {f"{s}.{k}": v for s, d in self.to_dict().items() for k, v in d.items()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def validate(self) -> None:
        t = self.train
        positive = ("seq_len", "batch_size", "grad_accum", "tokens", "warmup_steps", "log_every",
                    "keep_checkpoints", "max_bad_steps")
        for name in positive:
            if getattr(t, name) < (0 if name == "warmup_steps" else 1):
                kind = "a non-negative" if name == "warmup_steps" else "a positive"
                raise ConfigError(f"train.{name}={getattr(t, name)} must be {kind} integer")
        if t.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len={t.seq_len} is longer than model.max_seq_len={self.model.max_seq_len}: "
                "the model has no positions for it. Lower train.seq_len or raise model.max_seq_len."
            )
        choices = {"optimizer": ("adamw", "muon"), "lr_schedule": ("wsd", "cosine", "constant"),
                   "decay_shape": ("linear", "1-sqrt", "1-square"), "parallel": ("ddp", "fsdp"),
                   "checkpoint_format": ("auto", "dcp", "full"), "dtype": ("auto", "float32", "bfloat16"),
                   "init_fusion": ("auto", "keep", "reset"), "pass_loss": PASS_LOSSES, "exact_mode": EXACT_MODES}
        for name, allowed in choices.items():
            if getattr(t, name) not in allowed:
                raise ConfigError(f"train.{name}={getattr(t, name)!r}: allowed values are {', '.join(allowed)}")
        _check_wandb(t.wandb)
        if not t.adam_eps > 0:
            raise ConfigError(f"train.adam_eps={t.adam_eps} must be > 0 (AdamW divides by sqrt(v) + eps)")
        if t.grad_passes < 0:
            raise ConfigError(f"train.grad_passes={t.grad_passes} must be >= 0 (0: backpropagate through all passes)")
        if t.compile_recurrence < 0:  # build_config has checked that it is an integer
            raise ConfigError(f"train.compile_recurrence={t.compile_recurrence!r} must be an integer >= 0 (positions "
                              "per compiled call of the token steps; 0 = off)")
        if not 0 <= t.decay_fraction <= 1 or not 0 <= t.prefix_mixin <= 1:
            raise ConfigError("train.decay_fraction and train.prefix_mixin must lie in [0, 1]")
        if not 0 <= t.length_curriculum <= 1:
            raise ConfigError(f"train.length_curriculum={t.length_curriculum} must lie in [0, 1] (a fraction of the "
                              "steps; 0 = no curriculum)")
        if self.eval.fused_passes < 0 or self.eval.batches < 1 or self.eval.batch_size < 1:
            raise ConfigError("eval.batches and eval.batch_size must be >= 1 and eval.fused_passes >= 0")
        # The recurrent baselines have one pass and no feedback: no Jacobi or exact schedule, no fused or sequential
        # loss to keep, and no transformer blocks to shard or recompute.
        arch = arch_of(self.model)
        recurrent = not model_class(arch).has_feedback
        if t.keep_best:
            reported = ["standard", *(f"fused({k})" for k in range(1, self.eval.fused_passes + 1))]
            reported += ["sequential"] if self.eval.sequential else []
            reported = reported[:1] if recurrent else reported  # no fused passes to validate
            if t.keep_best not in reported:
                raise ConfigError(f"train.keep_best={t.keep_best!r} is not a validation loss this config reports; "
                                  f"choose from {', '.join(reported)} (eval.fused_passes and eval.sequential set them)")
            if t.eval_every < 1:
                raise ConfigError("train.keep_best needs train.eval_every >= 1: the best model is chosen among the "
                                  "evaluations made during training")
        if checkpoint_interval(t.activation_checkpointing) > self.model.n_layers:
            raise ConfigError(f"train.activation_checkpointing={t.activation_checkpointing!r} would checkpoint no "
                              f"block: the model has {self.model.n_layers}. Use full, or selective:N with N <= "
                              f"{self.model.n_layers}.")
        schedule = PassSchedule.parse(t.schedule)
        if recurrent and (schedule.exact or schedule.max_passes > 1):
            raise ConfigError(f"train.schedule={t.schedule!r}: model.arch {arch} has no latent feedback to run Jacobi "
                              "passes or the exact recurrence over; use train.schedule standard")
        if recurrent and t.parallel == "fsdp":
            raise ConfigError(f"train.parallel fsdp shards the transformer's blocks; model.arch {arch} trains with ddp")
        if recurrent and t.activation_checkpointing != "none":
            raise ConfigError(f"train.activation_checkpointing recomputes the transformer's blocks; model.arch {arch} "
                              "has none: leave it at none")
        if t.exact_mode == "sequential" and t.schedule == EXACT:
            self._check_sequential()
        d = self.data
        # data.format auto is only resolved when the data is prepared; the trainer checks that case with this.
        if d.isolate_documents is False or (d.isolate_documents is None and d.format == "text"):
            self.refuse_text_stream(f"data.format={d.format!r} with data.isolate_documents={d.isolate_documents}")

    def refuse_text_stream(self, data: str) -> None:
        """Refuse the options that need isolated documents (whole records packed into windows) on ``data``, which
        cuts a text stream into windows."""
        for option, on in (("train.schedule exact", self.train.schedule == EXACT),
                           ("train.length_curriculum", self.train.length_curriculum > 0)):
            if on:
                raise ConfigError(
                    f"{option} needs isolated documents (whole records packed into windows), but {data} cuts a text "
                    "stream into windows. Use data.format prompt_answer or chat (or data.isolate_documents true), or "
                    "turn the option off."
                )

    def _check_sequential(self) -> None:
        """train.exact_mode sequential computes the exact recurrence's pass only, as it is: refuse what it cannot."""
        t = self.train
        conflicts = [
            (t.pass_loss != "last", f"train.pass_loss={t.pass_loss!r} scores the plain and intermediate Jacobi passes, "
                                    "which the token steps never compute; set train.pass_loss last"),
            (self.model.feedback_jitter > 0, f"model.feedback_jitter={self.model.feedback_jitter}: the Jacobi path "
                                             "jitters each pass's states, which has no token-by-token form; set "
                                             "model.feedback_jitter 0"),
            (t.grad_passes > 0, f"train.grad_passes={t.grad_passes} truncates Jacobi passes; there are none: set 0"),
            (t.detach_passes, "train.detach_passes detaches states between Jacobi passes; there are none: set false"),
            (t.compile, "train.compile compiles FullBandLM.forward, which the token steps do not call: set false"),
            (t.parallel == "fsdp", "train.parallel fsdp: FSDP2 gathers the root module's weights in its forward, "
                                   "which the token steps do not call; use train.parallel ddp"),
        ]
        for conflict, why in conflicts:
            if conflict:
                raise ConfigError(f"train.exact_mode sequential (of train.schedule exact) cannot be combined with "
                                  f"{why}; or set train.exact_mode jacobi")


WANDB_KEYS = ("project", "name", "tags")


def _check_wandb(option: dict[str, Any]) -> None:
    """train.wandb: {} (off) or {project, name, tags}: the project required, name and tags optional."""
    if not option:
        return
    unknown = sorted(set(option) - set(WANDB_KEYS))
    if unknown:
        raise ConfigError(f"train.wandb: unknown key(s) {', '.join(map(str, unknown))}; the keys are project "
                          "(required), name and tags, e.g. {project: fullband, name: small-run, tags: [paper]}")
    project = option.get("project")
    if not isinstance(project, str) or not project.strip():
        raise ConfigError(f"train.wandb needs a project, a non-empty string (got {project!r}): e.g. "
                          "--train.wandb '{project: fullband}'; {} turns W&B logging off")
    if not isinstance(option.get("name", ""), str):
        raise ConfigError(f"train.wandb.name must be a string, the W&B run's name (got {option['name']!r})")
    tags = option.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(tag, str) and tag.strip() for tag in tags):
        raise ConfigError(f"train.wandb.tags must be a list of non-empty strings, e.g. [paper, small] (got {tags!r})")


def checkpoint_interval(setting: str) -> int:
    """train.activation_checkpointing as the block interval of ``FullBandLM.set_activation_checkpointing``:
    'none' -> 0, 'full' -> 1, 'selective:N' -> N."""
    if setting == "none":
        return 0
    if setting == "full":
        return 1
    kind, _, number = setting.partition(":")
    if kind == "selective" and number.isdigit() and int(number) >= 1:
        return int(number)
    raise ConfigError(f"train.activation_checkpointing={setting!r}: allowed values are none, full and selective:N "
                      "(N >= 1: checkpoint every N-th transformer block)")


# PyYAML reads an unquoted 1e6 or 3e-3 as a string (YAML 1.1 wants a dot in floats): accept those in YAML.
_YAML_EXPONENT_NUMBER = re.compile(r"[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+")
_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             dict: "a mapping (JSON on the command line)"}
_BOOLEAN_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False,
                  "off": False}


# Not jsonargparse's typed parsing (4.53 tried): it turns YAML's seq_len: "32" into 32, refuses 1e5 for an integer and
# none for an optional one on the command line, and its errors name no close field for a misspelt one.
def coerce(value: Any, annotation: Any, where: str, from_cli: bool = True) -> Any:
    """Convert a command-line string (``from_cli``) or check a YAML value against a field's annotated type.
    YAML values are not converted from strings: ``seq_len: "32"`` is an error, as is ``tokens: abc``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if type(None) in options and (value is None or str(value).lower() in ("none", "null")):
            return None
        errors = []
        for option in (option for option in options if option is not type(None)):
            try:
                return coerce(value, option, where, from_cli)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    kind = typing.get_origin(annotation) or annotation  # dict[str, Any] -> dict
    if isinstance(value, str) and kind is not str:
        value = _from_string(value, kind, where, from_cli)
    if kind is Any or (isinstance(value, kind) and (kind is bool or not isinstance(value, bool))):
        return value
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"{where} expects {_EXPECTED[kind]}, got {value!r}")


def _from_string(text: str, kind: Any, where: str, from_cli: bool) -> Any:
    """A string's value for a field of type ``kind``, or the string itself where it has none (coerce refuses it)."""
    yaml_number = kind in (int, float) and _YAML_EXPONENT_NUMBER.fullmatch(text.strip())
    if not from_cli and kind in (int, float, bool) and not yaml_number:
        raise ConfigError(f"{where} expects {_EXPECTED[kind]}, got the string {text!r} (write it unquoted in YAML)")
    if kind is bool:
        return _BOOLEAN_WORDS.get(text.lower(), text)
    if kind in (int, float):
        try:
            number = float(text.replace("_", ""))
        except ValueError:
            return text
        if kind is float:
            return number
        return int(number) if number.is_integer() else text
    if kind is dict or (kind is Any and text[:1] in "[{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            try:
                return yaml.safe_load(text)
            except yaml.YAMLError as exc:
                reason = " ".join(str(exc).split())  # PyYAML's message spans several lines
                raise ConfigError(f"{where}: cannot parse {text!r} as JSON or YAML ({reason})") from None
    return text

def build_config(raw: dict[str, Any], overrides: dict[str, str] | None = None, source: str = "config") -> RunConfig:
    """Build a RunConfig from nested dict values (a YAML file) plus ``section.field`` string overrides.
    Unknown sections or keys and values of the wrong type raise ConfigError."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section {section!r}; sections are {', '.join(SECTIONS)}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping of field: value")
        values[section] = {key: (value, False) for key, value in body.items()}
    for dotted, text in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS or not key:
            raise ConfigError(f"unknown option --{dotted}; options look like --section.field with sections "
                              f"{', '.join(SECTIONS)}")
        values[section][key] = (text, True)
    built = {}
    for section, cls in SECTIONS.items():
        given = values[section]
        if section == "model":
            cls, given = _model_section(given, (raw.get("model") or {}).get("arch", FBT), source)
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, (value, from_cli) in given.items():
            if key not in hints:
                raise ConfigError(_unknown_field(section, key, set(hints), from_cli, source))
            kwargs[key] = coerce(value, hints[key], f"{section}.{key}", from_cli)
        try:
            built[section] = cls(**kwargs)
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{source}: invalid {section} section: {exc}") from None
    config = RunConfig(**built)
    config.validate()
    return config


def _model_section(given: dict[str, tuple[Any, bool]], file_arch: Any,
                   source: str) -> tuple[type, dict[str, tuple[Any, bool]]]:
    """The model section's class (that of its model.arch) and fields. An arch set on the command line over the
    file's keeps the file's model fields that the new kind has and drops the others, so that
    a baseline set on the command line over the state-tracking preset has the preset's width and depth."""
    given = dict(given)
    value, from_cli = given.pop("arch", (FBT, False))
    arch = coerce(value, str, "model.arch", from_cli)
    try:
        cls = config_class(arch)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    known = {f.name for f in dataclasses.fields(cls)}
    if from_cli and arch != file_arch:
        given = {key: (value, cli) for key, (value, cli) in given.items() if cli or key in known}
    filed = {key: value for key, (value, cli) in given.items() if not cli} | ({} if arch == FBT else {"arch": arch})
    return cls, {**{key: (value, False) for key, value in filed.items()},
                 **{key: entry for key, entry in given.items() if entry[1]}}


def _unknown_field(section: str, key: str, known: set[str], from_cli: bool, source: str) -> str:
    what = f"unknown option --{section}.{key}" if from_cli else f"{source}: unknown field {section}.{key}"
    if section == "model":
        owners = [cls for cls in MODEL_CONFIGS if key in {f.name for f in dataclasses.fields(cls)}]
        if owners:
            return (f"{what}: a field of {owners[0].__name__}, not of this model.arch's config. Known model fields: "
                    f"{', '.join(sorted(known))}")
    close = [k for k in sorted(known) if k.startswith(key[:3])]
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return f"{what}.{hint} Known {section} fields: {', '.join(sorted(known))}"


def read_sections(path: str | Path) -> dict[str, Any]:
    """A YAML config file's top-level mapping (of sections), or ConfigError saying what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; see configs/ for examples")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read the config {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    return raw


def load_config(path: str | Path | None, overrides: dict[str, str] | None = None) -> RunConfig:
    return build_config(read_sections(path) if path is not None else {}, overrides, str(path or "config"))


def field_help(cls: type, name: str) -> str:
    """A config field's help text: its metadata's, or MODEL_HELP's for the fields of the model configs (declared
    without help in fullband.model and fullband.baselines)."""
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata.get("help") or MODEL_HELP.get(name, "")


MODEL_HELP = {
    "vocab_size": "vocabulary size (training sets it from the tokenizer)",
    "d_model": "width of the residual stream",
    "n_layers": "number of transformer blocks",
    "n_heads": "query heads",
    "n_kv_heads": "key/value heads (grouped-query attention); None = n_heads",
    "head_dim": "per-head width; None = d_model // n_heads",
    "d_ff": "hidden width of the SwiGLU MLP",
    "max_seq_len": "longest sequence the model handles (prompt + generation)",
    "rope_theta": "RoPE base",
    "rope_scaling": "None or a JSON dict {rope_type: linear|llama3, factor: ...}",
    "norm_eps": "RMSNorm epsilon",
    "qk_norm": "RMSNorm on queries and keys per head",
    "qkv_bias": "biases on the q/k/v projections (Qwen2)",
    "attn_output_gate": "a sigmoid gate per head on the attention output",
    "sliding_window": "sliding attention window in tokens; None = full attention everywhere",
    "full_attention_every": "with a window: every n-th layer keeps full attention (0 = none)",
    "tie_embeddings": "tie input and output embeddings (the paper's stability recipe)",
    "fusion": "how the fed-back state meets the embedding: gate (paper Eq. 4), concat or add",
    "feedback_source": "the state fed back: final_norm (the top hidden state after the final RMSNorm)",
    "feedback_jitter": "σ of the uniform jitter added to the carried state in training",
    "init_std": "standard deviation of the normal initialisation of linear and embedding weights",
    "gate_init_std": "standard deviation of W_G's initialisation (gate fusion); None = init_std",
    "fusion_init": "random (the paper) or identity (fusion add with W = 0: every decode mode starts as the standard "
                   "model; for mid-training a pretrained one)",
    "arch": f"'fbt' (the full-bandwidth transformer) or a recurrent baseline: {BASELINE_ARCH_HELP}; set on the "
            "command line over a config file of another arch, it keeps the file's model fields the new kind has",
    **BASELINE_FIELD_HELP,
}


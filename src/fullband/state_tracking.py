"""State tracking with the final answer only: train a model on prompts of 1..L moves and measure its
exact-match accuracy on prompts several times longer (docs/results.md, "State tracking").

Used by ``benchmarks/state_tracking.py`` (every task, seeds, baselines) and ``fullband demo`` (parity).
Rows of a batch all have the same number of moves, so batches need no padding; the loss is on the answer
tokens only. The FBT runs K = sequence length passes per step, so the positions that carry a label see the
exact recurrence over the whole prompt (docs/method.md); a baseline runs one pass with full attention, or
with the FBT's own window ("baseline_window": the same architecture without the feedback).
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fullband.config import RunConfig
from fullband.data import ByteTokenizer, Example
from fullband.data.synthetic import (
    STATE_TRACKING_TASKS,
    SyntheticTask,
    get_task,
    state_tracking_task,
    synthetic_examples,
)
from fullband.generation import sequential_forward
from fullband.model import FullBandLM
from fullband.train.feedback import pass_loss_at

IGNORE = -100


@dataclass
class Recipe:
    train_len: int = 8  # L: training prompts have 1..L moves
    steps: int = 600
    batch_size: int = 32
    grad_passes: int = 0  # FBT: backpropagate through the last N passes only; 0 = all
    curriculum: float = 0.5  # fraction of the steps over which the longest prompt grows from 2 to L moves
    eval_rows: int = 200
    multiples: tuple[int, ...] = (1, 2, 4, 8)  # test lengths, as multiples of L
    # FBT: weight of a pull of the state that predicts the answer towards the running mean of that state
    # over rows with the same answer ("center loss"): the same final state, reached after any number of
    # moves, is asked to be the same point, so the recurrence has fixed points to map between.
    center_loss: float = 0.0
    # Every `val_every` steps, grade `eval_rows` held-out rows of exactly L moves (the longest trained length,
    # no longer) with the model's own recurrence; 0 = never. keep="best" returns the model of the
    # evaluation with the lowest validation loss (the last one on ties) instead of the last step's: a run
    # whose loss reaches 0 and later jumps back (Adam's slingshot) keeps what it had learnt.
    val_every: int = 0
    keep: str = "last"

    def __post_init__(self) -> None:
        if self.keep not in ("last", "best"):
            raise ValueError(f"keep must be 'last' or 'best', got {self.keep!r}")
        if self.keep == "best" and self.val_every <= 0:
            raise ValueError("keep='best' needs val_every > 0 (validation steps to choose from)")


def encode_batch(examples: list[Example], tok: ByteTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """[bos] prompt answer \\n for rows of equal length; labels on the answer and its newline only."""
    rows, labels = [], []
    for ex in examples:
        prompt, answer = tok.encode(ex.prompt), tok.encode(ex.answer + "\n")
        rows.append([tok.bos_id, *prompt, *answer])
        # label at position i is token i+1: the answer tokens are predicted from the position before each
        labels.append([IGNORE] * len(prompt) + answer + [IGNORE])
    if len({len(r) for r in rows}) != 1:
        raise ValueError("a batch must hold rows of one length (same number of moves)")
    return torch.tensor(rows), torch.tensor(labels)


def answer_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) bool: every answer token (not the closing newline) is the argmax, i.e. greedy decoding
    reproduces the answer."""
    graded = labels != IGNORE
    graded[:, -2] = False  # the position predicting the newline: the answer ends before it
    right = (logits.argmax(-1) == labels) | ~graded
    return right.all(dim=1)


def center_pull(hidden: torch.Tensor, labels: torch.Tensor, answers: list[str], centers: dict[str, torch.Tensor],
                momentum: float = 0.9) -> torch.Tensor:
    """Mean squared distance from each row's top state at the position that predicts its answer's first token
    to the running mean of that state over the rows with the same answer seen so far (a center loss); then
    moves each answer's mean towards this batch's (momentum ``momentum``). An answer seen for the first time
    starts at its batch mean."""
    first = (labels != IGNORE).int().argmax(dim=1)  # label t is token t + 1: this position predicts the answer
    h = hidden[torch.arange(len(first)), first]  # (B, D)
    with torch.no_grad():
        batch_means = {a: h[[i for i, b in enumerate(answers) if b == a]].mean(0) for a in set(answers)}
        target = torch.stack([centers.get(a, batch_means[a]) for a in answers])
        for a, mean in batch_means.items():
            centers[a] = momentum * centers[a] + (1 - momentum) * mean if a in centers else mean
    return (h - target).pow(2).mean()


def curriculum_max(step: int, steps: int, train_len: int, fraction: float) -> int:
    """Longest move count allowed at a step: grows linearly from 2 to L over the first `fraction`."""
    if fraction <= 0:
        return train_len
    return max(2, min(train_len, round(2 + (train_len - 2) * step / (fraction * steps))))


# Tasks with a running state that are not in the final-answer-only family, used by the probe experiment
# (benchmarks/probes.py), and the field that sets their number of moves.
PROBE_TASKS = {"completion": "len", "delayed": "len", "registers": "writes"}


def task_base(name: str) -> str:
    """"cycle" of a task variant "cycle:size=3" (options separated by ";")."""
    return name.partition(":")[0]


def task_with_moves(name: str, moves: int) -> SyntheticTask:
    """The task with exactly `moves` moves (delayed memory: at least delay + 1 digits). A state-tracking
    task may name a variant, `name:key=value;key=value` (e.g. "cycle:size=3")."""
    base, _, options = name.partition(":")
    if base in STATE_TRACKING_TASKS:
        return state_tracking_task(base, moves, moves, options=options.replace(";", ","))
    if name == "delayed":
        moves = max(moves, 4)  # the default delay is 3
    field = PROBE_TASKS[name]
    return get_task(f"{name}:min_{field}={moves},max_{field}={moves}")


# How each kind of model is trained: (keeps the preset's attention window, passes per step; "T" = the
# sequence length, i.e. the exact recurrence over the whole prompt).
KINDS: dict[str, tuple[bool, int | str]] = {"fbt": (True, "T"), "baseline": (False, 1), "baseline_compute": (False, 1),
                                            "baseline_window": (True, 1), "fbt_k2": (False, 2)}


def build_model(config: RunConfig, kind: str, seed: int) -> FullBandLM:
    model_config = config.model
    if not KINDS[kind][0]:  # an ordinary transformer (or the paper's FBT): full attention
        model_config = type(model_config).from_dict({**model_config.to_dict(), "sliding_window": None})
    torch.manual_seed(seed)
    return FullBandLM(model_config)


def train_model(
    task: str, kind: str, seed: int, config: RunConfig, recipe: Recipe, steps: int | None = None,
    grade_last: Callable[[FullBandLM], dict] | None = None,
) -> tuple[FullBandLM, dict]:
    """Train a fresh model of a `kind` in KINDS ("fbt": window, K = sequence length passes; "baseline":
    full attention, one pass; "baseline_window": the FBT's window, one pass; "fbt_k2": full attention, two
    passes) with the optimiser settings of
    ``config.train``. Returns the model in eval mode and what the run cost. Where keep="best" returns an
    earlier model than the last, ``grade_last`` (if given) grades the last one first, in eval mode, and its
    result is ``info["last_step_eval"]``: what the kept model is compared with, from the same run."""
    steps = recipe.steps if steps is None else steps
    tok = ByteTokenizer()
    model = build_model(config, kind, seed)
    t = config.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps,
                            weight_decay=t.weight_decay)
    rng = random.Random(f"{task}:{seed}")  # the same batches for every model of a seed
    passes_total, tokens, started, losses, grad_norms = 0, 0, time.perf_counter(), [], []
    centers: dict[str, torch.Tensor] = {}
    val_curve: list[list[float]] = []
    val_ids, val_labels = validation_rows(task, recipe) if recipe.val_every > 0 else (None, None)
    best: tuple[float, int, dict] | None = None  # (validation loss, step, weights)
    model.train()
    for step in range(steps):
        lr = t.lr * min(1.0, (step + 1) / max(1, t.warmup_steps))
        decay_start = int(steps * (1 - t.decay_fraction))
        if step >= decay_start:
            lr *= max(0.0, (steps - step) / max(1, steps - decay_start))
        for group in opt.param_groups:
            group["lr"] = lr
        n = rng.randint(1, curriculum_max(step, steps, recipe.train_len, recipe.curriculum))
        examples = synthetic_examples(task_with_moves(task, n), recipe.batch_size, rng.randrange(2**31))
        ids, labels = encode_batch(examples, tok)
        # K = T passes: position T-1 (the last one with a label) then sees the exact recurrence.
        passes = ids.shape[1] if KINDS[kind][1] == "T" else int(KINDS[kind][1])
        grad_passes = min(passes, recipe.grad_passes) if recipe.grad_passes > 0 else None
        out = model.multipass(ids, passes, labels=labels, grad_passes=grad_passes, keep_logits=False,
                              later_pass_weight=t.later_pass_weight, pass_loss=pass_loss_at(step, steps, t))
        loss = out.loss
        if recipe.center_loss > 0 and kind == "fbt":
            loss = loss + recipe.center_loss * center_pull(out.hidden[-1], labels, [ex.answer for ex in examples],
                                                           centers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # the norm before clipping (inf = no clipping): a spike marks where a recurrence turns unstable
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))))
        opt.step()
        passes_total += passes
        tokens += ids.numel()
        losses.append(loss.item())
        if recipe.val_every > 0 and ((step + 1) % recipe.val_every == 0 or step + 1 == steps):
            val_loss, val_acc = validate(model, kind, val_ids, val_labels)
            val_curve.append([step + 1, float(f"{val_loss:.4g}"), val_acc])
            if recipe.keep == "best" and (best is None or val_loss <= best[0]):
                best = (val_loss, step + 1, copy.deepcopy(model.state_dict()))
    model.eval()
    kept_step = steps
    last_step_eval = None
    if best is not None and best[1] != steps:
        if grade_last is not None:
            last_step_eval = grade_last(model)
        model.load_state_dict(best[2])
        kept_step = best[1]
    info = {"steps": steps, "tokens": tokens, "mean_passes": passes_total / steps,
            "compute_tokens": tokens * passes_total / steps, "train_seconds": round(time.perf_counter() - started, 1),
            # mean training loss over each tenth of the run: did it learn, plateau, or diverge?
            "loss_curve": [round(sum(c) / len(c), 4) for c in _tenths(losses)],
            "grad_norm_max_curve": [round(max(c), 3) for c in _tenths(grad_norms)]}
    if val_curve:  # [step, validation loss, validation accuracy] per evaluation; the step whose model is returned
        info |= {"val_curve": val_curve, "kept_step": kept_step}
    if last_step_eval is not None:
        info["last_step_eval"] = last_step_eval
    return model, info


def validation_rows(task: str, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out rows of exactly L moves, none of them a test row (other seeds than `evaluate`'s)."""
    examples = synthetic_examples(task_with_moves(task, recipe.train_len), recipe.eval_rows, 20_000)
    return encode_batch(examples, ByteTokenizer())


@torch.no_grad()
def validate(model: FullBandLM, kind: str, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(loss on the answer tokens, exact-match accuracy) of validation rows (``validation_rows``), graded the
    way the model is used: an FBT by its exact recurrence, a baseline by one pass. Leaves it in train mode."""
    model.eval()
    logits = sequential_forward(model, ids)[0] if KINDS[kind][1] != 1 else model(ids).logits
    model.train()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)
    return loss.item(), answer_correct(logits, labels).float().mean().item()


def _tenths(values: list[float]) -> list[list[float]]:
    n = len(values)
    return [values[i * n // 10 : (i + 1) * n // 10] for i in range(10) if (i + 1) * n // 10 > i * n // 10]


@torch.no_grad()
def evaluate(model: FullBandLM, task: str, recipe: Recipe, modes: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """{multiple of L: {mode: per-row correctness as a 0/1 string}}. Modes: "exact" (the token-by-token
    recurrence) and "plain" (one ordinary pass). The rows depend only on the task, L and the multiple,
    so every model and seed is graded on the same rows and differences can be paired."""
    tok, results = ByteTokenizer(), {}
    for m in recipe.multiples:
        n = m * recipe.train_len
        examples = synthetic_examples(task_with_moves(task, n), recipe.eval_rows, 10_000 + m)
        ids, labels = encode_batch(examples, tok)
        results[str(m)] = {}
        for mode in modes:
            logits = sequential_forward(model, ids)[0] if mode == "exact" else model(ids).logits
            results[str(m)][mode] = "".join("1" if c else "0" for c in answer_correct(logits, labels).tolist())
    return results


# The move that leaves the state unchanged, for the tasks that have one.
NO_OP = {"parity": "0", "summod": "0", "cycle": "=", "flipflop": "."}


@torch.no_grad()
def evaluate_hold(model: FullBandLM, task: str, recipe: Recipe) -> dict[str, str]:
    """Can the learnt recurrence hold a state? {multiple m: per-row correctness (exact recurrence)} on
    prompts of L random moves followed by (m − 1)·L no-op moves, whose answer is that of the first L
    moves. A map that only approximately keeps the state under the no-op loses it as the run grows,
    even though no move changes it. Empty for tasks without a no-op move (S3, S5)."""
    if task_base(task) not in NO_OP:
        return {}
    tok, results = ByteTokenizer(), {}
    for m in recipe.multiples:
        examples = synthetic_examples(task_with_moves(task, recipe.train_len), recipe.eval_rows, 30_000 + m)
        pad = NO_OP[task_base(task)] * ((m - 1) * recipe.train_len)
        held = [Example(ex.prompt.removesuffix(" :") + pad + " :", ex.answer) for ex in examples]
        ids, labels = encode_batch(held, tok)
        correct = answer_correct(sequential_forward(model, ids)[0], labels)
        results[str(m)] = "".join("1" if c else "0" for c in correct.tolist())
    return results


def load_kept_model(path: str | Path) -> FullBandLM:
    """A model kept by benchmarks/state_tracking.py (``--save-models``), in eval mode; a half-written or
    foreign directory exits with a message that names it."""
    try:
        return FullBandLM.from_pretrained(path).eval()
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"{path}: not a model kept by benchmarks/state_tracking.py ({err})") from err


def write_analysis(records: list[dict], path: str | Path) -> None:
    """The records of an analysis of kept models, one JSON line each, written whole (a temporary file, then
    renamed); none at all exits with what to run first."""
    if not records:
        raise SystemExit("no saved model found; run benchmarks/state_tracking.py first (it keeps them under "
                         "--save-models)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


def accuracy(bits: str) -> float:
    return bits.count("1") / len(bits)


def paired_difference(a: str, b: str) -> float:
    """The mean over the same rows of (correct_a − correct_b), from two per-row grade strings ("1" = correct)."""
    return sum(int(x) - int(y) for x, y in zip(a, b, strict=True)) / len(a)

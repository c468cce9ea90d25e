"""The doors over a fixed batch: ``generate``, ``generate_stream`` and ``score_continuations`` in the decode modes of
docs/method.md §6. Their keywords are folded once, here, into one ``SamplingParams`` and one ``DecodeSettings``
(what a call leaves out comes from the model's stored settings); the decode loop is the server's
(``fullband.engine``), so a row's result does not depend on what it is batched with."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields, replace
from typing import Any

import torch

from fullband.architectures import LanguageModel
from fullband.decoding import FIELDS as DECODE_FIELDS
from fullband.decoding import DecodeSettings, DecodeSettingsError
from fullband.engine import Engine, Event, left_pad
from fullband.engine import Sequence as EngineSequence
from fullband.model import FullBandLM
from fullband.sampling import RequestLimits, SamplingParams, check_request, token_logprobs

__all__ = ["decode_settings", "generate", "generate_stream", "left_pad", "request", "score_continuations",
           "sequential_forward"]


def decode_settings(model: LanguageModel, decode: DecodeSettings | None = None, **overrides: Any) -> DecodeSettings:
    """The settings a call decodes with: ``decode`` (default: those stored with the model) with the fields a
    caller gave replaced; a mode the model cannot decode in is refused."""
    if decode is not None and not isinstance(decode, DecodeSettings):
        raise TypeError(f"decode must be a DecodeSettings (e.g. DecodeSettings('soft')), got {decode!r}; a mode alone "
                        "is given as mode='soft'")
    base = decode if decode is not None else DecodeSettings.of(model)
    settings = base.with_overrides(**overrides)
    if settings.mode != "standard" and not model.has_feedback:
        raise DecodeSettingsError(f"decode mode {settings.label}: {model.no_feedback}")
    return settings


# What generate allows beyond the model's limits (fullband.sampling.check_request): a call may ask for no token.
LIMITS = RequestLimits(max_tokens_name="max_new_tokens", context_name="max_seq_len", min_max_tokens=0)
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def request(
    model: LanguageModel, max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
    decode: DecodeSettings | None = None, eos_token_id: int | None = None, **fields: Any
) -> tuple[SamplingParams, DecodeSettings]:
    """A call's request, folded once: ``sampling`` (default: greedy) and ``decode`` (``decode_settings``) with the
    fields given as keywords replaced, ``eos_token_id`` added to the stop tokens; any other keyword is refused."""
    unknown = sorted(set(fields) - set(SAMPLING_FIELDS) - set(DECODE_FIELDS) - {"decode_mode"})
    if unknown:
        raise TypeError(f"unknown generate() argument(s) {', '.join(unknown)}; sampling fields are "
                        f"{', '.join(SAMPLING_FIELDS)} and decode settings {', '.join(DECODE_FIELDS)}")
    given = {k: v for k, v in fields.items() if k in SAMPLING_FIELDS}
    if max_new_tokens is not None:
        given["max_tokens"] = max_new_tokens
    sampling = replace(sampling or SamplingParams(), **given)
    if eos_token_id is not None:
        sampling = replace(sampling, stop_token_ids=tuple(dict.fromkeys([eos_token_id, *sampling.stop_token_ids])))
    settings = decode_settings(model, decode, **{k: v for k, v in fields.items() if k not in SAMPLING_FIELDS})
    return sampling, settings


def run_engine(model: LanguageModel, sequences: list[EngineSequence]) -> Iterator[None]:
    """Step a fixed batch of checked sequences through the engine until each has finished, once per step."""
    engine = Engine(model, max_batch=len(sequences), max_queue=0, prefill_tokens=None)
    engine.submit(sequences, limits=None)
    while not all(seq.finished for seq in sequences):
        engine.step()
        yield


@torch.no_grad()
def generate_stream(
    model: LanguageModel, input_ids: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int | None = None, *,
    sampling: SamplingParams | None = None, decode: DecodeSettings | None = None,
    attention_mask: torch.Tensor | None = None, eos_token_id: int | None = None, stats: dict[str, Any] | None = None,
    **fields: Any
) -> Iterator[torch.Tensor]:
    """Yield a (B,) tensor of new token ids per step, for the request ``request`` folds. Row i samples with seed
    ``seed + i``; a finished row keeps yielding the token it finished with. ``stats`` receives, once the prefill is
    done, ``"fused_passes"`` (per row) and with ``fused_passes="auto"`` ``"fused_converged"`` (per row)."""
    sampling, settings = request(model, max_new_tokens, sampling, decode, eos_token_id, **fields)
    ids, mask = left_pad(input_ids, attention_mask)
    rows = [row[m].tolist() for row, m in zip(ids, mask)]
    adjustments = check_request(model.config, rows, sampling, LIMITS)  # the whole batch checked once, here
    if sampling.max_tokens == 0:
        return
    events: list[list[Event]] = [[] for _ in rows]
    sequences = [EngineSequence(row, sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i),
                                events[i].append, settings, adjustments=adjustments) for i, row in enumerate(rows)]
    tokens = [0] * len(rows)
    for step, _ in enumerate(run_engine(model, sequences)):
        if stats is not None and step == 0:  # the prefill is done
            stats.pop("fused_converged", None)
            stats["fused_passes"] = [seq.prefill_passes for seq in sequences]
            if settings.fused_passes == "auto" and settings.mode == "fused":
                stats["fused_converged"] = [seq.prefill_converged for seq in sequences]
        for i, row_events in enumerate(events):
            if row_events:  # a finished row repeats the token it finished with
                tokens[i] = row_events.pop().token
        yield torch.tensor(tokens, device=model.device)


def generate(model: LanguageModel, input_ids: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int | None = None,
             **kwargs: Any) -> torch.Tensor:
    """The new tokens of ``generate_stream`` (the same arguments) as a (B, N) tensor, N <= max_new_tokens."""
    steps = list(generate_stream(model, input_ids, max_new_tokens, **kwargs))
    if not steps:
        rows = len(input_ids) if not isinstance(input_ids, torch.Tensor) or input_ids.dim() > 1 else 1
        return torch.zeros(rows, 0, dtype=torch.long, device=model.device)
    return torch.stack(steps, dim=1)


SCORINGS = ("decode", "prefill")


@torch.no_grad()
def score_continuations(
    model: LanguageModel, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
    decode: DecodeSettings | None = None, scoring: str = "decode", **decode_fields: Any
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Teacher-forced log-probabilities of each continuation given its context, batched, with the decode settings
    of ``decode_settings``. ``scoring="decode"``: what ``generate`` assigns, the context prefilled as a prompt and
    the continuation fed one decode step at a time; ``"prefill"``: the mode's prefill passes over context +
    continuation in parallel, as in validation. Returns per row (log-probabilities (L,), at least float32; whether
    each token was the most likely (L,))."""
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}; choose one of {', '.join(SCORINGS)}")
    settings = decode_settings(model, decode, **decode_fields)
    if scoring == "prefill" and settings.mode == "soft":
        raise ValueError("scoring='prefill' runs a mode's prefill passes over the whole text; soft decoding has "
                         "no such form: use decode_mode standard or fused, or scoring='decode'")
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    limit = model.config.max_seq_len
    for i, (ctx, cont) in enumerate(zip(contexts, continuations)):
        if len(ctx) == 0 or len(cont) == 0:
            raise ValueError(f"row {i}: context and continuation need at least one token each")
        if len(ctx) + len(cont) - 1 > limit:
            raise ValueError(
                f"row {i}: context {len(ctx)} + continuation {len(cont)} - 1 tokens exceed the model's max_seq_len "
                f"{limit}; truncate the context from the left"
            )
    scored = SamplingParams(max_tokens=0, logprobs=0)
    check_request(model.config, [list(c) for c in contexts], scored, LIMITS)
    check_request(model.config, [list(c) for c in continuations], scored, LIMITS)
    if scoring == "prefill" or settings.mode == "standard":
        return _score_prefill(model, contexts, continuations, settings)
    ids, mask = left_pad(contexts)
    # The engine's decode steps, each continuation token given instead of sampled: generate's own probabilities.
    events: list[list[Event]] = [[] for _ in contexts]
    sequences = [EngineSequence(row[m].tolist(), replace(scored, max_tokens=len(cont)), events[i].append, settings,
                                forced=list(cont)) for i, (row, m, cont) in enumerate(zip(ids, mask, continuations))]
    for _ in run_engine(model, sequences):
        pass
    dtype = torch.promote_types(model.embed.weight.dtype, torch.float32)
    return [(torch.tensor([e.logprob for e in row], dtype=dtype), torch.tensor([bool(e.greedy) for e in row]))
            for row in events]


def _score_prefill(model, contexts, continuations, settings: DecodeSettings):
    """One left-padded prefill over each context + continuation but its last token: every row's continuation is
    predicted by the logits of the last L positions, the only ones computed."""
    ids, mask = left_pad([list(ctx) + list(cont)[:-1] for ctx, cont in zip(contexts, continuations)])
    L = max(len(cont) for cont in continuations)
    out = model.prefill(ids.to(model.device), settings.prefill_passes, attention_mask=mask.to(model.device),
                        logits_to_keep=L, fused_tol=settings.fused_tol, fused_max_passes=settings.fused_max_passes)
    targets = torch.zeros(len(continuations), L, dtype=torch.long)
    for i, cont in enumerate(continuations):
        targets[i, L - len(cont) :] = torch.tensor(list(cont), dtype=torch.long)
    return _token_scores(out.logits, targets.to(model.device), [range(L - len(c), L) for c in continuations])


def _token_scores(
    logits: torch.Tensor, targets: torch.Tensor, spans: list[range]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, picked, greedy = token_logprobs(logits, targets)
    return [(picked[i, span.start : span.stop].cpu(), greedy[i, span.start : span.stop].cpu())
            for i, span in enumerate(spans)]


@torch.no_grad()
def sequential_forward(model: FullBandLM, input_ids: torch.Tensor, plain_mask: torch.Tensor | None = None,
                       segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, hidden) of the exact recurrence over a given sequence (``FullBandLM.recurrence``)."""
    out = model.recurrence(input_ids, plain_mask, segment_ids=segment_ids)
    return out.logits, out.hidden

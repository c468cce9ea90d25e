"""Decoding with a preallocated KV cache in the three modes of docs/method.md §6.

- ``standard``: plain prefill, plain decoding.
- ``soft``: plain prefill; every generated token is fused with the previous position's top state
  (the first one with the prompt's last top state).
- ``fused``: plain prefill plus ``fused_passes`` fused passes over the prompt (as in training); the KV
  cache of the last pass is kept; then decode as in soft. ``fused_passes="auto"`` iterates per row until
  the prompt's top states change by at most ``fused_tol`` (relative) in a pass, or ``fused_max_passes``
  (see ``FullBandLM.prefill``); pass ``stats={}`` to learn how many passes each row ran. ``fused_passes="exact"``
  computes that iteration's fixed point directly, the exact recurrence one prompt token at a time.

What a call does not say comes from the settings stored with the model (``fullband.decoding``): the mode
its training implies, and for ``fused_passes="auto"`` its tolerance and cap.

Batches of prompts with different lengths are **left-padded**: every row then shares one cache write
position, padding keys are masked, and RoPE positions count real tokens only, so a row's result does
not depend on what it is batched with. The loop only calls ``model.prefill`` and ``model.forward``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from fullband.architectures import LanguageModel, ModelCache
from fullband.decoding import DecodeSettings, DecodeSettingsError
from fullband.model import FullBandLM, ModelOutput, mask_positions
from fullband.sampling import BatchAdjuster, LogitsAdjustments, RequestLimits, check_request, check_token_ids

__all__ = ["decode_settings", "generate", "generate_stream", "left_pad", "sample_next",
           "score_continuations", "sequential_forward"]


def left_pad(
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    attention_mask: torch.Tensor | None = None,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise prompts to a left-padded (B, T) id tensor and its (B, T) bool mask.

    Accepts a 1-D or 2-D tensor (with an optional attention mask, padded on either side) or a list of
    token-id lists of any lengths.
    """
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be 1-D or 2-D, got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            rows = [row.tolist() for row in ids]
        else:
            if attention_mask.shape != ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(ids.shape)}"
                )
            rows = [row[m.bool()].tolist() for row, m in zip(ids, attention_mask)]
        device = ids.device
    else:
        rows = [list(r) for r in input_ids]
        device = None
    if not rows:
        raise ValueError("generate() needs at least one prompt")
    for i, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. a BOS token)")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = True
    return ids.to(device), mask.to(device)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids. Temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def decode_settings(
    model: LanguageModel,
    decode: DecodeSettings | None = None,
    mode: str | None = None,
    fused_passes: int | str | None = None,
    fused_tol: float | None = None,
    fused_max_passes: int | None = None,
) -> DecodeSettings:
    """The settings a call decodes with: ``decode`` (default: those stored with the model) with the fields a
    caller gave replaced."""
    base = decode if decode is not None else DecodeSettings.of(model)
    settings = base.with_overrides(mode=mode, fused_passes=fused_passes, fused_tol=fused_tol,
                                   fused_max_passes=fused_max_passes)
    if settings.mode != "standard" and not model.has_feedback:
        raise DecodeSettingsError(f"decode mode {settings.label}: {model.no_feedback}")
    return settings


# What generate allows beyond the model's limits (fullband.sampling.check_request): a call may ask for no token.
LIMITS = RequestLimits(max_tokens_name="max_new_tokens", context_name="max_seq_len", min_max_tokens=0)


def _prefill_prompts(
    model: LanguageModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    new_tokens: int,
    settings: DecodeSettings,
) -> tuple[ModelOutput, ModelCache, torch.Tensor]:
    """The prompt phase of decoding, shared by generation and scoring: left-padded prompts prefilled into
    a cache with room for ``new_tokens`` more positions (plain, or plus fused passes in fused mode).
    Returns the prefill output (last position's logits, every position's states), the cache and each
    row's next RoPE position (B, 1)."""
    B, T = ids.shape
    positions = mask_positions(mask)
    cache = model.new_cache(B, T + new_tokens)
    out = model.prefill(
        ids,
        settings.prefill_passes,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        fused_tol=settings.fused_tol,
        fused_max_passes=settings.fused_max_passes,
    )
    return out, cache, positions[:, -1:] + 1


@torch.no_grad()
def generate_stream(
    model: LanguageModel,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    mode: str | None = None,
    fused_passes: int | str | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    seed: int | None = None,
    fused_tol: float | None = None,
    fused_max_passes: int | None = None,
    stats: dict[str, Any] | None = None,
    decode: DecodeSettings | None = None,
    logit_bias: Mapping[int, float] | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    min_tokens: int = 0,
    stop_token_ids: Sequence[int] = (),
) -> Iterator[torch.Tensor]:
    """Yield a (B,) tensor of new token ids per step. A row finishes at ``eos_token_id`` or any of
    ``stop_token_ids`` and keeps yielding the token it finished with; the stream ends when every row has
    finished or after ``max_new_tokens`` steps.
    ``logit_bias``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` and ``min_tokens`` adjust
    every row's logits before the token is chosen, greedy included (``fullband.sampling``).
    The decode settings are ``decode`` (default: those stored with the model) with ``mode``,
    ``fused_passes`` (an integer >= 1, "auto" or "exact"), ``fused_tol`` and ``fused_max_passes`` replaced where
    given.
    ``stats``, a dict, receives ``"fused_passes"``: the fused prefill passes each row ran (a list of B
    ints, 0 outside fused mode) once the prefill is done, and with ``fused_passes="auto"`` also
    ``"fused_converged"``: whether each row's states met ``fused_tol`` before ``fused_max_passes``."""
    settings = decode_settings(model, decode, mode, fused_passes, fused_tol, fused_max_passes)
    ids, mask = left_pad(input_ids, attention_mask)
    ids, mask = ids.to(model.device), mask.to(model.device)
    vocab_size = model.config.vocab_size
    adjustments = LogitsAdjustments.of(vocab_size, None, logit_bias, presence_penalty, frequency_penalty,
                                       repetition_penalty, min_tokens)
    end_ids = check_token_ids("stop_token_ids", stop_token_ids, vocab_size)
    check_request(model.config, ids, max_new_tokens, temperature, top_k, top_p, adjustments, end_ids, limits=LIMITS)
    if eos_token_id is not None:
        end_ids = tuple(dict.fromkeys([eos_token_id, *end_ids]))
    if max_new_tokens == 0:
        return
    B = ids.shape[0]
    adjuster = BatchAdjuster([adjustments] * B, ids, mask, [end_ids] * B, vocab_size)
    ends = torch.tensor(end_ids, dtype=torch.long, device=model.device) if end_ids else None
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)
    out, cache, next_position = _prefill_prompts(model, ids, mask, max_new_tokens, settings)
    if stats is not None:
        stats["fused_passes"] = out.passes.tolist()
        if out.converged is not None:
            stats["fused_converged"] = out.converged.tolist()

    finished = torch.zeros(B, dtype=torch.bool, device=model.device)
    held = torch.zeros(B, dtype=torch.long, device=model.device)  # the token a finished row repeats
    logits, state = out.logits[:, -1], out.hidden[:, -1:]
    for step in range(max_new_tokens):
        token = sample_next(adjuster.adjust(logits), temperature, top_k, top_p, generator)
        if ends is not None:
            token = torch.where(finished, held, token)
            finished |= torch.isin(token, ends)
            held = token
        adjuster.record(token)
        yield token
        # finished.all() syncs with the device, so check it only when rows can finish early.
        if step + 1 == max_new_tokens or (ends is not None and bool(finished.all())):
            return
        out = model(
            token.unsqueeze(1),
            feedback=None if settings.mode == "standard" else state,
            position_ids=next_position + step,
            past_key_values=cache,
            use_cache=True,
        )
        logits, state = out.logits[:, -1], out.hidden


def generate(
    model: LanguageModel,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    **kwargs: Any,
) -> torch.Tensor:
    """Return the new tokens as a (B, N) tensor, N <= max_new_tokens (fewer when every row stopped at
    ``eos_token_id`` or one of ``stop_token_ids``; a row that stopped earlier is filled with the token it
    stopped at). Keyword arguments are those of ``generate_stream``: mode ("standard" | "soft" | "fused"),
    fused_passes (int, "auto" or "exact"), fused_tol, fused_max_passes (each defaults to the model's stored
    setting), decode (a whole ``DecodeSettings``), temperature (0 = greedy), top_k, top_p, eos_token_id,
    stop_token_ids, attention_mask, seed, stats, and the logits adjustments logit_bias, presence_penalty,
    frequency_penalty, repetition_penalty and min_tokens (``fullband.sampling``)."""
    steps = list(generate_stream(model, input_ids, max_new_tokens, **kwargs))
    if not steps:
        rows = len(input_ids) if not isinstance(input_ids, torch.Tensor) or input_ids.dim() > 1 else 1
        return torch.zeros(rows, 0, dtype=torch.long, device=model.device)
    return torch.stack(steps, dim=1)


SCORINGS = ("decode", "prefill")


@torch.no_grad()
def score_continuations(
    model: LanguageModel,
    contexts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    mode: str | None = None,
    fused_passes: int | str | None = None,
    scoring: str = "decode",
    fused_tol: float | None = None,
    fused_max_passes: int | None = None,
    decode: DecodeSettings | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Teacher-forced log-probabilities of each continuation given its context, batched (ragged rows).
    The decode settings are resolved as in ``generate_stream`` (stored with the model, then overridden).

    ``scoring="decode"``: the probability ``generate`` assigns to the continuation: the context
    is prefilled exactly as ``generate_stream`` prefills a prompt (plain, or plain + fused passes in fused
    mode, ``fused_passes`` may be "auto" or "exact"), then the continuation tokens are fed one decode step at a time,
    each fused with the previous step's top state (soft/fused). In standard mode, where a step carries no
    state, the continuation goes through the cached model in one call (the same keys, values and logits).
    ``scoring="prefill"``: the prefill's fused passes (none in standard mode, ``fused_passes`` in fused mode)
    over context + continuation in parallel, as in validation; soft decoding has no such form.

    Returns one (log-probabilities (L,) float32, greedy (L,) bool) pair per row: the log-probability of
    each continuation token and whether it was the most likely token at its step.
    """
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}; choose one of {', '.join(SCORINGS)}")
    settings = decode_settings(model, decode, mode, fused_passes, fused_tol, fused_max_passes)
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
    if scoring == "prefill":
        return _score_prefill(model, contexts, continuations, settings)
    ids, mask = left_pad(contexts)
    ids, mask = ids.to(model.device), mask.to(model.device)
    check_request(model.config, ids, 0, limits=LIMITS)
    lengths = [len(c) for c in continuations]
    L = max(lengths)
    cont = torch.zeros(len(continuations), L, dtype=torch.long)
    for i, c in enumerate(continuations):
        cont[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)  # rows that end early are fed token 0
    cont = cont.to(model.device)
    check_request(model.config, cont, 0, limits=LIMITS)
    out, cache, next_position = _prefill_prompts(model, ids, mask, L - 1, settings)
    if settings.mode == "standard" and L > 1:
        rest = model(cont[:, :-1], position_ids=next_position + torch.arange(L - 1, device=model.device),
                     past_key_values=cache, use_cache=True)
        logits = torch.cat([out.logits[:, -1:], rest.logits], dim=1)
    else:
        steps, state = [out.logits[:, -1]], out.hidden[:, -1:]
        for step in range(L - 1):  # the decode loop of generate_stream, with the continuation as the samples
            out = model(
                cont[:, step : step + 1],
                feedback=None if settings.mode == "standard" else state,
                position_ids=next_position + step,
                past_key_values=cache,
                use_cache=True,
            )
            steps.append(out.logits[:, -1])
            state = out.hidden
        logits = torch.stack(steps, dim=1)
    return _token_scores(logits, cont, [range(n) for n in lengths])


def _score_prefill(model, contexts, continuations, settings: DecodeSettings):
    full = [list(ctx) + list(cont)[:-1] for ctx, cont in zip(contexts, continuations)]
    ids, mask = left_pad(full)
    ids, mask = ids.to(model.device), mask.to(model.device)
    check_request(model.config, ids, 0, limits=LIMITS)
    out = model.prefill(ids, settings.prefill_passes, attention_mask=mask, fused_tol=settings.fused_tol,
                        fused_max_passes=settings.fused_max_passes)
    W = ids.shape[1]
    targets = torch.zeros(len(full), W, dtype=torch.long)
    for i, cont in enumerate(continuations):
        targets[i, W - len(cont) :] = torch.tensor(list(cont), dtype=torch.long)
    # Left padding puts every row's continuation at its end: logits at W - L .. W - 1 predict its L tokens.
    return _token_scores(out.logits, targets.to(model.device), [range(W - len(c), W) for c in continuations])


def _token_scores(
    logits: torch.Tensor, targets: torch.Tensor, spans: list[range]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # float32 at least; a float64 model's scores stay float64 (the RL log-probabilities are checked against them).
    logprobs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1)
    picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    greedy = logits.argmax(dim=-1) == targets
    return [(picked[i, span.start : span.stop].cpu(), greedy[i, span.start : span.stop].cpu())
            for i, span in enumerate(spans)]


@torch.no_grad()
def sequential_forward(
    model: FullBandLM,
    input_ids: torch.Tensor,
    plain_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact recurrence (docs/method.md §2) over a given sequence (teacher forcing), one token at a time
    with a KV cache (``FullBandLM.recurrence``): position t is fused with h_{t-1} unless it is position 0 or in
    ``plain_mask``. ``segment_ids``: packed documents that do not see each other (as in ``FullBandLM.forward``);
    the caller marks their first positions plain.

    Returns (logits (B, T, V), hidden (B, T, D)). This is the limit that K >= T passes converge to.
    """
    out = model.recurrence(input_ids, plain_mask, segment_ids=segment_ids)
    return out.logits, out.hidden

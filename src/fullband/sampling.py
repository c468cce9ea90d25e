"""The OpenAI and vLLM sampling fields that adjust a row's logits before a token is chosen, computed in one place for
every door and decode mode (docs/api.md), and ``check_request``, the one check of a request's parameters; a
refused parameter raises ``RequestError``, whose ``param`` names it as data."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fullband.errors import FullbandError

__all__ = ["BatchAdjuster", "LogitsAdjustments", "RequestError", "RequestLimits", "SamplingParams", "check_request",
           "check_token_ids", "sample_rows", "token_logprobs"]

MAX_LOGIT_BIAS = 100.0
MAX_OPENAI_PENALTY = 2.0
MAX_TOP_LOGPROBS = 20


class RequestError(FullbandError):
    """A request parameter that cannot be used. ``param`` names it as the caller spelled it (None: no single
    parameter), so that a door reports it (the server's error body carries it) without reading the message."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    """What one door allows beyond the model's own limits, and its names for the parameters it calls otherwise."""

    max_temperature: float = math.inf  # the server: 2, OpenAI's range
    max_logprobs: int = MAX_TOP_LOGPROBS  # how many top log-probabilities a token may come with
    logprobs_name: str = "logprobs"
    max_tokens_name: str = "max_tokens"
    context_name: str = "context length"  # generate: max_seq_len, the model config's name
    min_max_tokens: int = 1  # generate: 0, a call that asks for no token
    top_k_every: tuple[int, ...] = ()  # top_k values that mean every token (the server: -1 and 0, as in vLLM)


@dataclass(frozen=True)
class SamplingParams:
    """One request: how many tokens and how each is chosen, with vLLM's field names; every door folds its keywords,
    flags or JSON body into one (and one ``DecodeSettings``) where they arrive. ``stop_token_ids`` end the sequence
    (the token is emitted); ``logprobs`` k >= 0: the chosen token's log-probability and the top k."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # None (or a door's top_k_every value, e.g. the server's -1): every token
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: Mapping[int | str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def sampled_top_k(self) -> int | None:
        """top_k as sampling reads it: None when it keeps every token."""
        return self.top_k if self.top_k is not None and self.top_k >= 1 else None


def check_request(config: Any, prompts: torch.Tensor | Sequence[Sequence[int]], params: SamplingParams,
                  limits: RequestLimits = RequestLimits()) -> LogitsAdjustments:
    """Raise ``RequestError`` naming the first parameter of ``params`` that a model of ``config`` (its ``vocab_size``
    and ``max_seq_len``) cannot serve within a door's ``limits``; return the request's checked logits adjustments.
    ``prompts``: token-id rows, or a (T,) or (B, T) tensor of rows padded with valid ids."""
    budget = limits.max_tokens_name
    max_tokens, temperature, top_k, top_p = params.max_tokens, params.temperature, params.top_k, params.top_p
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise RequestError(f"{budget} must be an integer, got {max_tokens!r}", budget)
    if max_tokens < limits.min_max_tokens:
        raise RequestError(f"{budget} must be >= {limits.min_max_tokens}, got {max_tokens}", budget)
    if not _is_number(temperature) or not 0 <= temperature <= limits.max_temperature:  # also refuses NaN
        allowed = f"in [0, {limits.max_temperature:g}]" if math.isfinite(limits.max_temperature) else ">= 0"
        raise RequestError(f"temperature must be {allowed} (0 = greedy), got {temperature}", "temperature")
    if top_k is not None and top_k < 1 and top_k not in limits.top_k_every:
        every = " or ".join(str(k) for k in limits.top_k_every) or "None"
        raise RequestError(f"top_k must be >= 1, or {every} for every token, got {top_k}", "top_k")
    if top_p is not None and not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    vocab_size = config.vocab_size
    adjustments = LogitsAdjustments.of(vocab_size, max_tokens, params.logit_bias, params.presence_penalty,
                                       params.frequency_penalty, params.repetition_penalty, params.min_tokens)
    logprobs = params.logprobs
    if logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
        raise RequestError(f"{limits.logprobs_name} must be between 0 and {limits.max_logprobs}, got {logprobs}",
                           limits.logprobs_name)
    if isinstance(prompts, torch.Tensor):
        prompts = (prompts.unsqueeze(0) if prompts.dim() == 1 else prompts).tolist()
    if any(len(row) == 0 for row in prompts):
        raise RequestError("the prompt is empty: it needs at least one token (e.g. a BOS token)", "prompt")
    length = max(len(row) for row in prompts)
    bad = next((token for row in prompts for token in row if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size}) (ids outside the "
                           "vocabulary have no embedding); was the prompt encoded with this model's tokenizer?",
                           "prompt")
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    total = length + max_tokens
    if total > config.max_seq_len:
        raise RequestError(f"the prompt ({length} tokens) plus {budget} ({max_tokens}) = {total} exceeds the "
                           f"model's {limits.context_name} {config.max_seq_len}; shorten the prompt or lower {budget}",
                           budget)
    return adjustments


def check_token_ids(name: str, ids: Iterable[int], vocab_size: int) -> tuple[int, ...]:
    """``ids`` as a tuple of ints, each a token id of a vocabulary of ``vocab_size``; RequestError naming ``name``."""
    out = []
    for item in ids:
        try:  # ints, and integer numpy or 0-d torch values
            token = None if isinstance(item, bool) else operator.index(item)
        except TypeError:
            token = None
        if token is None:
            raise RequestError(f"{name} must hold integer token ids, got {item!r}", name)
        if not 0 <= token < vocab_size:
            raise RequestError(f"{name}: token id {token} is outside the model's vocabulary [0, {vocab_size})", name)
        out.append(token)
    return tuple(out)


@dataclass(frozen=True)
class LogitsAdjustments:
    """One row's sampling fields (see the module docstring); the defaults change nothing. Build it with ``of`` to
    have every field checked."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, token ids distinct
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    @classmethod
    def of(cls, vocab_size: int, max_tokens: int | None = None, logit_bias: Mapping[int | str, float] | None = None,
           presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
           min_tokens: int = 0) -> LogitsAdjustments:
        """The fields, checked: RequestError naming the field and its allowed range when one is out of it.
        ``logit_bias`` keys may be ints or the strings of ints (JSON object keys); ``max_tokens`` bounds min_tokens."""
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not _is_number(value) or not -MAX_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY:
                raise RequestError(f"{name} must be a number in [-{MAX_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}] "
                                   f"(0 = off), got {value!r}", name)
        if not _is_number(repetition_penalty) or not 0 < repetition_penalty < math.inf:
            raise RequestError(f"repetition_penalty must be a finite number > 0 (1 = off, > 1 discourages "
                               f"repeating), got {repetition_penalty!r}", "repetition_penalty")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise RequestError(f"min_tokens must be an integer >= 0, got {min_tokens!r}", "min_tokens")
        if max_tokens is not None and min_tokens > max_tokens:
            raise RequestError(f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")
        bias: dict[int, float] = {}
        for key, value in (logit_bias or {}).items():
            if isinstance(key, str) and key.strip().lstrip("-").isdigit():
                key = int(key)  # JSON object keys are strings
            if isinstance(key, bool) or not isinstance(key, int):
                raise RequestError(f"logit_bias keys must be token ids (integers, or their strings in JSON), got "
                                   f"{key!r}", "logit_bias")
            (token,) = check_token_ids("logit_bias", [key], vocab_size)
            if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias of token {token} must be a number in [-{MAX_LOGIT_BIAS:g}, "
                                   f"{MAX_LOGIT_BIAS:g}], got {value!r}", "logit_bias")
            if token in bias:
                raise RequestError(f"logit_bias names token {token} twice", "logit_bias")
            bias[token] = float(value)
        return cls(tuple(bias.items()), float(presence_penalty), float(frequency_penalty), float(repetition_penalty),
                   min_tokens)

    @property
    def counts_tokens(self) -> bool:
        """Whether the penalties need the row's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def changes_logits(self) -> bool:
        return self.counts_tokens or bool(self.logit_bias) or self.min_tokens > 0


def _is_number(value: object) -> bool:
    """An int or a float other than NaN (a bool is not a number here)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and not math.isnan(value))


class BatchAdjuster:
    """The adjusted logits of a batch whose rows each have their own ``LogitsAdjustments``, prompt and end tokens,
    following rows that leave and join (``select``, ``extend``). While some row has a penalty, each row keeps its
    tokens so far and the counts of its generated ones, so the penalties touch only those L logits, not all V."""

    def __init__(self, rows: Sequence[LogitsAdjustments], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 end_ids: Sequence[Iterable[int]], vocab_size: int):
        """``prompt_ids``, ``prompt_mask``: (B, T), padded on either side; ``end_ids``: per row, masked until
        ``min_tokens``."""
        if not len(rows) == len(prompt_ids) == len(end_ids):
            raise ValueError(f"{len(rows)} rows of adjustments, {len(prompt_ids)} prompts and {len(end_ids)} "
                             "end-id sets")
        self.vocab_size, self.device = vocab_size, prompt_ids.device
        self.rows = list(rows)
        self.end_ids = [tuple(ids) for ids in end_ids]
        self.generated = [0] * len(rows)
        self.counts: torch.Tensor | None = None  # (B, V) int32: each token's count among the generated ones
        # (B, L): each row's prompt and generated tokens. A padding position repeats a token of its row, so that
        # writing the penalised logits back writes that token's value twice, the same both times.
        self.history: torch.Tensor | None = None
        if any(r.counts_tokens for r in self.rows):
            first_real = prompt_ids.gather(1, prompt_mask.int().argmax(dim=1, keepdim=True))
            self.history = torch.where(prompt_mask.bool(), prompt_ids, first_real)
            self.counts = torch.zeros(len(self.rows), vocab_size, dtype=torch.int32, device=self.device)
        self._tensors: dict[str, torch.Tensor] | None = None

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits -> the adjusted (B, V) logits, in at least float32; the same tensor when no row changes
        anything."""
        if not any(r.changes_logits for r in self.rows):
            return logits
        if logits.shape != (len(self.rows), self.vocab_size):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(self.rows)} rows of a "
                             f"{self.vocab_size}-token vocabulary")
        out = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
        t = self._row_tensors(out.dtype)
        # The end tokens of the rows short of their min_tokens.
        pairs = [(i, token) for i, (r, n) in enumerate(zip(self.rows, self.generated)) if n < r.min_tokens
                 for token in self.end_ids[i]]
        if pairs:
            rows, tokens = torch.tensor(pairs, device=self.device).unbind(1)
            out[rows, tokens] = -math.inf
        if "bias_rows" in t:
            out.index_put_((t["bias_rows"], t["bias_tokens"]), t["bias_values"], accumulate=True)
        if self.history is not None:
            seen = out.gather(1, self.history)  # every token of the prompt or the answer so far, some twice
            counts = self.counts.gather(1, self.history).to(out.dtype)
            repeat = t["repetition"]
            seen = torch.where(seen > 0, seen / repeat, seen * repeat)
            seen = seen - t["frequency"] * counts - t["presence"] * (counts > 0).to(out.dtype)
            out.scatter_(1, self.history, seen)
        return out

    def record(self, tokens: torch.Tensor) -> None:
        """Add each row's chosen token (B,) to its history."""
        self.generated = [n + 1 for n in self.generated]
        if self.history is not None:
            column = tokens.view(-1, 1).to(self.device, torch.long)
            self.history = torch.cat([self.history, column], dim=1)
            self.counts.scatter_add_(1, column, torch.ones_like(column, dtype=self.counts.dtype))

    def select(self, keep: Sequence[int]) -> None:
        """Keep only the rows ``keep``, in that order."""
        self.rows = [self.rows[i] for i in keep]
        self.end_ids = [self.end_ids[i] for i in keep]
        self.generated = [self.generated[i] for i in keep]
        if self.history is not None:
            if any(r.counts_tokens for r in self.rows):
                index = torch.tensor(list(keep), dtype=torch.long, device=self.device)
                self.history, self.counts = self.history[index], self.counts[index]
            else:
                self.history = self.counts = None
        self._tensors = None

    def extend(self, other: BatchAdjuster) -> None:
        """Append the rows of ``other`` (same vocabulary) after these rows."""
        if self.history is not None or other.history is not None:
            (mine, my_counts), (theirs, their_counts) = self._tracked(), other._tracked()
            width = max(mine.shape[1], theirs.shape[1])
            self.history = torch.cat([_pad_with_first(mine, width), _pad_with_first(theirs, width)])
            self.counts = torch.cat([my_counts, their_counts])
        self.rows += other.rows
        self.end_ids += other.end_ids
        self.generated += other.generated
        self._tensors = None

    def _tracked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(history, counts); for rows that keep none, token 0 stands in for a history (rows without a penalty
        never change their logits through it) and the counts are zero."""
        if self.history is not None:
            return self.history, self.counts
        rows = len(self.rows)
        return (torch.zeros(rows, 1, dtype=torch.long, device=self.device),
                torch.zeros(rows, self.vocab_size, dtype=torch.int32, device=self.device))

    def _row_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The rows' fields as tensors of the logits' dtype, built once per batch composition."""
        if self._tensors is None or self._tensors["presence"].dtype != dtype:
            t: dict[str, torch.Tensor] = {}
            bias = [(i, token, value) for i, r in enumerate(self.rows) for token, value in r.logit_bias]
            if bias:
                rows, tokens, values = zip(*bias)
                t["bias_rows"] = torch.tensor(rows, device=self.device)
                t["bias_tokens"] = torch.tensor(tokens, device=self.device)
                t["bias_values"] = torch.tensor(values, dtype=dtype, device=self.device)
            for name in ("repetition", "frequency", "presence"):
                values = [getattr(r, f"{name}_penalty") for r in self.rows]
                t[name] = torch.tensor(values, dtype=dtype, device=self.device).unsqueeze(1)
            self._tensors = t
        return self._tensors


def _pad_with_first(history: torch.Tensor, width: int) -> torch.Tensor:
    """(B, L) -> (B, width): each row padded on the left with its own first token (a token it holds anyway)."""
    if history.shape[1] == width:
        return history
    return torch.cat([history[:, :1].expand(-1, width - history.shape[1]), history], dim=1)


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """(B, V) logits -> (B, V) probabilities at ``temperature`` restricted to the top_k tokens and the top_p
    nucleus (the first token always stays)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
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
    return logits.softmax(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(..., V) logits, (...) tokens -> the log-softmax, each token's log-probability, whether it was the most likely.
    At least float32: a float64 model's stay float64 (the RL log-probabilities are checked against them)."""
    logprobs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1)
    return logprobs, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), logits.argmax(dim=-1) == tokens


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """(B, V) adjusted logits -> (B,) token ids, row i chosen by ``params[i]`` (temperature 0: the argmax) with one
    uniform draw from its own ``generators[i]``, so a row's token never depends on the other rows. Rows that sample
    with the same temperature, top_k and top_p are filtered together."""
    tokens = logits.argmax(dim=-1)
    if all(p.temperature == 0 for p in params):
        return tokens
    groups: dict[tuple[float, int | None, float | None], list[int]] = {}
    for i, p in enumerate(params):
        if p.temperature > 0:
            groups.setdefault((p.temperature, p.sampled_top_k, p.top_p), []).append(i)
    for (temperature, top_k, top_p), rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        cdf = filtered_probs(logits[index], temperature, top_k, top_p).double().cumsum(dim=-1)
        uniform = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64, device=logits.device)
                             for i in rows])
        # The first token whose cumulative probability exceeds u · total: a token of probability 0 is never chosen.
        chosen = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        tokens[index] = chosen.clamp(max=logits.shape[-1] - 1)
    return tokens

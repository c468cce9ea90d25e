"""Per-token log-probabilities of sampled rollouts under the decode mode that sampled them, differentiable.

A completion sampled in soft or fused mode was drawn one token at a time, each token fused with the top state of
the step before (docs/method.md §6): its probability is not the one a plain teacher-forced pass gives. A policy
gradient computed from the plain pass optimises another policy than the one that sampled. ``rollout_logprobs``
recomputes, with gradients, exactly what ``generate`` computed when it sampled:

- ``standard``: the plain pass over prompt + completion;
- ``soft``: the prompt plain, every completion token fused with the previous position's top state (the first with
  the prompt's last top state): the exact recurrence over the completion;
- ``fused:N``: a plain pass and N fused Jacobi passes over the prompt (``FullBandLM.prefill``), then the completion
  as in soft; ``fused:auto`` the same with each row's own number of passes, chosen by the prefill's rule;
- ``fused:exact``: the exact recurrence over the prompt too (each row's first token plain), then the completion.

It runs the same calls as decoding (``model.prefill`` into a cache, then ``model.forward`` or ``model.recurrence``
after it) over a cache that never writes in place (``GradKVCache``), so autograd can save what attention reads; the
cost is one pass per token, as for sampling. Prompts are left-padded with RoPE positions that count real tokens
only, so a row's result does not depend on the rows batched with it.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from fullband.decoding import DecodeSettings
from fullband.generation import decode_settings, left_pad
from fullband.kv_cache import KVCache
from fullband.model import FullBandLM, mask_positions

__all__ = ["GradKVCache", "completion_logits", "rollout_logprobs", "rollout_logprobs_and_entropies"]


class GradKVCache(KVCache):
    """A ``KVCache`` for scoring with gradients: each layer's keys and values are a new tensor per write (the old
    ones concatenated with the new), never written in place, so the tensors autograd saved for earlier positions
    stay valid. The key mask (no gradient) is kept as in ``KVCache``. Meant for one scoring call: it does not
    preallocate, so ``join``, ``grow`` and ``compact`` (the serving engine's batch changes) are not for it."""

    def __init__(self, model: FullBandLM, batch_size: int, max_len: int):
        config = model.config
        weight = model.embed.weight
        # The base class sizes the key mask from max_len; its key and value buffers are replaced by empty ones.
        super().__init__(config, batch_size, 0, weight.device, weight.dtype)
        self._k = [k[:, :, :0] for k in self._k]
        self._v = [v[:, :, :0] for v in self._v]
        self._key_mask = torch.ones(batch_size, max_len, dtype=torch.bool, device=weight.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"GradKVCache holds {self.max_len} positions; writing up to {end} would overflow")
        # After a truncate (a fused prefill's next pass) the stored tensors are longer than the write position.
        self._k[layer] = torch.cat([self._k[layer][:, :, : self._length], k], dim=2)
        self._v[layer] = torch.cat([self._v[layer][:, :, : self._length], v], dim=2)
        return self._k[layer], self._v[layer]


def _check_rows(model: FullBandLM, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> None:
    if not isinstance(model, FullBandLM):
        raise TypeError(f"rollout_logprobs scores FullBandLM models (model.arch fbt), got {type(model).__name__}")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions: give one completion per prompt "
                         "(repeat a prompt for each of its rollouts)")
    if not prompts:
        raise ValueError("rollout_logprobs needs at least one prompt and completion")
    vocab, limit = model.config.vocab_size, model.config.max_seq_len
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if len(prompt) == 0 or len(completion) == 0:
            raise ValueError(f"row {i}: the prompt and the completion need at least one token each (a prompt starts "
                             "with BOS; drop rollouts that generated nothing)")
        if len(prompt) + len(completion) - 1 > limit:
            raise ValueError(f"row {i}: prompt {len(prompt)} + completion {len(completion)} - 1 tokens exceed the "
                             f"model's max_seq_len {limit}; generate fewer tokens or shorten the prompt")
        bad = [t for t in (*prompt, *completion)
               if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"row {i}: token id {bad[0]!r} is not an integer in [0, {vocab}) (the model's vocab_size)")


def completion_logits(
    model: FullBandLM,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    decode: DecodeSettings | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The logits from which each completion token was sampled, under ``decode`` (default: the model's stored
    settings), with gradients when they are enabled. Returns (logits (B, L, V), the completions right-padded with
    token 0 (B, L), each row's completion length); ``logits[i, j]`` is the distribution of ``completions[i][j]``."""
    _check_rows(model, prompts, completions)
    settings = decode_settings(model, decode)
    device = model.device
    ids, mask = left_pad(prompts)
    ids, mask = ids.to(device), mask.to(device)
    lengths = [len(c) for c in completions]
    L = max(lengths)
    # Rows that end early are fed token 0 after their end: attention is causal, so nothing flows back into them.
    targets = torch.zeros(len(completions), L, dtype=torch.long)
    for i, completion in enumerate(completions):
        targets[i, : len(completion)] = torch.tensor(list(completion), dtype=torch.long)
    targets = targets.to(device)
    B, P = ids.shape
    positions = mask_positions(mask)
    cache = GradKVCache(model, B, P + L - 1)
    out = model.prefill(ids, settings.prefill_passes, attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True, logits_to_keep=1, fused_tol=settings.fused_tol,
                        fused_max_passes=settings.fused_max_passes)
    first = out.logits[:, -1:]
    if L == 1:
        return first, targets, lengths
    next_positions = positions[:, -1:] + 1 + torch.arange(L - 1, device=device)
    if settings.mode == "standard":
        rest = model(targets[:, :-1], position_ids=next_positions, past_key_values=cache, use_cache=True)
    else:
        # Every completion token fused with the top state of the position before it: what the decode loop feeds.
        rest = model.recurrence(targets[:, :-1], past_key_values=cache, position_ids=next_positions,
                                state=out.hidden[:, -1:])
    return torch.cat([first, rest.logits], dim=1), targets, lengths


def rollout_logprobs(
    model: FullBandLM,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    decode: DecodeSettings | None = None,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """The log-probability of each completion token under the decode mode that sampled it (``decode``, default the
    settings stored with the model), one differentiable 1-D tensor per row, in the model's dtype. ``prompts`` and
    ``completions`` are token-id lists of any lengths (a prompt with its BOS token; a completion as sampled, with
    its end token if it has one). ``temperature``: the sampling temperature the rollouts were drawn at (the logits
    are divided by it, as the sampler divides them); top-k/top-p truncation is not undone."""
    return rollout_logprobs_and_entropies(model, prompts, completions, decode, temperature)[0]


def rollout_logprobs_and_entropies(
    model: FullBandLM,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    decode: DecodeSettings | None = None,
    temperature: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``rollout_logprobs`` and, per row, the entropy (nats, no gradient) of the distribution each completion token
    was sampled from: a policy whose entropy falls towards 0 has stopped exploring (TRL logs it for that)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the one the rollouts were sampled at), got {temperature!r}; "
                         "greedy rollouts have no log-probabilities to optimise")
    logits, targets, lengths = completion_logits(model, prompts, completions, decode)
    if temperature != 1.0:
        logits = logits / temperature
    # float32 at least (bf16 log-softmax loses the small differences the ratio is made of); float64 stays float64.
    logprobs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1)
    picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(dim=-1)
    return [picked[i, :n] for i, n in enumerate(lengths)], [entropy[i, :n] for i, n in enumerate(lengths)]

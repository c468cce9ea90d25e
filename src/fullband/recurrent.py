"""A recurrent baseline: torch's LSTM as a language model (``model.arch: lstm``).

Embedding -> ``nn.LSTM`` (n_layers layers of width d_model) -> RMSNorm -> the head (tied to the embedding or
not). It is trained by the same trainer on the same packed batches (one pass: ``train.schedule standard``) and
decoded by the same ``generate`` in standard mode, with its recurrent state as the cache, so a decode step
costs O(1) whatever the context. It has no latent feedback to fuse, so soft and fused decoding, Jacobi passes
and the exact schedule are refused, not imitated. ``RecurrentLM`` holds what it shares with the other recurrent
baseline, ``fullband.deltaproduct.DeltaProductLM`` (``model.arch: deltaproduct``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from fullband.model import (
    DEFAULT_FUSED_MAX_PASSES,
    DEFAULT_FUSED_TOL,
    FullBandConfig,
    FullBandLM,
    ModelOutput,
    RMSNorm,
    segment_positions,
)


class RecurrentState:
    """The LSTM's cache: the (h, c) state of every layer for each row, (n_layers, B, d_model) each. Unlike a
    KV cache it does not grow with the context."""

    def __init__(self, config: FullBandConfig, batch_size: int, device: torch.device, dtype: torch.dtype):
        shape = (config.n_layers, batch_size, config.d_model)
        self.h = torch.zeros(shape, device=device, dtype=dtype)
        self.c = torch.zeros(shape, device=device, dtype=dtype)


class RecurrentLM(nn.Module):
    """What the recurrent baselines (LSTMLM, fullband.deltaproduct.DeltaProductLM) share: FullBandLM's storage
    and its prefill / iterate_passes interface with one pass and no latent feedback. A subclass sets ``kind``
    (how messages name it), ``embed`` and ``forward``."""

    has_feedback = False
    kind = "a recurrent model"
    embed: nn.Embedding

    # The same storage as FullBandLM (config.json with the arch, safetensors, decode defaults).
    save_pretrained = FullBandLM.save_pretrained
    from_pretrained = classmethod(FullBandLM.from_pretrained.__func__)
    from_weights = classmethod(FullBandLM.from_weights.__func__)

    @property
    def no_feedback(self) -> str:
        """The refusal of soft and fused decoding, Jacobi passes and fed-back states."""
        return f"{self.kind} has no latent feedback; use decode_mode standard"

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def prefill(
        self,
        input_ids: torch.Tensor,
        fused_passes: int | str = 0,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        fused_tol: float = DEFAULT_FUSED_TOL,
        fused_max_passes: int = DEFAULT_FUSED_MAX_PASSES,
    ) -> ModelOutput:
        """The prompt phase of standard decoding (FullBandLM.prefill's interface): one pass over the prompts.
        Fused passes are refused: there is no state to fuse."""
        if fused_passes != 0:
            raise ValueError(self.no_feedback)
        out = self(input_ids, attention_mask=attention_mask, past_key_values=past_key_values, use_cache=use_cache,
                   logits_to_keep=logits_to_keep)
        out.passes = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        return out

    def iterate_passes(self, input_ids: torch.Tensor, passes: int, segment_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, **recurrence: Any) -> Iterator[ModelOutput]:
        """The trainer's and validation's pass loop (FullBandLM.iterate_passes' interface) with its one pass.
        ``recurrence``'s options (plain_mask, prefix_mixin, jitter, detach, grad_passes, ...) shape later passes
        only, so one pass is the same with any of them."""
        if passes != 1:
            raise ValueError(f"{passes} passes asked of {self.kind}: it has no latent feedback to run Jacobi "
                             "passes over; use train.schedule standard")
        yield self(input_ids, segment_ids=segment_ids, attention_mask=attention_mask)


class LSTMLM(RecurrentLM):
    kind = "an LSTM"

    def __init__(self, config: FullBandConfig):
        super().__init__()
        if config.arch != "lstm":
            raise ValueError(f"FullBandConfig.arch={config.arch!r}: LSTMLM is the arch 'lstm' model")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.lstm = nn.LSTM(config.d_model, config.d_model, config.n_layers, batch_first=True)
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.decode_defaults: dict[str, Any] = {}  # as FullBandLM's: standard, the only mode it has
        # The embedding and head as in FullBandLM; the LSTM keeps torch's initialisation (U(±1/sqrt(d_model))).
        for module in (self.embed, self.lm_head):
            if module is not None:
                nn.init.normal_(module.weight, mean=0.0, std=config.init_std)

    def new_cache(self, batch_size: int, max_len: int) -> RecurrentState:
        """An empty state for ``batch_size`` rows; its size does not depend on ``max_len``."""
        return RecurrentState(self.config, batch_size, self.device, self.embed.weight.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        feedback: torch.Tensor | None = None,
        plain_mask: torch.Tensor | None = None,
        past_key_values: RecurrentState | None = None,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        segment_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """FullBandLM.forward's interface, for the decode loop and the trainer. ``past_key_values``: the state
        the sequence continues from, updated in place (``use_cache``). ``attention_mask`` (B, T), or (B, cache
        length + T) of which the last T columns are read: left padding, whose tokens leave the state unchanged.
        ``segment_ids`` (B, T): packed documents, each run from a zero state as if alone. ``plain_mask`` and
        ``position_ids`` carry nothing for an LSTM (no feedback; the order is the position) and are accepted
        so that the decode loop and the trainer call both archs alike."""
        if feedback is not None:
            raise ValueError(self.no_feedback)
        if segment_ids is not None and (past_key_values is not None or use_cache):
            raise ValueError("segment_ids (packed, isolated documents) is for training and scoring; it cannot "
                             "be combined with a recurrent-state cache")
        B, T = input_ids.shape
        state = past_key_values
        if use_cache and state is None:
            state = self.new_cache(B, T)
        x = self.embed(input_ids)
        if segment_ids is not None:
            x = self._run_documents(x, segment_ids)
        elif attention_mask is not None and not bool(attention_mask[:, -T:].all()):
            x = self._run_left_padded(x, attention_mask[:, -T:].bool(), state)
        else:
            hx = None if state is None else (state.h, state.c)
            x, (h, c) = self.lstm(x, hx)
            if state is not None:
                state.h, state.c = h, c
        normed = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(normed[:, -logits_to_keep:] if logits_to_keep else normed, weight)
        return ModelOutput(logits=logits, hidden=normed, past_key_values=state if use_cache else None)

    def _run_documents(self, x: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
        """Each run of equal segment ids from a zero state: the documents of all rows are gathered into one
        right-padded batch (padding after a document cannot change its outputs), run, and scattered back."""
        B, T, D = x.shape
        starts = torch.ones_like(segment_ids, dtype=torch.bool)
        starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
        document = starts.flatten().long().cumsum(0) - 1  # (B*T,) index of each token's document
        position = segment_positions(segment_ids).flatten()
        docs = x.new_zeros(int(document[-1]) + 1, int(position.max()) + 1, D)
        docs = docs.index_put((document, position), x.reshape(B * T, D))
        out, _ = self.lstm(docs)
        return out[document, position].reshape(B, T, D)

    def _run_left_padded(self, x: torch.Tensor, mask: torch.Tensor, state: RecurrentState | None) -> torch.Tensor:
        """Left-padded rows (``mask`` False on each row's leading padding): each row's real tokens run from the
        row's state, whose final value is that of its last real token; padding outputs are those of a zero
        input and are not read."""
        B, T, _ = x.shape
        lengths = mask.sum(dim=1)
        if bool((lengths == 0).any()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError("an LSTM reads an attention_mask as left padding: every row needs real tokens, after "
                             "its padding and none between them")
        # Shift each row's real tokens to the front (right padding), run them packed, shift the outputs back.
        index = (torch.arange(T, device=x.device) + (T - lengths).unsqueeze(1)) % T
        packed = pack_padded_sequence(x.gather(1, index.unsqueeze(-1).expand_as(x)), lengths.cpu(),
                                      batch_first=True, enforce_sorted=False)
        hx = None if state is None else (state.h, state.c)
        out, (h, c) = self.lstm(packed, hx)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=T)
        if state is not None:
            state.h, state.c = h, c
        back = (torch.arange(T, device=x.device) - (T - lengths).unsqueeze(1)) % T
        return out.gather(1, back.unsqueeze(-1).expand_as(out))

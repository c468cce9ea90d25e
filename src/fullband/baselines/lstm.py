"""A recurrent baseline: torch's LSTM as a language model (``model.arch: lstm``), trained by the same trainer and
decoded by the same ``generate`` in standard mode with its state as the cache. It has no latent feedback, so the
other modes and schedules are refused, not imitated."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from fullband.baselines.base import BaselineConfig, RecurrentLM, RecurrentState
from fullband.model import segment_positions


class LSTMState(RecurrentState):
    """The LSTM's cache: the (h, c) state of every layer for each row, (n_layers, B, d_model) each."""

    def __init__(self, config: BaselineConfig, batch_size: int, device: torch.device, dtype: torch.dtype):
        shape = (config.n_layers, batch_size, config.d_model)
        self.h = torch.zeros(shape, device=device, dtype=dtype)
        self.c = torch.zeros(shape, device=device, dtype=dtype)


class LSTMLM(RecurrentLM):
    arch = "lstm"
    kind = "an LSTM"
    state_class = LSTMState

    def __init__(self, config: BaselineConfig):
        super().__init__(config)
        self.lstm = nn.LSTM(config.d_model, config.d_model, config.n_layers, batch_first=True)
        self.add_head()
        # The embedding and head as in FullBandLM; the LSTM keeps torch's initialisation (U(±1/sqrt(d_model))).
        for module in (self.embed, self.lm_head):
            if module is not None:
                nn.init.normal_(module.weight, mean=0.0, std=config.init_std)

    def mix(self, x: torch.Tensor, state: LSTMState | None, write: torch.Tensor | None,
            segment_ids: torch.Tensor | None) -> torch.Tensor:
        if segment_ids is not None:
            return self._run_documents(x, segment_ids)
        if write is not None:
            return self._run_left_padded(x, write, state)
        x, (h, c) = self.lstm(x, None if state is None else (state.h, state.c))
        if state is not None:
            state.h, state.c = h, c
        return x

    def _run_documents(self, x: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
        """Each run of equal segment ids from a zero state: the documents of all rows are gathered into one
        right-padded batch (padding after a document cannot change its outputs), run, and scattered back."""
        B, T, D = x.shape
        position = segment_positions(segment_ids).flatten()
        document = (position == 0).long().cumsum(0) - 1  # (B*T,) index of each token's document
        docs = x.new_zeros(int(document[-1]) + 1, int(position.max()) + 1, D)
        docs = docs.index_put((document, position), x.reshape(B * T, D))
        out, _ = self.lstm(docs)
        return out[document, position].reshape(B, T, D)

    def _run_left_padded(self, x: torch.Tensor, mask: torch.Tensor, state: LSTMState | None) -> torch.Tensor:
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

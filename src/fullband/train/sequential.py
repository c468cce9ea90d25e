"""The exact recurrence (docs/method.md §2) with gradients, one token step at a time: the training path of
``train.exact_mode: sequential``.

Position t is fused with the top state of position t-1 computed in the previous step, exactly as decoding does,
so T steps cost the FLOPs of one pass over T tokens (attention over the cached keys), where the Jacobi form
needs K = T passes over all T tokens for the same last pass. Backpropagation runs through all T steps.

All rows advance one position per step. Packed, isolated documents (``segment_ids``) restart inside a row:
a document's first token is plain and attends only to keys of its own document, and RoPE positions restart,
as in ``FullBandLM.forward`` with ``segment_ids``.

The blocks of the model are called as they are (``Block.forward``, with ``StepKeys`` in the place of the KV
cache), so attention, normalisation and the MLP are the model's own code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fullband.model import FullBandLM, segment_positions


class StepKeys:
    """The keys and values of every step so far, one tensor per step and layer, never written after they are
    read: autograd saves what attention reads, so the KV cache's in-place writes into one preallocated tensor
    would invalidate the saved tensors of earlier steps. ``update`` joins only the keys the layer's query may
    see (its sliding window), so a windowed layer copies at most ``window`` keys per step."""

    def __init__(self, model: FullBandLM):
        self.windows = [block.attn.window for block in model.layers]
        self.keys: list[list[torch.Tensor]] = [[] for _ in model.layers]
        self.values: list[list[torch.Tensor]] = [[] for _ in model.layers]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's (B, H_kv, 1, hd) key and value; return those the step's query attends to."""
        keys, values = self.keys[layer], self.values[layer]
        keys.append(k)
        values.append(v)
        first = first_visible(len(keys) - 1, self.windows[layer])
        if first == len(keys) - 1:
            return k, v
        return torch.cat(keys[first:], dim=2), torch.cat(values[first:], dim=2)


def first_visible(t: int, window: int | None) -> int:
    """The first key position a query at position t sees in a layer with this window (None: full attention)."""
    return 0 if window is None else max(0, t - window + 1)


def sequential_states(
    model: FullBandLM,
    input_ids: torch.Tensor,
    plain: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact recurrence over ``input_ids`` (B, T), teacher-forced, with gradients: position t is fused with
    h_{t-1} unless ``plain`` (B, T) bool marks it (position 0, which has no h_{t-1}, is always plain).
    ``segment_ids`` (B, T): packed documents that do not attend to each other, positions restarting at each run
    (the caller marks each run's first position plain, see ``fullband.model.plain_positions``).

    Returns (logits (B, T, V), hidden (B, T, D)): what the last of K >= T Jacobi passes computes
    (``FullBandLM.iterate_passes`` with jitter 0), and what ``fullband.generation.sequential_forward`` computes
    without gradients."""
    B, T = input_ids.shape
    config = model.config
    embedded = model.embed(input_ids)  # every position's embedding in one call; the steps slice it
    positions = segment_positions(segment_ids) if segment_ids is not None else (
        torch.arange(T, device=input_ids.device).expand(B, T))
    cos, sin = model.rotary(positions, embedded.dtype)
    # (B, T, T): query t may attend to key s of the same document; sliced per step and window below.
    same_document = None if segment_ids is None else segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    windows = {block.attn.window for block in model.layers}
    cache = StepKeys(model)
    normed_steps, hidden_steps = [], []
    state = None
    for t in range(T):
        x = embedded[:, t : t + 1]
        if state is not None:
            x = torch.where(plain[:, t : t + 1, None], x, model.fusion(x, state.to(x.dtype)))  # as in forward
        # None: the one query sees every key the cache returns (SDPA's unmasked path).
        masks = {w: None if same_document is None else same_document[:, None, t : t + 1, first_visible(t, w) : t + 1]
                 for w in windows}
        for block in model.layers:
            x = block(x, cos[:, :, t : t + 1], sin[:, :, t : t + 1], masks, cache)
        normed = model.norm(x)
        state = normed if config.feedback_source == "final_norm" else x
        normed_steps.append(normed)
        hidden_steps.append(state)
    normed = torch.cat(normed_steps, dim=1)
    weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
    # One output projection over all positions, not T small ones.
    return F.linear(normed, weight), torch.cat(hidden_steps, dim=1)

"""What the recurrent baselines share: their config (``BaselineConfig``, the model section of a run with
``model.arch: lstm`` or ``deltaproduct``) and ``RecurrentLM``, the FBT's storage and its prefill / iterate_passes
interface with one pass and no latent feedback."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from fullband.model import DEFAULT_FUSED_MAX_PASSES, DEFAULT_FUSED_TOL, FullBandConfig, FullBandLM, ModelOutput, RMSNorm

# The baselines and their configs' arch names (config.json and the run's config.yaml record it).
ARCHS = ("lstm", "deltaproduct")
# The command line's help (``fullband train --help``) for model.arch and the fields only the baselines have.
BASELINE_ARCH_HELP = ("'lstm' (torch's nn.LSTM, n_layers of width d_model) or 'deltaproduct' (n_layers DeltaProduct "
                      "blocks of n_heads heads and a d_ff MLP); they train with train.schedule standard and decode in "
                      "standard mode only")
BASELINE_FIELD_HELP = {
    "householder_steps": "model.arch deltaproduct: Householder transitions per token (n_h; 1 = DeltaNet); None = 2",
}
# Householder steps per token of a DeltaProduct layer when a config names none: DeltaProduct_2 (Siems et al. 2025).
DEFAULT_HOUSEHOLDER_STEPS = 2


@dataclass
class BaselineConfig:
    """An LSTM (embedding, torch's nn.LSTM of n_layers layers of width d_model, RMSNorm, the head) or a DeltaProduct
    linear RNN (n_layers blocks of a DeltaProduct mixer of n_heads heads of d_model // n_heads and a SwiGLU MLP of
    d_ff). The fields mean what the FBT's of the same names mean (``fullband.model.FullBandConfig``)."""

    arch: str = "lstm"
    vocab_size: int = 259
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4  # deltaproduct
    d_ff: int = 768  # deltaproduct
    max_seq_len: int = 512
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02
    # deltaproduct: the Householder transitions per token (n_h; 1 is DeltaNet). None: DEFAULT_HOUSEHOLDER_STEPS,
    # resolved here so that config.json records the number.
    householder_steps: int | None = None

    def __post_init__(self) -> None:
        if self.arch == "deltaproduct" and self.householder_steps is None:
            self.householder_steps = DEFAULT_HOUSEHOLDER_STEPS
        self.validate()

    def _fail(self, name: str, message: str) -> None:
        raise ValueError(f"model.{name}={getattr(self, name)!r}: {message}")

    def validate(self) -> None:
        if self.arch not in ARCHS:
            self._fail("arch", f"a baseline config is one of {', '.join(ARCHS)}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) \
                    or getattr(self, name) < 1:
                self._fail(name, "must be a positive integer")
        if self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError(f"model.arch {self.arch}: norm_eps and init_std must be > 0")
        if self.arch != "deltaproduct":
            if self.householder_steps is not None:
                self._fail("householder_steps", f"a DeltaProduct option; model.arch {self.arch} has no Householder "
                                                "transitions: leave it out")
            return
        steps = self.householder_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            self._fail("householder_steps", "must be a positive integer (1 = DeltaNet, 2 = DeltaProduct_2)")
        if self.d_model % self.n_heads:
            self._fail("d_model", f"must be divisible by n_heads={self.n_heads} (a DeltaProduct head is "
                                  "d_model // n_heads wide)")

    # The transformer config's storage: config.json with every field (the arch included).
    to_dict = FullBandConfig.to_dict
    save = FullBandConfig.save

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BaselineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"model.arch {data.get('arch')!r}: unknown field(s) {unknown}; known fields: "
                             f"{sorted(known)}")
        return cls(**data)


class RecurrentState:
    """A recurrent baseline's cache: tensors of (n_layers, B, ...), a state per layer and row. Unlike a KV cache it
    does not grow with the context."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (or reorder) batch rows by index: the decode engine drops finished rows."""
        for name, tensor in list(vars(self).items()):
            setattr(self, name, tensor.index_select(1, index))


class RecurrentLM(nn.Module):
    """Embedding -> a subclass's ``mix`` (its layers, carrying a state per row) -> RMSNorm -> the head (tied to the
    embedding or not). A subclass sets ``arch`` (its config's), ``kind`` (how messages name it), ``mix`` and
    ``state_class`` (its cache)."""

    has_feedback = False
    arch: str
    kind = "a recurrent model"
    state_class: type[RecurrentState]

    # The same storage as FullBandLM (config.json with the arch, safetensors, decode defaults), and its head.
    save_pretrained = FullBandLM.save_pretrained
    from_weights = classmethod(FullBandLM.from_weights.__func__)
    device = FullBandLM.device
    head = FullBandLM.head

    def __init__(self, config: BaselineConfig):
        super().__init__()
        if config.arch != self.arch:
            raise ValueError(f"model.arch {config.arch!r}: {type(self).__name__} is the arch {self.arch!r} model")
        self.config = config
        self.decode_settings = None  # as FullBandLM's: standard, the only mode it has
        self.embed = nn.Embedding(config.vocab_size, config.d_model)

    def add_head(self) -> None:
        """The final RMSNorm and the head, built after the subclass's layers (the order of the modules and of their
        random initialisation)."""
        self.norm = RMSNorm(self.config.d_model, self.config.norm_eps)
        self.lm_head = None if self.config.tie_embeddings else nn.Linear(self.config.d_model, self.config.vocab_size,
                                                                          bias=False)

    def mix(self, x: torch.Tensor, state: Any, write: torch.Tensor | None,
            segment_ids: torch.Tensor | None) -> torch.Tensor:
        """The layers over the embedded tokens ``x`` (B, T, d_model): ``state`` (or None: zero) is the one the rows
        continue from, updated to the final one; ``write`` (B, T) False on left padding, whose tokens leave the
        state unchanged (None: no padding); ``segment_ids`` (B, T), packed documents each run from a zero state."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        feedback: torch.Tensor | None = None,
        plain_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        segment_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """FullBandLM.forward's interface, so the decode loop and the trainer call every arch alike (``plain_mask``
        and ``position_ids`` carry nothing here). ``past_key_values``: the state the sequence continues from,
        replaced by the final one; left padding (``attention_mask``'s last T columns) leaves the state unchanged."""
        if feedback is not None:
            raise ValueError(self.no_feedback)
        if segment_ids is not None and (past_key_values is not None or use_cache):
            raise ValueError("segment_ids (packed, isolated documents) is for training and scoring; it cannot "
                             "be combined with a recurrent-state cache")
        B, T = input_ids.shape
        state = past_key_values
        if use_cache and state is None:
            state = self.new_cache(B, T)
        write = None
        if attention_mask is not None and not bool(attention_mask[:, -T:].all()):
            write = attention_mask[:, -T:].bool()
        normed = self.norm(self.mix(self.embed(input_ids), state, write, segment_ids))
        return ModelOutput(logits=self.head(normed, logits_to_keep), hidden=normed,
                           past_key_values=state if use_cache else None)

    @property
    def no_feedback(self) -> str:
        """The refusal of soft and fused decoding, Jacobi passes and fed-back states."""
        return f"{self.kind} has no latent feedback; use decode_mode standard"

    def new_cache(self, batch_size: int, max_len: int) -> RecurrentState:
        """Zero states for ``batch_size`` rows; their size does not depend on ``max_len``."""
        return self.state_class(self.config, batch_size, self.device, self.embed.weight.dtype)

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
        """FullBandLM.prefill's interface: one pass over the prompts (fused passes are refused)."""
        if fused_passes != 0:
            raise ValueError(self.no_feedback)
        out = self(input_ids, attention_mask=attention_mask, past_key_values=past_key_values, use_cache=use_cache,
                   logits_to_keep=logits_to_keep)
        out.fused_passes = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        return out

    def iterate_passes(self, input_ids: torch.Tensor, passes: int, segment_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, **recurrence: Any) -> Iterator[ModelOutput]:
        """FullBandLM.iterate_passes' interface with its one pass (``recurrence``'s options shape later passes only)."""
        if passes != 1:
            raise ValueError(f"{passes} passes asked of {self.kind}: it has no latent feedback to run Jacobi "
                             "passes over; use train.schedule standard")
        yield self(input_ids, segment_ids=segment_ids, attention_mask=attention_mask)

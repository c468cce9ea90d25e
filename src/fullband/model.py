"""The full-bandwidth transformer: a decoder-only transformer whose input at position t can be the token embedding
fused with the previous position's top state (docs/method.md §2-3). It imports nothing from the package but
``kv_cache.py`` on purpose: the Hugging Face export ships both as its remote code."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# Relative, unlike the rest of the package: the Hugging Face export ships these files next to this one.
from .compiled_steps import CompiledSteps
from .kv_cache import KVCache

FUSIONS = ("gate", "concat", "add")
# How the fusion's weights start: "random" (normal, like every other weight; the paper) or "identity" (add only:
# W = 0, so e ⊗ h = e and every decode mode computes exactly the standard model until training moves W).
FUSION_INITS = ("random", "identity")
# The state fed back is the top hidden state after the final RMSNorm, the one the head reads.
FEEDBACK_SOURCES = ("final_norm",)
ROPE_TYPES = ("default", "linear", "llama3")
CONFIG_NAME = "config.json"
# Adaptive fused prefill (prefill(fused_passes="auto")): stop when no real prompt position's top state
# moves by more than 0.1% in a pass; at most 8 fused passes (the paper's models train with up to 2).
DEFAULT_FUSED_TOL = 1e-3
DEFAULT_FUSED_MAX_PASSES = 8
WEIGHTS_NAME = "model.safetensors"


@dataclass
class FullBandConfig:
    vocab_size: int = 259
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int = 768
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3", ...} as in HF configs
    norm_eps: float = 1e-6
    qk_norm: bool = False
    qkv_bias: bool = False
    attn_output_gate: bool = False  # a sigmoid gate per head on the attention output
    sliding_window: int | None = None  # keys visible to a query: the last `sliding_window` positions
    full_attention_every: int = 0  # with a window: layers i with (i+1) % n == 0 stay full; 0 = none
    tie_embeddings: bool = True
    fusion: str = "gate"
    feedback_source: str = "final_norm"
    feedback_jitter: float = 0.02
    init_std: float = 0.02
    gate_init_std: float | None = None  # W_G's init std (gate fusions); None = init_std
    fusion_init: str = "random"

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self.validate()

    def _fail(self, name: str, message: str) -> None:
        raise ValueError(f"FullBandConfig.{name}={getattr(self, name)!r}: {message}")

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                self._fail(name, "must be a positive integer")
        if self.head_dim is None and self.d_model % self.n_heads:
            self._fail("d_model", f"must be divisible by n_heads={self.n_heads} (or set head_dim)")
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            self._fail("head_dim", "must be a positive even integer (RoPE rotates pairs)")
        if self.n_heads % self.n_kv_heads:
            self._fail("n_heads", f"must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.resolved_head_dim % 2:
            self._fail("d_model", "d_model // n_heads must be even (RoPE rotates pairs)")
        if self.fusion not in FUSIONS:
            self._fail("fusion", f"allowed values: {', '.join(FUSIONS)}")
        if self.fusion_init not in FUSION_INITS:
            self._fail("fusion_init", f"allowed values: {', '.join(FUSION_INITS)}")
        if self.fusion_init == "identity" and self.fusion != "add":
            # gate and concat end in an RMSNorm of a projection: zero weights give 0, not e. Only add's
            # e + W h becomes the identity at W = 0.
            self._fail("fusion_init", f"'identity' needs fusion='add' (e + W h with W = 0), got fusion={self.fusion!r}")
        if self.feedback_source not in FEEDBACK_SOURCES:
            self._fail("feedback_source", f"allowed values: {', '.join(FEEDBACK_SOURCES)}")
        if self.feedback_jitter < 0:
            self._fail("feedback_jitter", "must be >= 0")
        if self.gate_init_std is not None and self.gate_init_std <= 0:
            self._fail("gate_init_std", "must be None (init_std) or > 0")
        if self.norm_eps <= 0 or self.rope_theta <= 0 or self.init_std <= 0:
            raise ValueError("FullBandConfig: norm_eps, rope_theta and init_std must be > 0")
        if self.sliding_window is not None and self.sliding_window < 1:
            self._fail("sliding_window", "must be None (full attention) or a positive integer")
        if self.full_attention_every < 0:
            self._fail("full_attention_every", "must be >= 0 (0: every layer uses the window)")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                self._fail("rope_scaling", f"rope_type must be one of {', '.join(ROPE_TYPES)}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def layer_is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return not (self.full_attention_every > 0 and (layer + 1) % self.full_attention_every == 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FullBandConfig:
        data = dict(data)
        arch = data.pop("arch", "fbt")  # config.json names the model kind for the others (fullband.architectures)
        if arch != "fbt":
            raise ValueError(f"FullBandConfig: this is the config of a model.arch {arch!r} model, not the transformer "
                             "(fbt); load it with fullband.storage.load_pretrained")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"FullBandConfig: unknown field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in (at least) float32 for bf16 stability, as Llama-family checkpoints expect.
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: FullBandConfig) -> torch.Tensor:
    dim = config.resolved_head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, scaled, inv_freq)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: FullBandConfig, layer: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.resolved_head_dim
        self.window = config.sliding_window if config.layer_is_sliding(layer) else None
        d, hd = config.d_model, self.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.norm_eps) if config.qk_norm else None
        self.gate_proj = nn.Linear(d, self.n_heads, bias=False) if config.attn_output_gate else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: dict[int | None, torch.Tensor | None],
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(layer, k, v)
        mask = masks[self.window]
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, enable_gqa=self.n_heads != self.n_kv_heads
        )
        y = y.transpose(1, 2)  # (B, T, H, hd)
        if self.gate_proj is not None:
            y = y * torch.sigmoid(self.gate_proj(x)).unsqueeze(-1)
        return self.o_proj(y.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: FullBandConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: FullBandConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: dict[int | None, torch.Tensor | None],
        cache: KVCache | None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, masks, cache, self.layer)
        return x + self.mlp(self.mlp_norm(x))


# --------------------------------------------------------------------------------------------------
# The latent feedback: fusing the previous top state h with the token embedding e (docs/method.md §3)


def init_std_of(module: nn.Module, config: FullBandConfig) -> float:
    """The std a linear or embedding weight is initialised with: config.init_std, or the module's own
    (W_G with config.gate_init_std). The draws are the same whatever the std, so the rest of the init
    does not change with it."""
    own = getattr(module, "init_std", None)
    return config.init_std if own is None else own


class Fusion(nn.Module):
    """e ⊗ h. ``gate`` (paper Eq. 4): RMSNorm((W_U h) ⊙ sigmoid(W_G RMSNorm(e))); the state is the value
    and the token only gates it, so the model cannot ignore the state.
    Ablations: ``concat`` RMSNorm(W [e; h]) and ``add`` e + W h. ``add`` with ``fusion_init="identity"``
    starts at W = 0, i.e. as the identity e ⊗ h = e (beyond the paper: for mid-training a pretrained model)."""

    def __init__(self, config: FullBandConfig):
        super().__init__()
        self.kind = config.fusion
        d, eps = config.d_model, config.norm_eps
        if self.kind == "gate":
            self.value_proj = nn.Linear(d, d, bias=False)  # W_U
            self.gate_proj = nn.Linear(d, d, bias=False)  # W_G
            self.gate_proj.init_std = config.gate_init_std  # read by init_std_of
            self.embed_norm = RMSNorm(d, eps)
            self.out_norm = RMSNorm(d, eps)
        elif self.kind == "concat":
            self.proj = nn.Linear(2 * d, d, bias=False)
            self.out_norm = RMSNorm(d, eps)
        else:
            self.proj = nn.Linear(d, d, bias=False)
            if config.fusion_init == "identity":
                self.proj.init_std = 0.0  # read by init_std_of: W = 0, e ⊗ h = e

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "gate":
            return self.out_norm(self.value_proj(h) * torch.sigmoid(self.gate_proj(self.embed_norm(e))))
        if self.kind == "concat":
            return self.out_norm(self.proj(torch.cat([e, h], dim=-1)))
        return e + self.proj(h)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, T, V)
    hidden: torch.Tensor  # (B, T, D): the top states after the final norm, the ones fed back
    past_key_values: KVCache | None = None
    fused_passes: torch.Tensor | None = None  # prefill only: (B,) fused passes each row ran (fixed n or adaptive)
    # prefill with fused_passes="auto" only: (B,) whether the row's states met fused_tol (False: it was cut
    # off at fused_max_passes while still changing)
    converged: torch.Tensor | None = None


# FSDP2 unshards a module's parameters again before their backward through hooks on the tensors of its output,
# which torch 2.11 finds with pytree: a dataclass it does not know is a leaf there, so the model's parameters stay
# freed and a multi-pass step under fully_shard fails in its backward. torch 2.13 walks dataclasses itself.
torch.export.register_dataclass(ModelOutput)


@dataclass
class MultipassOutput:
    logits: list[torch.Tensor]  # one (B, T, V) tensor per pass
    hidden: list[torch.Tensor]  # one (B, T, D) tensor per pass


class StepKeys:
    """The keys and values of ``FullBandLM.recurrence``'s steps when it backpropagates: one tensor per step and layer,
    never written after it is read, since autograd saves what attention reads (a KV cache writes in place)."""

    def __init__(self, model: FullBandLM):
        self.windows = [block.attn.window for block in model.layers]
        self.keys: list[list[torch.Tensor]] = [[] for _ in model.layers]
        self.values: list[list[torch.Tensor]] = [[] for _ in model.layers]
        self.length = 0  # steps every layer has written (advanced after the last layer)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's (B, H_kv, 1, hd) key and value; return those inside the step's window."""
        keys, values = self.keys[layer], self.values[layer]
        keys.append(k)
        values.append(v)
        first = first_visible(self.length, self.windows[layer])
        if first == self.length:
            return k, v
        return torch.cat(keys[first:], dim=2), torch.cat(values[first:], dim=2)

    def advance(self, n: int) -> None:
        self.length += n


def first_visible(query: int, window: int | None) -> int:
    """The first key position a query at position ``query`` sees in a layer with this window (None: all keys)."""
    return 0 if window is None else max(0, query - window + 1)


def is_compile_failure(error: Exception) -> bool:
    """Whether ``torch.compile`` failed to build a function (no C++ compiler, a backend error), not the function."""
    from torch._dynamo.exc import BackendCompilerFailed  # torch.compile's own module, loaded when it runs

    return isinstance(error, BackendCompilerFailed) or type(error).__name__ in ("InductorError", "CppCompileError")


def windowed_token_steps(
    model: FullBandLM,
    embedded: torch.Tensor,
    plain: torch.Tensor,
    state: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    segments: torch.Tensor,
    pasts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    weights: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """The recurrence's steps over a chunk of C positions of a model whose layers all have a sliding window, written
    as one function of tensors for ``torch.compile`` (``FullBandLM.compile_recurrence``): a second form of the
    blocks' step, for speed only. Its keys carry their documents instead of positions, so every chunk has the same
    shapes and the steps compile once. ``state``: the top state fed to the chunk's first position (B, 1, D);
    ``pasts``: per layer, the keys, values and documents of the window - 1 positions before the chunk (a document
    of -1 for none); ``weights``: per layer, the joined q/k/v and gate/up projections. Returns the top states
    (B, C, D) and the pasts after the chunk."""
    B, C, _ = embedded.shape
    tops = []
    for c in range(C):
        x = embedded[:, c : c + 1]
        x = torch.where(plain[:, c : c + 1, None], x, model.fusion(x, state.to(x.dtype)))
        segment = segments[:, c : c + 1]
        after = []
        for block, (past_k, past_v, past_segments), (qkv, gate_up) in zip(model.layers, pasts, weights):
            attn = block.attn
            q, k, v = (block.attn_norm(x) @ qkv).view(B, 1, 3 * attn.n_heads, attn.head_dim).transpose(1, 2).chunk(
                3, dim=1)
            q = q * cos[:, :, c : c + 1] + rotate_half(q) * sin[:, :, c : c + 1]
            k = torch.cat([past_k, k * cos[:, :, c : c + 1] + rotate_half(k) * sin[:, :, c : c + 1]], dim=2)
            v = torch.cat([past_v, v], dim=2)
            key_segments = torch.cat([past_segments, segment], dim=1)
            # One query, at most `window` keys: fused products and sums, not two batched matmuls (library calls).
            scores = ((q * attn.head_dim**-0.5) * k).sum(-1)
            scores = scores.masked_fill((key_segments != segment)[:, None, :], float("-inf"))
            y = (torch.softmax(scores, dim=-1).unsqueeze(-1) * v).sum(2).reshape(B, 1, attn.n_heads * attn.head_dim)
            x = x + attn.o_proj(y)
            gate, up = (block.mlp_norm(x) @ gate_up).chunk(2, dim=-1)
            x = x + block.mlp.down_proj(F.silu(gate) * up)
            after.append((k[:, :, 1:], v[:, :, 1:], key_segments[:, 1:]))  # the window - 1 the next position sees
        pasts = after
        state = model.norm(x)
        tops.append(state)
    return torch.cat(tops, dim=1), pasts


# --------------------------------------------------------------------------------------------------


class FullBandLM(nn.Module):
    has_feedback = True  # its top state can be fused into the next input (soft and fused decoding)

    def __init__(self, config: FullBandConfig):
        super().__init__()
        if not isinstance(config, FullBandConfig):
            raise TypeError(f"FullBandLM takes a FullBandConfig, got {type(config).__name__}; build other model kinds "
                            "with fullband.architectures.build_model")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.fusion = Fusion(config)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config).float(), persistent=False)
        # How this model decodes when a caller does not say (a fullband.decoding.DecodeSettings, stored with the
        # weights). None: a fresh model, whose fusion is untrained, decodes in standard mode.
        self.decode_settings = None
        self._windows = {layer.attn.window for layer in self.layers}  # one SDPA mask per distinct window
        # Training settings of this process, not of the model (not saved): set_activation_checkpointing's block
        # interval (0 = off) and compile_recurrence's compiled chunk function and length (None: uncompiled).
        self.checkpoint_every = 0
        self.compiled_steps = None
        self.compiled_chunk = 0
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        # RoPE frequencies are computed, not stored: float32 on the weights' device whatever dtype the weights are
        # cast to (in bf16, position 1001 would round to 1000), and real again after a model built on the meta
        # device took its weights (from_weights), which leaves this buffer without data for fn to move.
        self.inv_freq = rope_inv_freq(self.config).float()
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config).float().to(self.embed.weight.device)
        return self

    def reset_parameters(self) -> None:
        self._init_modules(self.modules())

    def reset_fusion_parameters(self) -> None:
        """Fresh fusion weights, for adding feedback to a standard checkpoint (mid-training)."""
        self._init_modules(self.fusion.modules())

    def _init_modules(self, modules: Iterable[nn.Module]) -> None:
        for module in modules:
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=init_std_of(module, self.config))
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def set_activation_checkpointing(self, every: int) -> None:
        """Recompute blocks in the backward instead of keeping their activations: ``every`` = N checkpoints every
        N-th block (torchtitan's layer-selective AC), 0 turns it off. Only training forwards (grad enabled, no KV
        cache) checkpoint."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"activation checkpointing: every must be 0 (off) or a positive block interval, "
                             f"got {every!r}")
        if every > len(self.layers):  # would checkpoint no block at all
            raise ValueError(f"activation checkpointing every {every} blocks: the model has only {len(self.layers)}")
        self.checkpoint_every = every

    def compile_recurrence(self, chunk: int = 8, backend: str = "inductor") -> None:
        """Run the recurrence's token steps with gradients (sequential training) ``chunk`` positions per call of a
        ``torch.compile``d ``windowed_token_steps``: at small widths the steps are bound by kernel calls, not FLOPs.
        Needs every layer windowed and plain attention; calls with a KV cache, without gradients or with padding run
        uncompiled, and so do all of them, after a warning, where the compiler fails. ``chunk`` = 0 turns it off."""
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"compile_recurrence: chunk must be 0 (off) or a positive number of positions, got "
                             f"{chunk!r}")
        if chunk == 0:
            self.compiled_steps, self.compiled_chunk = None, 0
            return
        config = self.config
        unsupported = [name for name, bad in (
            ("a layer without a sliding window", any(block.attn.window is None for block in self.layers)),
            ("qk_norm", config.qk_norm), ("attn_output_gate", config.attn_output_gate),
            ("grouped-query heads (n_kv_heads < n_heads)", config.n_kv_heads != config.n_heads),
            ("qkv_bias", config.qkv_bias)) if bad]
        if unsupported:
            raise ValueError(f"compile_recurrence: the compiled steps do not support {', '.join(unsupported)}; "
                             "train this model with the uncompiled steps (chunk 0)")
        self.compiled_steps = CompiledSteps(windowed_token_steps, backend, self.device)
        self.compiled_chunk = chunk

    def _chunked_recurrence(self, embedded, plain, state, cos, sin, segments) -> torch.Tensor:
        """The top states (B, T, D) of ``recurrence``'s steps, ``compiled_chunk`` positions per compiled call."""
        B, T, D = embedded.shape
        layers = [block.attn for block in self.layers]
        # Joined once per call, so each step multiplies once for q, k, v and once for gate, up.
        weights = [(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).t(),
                    torch.cat([block.mlp.gate_proj.weight, block.mlp.up_proj.weight]).t())
                   for a, block in zip(layers, self.layers)]
        # The first chunk in the shapes of the others, so one graph serves all (one trace and compile, not two): a
        # zero state its first position does not take, and window - 1 keys of no document, which no query sees. A
        # compiled graph is specialised on strides and requires_grad too: these are slices, as a later chunk's state
        # and keys are (of the chunk's tops and of its keys with the new one), and require gradients as they do.
        if state is None:
            state = embedded.new_zeros(B, self.compiled_chunk, D).requires_grad_()[:, -1:]
            plain = plain.clone()
            plain[:, 0] = True
        pasts = [(embedded.new_zeros(B, a.n_heads, a.window, a.head_dim).requires_grad_()[:, :, 1:],
                  embedded.new_zeros(B, a.n_heads, a.window, a.head_dim).requires_grad_()[:, :, 1:],
                  segments.new_full((B, a.window), -1)[:, 1:]) for a in layers]
        tops = []
        for start in range(0, T, self.compiled_chunk):
            chunk = slice(start, start + self.compiled_chunk)
            args = (self, embedded[:, chunk], plain[:, chunk], state, cos[:, :, chunk], sin[:, :, chunk],
                    segments[:, chunk], pasts, weights)
            try:
                top, pasts = self.compiled_steps(*args)
            except Exception as error:  # the compiler itself is missing or failed; the steps are still right eager
                if self.compiled_steps is windowed_token_steps or not is_compile_failure(error):
                    raise
                warnings.warn(f"compile_recurrence: torch.compile failed ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); the recurrence runs its token "
                              "steps uncompiled (on a CPU, install a C++ compiler such as g++ for the compiled steps)",
                              stacklevel=3)
                self.compiled_steps = windowed_token_steps
                top, pasts = windowed_token_steps(*args)
            state = top[:, -1:]
            tops.append(top)
        return torch.cat(tops, dim=1)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty cache for decoding ``batch_size`` rows of up to ``max_len`` positions."""
        return KVCache(self.config, batch_size, max_len, self.device, self.embed.weight.dtype)

    def num_parameters(self, include_fusion: bool = True) -> int:
        fusion = 0 if include_fusion else sum(p.numel() for p in self.fusion.parameters())
        return sum(p.numel() for p in self.parameters()) - fusion

    # ---- the forward pass -----------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        feedback: torch.Tensor | None = None,
        plain_mask: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        segment_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """One pass of the stack. feedback: (B, T, D), row t fused into position t (None: all plain) but where
        plain_mask is True. attention_mask: (B, T) or (B, cache length + T), 0 = padding. position_ids: RoPE
        positions (default: the cache length + arange(T)). logits_to_keep: logits of the last n positions only
        (0 = all). segment_ids: (B, T), packed documents as runs of equal ids that do not attend to each other,
        positions restarting at 0 in each run, so a packed document computes what it would alone."""
        B, T = input_ids.shape
        cache = past_key_values
        if segment_ids is not None and (past_key_values is not None or use_cache):
            raise ValueError("segment_ids (packed, isolated documents) is for training and scoring; it cannot "
                             "be combined with a KV cache")
        if use_cache and cache is None:
            cache = self.new_cache(B, self.config.max_seq_len)
        start = cache.length if cache is not None else 0

        x = self.embed(input_ids)
        if feedback is not None:
            x = self._fuse(x, feedback, plain_mask)
        cos, sin = self.rotary(position_ids, x.dtype, segment_ids, start, B, T)

        masks = self._attention_masks(B, T, start, self._key_mask(attention_mask, cache, start, T), segment_ids)
        # A block under a KV cache writes the cache, so recomputing it would write twice: training only.
        every = self.checkpoint_every if cache is None and torch.is_grad_enabled() else 0
        for i, block in enumerate(self.layers):
            if every and (i + 1) % every == 0:
                # Non-reentrant: works with inputs that need no grad, FSDP2's hooks, autocast and torch.compile.
                # Blocks draw no random numbers (the jitter is drawn between passes), so the recomputation is exact.
                x = checkpoint(block, x, cos, sin, masks, None, use_reentrant=False)
            else:
                x = block(x, cos, sin, masks, cache)
        if cache is not None:
            cache.advance(T)

        hidden = self.norm(x)
        return ModelOutput(logits=self.head(hidden, logits_to_keep), hidden=hidden,
                           past_key_values=cache if use_cache else None)

    def head(self, hidden: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """The logits of (B, T, D) top states, of the last ``logits_to_keep`` positions only (0: all)."""
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden[:, -logits_to_keep:] if logits_to_keep else hidden, weight)

    def _fuse(self, x: torch.Tensor, feedback: torch.Tensor, plain_mask: torch.Tensor | None) -> torch.Tensor:
        """Embeddings ``x`` fused with ``feedback``, the states before them, but where ``plain_mask`` is True."""
        fused = self.fusion(x, feedback.to(x.dtype))
        return fused if plain_mask is None else torch.where(plain_mask.unsqueeze(-1), x, fused)

    def rotary(
        self, position_ids: torch.Tensor | None, dtype: torch.dtype, segment_ids: torch.Tensor | None, start: int,
        B: int, T: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (cos, sin), each (B, 1, T, head_dim), for (B, T) positions, angles in float32. Default positions:
        each document's own from 0 (``segment_ids``), else ``start`` + arange(T) for every row."""
        if position_ids is None and segment_ids is not None:
            position_ids = segment_positions(segment_ids)
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=self.device).expand(B, T)
        angles = position_ids.unsqueeze(-1).float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def prefill(
        self,
        input_ids: torch.Tensor,
        fused_passes: int | str = 0,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        fused_tol: float = DEFAULT_FUSED_TOL,
        fused_max_passes: int = DEFAULT_FUSED_MAX_PASSES,
    ) -> ModelOutput:
        """The prompt pass of decoding (docs/method.md §6): one plain pass, then ``fused_passes`` fused passes, each
        fusing the previous pass's states shifted by one position; padding and each row's first real token stay
        plain. ``"auto"``: each row until its largest relative state change is at most ``fused_tol`` or
        ``fused_max_passes`` ran, its result exactly fused(k*) for its own k* (``out.fused_passes``; ``out.converged``
        whether it met the tolerance). ``"exact"``: the fixed point those passes reach, computed token by token."""
        if fused_passes == "exact":
            return self._exact_prefill(input_ids, attention_mask, position_ids, past_key_values, use_cache,
                                       logits_to_keep)
        adaptive = fused_passes == "auto"  # the values are checked where they enter (DecodeSettings)
        B, T = input_ids.shape
        if position_ids is None and attention_mask is not None:
            position_ids = mask_positions(attention_mask)
        kwargs = dict(attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                      use_cache=use_cache, logits_to_keep=logits_to_keep)
        start = past_key_values.length if past_key_values is not None else 0
        out = self(input_ids, **kwargs)
        most_passes = fused_max_passes if adaptive else fused_passes
        if most_passes == 0:
            out.fused_passes = torch.zeros(B, dtype=torch.long, device=input_ids.device)
            return out
        real = None if attention_mask is None else attention_mask.to(torch.bool)
        plain = prompt_plain(input_ids, real, position_ids)
        passes_run = torch.zeros(B, dtype=torch.long, device=input_ids.device)  # each row's fused passes
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        feedback = shift_right(out.hidden)
        for _ in range(most_passes):
            if past_key_values is not None:
                past_key_values.truncate(start)  # the next pass overwrites this pass's keys and values
            new = self(input_ids, feedback=feedback, plain_mask=plain, **kwargs)
            passes_run += ~done
            if adaptive:
                done |= max_relative_change(new.hidden, out.hidden, real) <= fused_tol
                # A finished row keeps the feedback that produced its result: rerunning it reproduces
                # fused(k*) exactly (hidden states, logits and cache rows) while other rows go on.
                feedback = torch.where(done[:, None, None], feedback, shift_right(new.hidden))
            else:
                feedback = shift_right(new.hidden)
            out = new
            if adaptive and bool(done.all()):  # one device sync per pass, only in adaptive mode
                break
        out.fused_passes = passes_run
        if adaptive:
            out.converged = done
        return out

    def _exact_prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        past_key_values: KVCache | None,
        use_cache: bool,
        logits_to_keep: int,
    ) -> ModelOutput:
        """The prompt through the exact recurrence, as soft decoding feeds generated tokens; ``out.fused_passes``:
        the Jacobi passes it stands for (each row's real tokens - 1)."""
        B, T = input_ids.shape
        cache = past_key_values
        if cache is None:
            cache = self.new_cache(B, self.config.max_seq_len if use_cache else T)
        real = None
        if attention_mask is not None:
            real = attention_mask.to(device=input_ids.device, dtype=torch.bool)
            real = real[:, cache.length :] if real.shape[1] == cache.length + T else real
            if position_ids is None:
                position_ids = mask_positions(real)
        out = self.recurrence(input_ids, prompt_plain(input_ids, real, position_ids), cache, attention_mask=real,
                              position_ids=position_ids, logits_to_keep=logits_to_keep)
        out.past_key_values = cache if use_cache else None
        tokens = torch.full((B,), T, device=input_ids.device) if real is None else real.sum(dim=1)
        out.fused_passes = (tokens - 1).clamp(min=0)
        return out

    def recurrence(
        self,
        input_ids: torch.Tensor,
        plain_mask: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> ModelOutput:
        """The exact recurrence (docs/method.md §2) over ``input_ids`` (B, T), teacher-forced, one token step at a
        time: position t is fused with the top state of position t - 1 unless ``plain_mask`` marks it, the first
        with ``state`` (B, 1, D; None: plain). The limit that K >= T Jacobi passes converge to, at the FLOPs of one
        pass. The steps attend to and write into ``past_key_values``; without one, a temporary cache, or with
        gradients a ``StepKeys``. The other arguments are ``forward``'s (segment_ids: not after a filled cache)."""
        B, T = input_ids.shape
        keys = past_key_values
        if keys is None:
            keys = StepKeys(self) if torch.is_grad_enabled() else self.new_cache(B, T)
        start = keys.length
        if segment_ids is not None and start:
            raise ValueError("segment_ids (packed, isolated documents) start at position 0: the recurrence cannot "
                             f"run them after the {start} positions the cache already holds")
        real_keys = self._key_mask(attention_mask, keys, start, T)
        embedded = self.embed(input_ids)  # every position's embedding in one call; the steps slice it
        cos, sin = self.rotary(position_ids, embedded.dtype, segment_ids, start, B, T)
        if self.compiled_steps is not None and isinstance(keys, StepKeys) and real_keys is None:
            plain = torch.zeros_like(input_ids, dtype=torch.bool) if plain_mask is None else plain_mask
            segments = torch.zeros_like(input_ids) if segment_ids is None else segment_ids
            hidden = self._chunked_recurrence(embedded, plain, state, cos, sin, segments)
            return ModelOutput(logits=self.head(hidden, logits_to_keep), hidden=hidden)
        tops = []
        for t in range(T):
            x = embedded[:, t : t + 1]
            if state is not None:
                x = self._fuse(x, state, None if plain_mask is None else plain_mask[:, t : t + 1])
            # The step's one query at column start + t; a StepKeys returns only the keys inside each window.
            masks = self._attention_masks(B, 1, start + t, real_keys, segment_ids, isinstance(keys, StepKeys))
            for block in self.layers:
                x = block(x, cos[:, :, t : t + 1], sin[:, :, t : t + 1], masks, keys)
            keys.advance(1)
            state = self.norm(x)
            tops.append(state)
        hidden = torch.cat(tops, dim=1)
        return ModelOutput(logits=self.head(hidden, logits_to_keep), hidden=hidden)

    def _key_mask(
        self, attention_mask: torch.Tensor | None, keys: KVCache | StepKeys | None, start: int, T: int
    ) -> torch.Tensor | None:
        """(B, start + T) bool, which keys are real tokens (False: padding), or None when all are. A KV cache records
        ``attention_mask`` for later steps, so decode steps do not inspect it again (a device sync)."""
        if attention_mask is not None:
            attention_mask = attention_mask.to(device=self.device, dtype=torch.bool)
            if isinstance(keys, KVCache) and attention_mask.shape[1] == start + T:
                attention_mask = attention_mask[:, start:]
        if isinstance(keys, KVCache):
            if attention_mask is not None:
                keys.mask_keys(attention_mask)
            return keys.key_mask_through(start + T)
        return None if attention_mask is None or bool(attention_mask.all()) else attention_mask

    def _attention_masks(
        self, B: int, T: int, start: int, key_mask: torch.Tensor | None, segment_ids: torch.Tensor | None = None,
        windowed_keys: bool = False,
    ) -> dict[int | None, torch.Tensor | None]:
        """Boolean SDPA masks (True = may attend) of queries at columns start .. start + T - 1, by window size (None =
        full): a query sees the keys at or before it, inside its window, of its own document and real; always
        itself, so a padding row never has every key masked (NaN in SDPA). ``windowed_keys``: the keys are only
        those inside each window (a ``StepKeys``). None where plain causal attention suffices (SDPA's fused path)."""
        device, end = self.device, start + T
        masks: dict[int | None, torch.Tensor | None] = {}
        for window in self._windows:
            first = first_visible(start, window) if windowed_keys else 0  # the first key column attention reads
            need_window = window is not None and end - first > window
            if key_mask is None and segment_ids is None and not need_window and (start == first or T == 1):
                masks[window] = None  # causal (T > 1, no cache offset) or a single query seeing all keys
                continue
            q_pos = torch.arange(start, end, device=device).unsqueeze(1)
            k_pos = torch.arange(first, end, device=device).unsqueeze(0)
            allowed = k_pos <= q_pos
            if need_window:
                allowed = allowed & (k_pos > q_pos - window)
            allowed = allowed.expand(B, T, end - first)
            if segment_ids is not None:
                segments = segment_ids.to(device)
                allowed = allowed & (segments[:, start:end, None] == segments[:, None, first:end])
            if key_mask is not None:
                allowed = (allowed & key_mask[:, None, first:end]) | (k_pos == q_pos)
            masks[window] = allowed.unsqueeze(1)
        return masks

    # ---- multi-pass (Jacobi) computation (docs/method.md §4; the loss is fullband.train.objective) ------

    def iterate_passes(
        self,
        input_ids: torch.Tensor,
        passes: int,
        plain_mask: torch.Tensor | None = None,
        bos_token_id: int | None = None,
        jitter: float | None = None,
        prefix_mixin: float = 0.0,
        detach: bool = False,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        grad_passes: int | None = None,
    ) -> Iterator[ModelOutput]:
        """K passes over the whole sequence, all positions in parallel, yielded one at a time (docs/method.md §4).

        Pass 1 is plain; pass k >= 2 fuses position t with pass k-1's top state at t-1 plus jitter U[-σ, σ] (σ =
        ``jitter``, default config.feedback_jitter in training mode, 0 in eval mode). The positions of
        ``plain_positions`` stay plain. ``generator`` may be one per row, so a row's draws do not depend on where it
        lands. ``detach``: the fed-back states carry no gradient. ``grad_passes`` = g: only the last g passes build
        a graph, so K can reach the sequence length at the memory of g passes. Pass k + 1 runs only when asked for,
        so a consumer may backpropagate pass k's loss first; the arguments are checked at the call."""
        if passes < 1:
            raise ValueError(f"passes must be >= 1, got {passes}")
        if grad_passes is not None and grad_passes < 1:
            raise ValueError(f"grad_passes must be None (all passes) or >= 1, got {grad_passes}")
        if jitter is None:
            jitter = self.config.feedback_jitter if self.training else 0.0
        plain = plain_positions(input_ids, plain_mask, bos_token_id, segment_ids,
                                prefix_mixin if passes > 1 else 0.0, generator)
        forward = dict(attention_mask=attention_mask, position_ids=position_ids, segment_ids=segment_ids)

        def run() -> Iterator[ModelOutput]:  # a generator of its own, so that the checks above run at the call
            feedback = None
            for k in range(passes):
                with_grad = torch.is_grad_enabled() and (grad_passes is None or k >= passes - grad_passes)
                with torch.set_grad_enabled(with_grad):
                    step = self(input_ids, feedback=feedback, plain_mask=plain if k > 0 else None, **forward)
                yield step
                if k + 1 < passes:
                    feedback = shift_right(step.hidden.detach() if detach else step.hidden)
                    if jitter > 0:
                        noise = uniform(feedback.shape, generator, input_ids.device, feedback.dtype)
                        feedback = feedback + (2 * noise - 1) * jitter

        return run()

    def multipass(self, input_ids: torch.Tensor, passes: int, **recurrence: Any) -> MultipassOutput:
        """Every pass's logits and top states of ``iterate_passes`` (the same keyword arguments), held together."""
        out = MultipassOutput(logits=[], hidden=[])
        for step in self.iterate_passes(input_ids, passes, **recurrence):
            out.logits.append(step.logits)
            out.hidden.append(step.hidden)
        return out

    # ---- storage: config JSON + safetensors, never pickle -------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """config.json, model.safetensors and the decode settings (fullband.storage.ModelDir opens them)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_weights(self.state_dict(), directory)
        self.config.save(directory / CONFIG_NAME)
        if self.decode_settings is not None:
            self.decode_settings.save(directory)

    @classmethod
    def from_weights(
        cls, config: FullBandConfig, state: dict[str, torch.Tensor], device: str | torch.device | None = None,
        dtype: torch.dtype | None = None, source: str = "the weights",
    ) -> FullBandLM:
        """A model of ``config`` holding the tensors of ``state`` in ``dtype`` (default: torch's default dtype) on
        ``device``, built on the meta device so that no parameter is first initialised at random."""
        with torch.device("meta"):
            model = cls(config)
        dtype = dtype or torch.get_default_dtype()
        state = {key: value.to(dtype) if value.is_floating_point() else value for key, value in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected or missing:
            raise ValueError(f"{source} does not match its config: missing {missing}, unexpected {unexpected}")
        return model.to(device=device or "cpu")


def uniform(
    shape: Sequence[int],
    generator: torch.Generator | Sequence[torch.Generator] | None,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """U[0, 1) samples; with a list of per-row generators, row i is drawn from generator i."""
    if isinstance(generator, (list, tuple)):
        return torch.stack([torch.rand(shape[1:], generator=g, device=device, dtype=dtype) for g in generator])
    return torch.rand(shape, generator=generator, device=device, dtype=dtype)


def plain_positions(
    input_ids: torch.Tensor,
    plain_mask: torch.Tensor | None = None,
    bos_token_id: int | None = None,
    segment_ids: torch.Tensor | None = None,
    prefix_mixin: float = 0.0,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """(B, T) bool: the positions that take no feedback: position 0, ``plain_mask``, ``bos_token_id`` tokens, each
    ``segment_ids`` run's first, and with ``prefix_mixin`` = f > 0 a prefix t <= p, p ~ U{0, .., ceil(f·T) - 1}."""
    B, T = input_ids.shape
    device = input_ids.device
    plain = torch.zeros(B, T, dtype=torch.bool, device=device)
    plain[:, 0] = True
    if plain_mask is not None:
        plain |= plain_mask.to(device=device, dtype=torch.bool)
    if bos_token_id is not None:
        plain |= input_ids == bos_token_id
    if segment_ids is not None:
        plain[:, 1:] |= segment_ids[:, 1:] != segment_ids[:, :-1]
    if prefix_mixin > 0:
        max_prefix = max(1, math.ceil(prefix_mixin * T))
        p = (uniform((B, 1), generator, device, torch.float64) * max_prefix).floor()
        plain |= torch.arange(T, device=device).unsqueeze(0) <= p
    return plain


def mask_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) RoPE positions of left-padded rows from their (B, T) attention mask (1 = real token): each row's real
    tokens count from 0, so a row's result does not depend on its padding; padding takes 0 (never attended to)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def prompt_plain(input_ids: torch.Tensor, real: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor:
    """(B, T) bool: the prompt positions that a fused or exact prefill keeps plain: position 0, padding (``real``
    False) and each row's first token (RoPE position 0)."""
    plain = None if position_ids is None else position_ids == 0
    if real is not None:
        plain = ~real if plain is None else plain | ~real
    return plain_positions(input_ids, plain)


def relative_change(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """(B, T) ||new_t - old_t|| / ||old_t|| per position, in float32."""
    return (new - old).float().norm(dim=-1) / old.float().norm(dim=-1).clamp_min(1e-12)


def max_relative_change(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) max over positions t (where ``mask``, (B, T) bool, is True) of ``relative_change``."""
    change = relative_change(new, old)
    if mask is not None:
        change = change.masked_fill(~mask, 0.0)
    return change.amax(dim=-1)


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position of each token within its run of equal segment ids (0 at each run's start)."""
    T = segment_ids.shape[1]
    index = torch.arange(T, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def shift_right(h: torch.Tensor) -> torch.Tensor:
    """Row t of the result is h[t-1]; row 0 is zero (position 0 is always plain, there is no h_0)."""
    return F.pad(h[:, :-1], (0, 0, 1, 0))


def write_weights(state: dict[str, torch.Tensor], directory: Path) -> None:
    """``state`` as DIRECTORY/model.safetensors, whole or not at all: written beside it, then renamed into place."""
    from safetensors.torch import save_file

    tmp = directory / (WEIGHTS_NAME + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp),
              metadata={"format": "pt", "library": "fullband"})
    os.chmod(tmp, ordinary_file_mode())
    os.replace(tmp, directory / WEIGHTS_NAME)


def ordinary_file_mode() -> int:
    """0o666 & ~umask, the mode a new file gets: safetensors creates its files 0600, which a group could not read."""
    try:  # Linux reports the umask without changing it; os.umask can only read it by setting it
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o077)  # briefly a strict umask, so a file another thread creates meanwhile stays private
    os.umask(umask)
    return 0o666 & ~umask

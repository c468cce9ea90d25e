"""A fullband transformer as a vLLM model: vLLM's attention, paged KV cache, weight loading and sampler around
fullband's own fusion, RMSNorm and RoPE. In soft and fused modes the top state a token is fused with rides in a
per-request state slot (``FeedbackState``, a Mamba-style layer vLLM allocates and frees with the request)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.utils import maybe_prefix
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from fullband.architectures import config_from_dict
from fullband.decoding import EXACT
from fullband.model import FullBandConfig, Fusion, RMSNorm, rope_inv_freq, rotate_half
from fullband.vllm.config import served_settings


def _fullband_config(hf_config) -> FullBandConfig:
    config = config_from_dict(hf_config.fullband or {}, "the export's config.json")
    if not isinstance(config, FullBandConfig):
        raise ValueError("the fullband vLLM plugin serves the transformer (model.arch fbt); this export holds "
                         "another model kind: serve it with `fullband serve`")
    return config


class FullBandAttention(nn.Module):
    def __init__(self, config: FullBandConfig, layer: int, cache_config, quant_config, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        if config.n_heads % tp or (config.n_kv_heads % tp and tp % config.n_kv_heads):
            raise ValueError(f"{config.n_heads} heads / {config.n_kv_heads} KV heads do not split over "
                             f"tensor_parallel_size {tp}")
        self.head_dim = config.resolved_head_dim
        self.n_heads = config.n_heads // tp
        self.n_kv_heads = max(1, config.n_kv_heads // tp)
        self.qkv_proj = QKVParallelLinear(config.d_model, self.head_dim, config.n_heads, config.n_kv_heads,
                                          bias=config.qkv_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.n_heads * self.head_dim, config.d_model, bias=False,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.gate_proj = None
        if config.attn_output_gate:
            self.gate_proj = ColumnParallelLinear(config.d_model, config.n_heads, bias=False,
                                                  quant_config=quant_config, prefix=f"{prefix}.gate_proj")
        window = config.sliding_window if config.layer_is_sliding(layer) else None
        self.attn = Attention(self.n_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.n_kv_heads,
                              cache_config=cache_config, quant_config=quant_config,
                              per_layer_sliding_window=window, prefix=f"{prefix}.attn")
        sizes = self.attn.get_attn_backend().get_supported_head_sizes()
        if sizes and self.head_dim not in sizes:
            raise ValueError(f"head_dim {self.head_dim}: vLLM's {self.attn.get_attn_backend().get_name()} attention "
                             f"on this platform takes head sizes {', '.join(map(str, sizes))}")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        qkv, _ = self.qkv_proj(x)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(T, self.n_heads, self.head_dim), k.view(T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = self.attn(q.reshape(T, q_size), k.reshape(T, kv_size), v.contiguous())
        if self.gate_proj is not None:
            gate, _ = self.gate_proj(x)
            y = (y.view(T, self.n_heads, self.head_dim) * torch.sigmoid(gate).unsqueeze(-1)).reshape(T, q_size)
        out, _ = self.o_proj(y)
        return out


class FullBandMLP(nn.Module):
    def __init__(self, config: FullBandConfig, quant_config, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.d_model, [config.d_ff] * 2, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.d_ff, config.d_model, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)[0].chunk(2, dim=-1)
        out, _ = self.down_proj(torch.nn.functional.silu(gate) * up)
        return out


class FullBandBlock(nn.Module):
    def __init__(self, config: FullBandConfig, layer: int, cache_config, quant_config, prefix: str):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = FullBandAttention(config, layer, cache_config, quant_config, f"{prefix}.attn")
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = FullBandMLP(config, quant_config, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class FullBandModel(nn.Module):
    """The stack, named as ``fullband.model.FullBandLM`` names it (the export's ``model.*`` weights)."""

    def __init__(self, config: FullBandConfig, cache_config, quant_config, prefix: str):
        super().__init__()
        self.embed = VocabParallelEmbedding(config.vocab_size, config.d_model, prefix=f"{prefix}.embed")
        self.layers = nn.ModuleList(FullBandBlock(config, i, cache_config, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.fusion = Fusion(config)
        # RoPE frequencies in float32 whatever the weights' dtype (vLLM builds the model in its dtype and never casts).
        self.register_buffer("inv_freq", rope_inv_freq(config).float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token inputs (T, D) at ``positions`` (T,) -> the top states (T, D), after the final RMSNorm."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # (T, 1, head_dim): one row for all heads
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.norm(x)


class FeedbackState(MambaBase):
    """The top state each request carries to its next token, in a state slot vLLM manages like a Mamba layer's;
    ``run`` applies the decode mode's rules around the stack."""

    def __init__(self, d_model: int, dtype: torch.dtype, fused_passes: int, prefix: str):
        super().__init__()
        self.d_model, self.dtype, self.fused_passes, self.prefix = d_model, dtype, fused_passes, prefix
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_state_shape(self) -> tuple[tuple[int, int]]:
        return ((1, self.d_model),)

    def get_state_dtype(self) -> tuple[torch.dtype]:
        return (self.dtype,)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # Its metadata (state slots, decode/prefill split, whether a chunk has a prior state) is all this needs.
        return MambaAttentionBackendEnum.SHORT_CONV

    @property
    def is_kv_cache_tp_replicated(self) -> bool:
        return True  # every rank holds the whole (replicated) top state

    def run(self, model: FullBandModel, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if metadata is None:  # a profiling or warm-up run: no requests, no state
            return model(embeds, positions)
        slots = self.kv_cache[0].view(-1, self.d_model)
        n_decode, n_prefill = metadata.num_decode_tokens, metadata.num_prefill_tokens
        n_tokens = n_decode + n_prefill  # anything after them is padding
        fusion = model.fusion
        inputs = embeds
        last_slots, last_rows = [], []
        if n_decode:
            # One token per request: a generated token (or a fused:exact prompt token) at t > 0 takes the top state
            # of t - 1 from its slot; a one-token prompt (t = 0) stays plain.
            slots_d = metadata.state_indices_tensor_d[:, 0]
            fused = fusion(embeds[:n_decode], slots[slots_d].to(embeds.dtype))
            plain = (positions[:n_decode] == 0).unsqueeze(-1)
            inputs = torch.cat([torch.where(plain, embeds[:n_decode], fused), embeds[n_decode:]])
            last_slots.append(slots_d)
            last_rows.append(torch.arange(n_decode, device=embeds.device))
        starts = None
        if metadata.num_prefills:
            if bool(metadata.has_initial_states_p.any()):
                raise RuntimeError(
                    "fullband feedback decoding got a prompt chunk that continues an earlier chunk; this needs "
                    "chunked prefill and prefix caching off (fullband.vllm.config sets both): do not re-enable them")
            bounds = metadata.query_start_loc_p + n_decode
            starts, ends = bounds[:-1], bounds[1:]
            last_slots.append(metadata.state_indices_tensor_p)
            last_rows.append(ends - 1)
        hidden = model(inputs, positions)
        if starts is not None and self.fused_passes:
            # Prompt tokens t > 0 (the first of each chunk is position 0) are fused with the previous pass's top
            # state at t - 1; the other rows keep their inputs, so rerunning them recomputes the same values.
            rows = torch.arange(n_decode, n_tokens, device=embeds.device)
            fused_rows = rows[~torch.isin(rows, starts)]
            for _ in range(self.fused_passes):
                inputs = inputs.clone()
                inputs[fused_rows] = fusion(embeds[fused_rows], hidden[fused_rows - 1])
                hidden = model(inputs, positions)
        if last_slots:
            slots[torch.cat(last_slots)] = hidden[torch.cat(last_rows)].to(slots.dtype)
        return hidden


class FullBandForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """The ``FullBandForCausalLM`` architecture of a ``fullband export-hf`` directory. ``IsHybrid`` lets vLLM
    give the feedback modes their state slot; in standard mode the config lists attention layers only and vLLM
    treats the model as attention-only."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        self.settings = served_settings(hf_config)
        self.config = _fullband_config(hf_config)
        self.model = FullBandModel(self.config, vllm_config.cache_config, vllm_config.quant_config,
                                   maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.d_model,
                                      quant_config=vllm_config.quant_config, prefix=maybe_prefix(prefix, "lm_head"))
        if self.config.tie_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed)
        self.logits_processor = LogitsProcessor(self.config.vocab_size)
        self.feedback = None
        if self.settings.mode != "standard":
            passes = self.settings.prefill_passes
            # Named like a layer after the stack: vLLM reads a layer index from every state layer's name.
            # fused:exact's prompt goes token by token: no passes over it.
            self.feedback = FeedbackState(self.config.d_model, vllm_config.model_config.dtype,
                                          0 if passes == EXACT else passes,
                                          maybe_prefix(prefix, f"model.layers.{self.config.n_layers}.feedback_state"))

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, int]]:
        return ((1, vllm_config.model_config.hf_config.hidden_size),)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype]:
        return (vllm_config.model_config.dtype,)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return (get_conv_copy_spec,)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        embeds = self.model.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if self.feedback is None:
            return self.model(embeds, positions)
        return self.feedback.run(self.model, embeds, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    _STACKED = (  # (export name part, vLLM parameter part, shard)
        (".attn.q_proj.", ".attn.qkv_proj.", "q"),
        (".attn.k_proj.", ".attn.qkv_proj.", "k"),
        (".attn.v_proj.", ".attn.qkv_proj.", "v"),
        (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
        (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        if self.config.tie_embeddings:
            params.pop("lm_head.weight", None)
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard = "lm_head.weight" if name == "model.lm_head.weight" else name, None
            for weight_part, param_part, stacked_shard in self._STACKED:
                if weight_part in target:
                    target, shard = target.replace(weight_part, param_part), stacked_shard
                    break
            if target not in params:
                raise ValueError(f"the export has a weight {name!r} that the fullband vLLM model does not know "
                                 "(was it written by a newer fullband?)")
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the export lacks weights {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        return loaded

"""A fullband model inside ``transformers``: ``AutoModelForCausalLM`` + ``generate()`` in every decode mode
(docs/huggingface.md). Copied next to exported weights, it routes ``transformers``' generation loop through fullband's
own ``FullBandLM``; the carried top state lives in ``FullBandCache`` beside the keys and values, so batch expansion
and beam search reorder it with them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from .configuration_fullband import FullBandHFConfig
from .fullband_decoding import DecodeSettings
from .fullband_model import (
    FullBandConfig,
    FullBandLM,
    KVCache,
    RMSNorm,
    init_std_of,
    mask_positions,
    rope_inv_freq,
)

try:  # transformers >= 5: init functions that skip already-loaded tensors
    from transformers import initialization as _init
except ImportError:  # pragma: no cover
    _init = nn.init

# transformers renamed `past_key_values` to `cache` during 5.x; support both spellings.
_CACHE_KEY = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class FullBandCache(Cache):
    """fullband's :class:`KVCache` (allocated on the first forward, sized by ``max_length`` when ``generate`` knows
    it, doubled when a forward would overflow it) plus the carried top state and the decode settings."""

    def __init__(
        self,
        decode_mode: str = "standard",
        fused_passes: int | str = 1,
        max_length: int | None = None,
        fused_tol: float | None = None,
        fused_max_passes: int | None = None,
        settings: DecodeSettings | None = None,
    ):
        """Decode settings: ``settings`` if given, else the defaults with the given fields."""
        super().__init__(layers=[])
        self.settings = settings or DecodeSettings().with_overrides(
            mode=decode_mode, fused_passes=fused_passes, fused_tol=fused_tol, fused_max_passes=fused_max_passes)
        self.prefill_passes: torch.Tensor | None = None  # (B,): fused prefill passes each row ran
        self.max_length = max_length
        self.kv: KVCache | None = None
        self.state: torch.Tensor | None = None  # (B, 1, D): top state of the last processed position
        self.next_position: torch.Tensor | None = None  # (B, 1): RoPE position of the next token

    @property
    def decode_mode(self) -> str:
        return self.settings.mode

    @property
    def fused_passes(self) -> int | str:
        return self.settings.fused_passes

    def __repr__(self) -> str:
        return (
            f"FullBandCache(decode_mode={self.decode_mode!r}, fused_passes={self.fused_passes}, "
            f"length={self.get_seq_length()}, batch_size={self.batch_size})"
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.kv is None else self.kv.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows on demand

    @property
    def batch_size(self) -> int:
        return -1 if self.kv is None else self.kv.batch_size

    @property
    def is_initialized(self) -> bool:
        return self.kv is not None

    @property
    def is_croppable(self) -> bool:
        return self.decode_mode == "standard"

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_linear(self) -> list[bool]:
        return [False]

    @property
    def is_dummy(self) -> list[bool]:
        return [False]

    def reset(self) -> None:
        self.kv, self.state, self.next_position = None, None, None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep or reorder batch rows (beam search, dropping finished rows); the state follows its row."""
        if self.kv is None:
            return
        indices = indices.to(self.kv.device)
        self.kv.select_rows(indices)
        if self.state is not None:
            self.state = self.state.index_select(0, indices)
        if self.next_position is not None:
            self.next_position = self.next_position.index_select(0, indices)

    reorder_cache = batch_select_indices

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.kv is not None:
            rows = torch.arange(self.batch_size, device=self.kv.device)
            self.batch_select_indices(rows.repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Keep the first ``tokens_to_remove`` positions (negative: drop that many from the end), as transformers'
        caches do; standard mode only, as the carried top state of an earlier step is not kept."""
        length = self.get_seq_length()
        keep = length + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, length)
        if keep == length:
            return
        if self.decode_mode != "standard":
            raise NotImplementedError(
                f"FullBandCache cannot be rolled back in {self.decode_mode!r} mode (the fed-back top state of "
                "earlier steps is not kept); assisted/speculative decoding works in standard mode only"
            )
        self.kv.truncate(max(keep, 0))
        if self.next_position is not None:
            self.next_position = self.next_position - (length - self.kv.length)

    def ensure_capacity(self, model: FullBandLM, batch_size: int, needed: int) -> KVCache:
        kv = self.kv
        if kv is not None and kv.batch_size != batch_size:
            raise ValueError(
                f"FullBandCache holds {kv.batch_size} rows but the input has {batch_size}; "
                "use reorder_cache / batch_select_indices to change the batch"
            )
        if kv is not None and kv.max_len >= needed:
            return kv
        capacity = max(needed, self.max_length or 0, 2 * kv.max_len if kv is not None else 0)
        if kv is None:
            self.kv = model.new_cache(batch_size, capacity)
        else:
            kv.grow(capacity)
        return self.kv


class FullBandPreTrainedModel(PreTrainedModel):
    config_class = FullBandHFConfig
    base_model_prefix = "model"
    _input_embed_layer = "embed"  # transformers' get/set_input_embeddings find it under self.model
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        config = FullBandConfig.from_dict(self.config.fullband or {})
        if isinstance(module, (nn.Linear, nn.Embedding)):
            _init.normal_(module.weight, mean=0.0, std=init_std_of(module, config))
            if getattr(module, "bias", None) is not None:
                _init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            _init.ones_(module.weight)
        elif isinstance(module, FullBandLM):
            _init.copy_(module.inv_freq, rope_inv_freq(module.config).to(module.inv_freq.dtype))


class FullBandForCausalLM(FullBandPreTrainedModel, GenerationMixin):
    """``FullBandLM`` (under ``self.model``) as a ``transformers`` causal LM."""

    def __init__(self, config: FullBandHFConfig):
        super().__init__(config)
        self.model = FullBandLM(FullBandConfig.from_dict(config.fullband or {}))
        self.post_init()

    def get_output_embeddings(self) -> nn.Module | None:
        return self.model.lm_head  # None when tied: FullBandLM reuses the embedding matrix itself

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: FullBandCache | None = None,
        past_key_values: FullBandCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        decode_mode: str | None = None,
        fused_passes: int | str | None = None,
        fused_tol: float | None = None,
        fused_max_passes: int | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Without a cache: the prefill of the decode settings (fused mode: with its fused passes). With a
        :class:`FullBandCache`: an empty one is prefilled, a filled one decodes the new tokens, fusing each with the
        carried top state in soft/fused mode."""
        if inputs_embeds is not None:
            raise ValueError("fullband models take input_ids only (inputs_embeds is not supported)")
        if input_ids is None:
            raise ValueError("input_ids is required")
        cache = past_key_values if cache is None else cache
        if cache is not None and not isinstance(cache, FullBandCache):
            raise ValueError(
                f"fullband models need a FullBandCache, got {type(cache).__name__}; let generate() create it "
                "or pass FullBandCache(decode_mode=...)"
            )
        if use_cache is None:
            use_cache = cache is not None
        if cache is not None and cache.get_seq_length() > 0:
            settings = cache.settings  # fixed when the cache was filled; decode steps need not resolve them again
        else:
            base = cache.settings if cache is not None else self.config.decode_settings(vars(self.generation_config))
            settings = base.with_overrides(mode=decode_mode, fused_passes=fused_passes, fused_tol=fused_tol,
                                           fused_max_passes=fused_max_passes)
        if use_cache and cache is None:
            cache = FullBandCache(settings=settings)

        if cache is None:
            logits, hidden, _ = self._fb_prefill(input_ids, attention_mask, position_ids, None, settings)
        else:
            logits, hidden = self._fb_cached_forward(cache, input_ids, attention_mask, position_ids, settings)

        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        logits = logits[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep]
        hidden_states = (hidden,) if output_hidden_states else None
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden_states,
                                     **{_CACHE_KEY: cache if use_cache else None})
        return out.to_tuple() if return_dict is False else out

    def _fb_prefill(self, input_ids, attention_mask, position_ids, kv, settings: DecodeSettings):
        """``FullBandLM.prefill`` in the settings' mode (with ``kv``: into it): logits, hidden states and the (B,)
        fused passes each row ran."""
        T = input_ids.shape[1]
        mask = None if attention_mask is None else attention_mask[:, -T:].to(device=input_ids.device, dtype=torch.bool)
        out = self.model.prefill(input_ids, settings.prefill_passes, attention_mask=mask, position_ids=position_ids,
                                 past_key_values=kv, use_cache=kv is not None, fused_tol=settings.fused_tol,
                                 fused_max_passes=settings.fused_max_passes)
        return out.logits, out.hidden, out.fused_passes

    def _fb_cached_forward(self, cache, input_ids, attention_mask, position_ids, settings: DecodeSettings):
        fb = self.model
        B, T = input_ids.shape
        start = cache.get_seq_length()
        if start == 0:  # the prefill fixes the cache's settings; later calls decode as it was filled
            cache.settings = settings
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("fullband models take a 2-D (batch, length) attention_mask")
        if position_ids is None:
            if attention_mask is not None and attention_mask.shape[1] == start + T:
                position_ids = mask_positions(attention_mask)[:, -T:]
            elif cache.next_position is not None:
                position_ids = cache.next_position + torch.arange(T, device=input_ids.device)
        if position_ids is not None:
            position_ids = position_ids[:, -T:].to(input_ids.device)
        kv = cache.ensure_capacity(fb, B, start + T)
        if start == 0:
            logits, hidden, cache.prefill_passes = self._fb_prefill(
                input_ids, attention_mask, position_ids, kv, cache.settings)
            if position_ids is None:
                position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        else:
            if position_ids is None:
                position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
            mask = None if attention_mask is None else attention_mask[:, -T:].to(input_ids.device, torch.bool)
            if cache.decode_mode == "standard" or cache.state is None:
                out = fb(input_ids, attention_mask=mask, position_ids=position_ids, past_key_values=kv, use_cache=True)
            else:
                # Soft/fused decoding: token t is fused with the top state of position t-1 (the recurrence).
                out = fb.recurrence(input_ids, past_key_values=kv, attention_mask=mask, position_ids=position_ids,
                                    state=cache.state)
            logits, hidden = out.logits, out.hidden
        cache.state = hidden[:, -1:]
        cache.next_position = position_ids[:, -1:] + 1
        return logits, hidden

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        decode_mode: str | None = None,
        fused_passes: int | str | None = None,
        fused_tol: float | None = None,
        fused_max_passes: int | None = None,
        **kwargs,
    ) -> torch.LongTensor | ModelOutput:
        """``transformers``' ``generate`` plus the decode settings (default: those stored in generation_config.json,
        ``self.generation_config``); assisted decoding works in standard mode only (it rolls the cache back)."""
        settings = self.config.decode_settings(vars(self.generation_config)).with_overrides(
            mode=decode_mode, fused_passes=fused_passes, fused_tol=fused_tol, fused_max_passes=fused_max_passes)
        mode = settings.mode
        if mode != "standard":
            no_cache = kwargs.get("use_cache") is False or (
                generation_config is not None and getattr(generation_config, "use_cache", True) is False
            )
            if no_cache:
                raise ValueError(f"decode_mode={mode!r} carries the top state in the cache: use_cache must be True")
            if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
                raise ValueError(
                    f"assisted decoding is not supported with decode_mode={mode!r}: it rolls the cache back, and "
                    "the fed-back top state cannot be rolled back; use decode_mode='standard'"
                )
        return super().generate(inputs, generation_config, decode_mode=mode, fused_passes=settings.fused_passes,
                                fused_tol=settings.fused_tol, fused_max_passes=settings.fused_max_passes, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if cache is None and generation_config.use_cache is False:
            return
        if cache is None:
            # generate() passed all four settings as keywords: transformers moved those that self.generation_config
            # holds (an export's stored ones) into generation_config, and leaves the others in model_kwargs.
            cache = FullBandCache(settings=DecodeSettings().with_overrides(**{
                k: model_kwargs.get(k, getattr(generation_config, k, None))
                for k in ("decode_mode", "fused_passes", "fused_tol", "fused_max_passes")}))
            model_kwargs[_CACHE_KEY] = cache
        elif not isinstance(cache, FullBandCache):
            raise ValueError(f"fullband models need a FullBandCache, got {type(cache).__name__}")
        else:
            cache._is_user_defined = True
        max_length = getattr(generation_config, "max_length", None)
        if max_length:
            cache.max_length = max(cache.max_length or 0, int(max_length))


__all__ = ["FullBandCache", "FullBandForCausalLM", "FullBandPreTrainedModel"]

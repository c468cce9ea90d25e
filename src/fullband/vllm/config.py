"""The exported model's configuration as vLLM reads it (the decode settings of its generation_config.json with
``hf_overrides`` on top, checked by ``DecodeSettings``), and how its decode mode configures the engine."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from transformers import GenerationConfig

from fullband.decoding import AUTO, DecodeSettings, DecodeSettingsError
from fullband.hf.configuration_fullband import FullBandHFConfig

logger = logging.getLogger(__name__)

# The modes this plugin computes exactly inside vLLM (fused:auto is the one it refuses).
SUPPORTED = "standard, soft, fused:N (N >= 1) and fused:exact"
# vLLM counts a model as hybrid (attention plus per-request state layers) unless every entry of
# `layer_types` names attention; the feedback modes add one state layer after the attention stack.
ATTENTION_LAYER = "full_attention"
FEEDBACK_STATE_LAYER = "feedback_state"


class FullBandVLLMConfig(FullBandHFConfig):
    """``FullBandHFConfig`` plus the export's generation_config.json, read with it (vLLM reads that file for
    sampling defaults only), and ``layer_types``, derived from the decode mode so that it follows ``hf_overrides``:
    attention only in standard mode (vLLM then runs the model as it runs a Llama), one per-request state layer
    more in the feedback modes."""

    def __post_init__(self, **kwargs):
        self.generation = _generation_config(kwargs.get("name_or_path"))
        super().__post_init__(**kwargs)

    def decode_settings(self, generation: Mapping[str, Any] | None = None) -> DecodeSettings:
        """The export's stored settings with ``hf_overrides`` (set on this config) on top."""
        return super().decode_settings(self.generation if generation is None else generation)

    @property
    def layer_types(self) -> list[str]:
        layers = [ATTENTION_LAYER] * self.num_hidden_layers
        return layers if self.decode_settings().mode == "standard" else [*layers, FEEDBACK_STATE_LAYER]


def _generation_config(path: str | None) -> dict[str, Any]:
    if not path:  # a config built in code (transformers builds a default one to compare against)
        return {}
    try:
        return GenerationConfig.from_pretrained(path).to_diff_dict()
    except OSError:  # an export without generation_config.json: the settings on the config, else standard
        return {}


def served_settings(hf_config) -> DecodeSettings:
    """The decode settings a vLLM engine serves ``hf_config`` with; refuses those it cannot compute exactly."""
    settings = hf_config.decode_settings()
    if settings.mode == "fused" and settings.fused_passes == AUTO:
        raise DecodeSettingsError(
            "decode mode fused:auto is not supported inside vLLM (its pass count depends on each prompt's "
            f"convergence); the vLLM plugin serves {SUPPORTED}: set e.g. hf_overrides={{'decode_mode': 'fused', "
            "'fused_passes': 2}, or serve fused:auto with `fullband serve`")
    return settings


class EngineConfigForDecodeMode:
    """vLLM's per-architecture config hook: in a feedback mode a token's input depends on the top state before it,
    so chunked prefill and prefix caching are off (they would start a prompt part-way) and the scheduler keeps a
    preempted request's replay exact (``fullband.vllm.scheduler``)."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        served_settings(model_config.hf_config)

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        settings = served_settings(vllm_config.model_config.hf_config)
        if settings.mode == "standard":
            return
        scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
        if vllm_config.speculative_config is not None:
            raise DecodeSettingsError(f"decode mode {settings.label}: speculative decoding would feed unverified "
                                      "tokens' states back; serve this model without a speculative config")
        if cache.enable_prefix_caching:
            logger.info("fullband %s: prefix caching off (a cached prefix's states depend on its decode mode and "
                        "history)", settings.label)
            cache.enable_prefix_caching = False
        if scheduler.enable_chunked_prefill:
            logger.info("fullband %s: chunked prefill off (each prompt is prefilled in one piece)", settings.label)
            scheduler.enable_chunked_prefill = False
            scheduler.long_prefill_token_threshold = 0
        max_model_len = vllm_config.model_config.max_model_len
        if scheduler.max_num_batched_tokens < max_model_len:
            scheduler.max_num_batched_tokens = max_model_len
            scheduler.max_num_encoder_input_tokens = max_model_len
            scheduler.encoder_cache_size = max_model_len
        scheduler.scheduler_cls = "fullband.vllm.scheduler.FeedbackScheduler"
        # Which rows of a step are prompts and which are fed a state is decided on the host, per step: no graphs.
        vllm_config.model_config.enforce_eager = True

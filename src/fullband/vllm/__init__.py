"""fullband models in vLLM (docs/serving.md): loaded through the ``vllm.general_plugins`` entry point; the only
subpackage that imports vllm."""

from __future__ import annotations

ARCHITECTURE = "FullBandForCausalLM"
MODEL_CLASS = "fullband.vllm.model:FullBandForCausalLM"


def register() -> None:
    """Register the model class (by name: vLLM imports it in the processes that build a model), the config class
    for ``model_type="fullband"`` and the config hook that sets the engine up for the decode mode."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    from fullband.vllm.config import EngineConfigForDecodeMode, FullBandVLLMConfig

    _CONFIG_REGISTRY[FullBandVLLMConfig.model_type] = FullBandVLLMConfig
    MODELS_CONFIG_MAP[ARCHITECTURE] = EngineConfigForDecodeMode
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)

"""fullband models in vLLM: a plugin that vLLM loads through its ``vllm.general_plugins`` entry point.

With fullband installed, ``vllm.LLM(EXPORT_DIR)`` and ``vllm serve EXPORT_DIR`` load a ``fullband export-hf``
directory without ``trust_remote_code``, in the decode mode stored in its config.json; ``hf_overrides`` (e.g.
``{"decode_mode": "fused", "fused_passes": 2}``) change it per served model. Only this subpackage imports vllm.
"""

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

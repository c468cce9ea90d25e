"""Hugging Face interop (docs/huggingface.md). ``transformers`` (the ``hf`` extra) is imported lazily:
``FullBandHFConfig``, ``FullBandForCausalLM`` and ``FullBandCache`` are attributes that import it."""

from __future__ import annotations

from typing import Any

from fullband.hf.convert import convert_from_hf, hf_config_to_fullband, hf_to_fullband_model
from fullband.hf.export import export_hf

__all__ = [
    "FullBandCache",
    "FullBandForCausalLM",
    "FullBandHFConfig",
    "convert_from_hf",
    "export_hf",
    "hf_config_to_fullband",
    "hf_to_fullband_model",
    "register",
]


def register() -> None:
    """Register the fullband classes with ``AutoConfig`` / ``AutoModelForCausalLM`` (idempotent), so
    exported directories load without ``trust_remote_code`` in a process that has fullband installed."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover
        raise ImportError("fullband.hf.register() needs transformers: pip install 'fullband[hf]'") from exc

    from fullband.hf.configuration_fullband import FullBandHFConfig
    from fullband.hf.modeling_fullband import FullBandForCausalLM

    AutoConfig.register("fullband", FullBandHFConfig, exist_ok=True)
    AutoModelForCausalLM.register(FullBandHFConfig, FullBandForCausalLM, exist_ok=True)


def __getattr__(name: str) -> Any:
    if name == "FullBandHFConfig":
        from fullband.hf.configuration_fullband import FullBandHFConfig

        return FullBandHFConfig
    if name in ("FullBandForCausalLM", "FullBandCache"):
        from fullband.hf import modeling_fullband

        return getattr(modeling_fullband, name)
    raise AttributeError(f"module 'fullband.hf' has no attribute {name!r}")

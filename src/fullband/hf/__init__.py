"""Hugging Face interop: import Llama-family checkpoints, export ``trust_remote_code`` models.

- :func:`convert_from_hf` — a local HF directory (Llama, Qwen2, Qwen3, Mistral) -> a fullband model
  directory with fresh fusion weights (``fullband convert --from-hf SRC --out DST``).
- :func:`export_hf` — a fullband model directory -> an HF directory loadable with
  ``AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True)`` (``fullband export-hf``).
- :func:`register` — register ``model_type="fullband"`` with ``transformers``' Auto classes in-process.

``transformers`` is imported lazily (optional extra ``fullband[hf]``); importing this package needs only
torch and safetensors. ``FullBandHFConfig``, ``FullBandForCausalLM`` and ``FullBandCache`` are available
as attributes (importing them imports ``transformers``).
"""

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

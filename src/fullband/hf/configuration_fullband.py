"""Hugging Face configuration of an exported fullband model (``model_type="fullband"``), shipped beside the weights:
``FullBandConfig`` verbatim under the ``fullband`` key, the usual Hugging Face names filled in from it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedConfig

from .fullband_decoding import DecodeSettings

# Hugging Face attribute name -> fullband field, for tools that read the standard names.
_STANDARD_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "d_ff",
    "max_position_embeddings": "max_seq_len",
    "rms_norm_eps": "norm_eps",
}


class FullBandHFConfig(PreTrainedConfig):
    r"""
    fullband (dict): the fields of ``fullband.model.FullBandConfig`` (d_model, n_layers, fusion, ...).
    The stored decode settings (``fullband.decoding.DecodeSettings``: decode_mode, fused_passes, fused_tol,
    fused_max_passes) are in the export's generation_config.json; any given here override them (``decode_settings``).
    """

    model_type = "fullband"

    fullband: dict | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # The fullband model ties its embeddings itself (no lm_head when tied); transformers must not tie.
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        for name in (*_STANDARD_NAMES, "head_dim"):  # derived below; stale copies from a saved config.json are dropped
            kwargs.pop(name, None)
        super().__post_init__(**kwargs)
        self.decode_settings()  # refuse a bad value given here when the config is read, not at the first generate()
        fb = dict(self.fullband or {})
        for hf_name, fb_name in _STANDARD_NAMES.items():
            if fb.get(fb_name) is not None:
                object.__setattr__(self, hf_name, fb[fb_name])
        if fb.get("n_heads"):
            head_dim = fb.get("head_dim") or fb["d_model"] // fb["n_heads"]
            object.__setattr__(self, "head_dim", head_dim)
            if fb.get("n_kv_heads") is None:
                object.__setattr__(self, "num_key_value_heads", fb["n_heads"])

    def decode_settings(self, generation: Mapping[str, Any] | None = None) -> DecodeSettings:
        """The decode settings, checked: those of ``generation`` (the export's generation_config.json), any set on
        this config on top (``DecodeSettings.of_export``)."""
        return DecodeSettings.of_export(generation or {}, vars(self), "the export's decode settings")

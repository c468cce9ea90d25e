"""Hugging Face configuration of an exported fullband model (``model_type="fullband"``), shipped beside the weights:
``FullBandConfig`` verbatim under the ``fullband`` key, the usual Hugging Face names filled in from it."""

from __future__ import annotations

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
    decode_mode (str): default latent-feedback mode of ``generate()``: "standard", "soft" or "fused".
    fused_passes (int, "auto" or "exact"): default extra fused prefill passes in "fused" mode ("exact": the exact
        recurrence over the prompt, token by token).
    fused_tol (float), fused_max_passes (int): ``fused_passes="auto"``'s tolerance and cap.
    These four are the model's stored decode settings (``fullband.decoding.DecodeSettings``).
    """

    model_type = "fullband"

    fullband: dict | None = None
    decode_mode: str = "standard"
    fused_passes: int | str = 1
    fused_tol: float = 1e-3
    fused_max_passes: int = 8
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # The fullband model ties its embeddings itself (no lm_head when tied); transformers must not tie.
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        for name in (*_STANDARD_NAMES, "head_dim"):  # derived below; stale copies from a saved config.json are dropped
            kwargs.pop(name, None)
        self.decode_settings()  # refuse a bad stored value when the config is read, not at the first generate()
        super().__post_init__(**kwargs)
        fb = dict(self.fullband or {})
        for hf_name, fb_name in _STANDARD_NAMES.items():
            if fb.get(fb_name) is not None:
                object.__setattr__(self, hf_name, fb[fb_name])
        if fb.get("n_heads"):
            head_dim = fb.get("head_dim") or fb["d_model"] // fb["n_heads"]
            object.__setattr__(self, "head_dim", head_dim)
            if fb.get("n_kv_heads") is None:
                object.__setattr__(self, "num_key_value_heads", fb["n_heads"])

    def decode_settings(self) -> DecodeSettings:
        """The stored decode settings, checked."""
        return DecodeSettings.from_dict({k: getattr(self, k) for k in DecodeSettings().to_dict()}, "config.json")

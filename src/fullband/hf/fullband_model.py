"""In-package stand-in for the copy of ``model.py`` an export ships as ``fullband_model.py``, so that
``modeling_fullband.py`` imports ``.fullband_model`` the same way here and in an export."""

from fullband.model import FullBandConfig, FullBandLM, KVCache, RMSNorm, init_std_of, mask_positions, rope_inv_freq

__all__ = ["FullBandConfig", "FullBandLM", "KVCache", "RMSNorm", "init_std_of", "mask_positions", "rope_inv_freq"]

"""In-package stand-in for the copy of ``fullband/model.py`` that an export ships as ``fullband_model.py``.

``modeling_fullband.py`` imports ``.fullband_model`` relatively so that the same file works both here and
in an exported directory; here that resolves to the package's own model code (the same classes). The
exported copy of ``model.py`` imports ``KVCache`` from the ``kv_cache.py`` shipped beside it.
"""

from fullband.model import FullBandConfig, FullBandLM, KVCache, RMSNorm, init_std_of, mask_positions, rope_inv_freq

__all__ = ["FullBandConfig", "FullBandLM", "KVCache", "RMSNorm", "init_std_of", "mask_positions", "rope_inv_freq"]

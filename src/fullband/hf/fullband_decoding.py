"""In-package stand-in for the copy of ``fullband/decoding.py`` that an export ships as ``fullband_decoding.py``
(as ``fullband_model.py`` stands in for ``fullband/model.py``): the export's ``generate()`` reads and checks
its stored decode settings with the same code as every other front door."""

from fullband.decoding import AUTO, DecodeSettings, DecodeSettingsError

__all__ = ["AUTO", "DecodeSettings", "DecodeSettingsError"]

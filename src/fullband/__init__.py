"""fullband: full-bandwidth transformers (latent feedback of the top hidden state)."""

from fullband.decoding import DecodeSettings
from fullband.generation import generate, generate_stream, sequential_forward
from fullband.kv_cache import KVCache
from fullband.model import FullBandConfig, FullBandLM, ModelOutput, MultipassOutput
from fullband.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "DecodeSettings",
    "FullBandConfig",
    "FullBandLM",
    "KVCache",
    "ModelOutput",
    "MultipassOutput",
    "SamplingParams",
    "generate",
    "generate_stream",
    "sequential_forward",
]

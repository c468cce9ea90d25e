"""fullband: full-bandwidth transformers (latent feedback of the top hidden state)."""

from fullband.generation import generate, generate_stream, sequential_forward
from fullband.model import FullBandConfig, FullBandLM, KVCache, ModelOutput, MultipassOutput

__version__ = "0.1.0"

__all__ = [
    "FullBandConfig",
    "FullBandLM",
    "KVCache",
    "ModelOutput",
    "MultipassOutput",
    "generate",
    "generate_stream",
    "sequential_forward",
]

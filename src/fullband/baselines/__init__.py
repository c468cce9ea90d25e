"""The recurrent baselines the FBT is compared with through the same doors: torch's LSTM and a DeltaProduct linear
RNN. They register with ``fullband.architectures`` through ``MODELS``; nothing else in the package names them."""

from fullband.baselines.base import BASELINE_ARCH_HELP, BASELINE_FIELD_HELP, BaselineConfig, RecurrentLM
from fullband.baselines.deltaproduct import DeltaProductLM, DeltaState
from fullband.baselines.lstm import LSTMLM, LSTMState

# model.arch -> the class; every config of these is a BaselineConfig.
MODELS: dict[str, type[RecurrentLM]] = {model.arch: model for model in (LSTMLM, DeltaProductLM)}

# What their new_cache returns.
RecurrentCache = LSTMState | DeltaState

__all__ = ["BASELINE_ARCH_HELP", "BASELINE_FIELD_HELP", "MODELS", "BaselineConfig", "DeltaProductLM", "DeltaState",
           "LSTMLM", "RecurrentCache", "RecurrentLM", "LSTMState"]

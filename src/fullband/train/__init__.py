"""Training: the pass schedule, optimizers, checkpoints and the loop."""

from fullband.schedule import PassSchedule
from fullband.train.trainer import TrainingDiverged, TrainResult, train

__all__ = ["PassSchedule", "TrainResult", "TrainingDiverged", "train"]

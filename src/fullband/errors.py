"""User-facing errors. The CLI prints these as one paragraph instead of a traceback."""


class FullbandError(ValueError):
    """Base class for errors caused by the user's input (config, data, checkpoints)."""


class ConfigError(FullbandError):
    """A configuration value or combination is invalid."""


class DataError(FullbandError):
    """A corpus, tokenizer or prepared dataset is missing, empty, corrupt or mismatched."""


class CheckpointError(FullbandError):
    """A checkpoint is missing, incomplete, corrupt or does not match the run."""

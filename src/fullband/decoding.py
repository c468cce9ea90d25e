"""How a model decodes: one value, ``DecodeSettings``, parsed and checked here and nowhere else. A model's
defaults depend on how it was trained (``trained_with``), so they are stored with its weights and every door starts
from them (docs/method.md §6, docs/checkpoints.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

# A Hugging Face export ships this file as fullband_decoding.py beside fullband_model.py (a copy of
# fullband/model.py), so that its generate() reads and checks the same settings; there the package may be
# absent, and transformers' remote-code loader skips imports inside try blocks.
try:
    from fullband.errors import ConfigError as _ErrorBase
    from fullband.model import DEFAULT_FUSED_MAX_PASSES, DEFAULT_FUSED_TOL, FullBandLM
except ImportError:  # pragma: no cover - only in an export
    from .fullband_model import DEFAULT_FUSED_MAX_PASSES, DEFAULT_FUSED_TOL, FullBandLM

    _ErrorBase = ValueError

MODES = ("standard", "soft", "fused")
AUTO = "auto"
EXACT = "exact"
FIELDS = ("mode", "fused_passes", "fused_tol", "fused_max_passes")
# The decode settings' file, beside config.json: the name under which Hugging Face stores generation defaults. A
# model directory's holds exactly ``to_dict()``; an export's adds Hugging Face's token ids (a converted model keeps
# its own Hugging Face token-id defaults in its tokenizer/, and its export merges them in).
DECODE_SETTINGS_NAME = "generation_config.json"


class TrainingSchedule(Protocol):
    """What the defaults depend on: a pass schedule (``fullband.schedule.PassSchedule``)."""

    exact: bool  # K = each step's longest document: the exact recurrence
    max_passes: int  # the most Jacobi passes of a step (only asked of a schedule that is not exact)


class DecodeSettingsError(_ErrorBase):
    """A decode mode, number of fused passes, tolerance or cap that cannot be used."""


@dataclass(frozen=True)
class DecodeSettings:
    """``mode``: standard | soft | fused. ``fused_passes``: fused mode's extra prefill passes over the prompt, an
    integer >= 1, "auto" (per row, until the top states change by at most ``fused_tol``, at most
    ``fused_max_passes``) or "exact" (the fixed point, token by token; docs/method.md §6)."""

    mode: str = "standard"
    fused_passes: int | Literal["auto", "exact"] = 1
    fused_tol: float = DEFAULT_FUSED_TOL
    fused_max_passes: int = DEFAULT_FUSED_MAX_PASSES

    def __post_init__(self) -> None:
        # Values arrive as text from command lines, URLs (lm-eval's model_args) and YAML: read them here, once.
        object.__setattr__(self, "fused_passes", _passes(self.fused_passes))
        object.__setattr__(self, "fused_tol", _tol(self.fused_tol))
        object.__setattr__(self, "fused_max_passes", _positive(self.fused_max_passes, "fused_max_passes"))
        if self.mode not in MODES:
            raise DecodeSettingsError(f"unknown decode_mode {self.mode!r}; choose one of {', '.join(MODES)}")

    def with_overrides(self, **overrides: Any) -> DecodeSettings:
        """These settings with the given fields replaced; a None value keeps the field. The names are those
        of the dataclass; ``decode_mode`` is accepted for ``mode`` (the API and lm-eval spelling). Fused passes
        given without a mode ask for fused mode: they mean nothing in the others."""
        if "decode_mode" in overrides:
            value = overrides.pop("decode_mode")
            if overrides.get("mode") is None:
                overrides["mode"] = value
        unknown = sorted(set(overrides) - set(FIELDS))
        if unknown:
            raise DecodeSettingsError(f"unknown decode setting(s) {', '.join(unknown)}; the settings are "
                                      f"{', '.join(FIELDS)}")
        given = {k: v for k, v in overrides.items() if v is not None}
        if "fused_passes" in given and "mode" not in given:
            given["mode"] = "fused"
        return replace(self, **given) if given else self

    def with_label(self, label: str) -> DecodeSettings:
        """These settings in the mode a label names: standard, soft, fused (these settings' passes),
        fused:N, fused:auto (these settings' tolerance and cap) or fused:exact."""
        name, colon, passes = label.strip().partition(":")
        if name not in MODES or (colon and (name != "fused" or not passes)):
            raise DecodeSettingsError(f"unknown decode mode {label!r}; modes are standard, soft, fused, fused:N "
                                      "(N >= 1), fused:auto and fused:exact")
        return self.with_overrides(mode=name, fused_passes=passes or None)

    @classmethod
    def trained_with(cls, schedule: TrainingSchedule, max_seq_len: int) -> DecodeSettings:
        """The defaults of a model of context ``max_seq_len`` trained with ``schedule``: fused:exact after the exact
        recurrence, soft after Jacobi passes, standard where the fusion was never trained."""
        if schedule.exact:
            return cls("fused", EXACT, DEFAULT_FUSED_TOL, max_seq_len)
        return cls("soft") if schedule.max_passes > 1 else cls("standard")

    @property
    def label(self) -> str:
        """standard, soft, fused:N, fused:auto or fused:exact."""
        return f"fused:{self.fused_passes}" if self.mode == "fused" else self.mode

    @property
    def prefill_passes(self) -> int | Literal["auto", "exact"]:
        """Fused passes of the prompt phase: ``fused_passes`` in fused mode, else none."""
        return self.fused_passes if self.mode == "fused" else 0

    def describe(self) -> str:
        if self.mode == "fused" and self.fused_passes == AUTO:
            return f"fused:auto (tol {self.fused_tol:g}, at most {self.fused_max_passes} passes)"
        if self.mode == "fused" and self.fused_passes == EXACT:
            return "fused:exact (the exact recurrence over the prompt, token by token)"
        return self.label

    def check_within(self, limit: int) -> None:
        """Refuse settings that could run more fused passes than ``limit`` (a server's bound per request). The
        exact prefill runs none: its cost is one pass, in one step per prompt token."""
        if self.mode != "fused" or self.fused_passes == EXACT:
            return
        if self.fused_passes == AUTO and self.fused_max_passes > limit:
            raise DecodeSettingsError(f"fused_max_passes must be at most {limit} here, got {self.fused_max_passes}")
        if self.fused_passes != AUTO and self.fused_passes > limit:
            raise DecodeSettingsError(f"fused_passes must be at most {limit} here (or 'auto'), "
                                      f"got {self.fused_passes}")

    def to_dict(self) -> dict[str, Any]:
        """The stored form; ``decode_mode`` as in Hugging Face configs and the API."""
        data = asdict(self)
        return {"decode_mode": data.pop("mode"), **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "decode settings") -> DecodeSettings:
        if not isinstance(data, dict):
            raise DecodeSettingsError(f"{where}: expected a JSON object, got {type(data).__name__}")
        values = {k: data[k] for k in ("decode_mode", *FIELDS[1:]) if k in data}
        try:
            return cls().with_overrides(**values)
        except DecodeSettingsError as exc:
            raise DecodeSettingsError(f"{where}: {exc}") from None

    @classmethod
    def of_export(cls, generation: Mapping[str, Any], config: Mapping[str, Any], where: str) -> DecodeSettings:
        """A Hugging Face export's settings: those of its generation_config.json (``generation``), any set on its
        config on top: vLLM's ``hf_overrides`` and ``from_pretrained``'s keywords, and the top of config.json in
        exports written before the settings moved to generation_config.json."""
        names = cls().to_dict()
        return cls.from_dict({k: v for source in (generation, config) for k, v in source.items()
                              if k in names and v is not None}, where)

    @classmethod
    def of(cls, model: FullBandLM) -> DecodeSettings:
        """The settings stored with a model (``model.decode_settings``; a fresh model has none: standard)."""
        return model.decode_settings or cls()

    def save(self, directory: str | Path) -> None:
        """Write them into a model directory (``DECODE_SETTINGS_NAME``)."""
        (Path(directory) / DECODE_SETTINGS_NAME).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _passes(value: Any) -> int | Literal["auto", "exact"]:
    return value if value in (AUTO, EXACT) else _positive(value, "fused_passes", ", 'auto' or 'exact'")


def _positive(value: Any, name: str, alternatives: str = "") -> int:
    """An int >= 1 from an int or its decimal text (not a bool, a float or other text)."""
    number = int(value.strip()) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise DecodeSettingsError(f"{name} must be an integer >= 1{alternatives}, got {value!r}")
    return number


def _tol(value: Any) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise DecodeSettingsError(f"fused_tol must be a number >= 0, got {value!r}")
    return number

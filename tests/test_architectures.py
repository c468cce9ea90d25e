"""The registry of model kinds (fullband.architectures): each model.arch builds and loads its own config and
class, files written while every kind shared the transformer's config still load, and no module outside the
baselines' package and the registry names a baseline."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

import fullband
from fullband.architectures import CLASSES, build_model, config_from_dict
from fullband.baselines import LSTMLM, BaselineConfig, DeltaProductLM
from fullband.config import build_config, load_config
from fullband.errors import ConfigError
from fullband.loading import PRESET_DIR
from fullband.model import FullBandConfig, FullBandLM

PACKAGE = Path(fullband.__file__).parent
BASELINE_NAMES = {"lstm", "deltaproduct", "householder_steps", "LSTMLM", "DeltaProductLM", "DeltaState",
                  "LSTMState"}


def test_each_arch_builds_its_own_config_and_class():
    assert set(CLASSES) == {"fbt", "lstm", "deltaproduct"}
    for arch, cls, model_cls in (("fbt", FullBandConfig, FullBandLM), ("lstm", BaselineConfig, LSTMLM),
                                 ("deltaproduct", BaselineConfig, DeltaProductLM)):
        cfg = build_config({"model": {"arch": arch, "d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1},
                            "train": {"schedule": "paper" if arch == "fbt" else "standard"}})
        assert type(cfg.model) is cls and isinstance(build_model(cfg.model), model_cls)
        assert build_config(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))).model == cfg.model  # a run's config.yaml
    with pytest.raises(TypeError, match="FullBandLM takes a FullBandConfig"):
        FullBandLM(BaselineConfig())


def test_an_arch_set_on_the_command_line_keeps_the_files_fields_it_has():
    preset = load_config(PRESET_DIR / "state-tracking.yaml")
    lstm = load_config(PRESET_DIR / "state-tracking.yaml", {"model.arch": "lstm", "train.schedule": "standard",
                                                            "train.keep_best": "standard"}).model
    assert isinstance(lstm, BaselineConfig) and lstm.arch == "lstm"
    assert (lstm.d_model, lstm.n_layers, lstm.max_seq_len) == (preset.model.d_model, preset.model.n_layers,
                                                              preset.model.max_seq_len)
    # In a file, a field of another kind is an error, not dropped.
    with pytest.raises(ConfigError, match="sliding_window: a field of FullBandConfig"):
        build_config({"model": {"arch": "lstm", "sliding_window": 4}}, {"model.arch": "lstm"})


def test_a_config_json_naming_an_unknown_arch_is_refused_by_name():
    with pytest.raises(ValueError, match="names arch 'gru'; this version of fullband knows fbt, lstm, deltaproduct"):
        config_from_dict({"arch": "gru"}, "config.json")


def test_no_module_outside_the_baselines_and_the_registry_names_them():
    """The transformer, the trainer, the doors and the Hugging Face export know model kinds only through the
    registry: a baseline's name in an identifier, an attribute or a string literal anywhere else fails."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("baselines/") or relative == "architectures.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.alias):
                names = node.name.split(".")
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = node.module.split(".")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [word.strip("'\"`.,:;()") for word in node.value.split()]
            offenders += [f"{relative}:{node.lineno} {name}" for name in names if name in BASELINE_NAMES]
    assert offenders == []

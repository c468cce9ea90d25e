"""RunConfig: YAML + --section.field overrides, strict types, unknown keys, validation, help text."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from fullband.config import SECTIONS, RunConfig, build_config, field_help, load_config
from fullband.errors import ConfigError, FullbandError
from fullband.loading import PRESET_DIR
from fullband.model import FullBandConfig


def test_defaults_and_round_trip(tmp_path):
    config = build_config({})
    assert config.train.schedule == "paper" and config.model.fusion == "gate" and config.data.source == "pystdlib"
    config = build_config({"model": {"d_model": 64, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                           "train": {"schedule": [{"until": 1.0, "passes": {2: 1.0}}], "lr": 1e-3}})
    config.save(tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again.flat() == config.flat()
    assert set(config.flat()) == {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def test_command_line_strings_are_converted():
    config = build_config({"train": {"tokens": 100}}, {
        "train.tokens": "1_000_000", "train.seq_len": "64", "model.max_seq_len": "128", "train.lr": "3e-4",
        "train.progress": "off", "train.compile": "yes", "data.max_train_bytes": "1e5",
        "model.sliding_window": "none", "model.rope_scaling": '{"rope_type": "linear", "factor": 2.0}',
        "train.schedule": '[{"until": 1.0, "passes": {"3": 1.0}}]', "eval.fused_passes": "2",
    })
    assert config.train.tokens == 1_000_000 and config.train.seq_len == 64 and config.train.lr == 3e-4
    assert config.train.progress is False and config.train.compile is True
    assert config.data.max_train_bytes == 100_000 and config.model.sliding_window is None
    assert config.model.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.train.schedule == [{"until": 1.0, "passes": {"3": 1.0}}] and config.eval.fused_passes == 2
    # an override beats the YAML value; "fixed:2" stays a string
    assert build_config({"train": {"schedule": "paper"}}, {"train.schedule": "fixed:2"}).train.schedule == "fixed:2"


def test_yaml_numbers_without_a_dot_are_accepted():
    # PyYAML reads 1e6 and 3e-3 as strings (YAML 1.1): they are still numbers to the user.
    raw = yaml.safe_load("train: {tokens: 1e6, lr: 3e-3, seq_len: 32}\nmodel: {max_seq_len: 32}")
    assert isinstance(raw["train"]["tokens"], str)
    config = build_config(raw)
    assert config.train.tokens == 1_000_000 and config.train.lr == 0.003


@pytest.mark.parametrize(
    "raw, overrides, message",
    [
        ({"trian": {}}, None, "unknown section 'trian'"),
        ({"train": {"tokenz": 5}}, None, "unknown field train.tokenz. Did you mean tokens"),
        ({"model": {"width": 5}}, None, "unknown field model.width"),
        ({"data": {"path": "x"}}, None, "unknown field data.path"),
        ({}, {"train.tokenz": "5"}, "unknown option --train.tokenz"),
        ({}, {"optim.lr": "5"}, "unknown option --optim.lr"),
        ({}, {"train": "5"}, "unknown option --train"),
        ({"train": 5}, None, "section 'train' must be a mapping"),
        ([1, 2], None, "top level must be a mapping"),
        # wrong types
        ({}, {"train.tokens": "abc"}, "train.tokens expects an integer, got 'abc'"),
        ({}, {"train.tokens": "1.5"}, "train.tokens expects an integer"),
        ({}, {"train.lr": "fast"}, "train.lr expects a number"),
        ({}, {"train.progress": "maybe"}, "train.progress expects true or false"),
        ({"train": {"seq_len": "32"}}, None, "train.seq_len expects an integer, got the string '32'"),
        ({"train": {"tokens": "abc"}}, None, "train.tokens expects an integer"),
        ({"train": {"lr": "0.01"}}, None, "train.lr expects a number, got the string"),
        ({"train": {"progress": "false"}}, None, "train.progress expects true or false"),
        ({"train": {"seq_len": True}}, None, "train.seq_len expects an integer"),
        ({"train": {"seq_len": 3.5}}, None, "train.seq_len expects an integer"),
        ({"train": {"device": 0}}, None, "train.device expects a string"),
        ({"data": {"max_train_bytes": "100"}}, None, "data.max_train_bytes expects an integer"),
        ({"model": {"d_model": "64"}}, None, "model.d_model expects an integer"),
        ({"model": {"rope_scaling": "linear"}}, None, "model.rope_scaling expects a mapping"),
        ({}, {"model.rope_scaling": "{bad json"}, "model.rope_scaling"),
        # values
        ({"train": {"seq_len": 1024}, "model": {"max_seq_len": 512}}, None, "train.seq_len=1024 is longer than"),
        ({"train": {"batch_size": 0}}, None, "train.batch_size=0 must be a positive integer"),
        ({"train": {"grad_accum": -1}}, None, "train.grad_accum=-1"),
        ({"train": {"optimizer": "sgd"}}, None, "train.optimizer='sgd': allowed values are adamw, muon"),
        ({"train": {"parallel": "zero3"}}, None, "train.parallel='zero3'"),
        ({"train": {"prefix_mixin": 1.5}}, None, "prefix_mixin must lie in"),
        ({"train": {"schedule": "papr"}}, None, "not a known schedule"),
        ({"eval": {"batches": 0}}, None, "eval.batches"),
        ({"train": {"adam_eps": 0}}, None, "adam_eps=0.0 must be > 0"),
        ({"model": {"d_model": 30, "n_heads": 4}}, None, "invalid model section.*d_model"),
        ({"model": {"fusion": "mul"}}, None, "fusion"),
        ({"data": {"val_fraction": 1.5}}, None, "val_fraction"),
        ({"data": {"source": "synthetic:nosuchtask"}}, None, "nosuchtask"),
    ],
)
def test_bad_config_raises_config_error(raw, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_config(raw, overrides)
    assert isinstance(info.value, FullbandError)
    assert "\n" not in str(info.value).strip()  # one paragraph


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {tokens: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("train:\n  tokenz: 5\n")
    with pytest.raises(ConfigError, match=f"{unknown}: unknown field train.tokenz"):
        load_config(unknown)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty).flat() == RunConfig().flat()


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
def test_shipped_presets_load(preset):
    config = load_config(PRESET_DIR / f"{preset}.yaml")
    assert config.train.seq_len <= config.model.max_seq_len


def test_every_field_has_help():
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert field_help(cls, f.name), f"{cls.__name__}.{f.name} has no help text"


# ---- options fullband no longer has ------------------------------------------------------------------------

REMOVED = [("model", "embed_norm", False), ("train", "last_pass_loss_from", 1.0),
           ("train", "later_pass_weight_ramp", 0.0), ("train", "fusion_lr_multiplier", 1.0),
           ("train", "fusion_warmup_steps", 0)]


@pytest.mark.parametrize("section, name, value", REMOVED)
def test_a_config_that_names_a_removed_option_is_refused_as_unknown(section, name, value):
    """Whatever its value, the run that set it cannot be reproduced: one error, naming the option."""
    with pytest.raises(ConfigError, match=f"^config: unknown field {section}.{name}"):
        build_config({section: {name: value}})
    with pytest.raises(ConfigError, match=f"^unknown option --{section}.{name}"):
        build_config({}, {f"{section}.{name}": str(value)})


@pytest.mark.parametrize("section, name, value, allowed", [
    ("model", "fusion", "gate_token", "allowed values: gate, concat, add"),
    ("model", "feedback_source", "residual", "allowed values: final_norm"),
    ("train", "pass_loss", "first+last", "allowed values are paper, last, paper\\+last"),
])
def test_a_removed_value_is_refused_with_the_values_there_are(section, name, value, allowed):
    with pytest.raises(ConfigError, match=f"{name}={value!r}".replace("+", "\\+") + f".*{allowed}"):
        build_config({section: {name: value}})


def test_a_model_config_json_naming_a_removed_option_is_refused(tmp_path):
    fields = FullBandConfig().to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**fields, "embed_norm": False}))
    with pytest.raises(ValueError, match="unknown field\\(s\\) \\['embed_norm'\\]"):
        FullBandConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))

"""DecodeSettings: the one value every front door decodes with — parsing, overrides, errors, storage."""

from __future__ import annotations

import json

import pytest
from conftest import make_model

from fullband.decoding import DecodeSettings, DecodeSettingsError
from fullband.errors import ConfigError
from fullband.schedule import PassSchedule
from fullband.storage import load_pretrained


def test_values_from_text_are_read_once_and_checked():
    # command lines, URLs (lm-eval's model_args) and YAML deliver text
    assert DecodeSettings("fused", "3", "0.01", "16") == DecodeSettings("fused", 3, 0.01, 16)
    assert DecodeSettings("fused", "auto").fused_passes == "auto"
    for kwargs, message in [
        (dict(mode="hard"), "unknown decode_mode 'hard'; choose one of standard, soft, fused"),
        (dict(fused_passes=0), "fused_passes must be an integer >= 1, 'auto' or 'exact', got 0"),
        (dict(fused_passes=True), "fused_passes must be an integer >= 1, 'auto' or 'exact', got True"),
        (dict(fused_passes=2.5), "fused_passes must be an integer >= 1, 'auto' or 'exact', got 2.5"),
        (dict(fused_tol=-1), "fused_tol must be a number >= 0, got -1"),
        (dict(fused_tol=float("nan")), "fused_tol must be a number >= 0"),
        (dict(fused_tol="x"), "fused_tol must be a number >= 0, got 'x'"),
        (dict(fused_max_passes=0), "fused_max_passes must be an integer >= 1, got 0"),
    ]:
        with pytest.raises(DecodeSettingsError, match=message):
            DecodeSettings().with_overrides(**kwargs)
    assert issubclass(DecodeSettingsError, ConfigError)  # the CLI prints it as one line, exit status 2


def test_overrides_replace_only_what_is_given():
    stored = DecodeSettings("fused", "auto", 0.0, 1024)
    assert stored.with_overrides(mode=None, fused_passes=None) == stored
    assert stored.with_overrides(decode_mode="soft") == DecodeSettings("soft", "auto", 0.0, 1024)
    # fused passes alone ask for fused mode, keeping the stored tolerance and cap
    assert DecodeSettings("soft").with_overrides(fused_passes="auto") == DecodeSettings("fused", "auto")
    assert DecodeSettings("soft").with_overrides(fused_passes=2, mode="soft").mode == "soft"
    assert DecodeSettings("soft").with_overrides(fused_tol=0.5).mode == "soft"
    with pytest.raises(DecodeSettingsError, match="unknown decode setting"):
        stored.with_overrides(passes=2)


def test_labels():
    stored = DecodeSettings("fused", "auto", 0.1, 64)
    assert stored.with_label("fused") == stored
    assert stored.with_label("fused:2") == DecodeSettings("fused", 2, 0.1, 64)
    assert stored.with_label("standard").label == "standard"
    assert [DecodeSettings().with_label(x).label for x in ("soft", "fused:auto", "fused:7")] == [
        "soft", "fused:auto", "fused:7"]
    for bad in ("soft:2", "fused:", "turbo"):
        with pytest.raises(DecodeSettingsError, match="unknown decode mode"):
            DecodeSettings().with_label(bad)
    assert stored.describe() == "fused:auto (tol 0.1, at most 64 passes)"
    assert stored.prefill_passes == "auto" and DecodeSettings("soft", 3).prefill_passes == 0


def test_defaults_follow_the_training_schedule():
    assert DecodeSettings.trained_with(PassSchedule.parse("exact"), 512) == DecodeSettings(
        "fused", "exact", fused_max_passes=512)
    for schedule, mode in (("paper", "soft"), ("fixed:3", "soft"), ("standard", "standard"), ("fixed:1", "standard")):
        assert DecodeSettings.trained_with(PassSchedule.parse(schedule), 512) == DecodeSettings(mode), schedule


def test_a_bound_per_request():
    limit = DecodeSettings("fused", 8).fused_max_passes
    DecodeSettings("fused", 8).check_within(limit)
    DecodeSettings("soft", 100).check_within(limit)  # passes that will not run are not refused
    with pytest.raises(DecodeSettingsError, match="fused_passes must be at most 8 here"):
        DecodeSettings("fused", 9).check_within(limit)
    with pytest.raises(DecodeSettingsError, match="fused_max_passes must be at most 8 here"):
        DecodeSettings("fused", "auto", fused_max_passes=9).check_within(limit)


def test_stored_with_the_weights(tmp_path):
    model = make_model()
    assert DecodeSettings.of(model) == DecodeSettings()  # a fresh model's fusion is untrained
    model.save_pretrained(tmp_path / "fresh")
    assert not (tmp_path / "fresh" / "generation_config.json").exists()
    settings = DecodeSettings("fused", "auto", 0.0, 96)
    model.decode_settings = settings
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "generation_config.json").read_text()) == {
        "decode_mode": "fused", "fused_passes": "auto", "fused_tol": 0.0, "fused_max_passes": 96}
    assert DecodeSettings.of(load_pretrained(tmp_path / "m")) == settings
    (tmp_path / "m" / "generation_config.json").write_text('{"decode_mode": "loud"}')
    with pytest.raises(DecodeSettingsError, match="generation_config.json: unknown decode_mode 'loud'"):
        load_pretrained(tmp_path / "m")  # refused where the directory is opened

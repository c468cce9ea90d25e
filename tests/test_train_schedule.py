"""The pass schedule (docs/method.md §5): presets, the paper's 75/22/3 mix, seeded draws, validation; and the lr
schedule."""

from __future__ import annotations

from collections import Counter

import pytest

from fullband.config import TrainConfig
from fullband.errors import ConfigError
from fullband.schedule import PRESETS, PassSchedule
from fullband.train.optim import in_cooldown, lr_multiplier


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_parse(name):
    schedule = PassSchedule.parse(name)
    assert schedule.phases[-1].until == 1.0
    for phase in schedule.phases:
        assert sum(p for _, p in phase.passes) == pytest.approx(1.0)


def test_paper_schedule():
    schedule = PassSchedule.parse("paper")
    total = 4000
    ks = [schedule.passes_for_step(s, total, seed=0) for s in range(total)]
    assert ks[:3000] == [1] * 3000  # the first 75% of the budget is single-pass
    later = Counter(ks[3000:])
    assert set(later) == {2, 3}
    assert later[2] / 1000 == pytest.approx(0.88, abs=0.03)  # 88/12 of the last quarter
    assert later[3] / 1000 == pytest.approx(0.12, abs=0.03)
    # over the whole run: 75 / 22 / 3
    overall = Counter(ks)
    assert overall[1] / total == 0.75
    assert overall[2] / total == pytest.approx(0.22, abs=0.01) and overall[3] / total == pytest.approx(0.03, abs=0.01)
    assert schedule.mean_passes() == pytest.approx(1.28)
    assert schedule.max_passes == 3
    assert sum(ks) / total == pytest.approx(1.28, abs=0.01)


def test_other_presets_and_fixed():
    assert PassSchedule.parse("paper-100b").mean_passes() == pytest.approx(1.5)
    assert PassSchedule.parse("standard").mean_passes() == 1.0
    from_start = PassSchedule.parse("feedback-from-start")
    assert from_start.mean_passes() == pytest.approx(2.12) and from_start.max_passes == 3
    assert {from_start.passes_for_step(s, 100, 0) for s in range(100)} == {2, 3}  # no single-pass step
    fixed = PassSchedule.parse("fixed:3")
    assert {fixed.passes_for_step(s, 10, 0) for s in range(10)} == {3} and fixed.max_passes == 3
    assert [PassSchedule.parse("paper-100b").passes_for_step(s, 8, 0) for s in range(8)] == [1] * 6 + [3] * 2


def test_draws_depend_only_on_seed_and_step():
    a, b = PassSchedule.parse("paper"), PassSchedule.parse("paper")
    draws = [a.passes_for_step(s, 400, seed=7) for s in range(300, 400)]
    assert draws == [b.passes_for_step(s, 400, seed=7) for s in range(300, 400)]
    # in any order (a resumed run, another rank): the same K for the same step
    assert [a.passes_for_step(s, 400, seed=7) for s in reversed(range(300, 400))] == draws[::-1]
    assert draws != [a.passes_for_step(s, 400, seed=8) for s in range(300, 400)]


def test_custom_phases_and_command_line_json_keys():
    spec = [{"until": 0.5, "passes": {"1": 1.0}}, {"until": 1.0, "passes": {"2": 0.25, "4": 0.75}}]
    schedule = PassSchedule.parse(spec)
    assert schedule.phases[1].passes == ((2, 0.25), (4, 0.75))
    assert schedule.mean_passes() == pytest.approx(0.5 + 0.5 * (0.5 + 3.0))
    assert schedule.passes_for_step(4, 10, 0) == 1 and schedule.passes_for_step(5, 10, 0) in (2, 4)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("papr", "not a known schedule"),
        ("fixed:0", "fixed:K needs an integer K >= 1"),
        ("fixed:two", "fixed:K needs an integer K >= 1"),
        ([], "non-empty list"),
        (42, "preset name or a non-empty list"),
        ([{"until": 1.0}], "expected {until"),
        ([{"until": 1.0, "passes": {1: 1.0}, "extra": 1}], "expected {until"),
        ([{"until": 1.0, "passes": [1, 2]}], "expected {until"),
        ([{"until": "soon", "passes": {1: 1.0}}], "'until' must be a number"),
        ([{"until": None, "passes": {1: 1.0}}], "'until' must be a number"),
        ([{"until": 0.5, "passes": {1: 1.0}}], "last phase must end at until: 1.0"),
        ([{"until": 0.6, "passes": {1: 1.0}}, {"until": 0.4, "passes": {1: 1.0}}], "must increase"),
        ([{"until": 1.5, "passes": {1: 1.0}}], "must increase within"),
        ([{"until": 0.0, "passes": {1: 1.0}}], "must increase within"),
        ([{"until": 1.0, "passes": {1: 0.5, 2: 0.4}}], "sum to 1"),
        ([{"until": 1.0, "passes": {0: 1.0}}], "K >= 1"),
        ([{"until": 1.0, "passes": {1: 1.5, 2: -0.5}}], "probabilities in \\[0, 1\\]"),
        ([{"until": 1.0, "passes": {1: float("nan")}}], "sum to 1"),
        ([{"until": 1.0, "passes": {}}], "sum to 1"),
        ([{"until": 1.0, "passes": {"two": 1.0}}], "integers K"),
        ([{"until": 1.0, "passes": {2.5: 1.0}}], "integers K"),
        ([{"until": 1.0, "passes": {1: "most"}}], "integers K"),
    ],
)
def test_invalid_schedules_raise_config_error(spec, message):
    with pytest.raises(ConfigError, match=message):
        PassSchedule.parse(spec)


def test_lr_schedule():
    cfg = TrainConfig(warmup_steps=2, lr_schedule="wsd", decay_fraction=0.25, min_lr_ratio=0.0)
    mult = [lr_multiplier(s, 8, cfg) for s in range(8)]
    assert mult == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0])
    assert [in_cooldown(s, 8, cfg) for s in range(8)] == [False] * 6 + [True] * 2
    sqrt = TrainConfig(warmup_steps=0, lr_schedule="wsd", decay_fraction=0.5, decay_shape="1-sqrt", min_lr_ratio=0.1)
    assert [lr_multiplier(s, 8, sqrt) for s in range(8)] == pytest.approx(
        [1.0] * 4 + [0.1 + 0.9 * (1 - (k / 4) ** 0.5) for k in (1, 2, 3, 4)])
    square = TrainConfig(warmup_steps=0, lr_schedule="wsd", decay_fraction=0.5, decay_shape="1-square")
    assert [lr_multiplier(s, 8, square) for s in range(4, 8)] == pytest.approx([1 - (k / 4) ** 2 for k in (1, 2, 3, 4)])
    cosine = TrainConfig(warmup_steps=0, lr_schedule="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(0, 10, cosine) == pytest.approx(1.0) and lr_multiplier(10, 10, cosine) == pytest.approx(0.1)
    assert lr_multiplier(5, 10, TrainConfig(warmup_steps=1, lr_schedule="constant")) == 1.0

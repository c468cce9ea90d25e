"""The state-tracking lab's helpers (experiments/state_tracking/): batches and grading of kept models, task
variants, the sweep table built from the runner's records, and the flip-flop window analysis."""

from __future__ import annotations

import json
import random

import pytest
import torch

from experiments.state_tracking import flipflop_window, table
from experiments.state_tracking import tasks as core
from experiments.state_tracking.state_drift import Novelty, per_move_curves
from experiments.stats import fmt, interval, t975, wilson
from fullband.data import ByteTokenizer
from fullband.data.synthetic import state_tracking_task, synthetic_examples


def test_labels_cover_the_answer_and_grading_is_exact():
    task = state_tracking_task("s3", 4, 4)
    examples = [task.generate(random.Random(i)) for i in range(3)]
    ids, labels = core.encode_batch(examples, ByteTokenizer())
    tok = ByteTokenizer()
    for row, label, ex in zip(ids, labels, examples):
        predicted = [t for t in label.tolist() if t != core.IGNORE]
        assert tok.decode(predicted) == ex.answer + "\n"
        # label t is token t + 1
        assert all(label[t] == row[t + 1] for t in range(len(row) - 1) if label[t] != core.IGNORE)
    perfect = torch.nn.functional.one_hot(labels.clamp(min=0), 259).float()
    assert core.answer_correct(perfect, labels).all()
    wrong = perfect.clone()
    first = (labels[0] != core.IGNORE).nonzero()[1].item()  # the first digit of row 0's answer
    wrong[0, first] = torch.roll(wrong[0, first], 1)
    assert core.answer_correct(wrong, labels).tolist() == [False, True, True]
    newline = perfect.clone()
    newline[1, -2] = torch.roll(newline[1, -2], 1)  # the closing newline is not graded
    assert core.answer_correct(newline, labels).all()


def test_task_variants_pass_their_options():
    example = core.task_with_moves("cycle:size=3", 6).generate(random.Random(0))
    moves = example.prompt.split(" ")[1]
    assert example.answer == f" {sum({'+': 1, '-': -1, '=': 0}[m] for m in moves) % 3}"
    digits = core.task_with_moves("summod:modulus=3", 40).generate(random.Random(1)).prompt.split(" ")[1]
    assert set(digits) <= {"0", "1", "2"} and len(digits) == 40
    assert core.task_base("cycle:size=3") == "cycle" and core.task_base("s5") == "s5"


def test_t_interval_is_wider_than_one_standard_deviation_for_three_seeds():
    assert t975(2) == 4.303 and abs(t975(200) - 1.972) < 1e-3 and t975(31) < t975(30)
    mean, half = interval([0.855, 0.995, 0.760])
    assert round(mean, 3) == 0.870 and round(half, 3) == 0.294  # ± 0.118 sd would claim 2.5× the precision
    assert fmt([0.5]) == "0.500 (1 seed)" and fmt([1.0, 1.0], "+.2f") == "+1.00 [+1.00, +1.00]"
    with pytest.raises(ValueError, match="at least 2"):
        interval([1.0])


def test_wilson_interval_gives_rows_that_all_agree_a_width():
    low, high = wilson(600, 600)  # 3 seeds x 200 rows, all right: the t interval over seeds has zero width
    assert high == pytest.approx(1.0) and round(low, 4) == 0.9936 and low == pytest.approx(600 / (600 + 1.959964**2))
    assert [round(x, 4) for x in wilson(5, 10)] == [0.2366, 0.7634]
    assert wilson(0, 10)[0] == 0.0 and round(wilson(0, 10)[1], 4) == 0.2775
    with pytest.raises(ValueError, match="Wilson"):
        wilson(3, 2)


def record(task: str, seed: int, fused: dict[str, str], standard: str | dict[str, str] = "0000") -> dict:
    """A run's record as the runner merges it, graded on four rows at each length (`standard`: the plain pass's
    grades, the same at every length or per length)."""
    def cell(bits: str) -> dict:
        return {"accuracy": bits.count("1") / len(bits), "ci": [0.0, 1.0], "mean_passes": 9.0, "unconverged": 0,
                "problems": ["0", "1", "2", "3"], "correct": bits}
    return {"task": task, "seed": seed, "steps": 10, "tokens": 1000, "compute_tokens": 9000, "train_seconds": 3,
            "passes_min": 5, "passes_max": 9, "passes_mean": 7.0, "kept_step": 10,
            "lengths": {m: {"fused:auto": cell(bits),
                            "standard": cell(standard if isinstance(standard, str) else standard[m])}
                        for m, bits in fused.items()}}


def test_table_pairs_modes_on_the_same_rows_with_t_intervals_and_marks_missing_lengths(tmp_path, capsys):
    runs = [record("s5", 0, {"2": "1111", "4": "1100"}), record("s5", 1, {"2": "1111", "4": "1110"}),
            record("parity", 0, {"2": "1111"})]
    text = table.table(runs)
    rows = text.splitlines()
    assert rows[2].startswith("| parity | 0 |") and "1.000 / —" in rows[2]  # parity was not graded at 4 moves
    assert rows[-1].startswith("| s5 | [0, 1] | 1.000 [1.000, 1.000] / 0.625 [")
    diff = fmt([0.5, 0.75], "+.3f")
    assert rows[-1].endswith(f"/ {diff} |")  # fused:auto − standard per seed, then the t interval over seeds
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text(json.dumps(runs))
    table.main(["a", "--results", str(results)])
    assert capsys.readouterr().out.strip() == text and (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    longer = [record("s5", 0, {"2": "1111", "4": "1111"}), record("s5", 1, {"2": "1111", "4": "1000"})]
    (results / "b.json").write_text(json.dumps(longer))
    table.main(["b", "--results", str(results), "--against", "a"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| s5 | 0 | 2: +0.000, 4: +0.500 | 0 / 2 / 0 (0.0) |"
    assert lines[3] == "| s5 | 1 | 2: +0.000, 4: -0.500 | 3 / 1 / 1 (0.8) |"  # rows 1, 2, 3 and row 3 fail
    other_rows = record("s5", 0, {"2": "1111"})
    other_rows["lengths"]["2"]["fused:auto"]["problems"] = ["0", "1", "2", "5"]
    with pytest.raises(SystemExit, match="different rows"):
        table.against([other_rows], runs, "x", "a")
    with pytest.raises(SystemExit, match="python -m experiments.run missing"):
        table.main(["missing", "--results", str(results)])


def test_a_baseline_sweep_is_tabled_in_its_one_pass_and_paired_with_the_fbt_in_its_recurrence():
    fbt = [record("s5", 0, {"2": "1111", "4": "1100"})]
    baseline = record("s5", 0, {"2": "0000", "4": "0000"}, standard={"2": "1111", "4": "1100"})
    for cell in baseline["lengths"].values():
        del cell["fused:auto"]  # a baseline sweep grades standard only
    rows = table.table([baseline]).splitlines()
    assert "fused:auto" not in rows[0] and rows[0].endswith("| standard at 4 moves: 95% interval (mean passes) |")
    assert rows[-1] == "| s5 | [0] | 1.000 (1 seed) / 0.500 (1 seed) |"  # no paired column without fused:auto
    lines = table.against(fbt, [baseline], "fbt", "base").splitlines()
    assert "paired fbt fused:auto − base standard" in lines[0]
    assert lines[2] == "| s5 | 0 | 2: +0.000, 4: +0.000 | 2 / 2 / 2 (1.0) |"


def test_flipflop_visibility_counts_the_tokens_before_the_digit_and_splits_a_run(tmp_path, capsys):
    examples = synthetic_examples(core.task_with_moves("flipflop", 12), 50, 10_001)
    # the digit is predicted at the answer's space; " :" and that space sit between it and the last move
    assert flipflop_window.visible_rows("flipflop", 12, 50, 10_001, 3) == [False] * 50
    last_is_write = [ex.prompt[-3] != "." for ex in examples]
    assert flipflop_window.visible_rows("flipflop", 12, 50, 10_001, 4) == last_is_write
    assert 0 < sum(last_is_write) < 50
    assert flipflop_window.visible_rows("flipflop", 12, 50, 10_001, 16) == [True] * 50  # the first move is a write
    run = {"eval": {"1": {"plain": "1100"}}}
    assert flipflop_window.run_split(run, {"1": [True, False, True, False]}) == {"visible": [0.5], "hidden": [0.5]}
    assert flipflop_window.run_split(run, {"1": [True, True, False, False]}) == {"visible": [1.0], "hidden": [0.0]}
    flipflop_window.main(["--quick", "--out", str(tmp_path / "w.json")])
    assert "ceiling without feedback" in capsys.readouterr().out
    assert json.loads((tmp_path / "w.json").read_text())["receptive_field"] == 7


def test_probe_and_novelty_tell_states_on_the_trained_region_from_states_that_drift():
    torch.manual_seed(0)
    codebook = torch.randn(5, 16, dtype=torch.float64) * 10
    fit_y = torch.randint(0, 5, (400,))
    fit_h = codebook[fit_y] + torch.randn(400, 16, dtype=torch.float64)
    fit_h = torch.cat([fit_h, fit_h[:200]])  # shared prefixes repeat states exactly: they must not zero the scale
    fit_y = torch.cat([fit_y, fit_y[:200]])
    assert Novelty(fit_h)(fit_h[:3]).tolist() == [0.0, 0.0, 0.0]
    y = torch.randint(0, 5, (50, 6))
    offsets = torch.tensor([0.0, 0.0, 5.0, 10.0, 20.0, 40.0], dtype=torch.float64)  # a state that drifts away
    h = codebook[y] + torch.randn(50, 6, 16, dtype=torch.float64) + offsets[None, :, None] * torch.randn(16).abs()
    curves = per_move_curves(h, y, fit_h, fit_y, classes=5)
    assert curves["probe"][:2] == [1.0, 1.0] and curves["probe"][-1] < 0.9
    assert 0.5 < curves["novelty"][0] < 2 and curves["novelty"][1] < 2
    later = curves["novelty"][1:]
    assert all(b > a for a, b in zip(later, later[1:]))


def test_a_half_written_model_is_named_in_the_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"half a file")
    with pytest.raises(SystemExit, match="not a model written by fullband train"):
        core.load_run_model(tmp_path)


def test_a_sweep_graded_with_fused_exact_and_on_validation_rows():
    """The sweeps graded to 32x use fused:exact as the recurrence (paired with an older sweep's fused:auto) and
    carry validation rows; `--rows val` tables those instead of the test rows."""
    exact = record("s5", 0, {"2": "1111", "4": "1100"})
    for cell in exact["lengths"].values():
        cell["fused:exact"] = cell.pop("fused:auto")
    exact["val_lengths"] = record("s5", 0, {"2": "1111", "4": "0000"})["lengths"]
    for cell in exact["val_lengths"].values():
        cell["fused:exact"] = cell.pop("fused:auto")
    rows = table.table([exact]).splitlines()
    assert "paired fused:exact − standard" in rows[-3] and rows[-1].startswith("| s5 | [0] | 1.000 (1 seed) / 0.500")
    val = table.rows_of([exact], "val", "x")
    assert table.table(val).splitlines()[-1].startswith("| s5 | [0] | 1.000 (1 seed) / 0.000")
    lines = table.against([exact], [record("s5", 0, {"2": "1111", "4": "1000"})], "new", "old").splitlines()
    assert "paired new fused:exact − old fused:auto" in lines[0]
    assert lines[2].startswith("| s5 | 0 | 2: +0.000, 4: +0.250")
    with pytest.raises(SystemExit, match="no val_seed"):
        table.rows_of([record("s5", 0, {"2": "1111"})], "val", "old")


def test_compare_tables_each_sweep_in_its_own_mode_and_pairs_the_first_with_the_others(tmp_path, capsys):
    from experiments.state_tracking import compare

    fbt = [record("s5", 0, {"2": "1111", "4": "1100"}), record("s5", 1, {"2": "1111", "4": "1110"})]
    lstm = [record("s5", s, {"2": "0000", "4": "0000"}, standard={"2": "1100", "4": "1000"}) for s in (0, 1)]
    for r in lstm:
        r["arch"], r["compute_tokens"] = "lstm", r["tokens"]
        for cell in r["lengths"].values():
            del cell["fused:auto"]
    results = tmp_path / "results"
    results.mkdir()
    (results / "fbt.json").write_text(json.dumps(fbt))
    (results / "lstm.json").write_text(json.dumps(lstm))
    compare.main(["fbt", "lstm", "--results", str(results), "--plot", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert "| s5 | FBT (fbt, fused:auto) | 2 | 1.000 [1.000, 1.000] | 0.625 [" in out
    assert "| s5 | LSTM (lstm, standard) | 2 | 0.500 [0.500, 0.500] | 0.250 [0.250, 0.250] |" in out
    assert "| LSTM (lstm, standard) | 2 | 0.00 M | 0.00 M | 3–3 |" in out  # tokens = compute: one pass
    assert f"| s5 | [0, 1] | {fmt([0.5, 0.5], '+.3f')} / {fmt([0.25, 0.5], '+.3f')} |" in out
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_pooled_gives_the_seed_interval_and_the_wilson_interval_over_the_pooled_rows(tmp_path, capsys):
    from experiments.state_tracking import pooled

    runs = [record("s5", 0, {"4": "1111", "8": "1110"}), record("s5", 1, {"4": "1111", "8": "1111"}),
            record("parity", 0, {"4": "0000", "8": "0000"})]
    lines = pooled.pooled(runs, "s5")
    assert [line["moves"] for line in lines] == [4, 8] and lines[0]["mode"] == "fused:auto"
    assert lines[0]["t"] == "1.000 [1.000, 1.000]" and (lines[0]["correct"], lines[0]["rows"]) == (8, 8)
    assert lines[0]["wilson"] == wilson(8, 8) and lines[0]["wilson"][0] < 1.0
    assert lines[1]["accuracy"] == [0.75, 1.0] and (lines[1]["ge090"], lines[1]["ge099"]) == (1, 1)
    (tmp_path / "sweep.json").write_text(json.dumps(runs))
    pooled.main(["sweep", "--results", str(tmp_path)])
    assert "| 8 | 0.750 1.000 | 0.875 [" in capsys.readouterr().out


def test_twins_pair_the_same_seeds_and_find_where_their_training_losses_part():
    from experiments.state_tracking.twins import parting_step, twins

    def record(seed, accuracy, losses):
        cell = {"fused:exact": {"accuracy": accuracy, "correct": "1"}, "standard": {"accuracy": 0.0, "correct": "0"}}
        return {"task": "s5", "seed": seed, "kept_step": 3, "lengths": {"16": cell},
                "val_lengths": {"16": cell, "128": cell}, "train_curve": [[i + 1, v] for i, v in enumerate(losses)],
                "val_curve": [[3, {"sequential": 0.1}]]}

    first = [record(1, 0.95, [5.0, 4.0, 3.0]), record(2, 0.40, [5.0, 4.0, 3.0]), record(3, 1.0, [1.0])]
    second = [record(1, 0.90, [5.0, 4.001, 1.0]), record(2, 0.99, [5.0, 2.0, 1.0])]
    result = twins(first, second, "s5")
    assert result["seeds"] == [1, 2]  # seed 3 has no twin
    row = next(r for r in result["lengths"] if r["moves"] == 128)
    assert row["within_005"] == 1 and row["ge099"] == 1 and row["runs"] == 4
    parts = {c["seed"]: c["parting_steps"] for c in result["curves"]}
    assert parts[1] == {"0.0001": 2, "0.01": 3, "0.5": 3} and parts[2] == {"0.0001": 2, "0.01": 2, "0.5": 3}
    assert parting_step([[1, 1.0], [2, 1.0]], [[1, 1.0], [2, 1.0]], 1e-4) is None

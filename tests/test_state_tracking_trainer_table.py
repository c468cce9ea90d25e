"""benchmarks/state_tracking_trainer.sh end to end at a tiny size (export, `fullband train --config
state-tracking`, `fullband bench` at 1, 2, 4 and 8 x L moves), and the table and plot built from its run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("trainer_table", ROOT / "benchmarks" / "state_tracking_trainer_table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)


def test_trainer_script_runs_and_its_table_pairs_the_modes_on_the_same_rows(tmp_path, capsys):
    run = tmp_path / "st_trainer_parity_s0_len16"
    env = {**os.environ, "PYTHON": sys.executable, "MOVES": "2", "RECORDS": "300", "OMP_NUM_THREADS": "1"}
    # 3 steps of 32 windows, a validation every step (the kept model), a tiny model
    subprocess.run(["bash", str(ROOT / "benchmarks/state_tracking_trainer.sh"), "parity", "0", str(run),
                    "--train.tokens", "3072", "--train.eval_every", "1", "--eval.batches", "1",
                    "--model.d_model", "16", "--model.d_ff", "32", "--model.n_heads", "2"],
                   check=True, env=env, cwd=ROOT, capture_output=True)
    out = tmp_path / "len16.json"
    png = tmp_path / "len16.png"
    table.main(["--runs-dir", str(tmp_path), "--out", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    (record,) = json.loads(out.read_text())
    assert (record["task"], record["seed"], record["steps"]) == ("parity", 0, 3)
    assert set(record["lengths"]) == {"2", "4", "8", "16"} and 1 <= record["kept_step"] <= 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["passes_min"] <= record["passes_mean"] <= record["passes_max"]
    for cells in record["lengths"].values():
        std, fused = cells["standard"], cells["fused:auto"]
        assert std["problems"] == fused["problems"] and len(std["correct"]) == len(std["problems"]) == 200
        assert std["accuracy"] == std["correct"].count("1") / 200  # the per-row grades are fullband bench's
    diff = (record["lengths"]["16"]["fused:auto"]["correct"].count("1")
            - record["lengths"]["16"]["standard"]["correct"].count("1")) / 200
    assert "| parity | [0] | " in printed and f"{diff:+.3f}" in printed.splitlines()[-1]
    assert "| standard, 2 / 4 / 8 / 16 moves |" in printed
    table.main(["--from-json", "--out", str(out), "--plot", ""])  # the committed JSON alone rebuilds the same table
    assert capsys.readouterr().out == printed

    # runs/ is not committed: a later table keeps the JSON's other runs and replaces the one it has again
    other = {**record, "task": "summod", "seed": 1}
    stale = {**record, "kept_step": -1}
    out.write_text(json.dumps([other, stale]) + "\n")
    table.main(["--runs-dir", str(tmp_path), "--out", str(out), "--plot", ""])
    merged = json.loads(out.read_text())
    assert [(r["task"], r["seed"], r["kept_step"]) for r in merged] == [
        ("parity", 0, record["kept_step"]), ("summod", 1, record["kept_step"])]
    for task, seed, code in (("summod", "1", 0), ("summod", "0", 1), ("s5", "1", 1)):
        try:
            table.main(["--out", str(out), "--has", task, seed])
        except SystemExit as exit_:
            assert exit_.code == code
        else:
            raise AssertionError("--has must exit")

    # a run graded at fewer lengths (an earlier grading script) shows — there, and its task's difference says
    # over how many seeds it is
    short = {**record, "seed": 1, "lengths": {m: record["lengths"][m] for m in ("2", "16")}}
    rows = table.table([record, short]).splitlines()
    assert rows[3].startswith("| parity | 1 |") and " / — / — / " in rows[3]
    assert rows[-1].startswith("| parity | [0, 1] | ") and rows[-1].count("(1 of 2 seeds)") == 2


def test_a_label_the_table_cannot_name_is_refused_before_any_training():
    # "len16_decay0.5" once trained for 30 minutes and then could not be merged: refuse it up front, and
    # never with --has's "not held" (exit 1), which would make the queue train it.
    env = {**os.environ, "PYTHON": sys.executable, "LABEL": "len16_decay0.5", "JOBS": "parity:0"}
    queue = subprocess.run(["sh", "benchmarks/state_tracking_trainer_queue.sh"], env=env, cwd=ROOT,
                           capture_output=True, text=True)
    assert queue.returncode == 2 and "letters, digits and _ only" in queue.stderr
    assert not list((ROOT / "runs").glob("st_trainer_*_len16_decay0.5*"))  # no run, no data, no lane log
    has = subprocess.run([sys.executable, str(ROOT / "benchmarks/state_tracking_trainer_table.py"), "--label",
                          "len16_decay0.5", "--has", "parity", "0"], capture_output=True, text=True)
    assert has.returncode == 2 and "letters, digits and _ only" in has.stderr


def _record(seed: int, correct_at: dict[str, str]) -> dict:
    return {"task": "s5", "seed": seed, "lengths": {
        m: {"fused:auto": {"problems": [str(i) for i in range(len(c))], "correct": c}} for m, c in correct_at.items()}}


def test_against_pairs_two_labels_on_the_same_rows_and_counts_shared_failures(tmp_path, capsys):
    # seed 2 in both labels (seed 1 only in one: left out); at 128 moves "new" fails rows 0 and 1, "old" rows 1-3
    (tmp_path / "new.json").write_text(json.dumps([_record(1, {"16": "1111"}),
                                                   _record(2, {"16": "1111", "64": "1110", "128": "0011"})]))
    (tmp_path / "old.json").write_text(json.dumps([_record(2, {"16": "1111", "128": "1000"})]))
    table.main(["--label", "new", "--out", str(tmp_path / "new.json"), "--against", "old"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| s5")]
    # 128: (0+0+1+1)/4 − (1+0+0+0)/4 = +0.25; failures 2 and 3, one shared, 2 × 3 / 4 = 1.5 if independent
    assert rows == ["| s5 | 2 | 16: +0.000, 128: +0.250 | 2 / 3 / 1 (1.5) |"]
    (tmp_path / "old.json").write_text(json.dumps([_record(2, {"16": "11"})]))  # graded on other rows
    with pytest.raises(SystemExit, match="different rows"):
        table.main(["--label", "new", "--out", str(tmp_path / "new.json"), "--against", "old"])
    with pytest.raises(SystemExit, match="grade both labels first"):
        table.main(["--label", "new", "--out", str(tmp_path / "new.json"), "--against", "missing"])

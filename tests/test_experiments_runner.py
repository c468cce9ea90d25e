"""experiments/run.py, the one runner of the lab, at a tiny size: a state-tracking sweep trains through
`fullband train`, grades through `fullband bench` and merges its record; a rerun skips it; a runner killed in the
middle of training resumes the run from its checkpoint. Also the registry and the data it trains on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from experiments import run as runner
from experiments.state_tracking.tasks import export_records
from experiments.sweeps import ARMS, SWEEPS, LMSweep, StateTrackingSweep
from fullband.config import load_config
from fullband.data.synthetic import state_tracking_task, synthetic_examples
from fullband.loading import PRESET_DIR

ROOT = Path(__file__).resolve().parents[1]
# 20 steps of 4 windows on a tiny model, a checkpoint and a validation every 5: long enough to be killed mid-run
TINY = {"train.tokens": "2560", "train.batch_size": "4", "train.eval_every": "5", "train.ckpt_every": "5",
        "eval.batches": "1", "model.d_model": "16", "model.d_ff": "32", "model.n_heads": "2",
        "train.compile_recurrence": "0"}  # the token steps uncompiled: no cold compile (~150 s) in a test
SWEEP_ARGS = {"name": "tiny", "doc": "a test", "tasks": ["parity"], "seeds": [0], "overrides": TINY, "moves": 4,
              "records": 400, "lengths": [1, 2], "test_rows": 10, "val_seed": 30_000, "modes": "standard,fused:exact"}
SWEEP = StateTrackingSweep(**SWEEP_ARGS)


def test_export_keeps_every_test_prompt_out_of_the_training_and_validation_records(tmp_path):
    # Flip-flop on 1..4 moves repeats prompts often, as it does at 16 moves (98 of its 200 test rows at 1× were
    # validation prompts): the test rows of 4 moves must not come back through train.jsonl, from which the
    # trainer draws its validation rows too.
    out = tmp_path / "data"
    manifest = export_records("flipflop", 0, 4, 2000, [4, 8], 50, 10_000, out)
    tests = {json.loads(line)["prompt"] for n in (4, 8) for line in (out / f"test{n}.jsonl").open()}
    train = [json.loads(line)["prompt"] for line in (out / "train.jsonl").open()]
    assert manifest["dropped_test_prompts"] > 0  # there were repeats to drop
    assert not tests & set(train) and len(train) == manifest["records"] == 2000 - manifest["dropped_test_prompts"]
    # the records the committed runs trained on (the queue exported synthetic_examples of the same seed), less the
    # repeats of a test prompt
    drawn = [ex.prompt for ex in synthetic_examples(state_tracking_task("flipflop", 1, 4), 2000, 0)]
    assert train == [p for p in drawn if p not in tests]
    before = (out / "train.jsonl").stat().st_mtime_ns
    assert export_records("flipflop", 0, 4, 2000, [4, 8], 50, 10_000, out) == manifest
    assert (out / "train.jsonl").stat().st_mtime_ns == before  # prepared once


def test_runner_trains_grades_merges_skips_and_resumes_a_killed_run(tmp_path, monkeypatch):
    monkeypatch.setitem(SWEEPS, "tiny", SWEEP)
    results, runs = tmp_path / "tiny.json", tmp_path / "runs"
    # A runner in its own process group, killed (with its `fullband train`) once the run has a checkpoint.
    code = ("import json, sys; from pathlib import Path; from experiments import run, sweeps; "
            "s = sweeps.StateTrackingSweep(**json.loads(sys.argv[3])); "
            "run.Runner(s, Path(sys.argv[1]), Path(sys.argv[2])).run(s.jobs(), 1)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(runs), str(results), json.dumps(SWEEP_ARGS)], cwd=ROOT,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = runs / "tiny" / "parity_s0"
    deadline = time.monotonic() + 120
    while not list((run / "checkpoints").glob("step_*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the runner finished before it could be killed"
    assert not results.exists() and not (run / "bench").exists()

    # --train-only: the run is finished from its checkpoint, nothing is graded or merged
    assert runner.Runner(SWEEP, runs, results, train_only=True).run(SWEEP.jobs(), 1) == [("parity", 0)]
    assert not results.exists() and not (run / "bench").exists()
    assert runner.Runner(SWEEP, runs, results).run(SWEEP.jobs(), 2) == [("parity", 0)]
    log = (runs / "tiny" / "parity_s0.log").read_text()
    assert "--resume" in log and "resumed from" in log  # continued from the checkpoint, not started again
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))  # every step once: the lines after the checkpoint were dropped and redone
    (record,) = json.loads(results.read_text())
    assert (record["task"], record["seed"], record["steps"]) == ("parity", 0, 20)
    assert set(record["lengths"]) == {"4", "8"} and 5 <= record["kept_step"] <= 20
    assert record["data"]["records"] + record["data"]["dropped_test_prompts"] == 400
    for cells in record["lengths"].values():  # the per-row grades are fullband bench's, the same rows per mode
        std, fused = cells["standard"], cells["fused:exact"]
        assert std["problems"] == fused["problems"] and len(std["correct"]) == 10
        assert std["accuracy"] == std["correct"].count("1") / 10
    # the validation rows (seed 30,000 + n) are graded beside the test rows, and are other rows
    assert set(record["val_lengths"]) == {"4", "8"}
    data = run.with_name(run.name + ".data")
    assert (data / "val8.jsonl").read_text() != (data / "test8.jsonl").read_text()
    assert len(record["val_lengths"]["8"]["fused:exact"]["correct"]) == 10
    stamp = results.stat().st_mtime_ns
    assert runner.Runner(SWEEP, runs, results).run(SWEEP.jobs(), 2) == []  # done: skipped, nothing rewritten
    assert results.stat().st_mtime_ns == stamp

    # the drift analysis reads the sweep's kept model: curves over every move of the 2× test rows
    from experiments.state_tracking import state_drift

    out, png = tmp_path / "drift.jsonl", tmp_path / "drift.png"
    state_drift.main(["--quick", "--sweep", "tiny", "--runs-dir", str(runs), "--tasks", "parity", "--seeds", "0",
                      "--out", str(out), "--plot", str(png)])
    (drift,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert drift["moves"] == 8 and drift["model"] == str(run / "best") and png.stat().st_size > 0
    assert all(len(drift[key]) == 8 for key in ("answer", "probe", "novelty", "novelty_ok"))
    assert drift["answer"][-1] == drift["answer_accuracy"]  # after all moves: the whole prompt's answer


def test_lm_sweep_trains_each_arm_at_its_budget_and_records_the_curve(tmp_path, single_thread):
    tiny = {"train.tokens": "1536", "train.seq_len": "32", "train.batch_size": "4", "eval.batches": "1",
            "eval.batch_size": "2", "data.max_train_bytes": "60000", "model.d_model": "32", "model.n_layers": "2",
            "model.d_ff": "64", "model.max_seq_len": "64", "train.eval_every": "4"}
    sweep = LMSweep("tiny_lm", "a test", ("baseline", "fbt_from0@2"), (0,), tiny)
    results = tmp_path / "lm.jsonl"
    runner.Runner(sweep, tmp_path / "runs", results).run(sweep.jobs(), 1)
    records = {r["arm"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert records["baseline"]["tokens"] == 1536 and records["fbt_from0@2"]["tokens"] == 3072  # NAME@X: X × tokens
    assert records["baseline"]["compute_tokens"] == 1536  # one pass
    assert records["fbt_from0@2"]["compute_tokens"] > 3072  # feedback passes cost compute
    final = records["fbt_from0@2"]["curve"][-1]
    assert final["loss"] == records["fbt_from0@2"]["loss"] and final["tokens"] == 3072
    assert [c["step"] for c in records["baseline"]["curve"]] == [4, 8, 12]


def test_every_sweep_is_a_valid_config_with_unique_jobs():
    for name, sweep in SWEEPS.items():
        assert len(set(sweep.jobs())) == len(sweep.jobs()), name
        arms = [runner.parse_arm(a)[0] for a in sweep.arms] if isinstance(sweep, LMSweep) else [None]
        for arm in arms:
            overrides = {**(ARMS[arm] if arm else {}), **sweep.overrides}
            load_config(PRESET_DIR / f"{sweep.preset}.yaml", overrides)  # raises on an unknown or bad field
    # sweeps that add to another's file share it; every file named is a sweep's own
    owners = {s.results for s in SWEEPS.values() if not s.into}
    assert all(s.results in owners for s in SWEEPS.values())
    # The regrade of the final preset draws test rows and seeds no reported sweep used; the sweeps graded on those
    # rows beside it (candidate recipes) are chosen on validation rows of their own seed, disjoint from every test set.
    fresh = SWEEPS["preset_fresh"]
    st = [s for s in SWEEPS.values() if isinstance(s, StateTrackingSweep)]
    on_fresh_rows = [s for s in st if s.test_seed == fresh.test_seed]
    older = [s for s in st if s.test_seed != fresh.test_seed]
    assert not set(fresh.seeds) & {seed for s in older for seed in s.seeds}
    assert all(s.val_seed is not None and s.val_seed not in {t.test_seed for t in st} for s in on_fresh_rows)


def test_unknown_jobs_and_sweeps_are_refused_with_what_exists(capsys):
    with pytest.raises(SystemExit, match="not a job of len16"):
        runner.main(["len16", "--only", "s5:9", "--dry-run"])
    with pytest.raises(SystemExit):
        runner.main(["no_such_sweep"])
    assert "unknown sweep 'no_such_sweep'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown LM arm"):
        runner.parse_arm("fbt_ramp")  # an arm of an option removed after 38f4146


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(SWEEPS, "tiny", SWEEP)  # a sweep no results file holds, so its job is not skipped
    assert runner.main(["tiny", "--only", "parity:0", "--runs-dir", str(tmp_path), "--dry-run"]) == [("parity", 0)]
    train, bench = capsys.readouterr().out.splitlines()
    assert " -m fullband train --config state-tracking " in train and "--train.seed 0" in train
    assert " -m fullband bench " in bench and "test8.jsonl" in bench and "--modes standard,fused:exact" in bench
    assert not any(tmp_path.iterdir())


def test_along_keeps_and_grades_every_checkpoint_once_and_the_analysis_reads_them(tmp_path, capsys):
    overrides = {k: v for k, v in TINY.items() if k != "train.ckpt_every"}  # a sweep's own overrides would win
    sweep = StateTrackingSweep(**{**SWEEP_ARGS, "name": "tiny_along", "overrides": overrides}, along=10,
                               along_lengths=(1, 2))
    results, runs = tmp_path / "results" / "tiny_along.json", tmp_path / "runs"
    assert runner.Runner(sweep, runs, results).run(sweep.jobs(), 1) == [("parity", 0)]
    (record,) = json.loads(results.read_text())
    run = runs / "tiny_along" / "parity_s0"
    # every `along` steps a checkpoint, all kept (the preset's keep_checkpoints would delete the first), each graded
    # by fullband bench on the validation rows of the sweep's along lengths
    assert [p["step"] for p in record["along"]] == [10, 20]
    for point in record["along"]:
        graded = json.loads((run / "along" / f"step_{point['step']:08d}" / "results.json").read_text())["results"]
        for moves in ("4", "8"):
            path = run.with_name(run.name + ".data") / f"val{moves}.jsonl"
            assert point["val"][moves] == graded[f"jsonl:{path}"]["fused:exact"]["0.0"]["accuracy"]
    stamps = [p.stat().st_mtime_ns for p in sorted((run / "along").glob("*/results.json"))]
    assert runner.Runner(sweep, runs, results).grade_along(run, {n: str(run.with_name(run.name + ".data") /
                                                                       f"val{n}.jsonl") for n in ("4", "8")},
                                                           tmp_path / "log") == record["along"]
    assert [p.stat().st_mtime_ns for p in sorted((run / "along").glob("*/results.json"))] == stamps  # not regraded

    from experiments.state_tracking import along

    SWEEPS["tiny_along"] = sweep
    try:
        along.main(["tiny_along", "--task", "parity", "--results", str(results.parent), "--runs-dir", str(runs),
                    "--plot", str(tmp_path / "along.png"), "--levers"])
    finally:
        del SWEEPS["tiny_along"]
    out = capsys.readouterr().out
    assert "| 0 |" in out and f"| {record['kept_step']} |" in out and (tmp_path / "along.png").stat().st_size > 0
    # the levers: graded at the along lengths; the averages are the mean weights of the checkpoints they name
    (graded,) = map(json.loads, (results.parent / "tiny_along_levers.jsonl").read_text().splitlines())
    assert graded["tail_steps"] == [10, 20] and set(graded["tail"]) == set(graded["keep8x"]) == {"4", "8"}
    weights = [load_file(run / "checkpoints" / f"step_{step:08d}" / "model" / "model.safetensors") for step in (10, 20)]
    tail = load_file(run / "levers" / "tail_model" / "model.safetensors")
    assert all(torch.allclose(tail[k], (weights[0][k].double() + weights[1][k].double()).div(2).float()) for k in tail)
    assert "- test rows, tail " in out and "- validation rows, swa (steps " in out


def test_along_refuses_lengths_the_sweep_does_not_grade(tmp_path):
    sweep = StateTrackingSweep(**{**SWEEP_ARGS, "name": "tiny_along"}, along=10, along_lengths=(4,))
    with pytest.raises(ValueError, match="along_lengths"):
        runner.Runner(sweep, tmp_path).grade_along(tmp_path, {}, tmp_path / "log")

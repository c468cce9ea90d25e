"""The language-modelling lab (experiments/lm_recipes/, experiments/contraction/): the arms' schedules, the tables
and plots built from an LM sweep's records, and the contraction measurement on the runs it trained."""

import json

from experiments import run as runner
from experiments.contraction import contraction
from experiments.lm_recipes import table as lm
from experiments.stats import fmt
from experiments.sweeps import ARMS, PAPER_LATE, LMSweep, phases
from experiments.traces import reasoning_traces as rt
from fullband.config import load_config
from fullband.loading import PRESET_DIR
from fullband.schedule import PassSchedule

TINY = {"train.tokens": "1536", "train.seq_len": "32", "train.batch_size": "4", "eval.batches": "1",
        "eval.batch_size": "2", "data.max_train_bytes": "60000", "model.d_model": "32", "model.n_layers": "2",
        "model.d_ff": "64", "model.max_seq_len": "64"}


def test_the_from_start_arm_is_the_schedule_its_runs_were_made_with():
    from_start = load_config(PRESET_DIR / "cpu.yaml", ARMS["fbt_from0"]).train.schedule
    explicit = load_config(PRESET_DIR / "cpu.yaml", {"train.schedule": phases((1.0, PAPER_LATE))})
    assert PassSchedule.parse(from_start) == PassSchedule.parse(explicit.train.schedule)
    assert PassSchedule.parse(from_start).phases[0].until == 1.0


def lm_record(arm: str, seed: int, standard: float, fused: float, mult: float = 1.0) -> dict:
    name = arm.partition("@")[0]
    compute = 100 * mult if name == "baseline" else 128
    return {"arm": arm, "name": name, "mult": mult, "seed": seed, "tokens": round(100 * mult),
            "compute_tokens": compute, "loss": {"standard": standard, "fused(1)": fused}}


def test_summary_pairs_each_arm_with_its_own_plain_pass_and_the_baselines_per_seed(tmp_path, capsys):
    records = [lm_record("baseline", 0, 1.0, 4.0), lm_record("baseline", 1, 1.2, 4.0),
               lm_record("fbt", 0, 1.1, 1.3), lm_record("fbt", 1, 1.25, 1.3),
               lm_record("baseline@1.25", 0, 0.9, 4.0, 1.25), lm_record("baseline@1.25", 1, 1.0, 4.0, 1.25)]
    text = lm.summarise(records)
    assert f"| fbt: fused(1) − own standard | 2 | {fmt([1.3 - 1.1, 1.3 - 1.25], '.4f')} |" in text
    assert f"| fbt standard − baseline (equal tokens) | 2 | {fmt([1.1 - 1.0, 1.25 - 1.2], '.4f')} |" in text
    # the baseline at 1.25× the tokens is the one of about the FBT's compute (1.28×)
    assert "| fbt fused(1) − baseline@1.25 (baseline at 1.25× tokens ≈ equal compute (1.28×)) | 2 |" in text
    results = tmp_path / "results"
    results.mkdir()
    (results / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lm.main(["x", "--results", str(results)])
    assert capsys.readouterr().out.startswith("| arm | seeds |") and (tmp_path / "x.png").stat().st_size > 0


def test_equal_token_differences_use_the_baseline_of_the_same_budget():
    def run(arm: str, name: str, mult: float, losses: list[float]) -> dict:
        return {"arm": arm, "name": name, "mult": mult, "seed": 0,
                "curve": [{"step": 10 * (i + 1), "tokens": 100 * (i + 1), "loss": {"standard": x, "fused(1)": x - 0.01}}
                          for i, x in enumerate(losses)]}

    baseline = run("baseline", "baseline", 1.0, [2.0, 1.5])
    longer = run("baseline@2", "baseline", 2.0, [2.2, 1.9, 1.4, 1.2])
    fbt = run("fbt", "fbt", 1.0, [2.1, 1.6])
    # the longer baseline comes last, as it does in a results file where it was run after the others
    diffs = lm.equal_token_differences([baseline, fbt, longer], lambda r, mode: r["curve"])
    assert [(r["arm"], mode, tokens) for r, mode, tokens, _ in diffs] == [
        ("fbt", "standard", [100, 200]), ("fbt", "fused(1)", [100, 200])]
    assert [round(d, 6) for d in diffs[0][3]] == [0.1, 0.1] and [round(d, 6) for d in diffs[1][3]] == [0.09, 0.09]


def test_contraction_reads_the_runs_an_lm_sweep_trained(tmp_path, capsys, single_thread):
    sweep = LMSweep("tiny_lm", "a test", ("fbt",), (0,), TINY)
    runs = tmp_path / "lm.jsonl"
    runner.Runner(sweep, tmp_path / "runs", runs).run(sweep.jobs(), 1)
    result = tmp_path / "c.jsonl"
    contraction.main(["--runs", str(runs), "--arms", "fbt", "--seeds", "0", "--seq-len", "16", "--out", str(result)])
    (record,) = [json.loads(line) for line in result.read_text().splitlines()]
    curve = record["curve"]
    assert curve["passes"] == list(range(16))  # k = 0 .. seq_len - 1
    assert abs(curve["loss"][15] - curve["sequential_loss"][15]) < 1e-5  # exact after seq_len - 1 passes
    assert "contraction ratio" in capsys.readouterr().out


def test_contraction_reads_the_reasoning_trace_runs(tmp_path, capsys, single_thread):
    runs = tmp_path / "rt.jsonl"
    rt.main(["--quick", "--seeds", "0", "--models", "fbt", "--work-dir", str(tmp_path / "w"), "--out", str(runs),
             "--plot", ""])
    result = tmp_path / "c.jsonl"
    contraction.main(["--runs", str(runs), "--arms", "fixed-fbt", "--seeds", "0", "--seq-len", "16",
                      "--out", str(result)])
    (record,) = [json.loads(line) for line in result.read_text().splitlines()]
    assert record["arm"] == "fixed-fbt" and record["run_dir"].endswith("fixed-fbt-seed0")
    assert "| fixed-fbt | 1 |" in capsys.readouterr().out

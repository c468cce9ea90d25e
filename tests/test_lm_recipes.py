"""benchmarks/lm_recipes.py --quick end to end: arms, token multiples, resume, paired summary."""

import importlib.util
import json
from pathlib import Path

from fullband.train.schedule import PassSchedule

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "lm_recipes.py"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lm = load_script("lm_recipes")


def test_every_arm_is_a_valid_config():
    for name, overrides in lm.ARMS.items():
        config = lm.load_config(lm.PRESET_DIR / "cpu.yaml", overrides)
        assert config.train.schedule is not None, name
    from_start = lm.load_config(lm.PRESET_DIR / "cpu.yaml", lm.ARMS["fbt_from0"]).train.schedule
    explicit = lm.load_config(lm.PRESET_DIR / "cpu.yaml", {"train.schedule": lm.phases((1.0, lm.PAPER_LATE))})
    # the preset is the same schedule as the phases the arm's recorded runs were made with
    assert PassSchedule.parse(from_start) == PassSchedule.parse(explicit.train.schedule)
    assert PassSchedule.parse(from_start).phases[0].until == 1.0


def test_quick_run_records_budgets_resumes_and_pairs(tmp_path, capsys, single_thread):
    out = tmp_path / "lm.jsonl"
    argv = ["--quick", "--arms", "baseline,fbt,baseline@2", "--seeds", "0", "--work-dir", str(tmp_path / "w"),
            "--out", str(out), "--plot", str(tmp_path / "lm.png")]
    lm.main(argv)
    records = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"baseline", "fbt", "baseline@2"}
    assert records["baseline@2"]["tokens"] == 2 * records["baseline"]["tokens"]
    assert records["baseline"]["compute_tokens"] == records["baseline"]["tokens"]  # one pass
    assert records["fbt"]["compute_tokens"] > records["fbt"]["tokens"]  # feedback passes cost compute
    text = capsys.readouterr().out
    assert "| fbt: fused(1) − own standard | 1 |" in text and "fbt standard − baseline (equal tokens)" in text
    assert (tmp_path / "lm.png").stat().st_size > 0
    lm.main(argv)  # all done: nothing retrained, nothing appended
    assert len(out.read_text().splitlines()) == 3


def test_contraction_reads_the_recipe_runs(tmp_path, capsys, single_thread):
    out = tmp_path / "lm.jsonl"
    lm.main(["--quick", "--arms", "fbt", "--seeds", "0", "--work-dir", str(tmp_path / "w"), "--out", str(out),
             "--plot", ""])
    contraction = load_script("contraction")
    result = tmp_path / "c.jsonl"
    contraction.main(["--runs", str(out), "--arms", "fbt", "--seeds", "0", "--seq-len", "16", "--out", str(result)])
    (record,) = [json.loads(line) for line in result.read_text().splitlines()]
    curve = record["curve"]
    assert curve["passes"] == list(range(16))  # k = 0 .. seq_len - 1
    assert abs(curve["loss"][15] - curve["sequential_loss"][15]) < 1e-5  # exact after seq_len - 1 passes
    assert "contraction ratio" in capsys.readouterr().out


def test_set_overrides_every_arm_and_records_the_validation_curve(tmp_path, capsys, single_thread):
    out = tmp_path / "lm.jsonl"
    lm.main(["--quick", "--arms", "baseline,fbt_from0", "--seeds", "0", "--work-dir", str(tmp_path / "w"),
             "--out", str(out), "--plot", "", "--set", "train.tokens=2048", "--set", "train.eval_every=4",
             "--curve-plot", str(tmp_path / "curve.png")])
    records = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["baseline"]["tokens"] == 2048  # --set wins over the preset's budget
    steps = [c["step"] for c in records["fbt_from0"]["curve"]]
    assert steps == [4, 8, 12, 16]  # every eval_every steps, then the final evaluation
    final = records["fbt_from0"]["curve"][-1]
    assert final["loss"] == records["fbt_from0"]["loss"] and final["tokens"] == 2048
    assert final["compute_tokens"] == records["fbt_from0"]["compute_tokens"] > 2048
    text = capsys.readouterr().out
    assert "| 16 | 2,048 |" in text and "fused(1) − baseline" in text
    assert (tmp_path / "curve.png").stat().st_size > 0
    try:
        lm.main(["--quick", "--arms", "baseline", "--out", str(out), "--set", "train.tokens"])
    except SystemExit as err:
        assert "SECTION.FIELD=VALUE" in str(err)
    else:
        raise AssertionError("a malformed --set must be refused")


def test_contraction_reads_the_reasoning_trace_runs(tmp_path, capsys, single_thread):
    rt = load_script("reasoning_traces")
    runs = tmp_path / "rt.jsonl"
    rt.main(["--quick", "--seeds", "0", "--models", "fbt", "--work-dir", str(tmp_path / "w"), "--out", str(runs),
             "--plot", ""])
    contraction = load_script("contraction")
    result = tmp_path / "c.jsonl"
    contraction.main(["--runs", str(runs), "--arms", "fixed-fbt", "--seeds", "0", "--seq-len", "16",
                      "--out", str(result)])
    (record,) = [json.loads(line) for line in result.read_text().splitlines()]
    assert record["arm"] == "fixed-fbt" and record["run_dir"].endswith("fixed-fbt-seed0")
    assert "| fixed-fbt | 1 |" in capsys.readouterr().out


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

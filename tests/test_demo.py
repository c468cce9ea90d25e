"""The main job, in its quick form: both runs, the table, samples in every mode, the plot; then the parity part,
trained by the trainer with the state-tracking preset and graded by the bench runner."""

import json

import yaml

from fullband.config import load_config
from fullband.data.config import DataConfig
from fullband.data.sources import iter_documents
from fullband.loading import PRESET_DIR
from fullband.tools.demo import PARITY, RUNS, TEST_BITS, TRAIN_BITS, run_demo, write_parity_data


def _bits(prompt: str) -> int:
    return len(prompt.removeprefix("parity ").removesuffix(" :"))


def test_quick_demo_end_to_end(tmp_path, capsys):
    summary = run_demo(tmp_path, quick=True)
    printed = capsys.readouterr().out
    assert "| baseline |" in printed and "| fbt |" in printed
    assert set(summary["eval"]) == set(RUNS)
    for result in summary["eval"].values():
        assert set(result["loss"]) == {"standard", "fused(1)", "fused(2)", "fused(3)", "sequential"}
    # Same token budget; the FBT's token-equivalent compute is larger once K > 1 steps happen.
    assert summary["compute_tokens"]["fbt"] > summary["compute_tokens"]["baseline"]
    assert len(summary["samples"]) == 6 and all(s.startswith("import os") for s in summary["samples"].values())
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["token_budget"] == summary["token_budget"]

    # The parity part: both models graded at 8 and 64 bits in their modes, table and plot.
    parity = summary["state_tracking"]
    runs = parity["runs"]
    assert set(runs["fbt"]["accuracy"]) == set(runs["baseline"]["accuracy"]) == {str(n) for n in TEST_BITS}
    assert set(runs["fbt"]["accuracy"]["64"]) == {"fused:exact", "standard"}
    assert set(runs["baseline"]["accuracy"]["64"]) == {"standard"}
    assert "| FBT, exact recurrence over the prompt |" in printed and "| standard transformer |" in printed
    assert (tmp_path / "state_tracking.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Same data and batches; the FBT ran more than one pass per step.
    fbt, baseline = runs["fbt"]["train"], runs["baseline"]["train"]
    assert fbt["tokens"] == baseline["tokens"] and fbt["compute_tokens"] > baseline["compute_tokens"]
    # The path a user runs: run directories of `fullband train --config state-tracking` (the FBT with the
    # preset's exact schedule and window, the baseline one pass with full attention), the kept model of each
    # graded by the bench runner, whose results.json holds the accuracies of the summary.
    work = tmp_path / "parity"
    for kind, schedule, window in (("fbt", "exact", 4), ("baseline", "standard", None)):
        config = yaml.safe_load((work / kind / "config.yaml").read_text())
        assert config["train"]["schedule"] == schedule and config["model"]["sliding_window"] == window
        assert config["data"]["source"] == str(work / "train.jsonl")
        assert (work / kind / "best").is_dir()
        results = json.loads((work / kind / "bench" / "results.json").read_text())["results"]
        for n in TEST_BITS:
            for mode, value in runs[kind]["accuracy"][str(n)].items():
                assert results[f"jsonl:{work / f'test_{n}bits.jsonl'}"][mode]["0.0"]["accuracy"] == value


def test_parity_data_split_as_the_pipeline_reads_it(tmp_path):
    """At the demo's own sizes: the data pipeline's validation split of train.jsonl holds exactly the
    validation rows (8 bits), its training split 1..8 bits in every length, and no test prompt is seen in
    training or validation, nor a validation prompt in training."""
    preset = load_config(PRESET_DIR / "state-tracking.yaml")
    val_rows = preset.eval.batches * preset.eval.batch_size
    train_path, tests = write_parity_data(tmp_path, PARITY, val_rows, preset.data.val_fraction, seed=0)
    data = DataConfig(source=str(train_path), format="prompt_answer")
    train = [doc for _, doc in iter_documents(data, "train")]
    val = [doc for _, doc in iter_documents(data, "val")]
    assert len(train) + len(val) == PARITY.records and len(val) >= val_rows
    assert {_bits(doc["prompt"]) for doc in val} == {TRAIN_BITS}
    assert {_bits(doc["prompt"]) for doc in train} == set(range(1, TRAIN_BITS + 1))
    # The trainer validates on the first val_rows windows: distinct validation rows are all among them.
    assert {doc["prompt"] for doc in val[:val_rows]} == {doc["prompt"] for doc in val}
    test_prompts = set()
    for n, path in tests.items():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == PARITY.test_rows and {_bits(r["prompt"]) for r in rows} == {n}
        assert all(r["answer"] == f" {r['prompt'].count('1') % 2}" for r in rows)
        test_prompts |= {r["prompt"] for r in rows}
    train_prompts = {doc["prompt"] for doc in train}
    assert not test_prompts & (train_prompts | {doc["prompt"] for doc in val})
    assert not train_prompts & {doc["prompt"] for doc in val}
    # Each length keeps its share of the training records although most 8-bit prompts are held out.
    eights = sum(_bits(doc["prompt"]) == TRAIN_BITS for doc in train)
    assert abs(eights / len(train) - 1 / TRAIN_BITS) < 0.01

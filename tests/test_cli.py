"""The fullband command, in process through fullband.cli.main: help, the prepare -> train -> eval ->
generate flow on a tiny corpus, and bad input (exit code 2, one paragraph on stderr, no traceback)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import yaml

from fullband import storage
from fullband.cli import build_parser, main

TINY = {
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64, "max_seq_len": 32},
    "data": {"tokenizer": "byte", "val_fraction": 0.25},
    "train": {"seq_len": 32, "batch_size": 4, "tokens": 3 * 128, "warmup_steps": 1, "progress": False,
              "device": "cpu", "schedule": "fixed:2"},
    "eval": {"batches": 1, "batch_size": 2, "fused_passes": 1, "sequential": False},
}
WORDS = "the cat sat on a mat while seven dogs ran past quickly and then slept under warm blue sky".split()


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def fails(argv, capsys, message: str) -> str:
    code, _, err = run(argv, capsys)
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """24 small UTF-8 .txt documents (some non-ASCII), split deterministically by their names."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(24):
        text = " ".join(rng.choice(WORDS) for _ in range(120)) + " café ünïcode.\n"
        (root / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, corpus) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    raw = json.loads(json.dumps(TINY))
    raw["data"]["source"] = str(corpus)
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, config_file) -> dict:
    """prepare, then train --data-dir: the flow the other tests build on."""
    root = tmp_path_factory.mktemp("flow")
    data, out = root / "prepared", root / "run"
    code = main(["prepare", "--config", str(config_file), "--out", str(data)])
    assert code == 0
    code = main(["train", "--config", str(config_file), "--data-dir", str(data), "--out-dir", str(out)])
    assert code == 0
    return {"data": data, "run": out, "config": config_file}


# ---- help ----------------------------------------------------------------------------------------


def test_help_lists_commands_and_config_options(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for command in ("prepare", "train", "eval", "generate", "demo", "convert", "export-hf"):
        assert command in out
    for command in ("prepare", "train"):
        code, out, _ = run([command, "--help"], capsys)
        assert code == 0
        for option in ("--config", "--model.d_model", "--data.source", "--data.tokenizer", "--train.schedule",
                       "--train.stop_after_steps", "--eval.fused_passes"):
            assert option in out, (command, option)
        assert "model options" in out and "train options" in out
    code, out, _ = run(["train", "--help"], capsys)
    assert "--resume" in out and "--init-from" in out and "--data-dir" in out
    assert "(default: 'paper')" in out  # defaults are shown
    for command in ("eval", "generate", "demo", "convert", "export-hf"):
        code, out, _ = run([command, "--help"], capsys)
        assert code == 0 and "usage: fullband " + command in out
    code, out, _ = run(["generate", "--help"], capsys)
    assert "--mode" in out and "soft" in out and "--fused-passes" in out


# ---- the flow ------------------------------------------------------------------------------------


def test_prepare_train_eval_generate(trained, capsys, tmp_path):
    manifest = json.loads((trained["data"] / "manifest.json").read_text())
    assert manifest["splits"]["train"]["documents"] > 0 and manifest["splits"]["val"]["documents"] > 0
    run_dir = trained["run"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["passes"] == 2 for r in rows)

    # eval RUN finds the dataset the run was trained on (it was prepared outside the run directory)
    code, out, err = run(["eval", run_dir, "--batches", 1, "--batch-size", 2, "--seq-len", 32,
                          "--fused-passes", 2, "--json", tmp_path / "eval.json"], capsys)
    assert code == 0, err
    assert "| standard | fused(1) | fused(2) | sequential |" in out and "Jacobi" in out
    result = json.loads((tmp_path / "eval.json").read_text())
    assert set(result["loss"]) == {"standard", "fused(1)", "fused(2)", "sequential"}
    assert all(v == v and v > 0 for v in result["loss"].values())

    code, out, err = run(["generate", run_dir, "--prompt", "the cat", "--mode", "soft", "--max-new-tokens", 8,
                          "--device", "cpu"], capsys)
    assert code == 0, err
    assert out.startswith("the cat") and len(out) > len("the cat\n")
    code, out2, err = run(["generate", run_dir, "--prompt", "the cat", "--mode", "soft", "--max-new-tokens", 8,
                           "--device", "cpu"], capsys)
    assert out2 == out  # greedy decoding is deterministic
    code, out, err = run(["generate", run_dir, "--prompt", "the cat", "--mode", "fused", "--fused-passes", 2,
                          "--max-new-tokens", 4, "--stream"], capsys)
    assert code == 0 and out.startswith("the cat"), err
    # a bad request is refused before anything is printed
    code, out, err = run(["generate", run_dir, "--prompt", "the cat", "--max-new-tokens", 100000], capsys)
    assert code == 2 and out == "" and "exceeds the model's max_seq_len" in err


def test_resume_defaults_to_the_runs_own_config(trained, capsys, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained["run"], run_dir)
    # a finished run resumes to its end at once; no --config needed
    code, out, err = run(["train", "--out-dir", run_dir, "--data-dir", trained["data"], "--resume"], capsys)
    assert code == 0, err
    assert "is already complete" in err and "steps 3" in out
    # --resume with a changed architecture names the field
    err = fails(["train", "--out-dir", run_dir, "--data-dir", trained["data"], "--resume", "--model.d_model", 64],
                capsys, "was trained with a different config")
    assert "model.d_model: 32 -> 64" in err


# ---- bad input -----------------------------------------------------------------------------------


def test_unknown_options_and_keys(config_file, tmp_path, capsys):
    out = ["--out-dir", tmp_path / "run"]
    fails(["train", "--config", config_file, "--train.tokenz", 5, *out], capsys, "unknown option --train.tokenz")
    # an abbreviation of a real option is not silently accepted
    fails(["train", "--config", config_file, "--train.token", 5, *out], capsys, "unknown option --train.token")
    fails(["train", "--config", config_file, "--optim.lr", 5, *out], capsys, "unknown option --optim.lr")
    bad = tmp_path / "bad.yaml"
    bad.write_text(config_file.read_text() + "\nextra:\n  x: 1\n")
    fails(["train", "--config", bad, *out], capsys, "unknown section 'extra'")
    raw = yaml.safe_load(config_file.read_text())
    raw["train"]["warmup"] = 3
    bad.write_text(yaml.safe_dump(raw))
    fails(["train", "--config", bad, *out], capsys, "unknown field train.warmup")
    fails(["train", "--config", tmp_path / "nope.yaml", *out], capsys, "does not exist")
    assert not (tmp_path / "run").exists()


def test_wrong_types(config_file, tmp_path, capsys):
    out = ["--out-dir", tmp_path / "run"]
    fails(["train", "--config", config_file, "--train.tokens", "abc", *out], capsys,
          "train.tokens expects an integer, got 'abc'")
    raw = yaml.safe_load(config_file.read_text())
    raw["train"]["batch_size"] = "4"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    fails(["train", "--config", bad, *out], capsys, "train.batch_size expects an integer, got the string '4'")
    fails(["train", "--config", config_file, "--train.seq_len", 64, *out], capsys,
          "train.seq_len=64 is longer than model.max_seq_len=32")


def test_bad_data(config_file, tmp_path, capsys):
    base = ["train", "--config", config_file, "--out-dir", tmp_path / "run"]
    fails([*base, "--data.source", tmp_path / "missing"], capsys, "does not exist")
    fails([*base, "--data.source", str(tmp_path / "missing" / "*.txt")], capsys, "matches no files")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    fails([*base, "--data.source", empty, "--data.val_fraction", 0.01], capsys, "is empty")
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "a.txt").write_bytes("caf\u00e9 au lait ".encode("latin-1") * 20)
    fails([*base, "--data.source", latin], capsys, "is not valid UTF-8")
    fails(["prepare", "--config", config_file, "--out", tmp_path / "d", "--data.source", latin], capsys,
          "is not valid UTF-8")
    fails(["eval", tmp_path / "nothing-here"], capsys, "does not exist")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    fails(["generate", garbage, "--prompt", "x"], capsys, "neither a model directory")


def test_tokenizer_mismatch_with_the_checkpoint(trained, tmp_path, capsys):
    fails(["train", "--config", trained["config"], "--out-dir", tmp_path / "mid", "--init-from", trained["run"],
           "--data.tokenizer", "bpe", "--data.bpe_vocab_size", 300, "--train.schedule", "paper"], capsys,
          "tokenizer mismatch")
    # eval of the checkpoint on data prepared with another tokenizer
    other = tmp_path / "bpe-data"
    code, _, err = run(["prepare", "--config", trained["config"], "--out", other, "--data.tokenizer", "bpe",
                        "--data.bpe_vocab_size", 300], capsys)
    assert code == 0, err
    fails(["eval", trained["run"], "--data-dir", other], capsys, "prepared with another tokenizer")


def test_existing_run_directory(trained, tmp_path, capsys):
    fails(["train", "--config", trained["config"], "--data-dir", trained["data"], "--out-dir", trained["run"]],
          capsys, "already holds checkpoints of a run. Pass --resume")
    fails(["train", "--config", trained["config"], "--out-dir", tmp_path / "fresh", "--resume"], capsys,
          "holds no run")
    # a data dir prepared from another data config is not silently reused or replaced
    fails(["train", "--config", trained["config"], "--data-dir", trained["data"], "--out-dir", tmp_path / "r2",
           "--data.val_fraction", 0.3], capsys, "already holds a dataset prepared from a different data config")


def test_a_user_error_is_one_paragraph_and_a_bug_keeps_its_traceback(monkeypatch, capsys, tmp_path):
    """fullband's own errors and the operating system's about named files are the user's to fix: one paragraph, exit
    code 2. Any other exception, a plain ValueError included, is a bug: it propagates with its traceback."""
    fails(["generate", tmp_path / "missing", "--prompt", "x"], capsys, f"error: {tmp_path / 'missing'} does not exist")

    def verify_raising(error: Exception):
        def parser():  # fullband's parser, with `verify` running a command that raises `error`
            built = build_parser()
            built._subparsers._group_actions[0].choices["verify"].set_defaults(func=lambda args: _raise(error))
            return built
        monkeypatch.setattr("fullband.cli.build_parser", parser)

    verify_raising(ValueError("an internal invariant broke"))
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(["verify", str(tmp_path)])
    verify_raising(PermissionError(13, "Permission denied", str(tmp_path / "prompt.txt")))
    fails(["verify", tmp_path], capsys, "Permission denied")


def _raise(error: Exception):
    raise error




# ---- opening a model ------------------------------------------------------------------------------

# Audit hooks cannot be removed: the hook records only while a test has put a list here.
OPENED: list[list[Path]] = []


def _record_open(event: str, args: tuple) -> None:
    if OPENED and event == "open" and isinstance(args[0], str | Path):
        OPENED[-1].append(Path(args[0]).resolve())


def test_generate_opens_each_file_of_the_run_once(trained, capsys, monkeypatch):
    """``fullband generate RUN`` enters storage once (one ``ModelDir.open``) and opens every file of the run at
    most once. safetensors opens the weights in Rust, unseen by the audit hook: its reads are counted apart."""
    entered, weight_reads = [], []
    open_model_dir, load_file = storage.ModelDir.open.__func__, storage.load_file

    def counted_open(cls, path, *args, **kwargs):
        entered.append(path)
        return open_model_dir(cls, path, *args, **kwargs)

    def counted_load_file(file):
        weight_reads.append(file)
        return load_file(file)

    monkeypatch.setattr(storage.ModelDir, "open", classmethod(counted_open))
    monkeypatch.setattr(storage, "load_file", counted_load_file)
    sys.addaudithook(_record_open)
    run_dir = trained["run"].resolve()
    OPENED.append([])
    try:
        code, _, err = run(["generate", run_dir, "--prompt", "the cat", "--max-new-tokens", 4, "--device", "cpu"],
                           capsys)
    finally:
        opened = [path for path in OPENED.pop() if path.is_relative_to(run_dir)]
    assert code == 0, err
    assert entered == [str(run_dir)]
    model = storage.list_checkpoints(run_dir)[-1] / "model"
    assert weight_reads == [str(model / "model.safetensors")]
    assert sorted(opened) == sorted({model.parent / "manifest.json", model / "config.json",
                                     model / "generation_config.json", model / "tokenizer" / "fullband_tokenizer.json"})

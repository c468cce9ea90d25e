"""``fullband bench`` on tiny random models: batched, stopped generation equals one-prompt-at-a-time
``generate``; scoring, pass@k and resumption are checked against values computed here; the command
line writes every output and fails cleanly on bad input."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fullband import FullBandConfig, FullBandLM
from fullband.bench import runner
from fullband.bench.metrics import pass_at_k
from fullband.bench.runner import BenchSettings, parse_modes, run_bench
from fullband.bench.tasks import JsonlTask, ReasoningGymTask, make_task
from fullband.cli import main
from fullband.data.tokenizers import ByteTokenizer
from fullband.decoding import DecodeSettings
from fullband.errors import ConfigError, FullbandError
from fullband.generation import generate
from fullband.loading import encode_prompt

PARITY = "synthetic:parity:min_len=2,max_len=7"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = FullBandLM(FullBandConfig(vocab_size=ByteTokenizer().vocab_size, d_model=32, n_layers=2, n_heads=4,
                                      d_ff=64, max_seq_len=64, init_std=0.1))
    path = tmp_path_factory.mktemp("bench") / "model"
    model.save_pretrained(path)
    ByteTokenizer().save(path / "tokenizer")
    return path


@pytest.fixture(scope="module")
def model_and_tokenizer(model_dir):
    from fullband.loading import load_model

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models run fastest on one thread
    yield load_model(model_dir, device="cpu")
    torch.set_num_threads(previous)


def settings(**overrides) -> BenchSettings:
    base = dict(model="tiny", modes=["standard"], temperatures=[0.0], samples=1, ks=[1], limit=6, batch_size=4,
                bootstrap=100)
    base.update(overrides)
    return BenchSettings(**base)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def reference_completion(model, tokenizer, prompt: str, max_new: int, **kwargs) -> list[int]:
    """One prompt alone through ``generate``, cut after the first newline (kept) or at EOS."""
    ids = generate(model, [encode_prompt(tokenizer, prompt)], max_new, eos_token_id=tokenizer.eos_id, **kwargs)[0]
    out = []
    for token in ids.tolist():
        if token == tokenizer.eos_id:
            break
        out.append(token)
        if token == ord("\n"):
            break
    return out


def test_parse_modes_reads_labels_against_the_stored_settings():
    stored = DecodeSettings("fused", "auto", fused_tol=0.1, fused_max_passes=5)
    assert parse_modes("standard")[0].mode == "standard"
    assert parse_modes("fused") == parse_modes("fused:1")  # no stored settings: the defaults
    assert parse_modes("fused", stored)[0] == stored  # "fused" takes the stored passes
    assert parse_modes("fused:3", stored)[0] == DecodeSettings("fused", 3, 0.1, 5)
    assert parse_modes("fused:auto")[0] == DecodeSettings("fused", "auto")
    assert [m.label for m in parse_modes("soft, fused:2,soft")] == ["soft", "fused:2"]
    for bad in ("fused:0", "fused:x"):
        with pytest.raises(ConfigError, match="fused_passes must be an integer >= 1, 'auto' or 'exact'"):
            parse_modes(bad)
    with pytest.raises(ConfigError, match="unknown decode mode 'turbo'"):
        parse_modes("turbo")


@pytest.mark.parametrize("modes", [["standard", "soft"], ["fused:2"]])
def test_batched_greedy_equals_one_prompt_at_a_time(model_and_tokenizer, tmp_path, modes):
    model, tokenizer = model_and_tokenizer
    task = make_task(PARITY)
    run_bench(model, tokenizer, [task], settings(modes=modes), tmp_path, progress=False, plots=False)
    got = rows(tmp_path)
    assert len(got) == 6 * len(modes)
    problems = {p.id: p for p in task.problems(6)}
    assert len({len(p.prompt) for p in problems.values()}) > 1  # ragged batches (left padding) are exercised
    for row in got:
        mode = parse_modes(row["mode"])[0]
        ref = reference_completion(model, tokenizer, row["prompt"], task.default_max_new_tokens, decode=mode)
        assert row["length"] == len(ref)
        assert row["completion"] == tokenizer.decode(ref).split("\n")[0]
        assert row["score"] == float(task.task.check(problems[row["problem"]].reference, row["completion"]))
        assert row["fused_passes"] == (2 if mode.mode == "fused" else 0)


def test_fused_auto_with_zero_tolerance_equals_fused_at_the_cap(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    task = make_task(PARITY)
    run_bench(model, tokenizer, [task], settings(modes=["fused:auto", "fused:3"], fused_tol=0.0, fused_max_passes=3),
              tmp_path, progress=False, plots=False)
    by_mode: dict[str, dict] = {}
    for row in rows(tmp_path):
        by_mode.setdefault(row["mode"], {})[row["problem"]] = (row["completion"], row["fused_passes"])
    assert by_mode["fused:auto"] == by_mode["fused:3"]


def test_fused_auto_says_when_prefills_stop_at_the_cap(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    task = make_task(PARITY)
    longest = max(len(encode_prompt(tokenizer, p.prompt)) for p in task.problems(6))
    # With tolerance 0 a prefill converges only at the exact recurrence's fixed point: after T - 1 fused passes
    # its next pass changes nothing. Below that the cap cuts it off.
    ids = torch.tensor([encode_prompt(tokenizer, task.problems(1)[0].prompt)])
    assert model.prefill(ids, "auto", fused_tol=0.0, fused_max_passes=ids.shape[1]).converged.tolist() == [True]
    assert model.prefill(ids, "auto", fused_tol=0.0, fused_max_passes=2).converged.tolist() == [False]
    assert model.prefill(ids, 2).converged is None
    for cap, cut in ((2, 6), (longest, 0)):
        out = tmp_path / f"cap{cap}"
        run_bench(model, tokenizer, [task], settings(modes=["fused:auto", "fused:2"], fused_tol=0.0,
                                                     fused_max_passes=cap), out, progress=False, plots=False)
        got = rows(out)
        assert [r["fused_converged"] for r in got if r["mode"] == "fused:auto"] == [cut == 0] * 6
        assert all(r["fused_converged"] is None for r in got if r["mode"] == "fused:2")
        cells = json.loads((out / "results.json").read_text())["results"][PARITY]
        assert cells["fused:auto"]["0.0"]["fused_unconverged"] == cut
        assert cells["fused:2"]["0.0"]["fused_unconverged"] == 0
        report = (out / "results.md").read_text()
        assert (f"{cut} of 6 samples stopped at --fused-max-passes {cap}" in report) == (cut > 0)
        assert ("**Warning**" in report) == (cut > 0)


def test_exact_match_scoring_against_known_answers(model_and_tokenizer, tmp_path):
    """A JSONL task whose answers are the model's own greedy outputs for half the problems and wrong for
    the other half scores exactly 0.5."""
    model, tokenizer = model_and_tokenizer
    prompts = ["add 12+7 :", "regs a=1 ? a :", "parity 0110 :", "hello", "s5 01234 :", "x"]
    records = []
    for i, prompt in enumerate(prompts):
        own = tokenizer.decode(reference_completion(model, tokenizer, prompt, 20)).split("\n")[0]
        records.append({"prompt": prompt, "answer": own if i % 2 == 0 else own + "WRONG"})
    path = tmp_path / "task.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    results = run_bench(model, tokenizer, [make_task(f"jsonl:{path}")], settings(max_new_tokens=20), tmp_path / "out",
                        progress=False, plots=False)
    cell = results[f"jsonl:{path}"]["standard"]["0.0"]
    assert cell["accuracy"] == 0.5 and cell["pass_at_k"]["1"]["value"] == 0.5
    assert [r["correct"] for r in sorted(rows(tmp_path / "out"), key=lambda r: int(r["problem"]))] == [
        True, False] * 3


def test_sampling_pass_at_k_and_determinism(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    s = settings(modes=["soft"], temperatures=[0.0, 1.0], samples=4, ks=[1, 2], limit=3)
    results = run_bench(model, tokenizer, [make_task(PARITY)], s, tmp_path / "a", progress=False, plots=False)
    first = rows(tmp_path / "a")
    assert len(first) == 3 * 1 + 3 * 4  # greedy: one sample per problem
    run_bench(model, tokenizer, [make_task(PARITY)], s, tmp_path / "b", progress=False, plots=False)
    assert rows(tmp_path / "b") == first  # seeded
    sampled = [r for r in first if r["temperature"] == 1.0]
    assert len({r["completion"] for r in sampled}) > 1
    cell = results[PARITY]["soft"]["1.0"]
    expected = []
    for pid in {r["problem"] for r in sampled}:
        c = sum(r["correct"] for r in sampled if r["problem"] == pid)
        expected.append(pass_at_k(4, c, 2))
    assert cell["pass_at_k"]["2"]["value"] == pytest.approx(sum(expected) / len(expected))
    assert cell["mean_length"] == pytest.approx(sum(r["length"] for r in sampled) / len(sampled))
    greedy = results[PARITY]["soft"]["0.0"]
    assert greedy["pass_at_k"]["2"] == greedy["pass_at_k"]["1"]  # deterministic: pass@k = pass@1
    assert sum(t["best"] for t in results[PARITY]["soft"].values()) == 1


def test_interrupted_run_resumes_from_finished_samples(model_and_tokenizer, tmp_path, monkeypatch):
    model, tokenizer = model_and_tokenizer
    s = settings(modes=["standard", "soft"], limit=5)
    full = run_bench(model, tokenizer, [make_task(PARITY)], s, tmp_path / "full", progress=False, plots=False)
    lines = (tmp_path / "full" / "samples.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "cut").mkdir()
    # Four finished rows and half a row: what a run killed while writing leaves behind.
    (tmp_path / "cut" / "samples.jsonl").write_text("".join(lines[:4]) + lines[4][:30])
    generated = []
    original = runner.generate_batch

    def counting(model, tokenizer, prompts, *args, **kwargs):
        generated.extend(prompts)
        return original(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(runner, "generate_batch", counting)
    resumed = run_bench(model, tokenizer, [make_task(PARITY)], s, tmp_path / "cut", progress=False, plots=False)
    assert len(generated) == 10 - 4
    assert resumed == full
    assert sorted(rows(tmp_path / "cut"), key=json.dumps) == sorted(rows(tmp_path / "full"), key=json.dumps)
    generated.clear()
    run_bench(model, tokenizer, [make_task(PARITY)], s, tmp_path / "cut", progress=False, plots=False)
    assert generated == []  # everything already there
    with pytest.raises(FullbandError, match="other settings"):
        run_bench(model, tokenizer, [make_task(PARITY)], settings(modes=["soft"], limit=5, seed=1), tmp_path / "cut",
                  progress=False, plots=False)


def test_reasoning_gym_and_math_verify_scorers():
    pytest.importorskip("reasoning_gym")
    task = ReasoningGymTask("basic_arithmetic", seed=0, size=4)
    problems = task.problems(None)
    assert len(problems) == 4 and problems[0].prompt.endswith("\nAnswer:")
    assert task.score(problems, [" " + p.reference["answer"] for p in problems]) == [1.0] * 4
    assert task.score(problems, ["no idea"] * 4) == [0.0] * 4
    pytest.importorskip("math_verify")
    math = JsonlTask.__new__(JsonlTask)
    math.match = "math"
    problems = [runner.Problem("0", "q", "$\\frac{1}{2}$"), runner.Problem("1", "q", "$3$")]
    assert math.score(problems, ["so the answer is $0.5$", "it is 4"]) == [1.0, 0.0]


def test_cli_end_to_end(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["bench", str(model_dir), "--task", PARITY, "--modes", "standard,fused:auto", "--temperatures", "0,0.7",
            "--samples", "2", "--k", "1,2", "--limit", "3", "--out", str(out), "--device", "cpu", "--no-progress",
            "--bootstrap", "50"]
    assert main(argv) == 0
    for name in ("results.json", "results.md", "samples.jsonl", "accuracy.png", "lengths.png"):
        assert (out / name).is_file(), name
    report = json.loads((out / "results.json").read_text())
    cells = report["results"][PARITY]
    assert set(cells) == {"standard", "fused:auto"} and set(cells["standard"]) == {"0.0", "0.7"}
    assert "pass@2" in capsys.readouterr().out
    assert len(rows(out)) == 2 * (3 + 3 * 2)


def _fails(argv, capsys, message):
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_cli_bad_input(model_dir, tmp_path, capsys, monkeypatch):
    base = ["bench", model_dir, "--out", tmp_path / "o", "--device", "cpu", "--no-progress"]
    _fails(base + ["--task", "nope"], capsys, "unknown task 'nope'")
    _fails(base + ["--task", "synthetic:nope"], capsys, "Unknown synthetic task")
    _fails(base + ["--task", PARITY, "--modes", "fast"], capsys, "unknown decode mode")
    _fails(base + ["--task", PARITY, "--temperatures", "0.5", "--k", "3"], capsys, "--samples >= 3")
    # (the flag: where bubblewrap cannot run, the task would be refused before the context is checked)
    _fails(base + ["--task", "humaneval", "--allow-unsandboxed-code"], capsys, "context is 64 tokens")
    _fails(base + ["--task", "jsonl:/nonexistent.jsonl"], capsys, "cannot read task file")
    _fails(base + ["--task", "rg:no_such_task"], capsys, "not registered")
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"garbage")
    _fails(["bench", broken, "--task", PARITY, "--out", tmp_path / "o2"], capsys, "unreadable")
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an environment without the extra sees
    _fails(base + ["--task", "rg:basic_arithmetic"], capsys, "pip install 'fullband[eval]'")


def test_hf_export_gives_the_same_samples(model_dir, tmp_path, capsys):
    """A directory written by ``fullband export-hf`` benchmarks exactly like the model it came from."""
    pytest.importorskip("transformers")
    from fullband.hf import export_hf

    export = export_hf(model_dir, tmp_path / "export")
    common = ["--task", PARITY, "--modes", "standard,soft,fused:1", "--limit", "4", "--device", "cpu",
              "--no-progress", "--no-plots"]
    assert main(["bench", str(model_dir), "--out", str(tmp_path / "a"), *common]) == 0
    assert main(["bench", str(export), "--out", str(tmp_path / "b"), *common]) == 0
    capsys.readouterr()
    assert rows(tmp_path / "a") == rows(tmp_path / "b")

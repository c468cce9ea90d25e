"""Addition's trace_percent option, and experiments/traces/reasoning_traces.py --quick end to end (records, summary,
plot, resume)."""

import hashlib
import json

import pytest

from experiments.traces import reasoning_traces as rt
from fullband.data.synthetic import final_answer, get_task, synthetic_examples
from fullband.errors import ConfigError


@pytest.mark.parametrize("task, digest", [
    # sha256 of the examples' texts as generated before trace_percent existed (the same seed must give them).
    ("addition", "b0e47904634bdf0a641ad37701b9650890944221ebe7848b26003a6990b42d47"),
    ("addition:max_digits=3", "b9c52349281799453bf126727d84c6c88760ba089f4d1d27379aaa3219bc9856"),
    ("addition:max_digits=3,trace_percent=100", "b9c52349281799453bf126727d84c6c88760ba089f4d1d27379aaa3219bc9856"),
])
def test_full_trace_keeps_the_examples_of_every_seed(task, digest):
    text = "".join(ex.text for ex in synthetic_examples(task, 1000, 12345))
    assert hashlib.sha256(text.encode()).hexdigest() == digest


def test_trace_percent_mixes_direct_answers_the_checker_accepts():
    task = get_task("addition:max_digits=3,trace_percent=50")
    examples = synthetic_examples(task, 1000, 1)
    direct = [ex for ex in examples if not rt.writes_trace(ex.answer)]
    assert 400 < len(direct) < 600
    for ex in direct:
        a, b = map(int, ex.prompt.split()[1].split("+"))
        assert ex.answer == f" => {a + b}" and task.check(ex, ex.answer + "\n")
    traced = [ex for ex in examples if rt.writes_trace(ex.answer)]
    assert all(ex.answer.count("+") >= 2 and final_answer(ex.answer) for ex in traced)
    assert not any(rt.writes_trace(ex.answer) for ex in synthetic_examples("addition:trace_percent=0", 200, 0))


@pytest.mark.parametrize("value", ["101", "-1"])
def test_trace_percent_out_of_range_is_refused(value):
    with pytest.raises(ConfigError, match="trace_percent must be 0..100"):
        get_task(f"addition:trace_percent={value}")


def test_writes_trace():
    assert rt.writes_trace(" 7+5+0=12 c1 => 12\n")
    assert not rt.writes_trace(" => 132\n")
    assert rt.writes_trace(" 7+5+0")  # cut off before its `=>`: a trace all the same
    assert not rt.writes_trace("\n")


def test_quick_run_records_summarises_plots_and_resumes(tmp_path, capsys, single_thread):
    out = tmp_path / "rt.jsonl"
    argv = ["--quick", "--seeds", "0", "--work-dir", str(tmp_path / "w"), "--out", str(out),
            "--plot", str(tmp_path / "rt.png")]
    rt.main(argv)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["task"], r["model"]) for r in records} == {(t, m) for t in rt.TASKS for m in rt.MODELS}
    for r in records:
        assert set(r["bench"]) == set(rt.MODES[r["model"]])
        for cell in r["bench"].values():
            assert cell["problems"] == 8 and len(cell["rows"]["correct"]) == 8
            assert 0 <= cell["accuracy"] <= 1 and 0 <= cell["trace_fraction"] <= 1
            assert cell["median_length"] > 0
        if r["model"] == "baseline":
            assert r["compute_tokens"] == r["tokens"]  # one pass
        else:
            assert r["compute_tokens"] > r["tokens"]  # feedback passes cost compute
    assert len({r["tokens"] for r in records}) == 1  # equal tokens for every model
    text = capsys.readouterr().out
    assert "#### optional: `addition:max_digits=3,trace_percent=50`" in text
    assert "| fbt soft − fbt standard | 1 |" in text and "fbt soft − baseline standard (equal tokens)" in text
    assert (tmp_path / "rt.png").stat().st_size > 0
    rt.main(argv)  # all done: nothing retrained, nothing appended
    assert len(out.read_text().splitlines()) == len(records)
    rt.main(["--summary-only", "--out", str(out), "--plot", ""])
    assert "| fbt_from0 | soft | 1 |" in capsys.readouterr().out

"""fullband.state_tracking (batches, grading, curriculum) and benchmarks/state_tracking.py --quick end to end."""

import importlib.util
import json
import random
from pathlib import Path

import torch

from fullband import state_tracking as core
from fullband.data import ByteTokenizer
from fullband.data.synthetic import state_tracking_task

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "state_tracking.py"
spec = importlib.util.spec_from_file_location("state_tracking", SCRIPT)
st = importlib.util.module_from_spec(spec)
spec.loader.exec_module(st)


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


def test_curriculum_grows_from_2_to_L_over_the_given_fraction():
    assert [core.curriculum_max(s, 100, 8, 0.5) for s in (0, 25, 50, 99)] == [2, 5, 8, 8]
    assert core.curriculum_max(0, 100, 8, 0.0) == 8


def test_quick_run_writes_records_summary_and_resumes(tmp_path, capsys, single_thread):
    out = tmp_path / "st.jsonl"
    argv = ["--quick", "--threads", "1", "--tasks", "parity", "--out", str(out), "--plot", str(tmp_path / "st.png")]
    st.main(argv)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["model"] for r in records] == ["fbt", "baseline", "baseline_compute"]
    fbt, base, compute = records
    assert set(fbt["eval"]["1"]) == {"exact", "plain"} and set(base["eval"]["1"]) == {"plain"}
    assert base["train"]["tokens"] == fbt["train"]["tokens"]  # same batches
    assert compute["train"]["steps"] == round(fbt["train"]["steps"] * fbt["train"]["mean_passes"])
    text = capsys.readouterr().out
    assert "| fbt exact |" in text and "paired: fbt exact − baseline |" in text
    st.main(argv)  # everything is done: nothing is retrained
    assert len(out.read_text().splitlines()) == 3

"""fullband jacobi: per-pass loss and relative change on positions >= k, against ``evaluate`` restricted to
the same positions and against the exact sequential recurrence; the command's outputs and errors."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import make_model

from fullband.data.config import DataConfig
from fullband.data.shards import IGNORE_INDEX, Batch, prepare_dataset
from fullband.eval import evaluate
from fullband.tools.jacobi import jacobi_curve

pytestmark = pytest.mark.usefixtures("single_thread")

T = 12
WORDS = "the cat sat on a mat while seven dogs ran past quickly and then slept".split()


@pytest.fixture(scope="module")
def data_and_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("jacobi")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(40)) + "\n")
    dataset = prepare_dataset(DataConfig(source=str(corpus), tokenizer="byte", val_fraction=0.25), root / "data")
    model = make_model(vocab_size=259, max_seq_len=32, fusion="add")
    with torch.no_grad():
        model.fusion.proj.weight.mul_(0.3)  # a contracting iteration, like a trained FBT's
    model.save_pretrained(root / "model")
    dataset.tokenizer.save(root / "model" / "tokenizer")
    return root, dataset, model


def batches(dataset, n=2, batch_size=3):
    return list(dataset.split("val").eval_batches(T, batch_size, n))


def from_position(batch: Batch, k: int) -> Batch:
    """The batch with targets before position k ignored: ``evaluate`` then scores positions >= k only."""
    targets = batch.targets.clone()
    targets[:, :k] = IGNORE_INDEX
    return Batch(batch.input_ids, targets, batch.plain_mask, batch.segment_ids)


@pytest.mark.parametrize("isolated", [False, True])
def test_curve_matches_evaluate_restricted_to_positions_from_k(data_and_model, isolated, tmp_path):
    root, dataset, model = data_and_model
    if isolated:  # packed documents that do not see each other (segment ids), short ones so windows hold several
        (tmp_path / "c").mkdir()
        for i in range(30):
            (tmp_path / "c" / f"d{i}.txt").write_text(" ".join(WORDS[i % 5 : i % 5 + 2]) + "\n")
        dataset = prepare_dataset(DataConfig(source=str(tmp_path / "c"), tokenizer="byte", val_fraction=0.5,
                                             isolate_documents=True), tmp_path / "data")
    data = batches(dataset)
    assert (data[0].segment_ids is not None) == isolated
    if isolated:
        assert data[0].segment_ids[0].unique().numel() > 1  # several documents inside one window
    curve = jacobi_curve(model, data, passes=4)
    assert curve.passes == [0, 1, 2, 3, 4] and curve.seq_len == T and curve.sequences == 6
    for k in range(5):
        ref = evaluate(model, [from_position(b, k) for b in data], fused_passes=4, sequential=True)
        name = "standard" if k == 0 else f"fused({k})"
        assert curve.loss[k] == pytest.approx(ref.loss[name], abs=1e-5)
        assert curve.sequential_loss[k] == pytest.approx(ref.loss["sequential"], abs=1e-5)
        if k > 0:
            # evaluate averages the change over all T positions; positions < k do not move at pass k.
            assert curve.relative_change[k] == pytest.approx(ref.jacobi_delta[str(k + 1)] * T / (T - k), rel=1e-4)
            assert curve.relative_change_max[k] >= curve.relative_change[k] > 0
    # Not vacuous: feedback changes the loss, and the iteration contracts.
    assert abs(curve.loss[1] - curve.loss[0]) > 1e-3
    assert curve.relative_change[4] < curve.relative_change[1]


def test_after_enough_passes_the_loss_is_the_sequential_loss(data_and_model):
    _, dataset, model = data_and_model
    curve = jacobi_curve(model, batches(dataset, n=1), passes=100)
    assert curve.passes == list(range(T))  # positions >= k exist up to k = T - 1
    # After k fused passes positions 0..k are exact, so after T - 1 every position is.
    assert curve.loss[T - 1] == pytest.approx(curve.sequential_loss[T - 1], abs=1e-5)
    assert curve.sequential_gap[T - 1] < 1e-5
    assert curve.sequential_gap[1] > 1e-3  # far from the fixed point early on
    no_seq = jacobi_curve(model, batches(dataset, n=1), passes=2, sequential=False)
    assert no_seq.sequential_loss == [None] * 3 and no_seq.loss == pytest.approx(curve.loss[:3], abs=1e-6)


def test_command_writes_json_and_png(data_and_model, tmp_path, capsys):
    from fullband.cli import main

    root, _, _ = data_and_model
    code = main(["jacobi", str(root / "model"), "--data-dir", str(root / "data"), "--passes", "1000",
                 "--seq-len", str(T), "--batches", "1", "--batch-size", "2", "--out", str(tmp_path / "j"),
                 "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "stopping there" in err and "| k | loss |" in out
    record = json.loads((tmp_path / "j" / "jacobi.json").read_text())
    assert record["passes"] == list(range(T)) and record["sequences"] == 2
    assert record["relative_change"][0] is None and len(record["loss"]) == T
    assert (tmp_path / "j" / "jacobi.png").stat().st_size > 1000


def test_command_errors(data_and_model, tmp_path, capsys, monkeypatch):
    import sys

    from fullband.cli import main

    root, _, _ = data_and_model
    common = ["--data-dir", str(root / "data"), "--out", str(tmp_path / "j"), "--device", "cpu"]
    (tmp_path / "junk").mkdir()
    assert main(["jacobi", str(tmp_path / "junk"), *common]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main(["jacobi", str(root / "model"), "--seq-len", "64", *common]) == 2
    assert "exceeds the model's max_seq_len 32" in capsys.readouterr().err
    assert main(["jacobi", str(root / "model"), "--passes", "-1", "--seq-len", "8", *common]) == 2
    assert "passes=-1 must be >= 0" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["jacobi", str(root / "model"), *common]) == 2
    assert "pip install 'fullband[plot]'" in capsys.readouterr().err

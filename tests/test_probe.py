"""Linear probes: the probe itself on constructed features, grouped folds, per-layer states read by hooks
against direct computations, per-position targets of the synthetic tasks, and the command end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import make_model, shift

from fullband import FullBandConfig, FullBandLM
from fullband.cli import main
from fullband.data.synthetic import SYNTHETIC_TASKS, final_answer, get_task, synthetic_examples
from fullband.data.tokenizers import ByteTokenizer
from fullband.tools.probe import grouped_folds, layer_states, parse_probe_modes, probe_accuracy


def _groups(n_seq: int, per_seq: int) -> np.ndarray:
    return np.repeat(np.arange(n_seq), per_seq)


def test_probe_reads_a_linearly_encoded_label():
    rng = np.random.default_rng(0)
    groups = _groups(100, 10)
    labels = rng.integers(0, 3, len(groups))
    codes = rng.normal(size=(3, 16))
    x = torch.tensor(codes[labels] + 0.3 * rng.normal(size=(len(labels), 16)))
    accuracy, majority = probe_accuracy(x, labels, groups, 3)
    assert accuracy > 0.98 and majority < 0.45


def test_probe_on_noise_scores_the_majority_rate():
    rng = np.random.default_rng(1)
    groups = _groups(100, 10)
    labels = (rng.random(len(groups)) < 0.3).astype(int)  # 70% class 0
    x = torch.tensor(rng.normal(size=(len(labels), 16)))
    accuracy, majority = probe_accuracy(x, labels, groups, 2)
    assert majority == pytest.approx(np.mean(labels == 0))
    assert majority - 0.06 < accuracy < majority + 0.03


def test_folds_keep_each_sequence_in_one_fold():
    groups = _groups(10, 3)
    folds = grouped_folds(groups, 4, seed=0)
    assert sum(f.astype(int) for f in folds).tolist() == [1] * 30  # a partition
    for fold in folds:
        assert set(groups[fold]).isdisjoint(set(groups[~fold]))
    with pytest.raises(ValueError, match="at least 4 sequences"):
        grouped_folds(_groups(3, 2), 4, seed=0)


def test_parse_probe_modes():
    assert parse_probe_modes("standard, fused:2,fused") == [("standard", 0), ("fused:2", 2), ("fused:1", 1)]
    for bad in ("soft", "fused:0"):
        with pytest.raises(ValueError, match="unknown probe mode"):
            parse_probe_modes(bad)


def test_layer_states_match_direct_computation():
    model = make_model(dtype=torch.float64)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # row 1 is left-padded
    plain = model.prefill(ids, 0, attention_mask=mask)
    states = layer_states(model, ids, mask, 0)
    assert len(states) == model.config.n_layers + 1
    torch.testing.assert_close(states[0], model.embed(ids), rtol=0, atol=0)
    top = model.norm(states[-1])
    torch.testing.assert_close(top[mask], plain.hidden[mask], rtol=1e-12, atol=1e-12)
    fused = layer_states(model, ids, mask, 1)
    expected = model.fusion(model.embed(ids), shift(plain.hidden))
    first = torch.zeros_like(mask)
    first[0, 0] = first[1, 3] = True  # each row's first real token stays plain
    fusedpos = mask & ~first
    torch.testing.assert_close(fused[0][fusedpos], expected[fusedpos], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused[0][first], model.embed(ids)[first], rtol=0, atol=0)
    # A padded row's states equal the same prompt alone.
    alone = layer_states(model, ids[1:, 3:], None, 1)
    for got, ref in zip(fused, alone):
        torch.testing.assert_close(got[1, 3:], ref[0], rtol=1e-10, atol=1e-10)


FINAL_STATE_TASKS = ["parity:trace=false", "summod", "flipflop", "cycle", "s5", "s5:generators=true", "s3",
                     "completion", "delayed", "delayed:delay=5"]


@pytest.mark.parametrize("spec", FINAL_STATE_TASKS)
def test_last_target_is_the_answer(spec):
    task = get_task(spec)
    for example in synthetic_examples(task, 20, seed=3):
        targets = task.targets(example)
        assert targets and all(0 <= offset < len(example.prompt) for offset, _ in targets)
        assert targets[-1][1] == final_answer(example.answer)
        offsets = [offset for offset, _ in targets]
        assert offsets == sorted(set(offsets))


def test_target_offsets_point_at_the_moves():
    ex = get_task("parity").generate(__import__("random").Random(0))
    bits = ex.prompt.split(" ")[1]
    targets = get_task("parity").targets(ex)
    assert "".join(ex.prompt[o] for o, _ in targets) == bits
    assert [label for _, label in targets] == list(ex.answer.strip())  # the trace is the running parity
    completion = get_task("completion")
    ex = completion.generate(__import__("random").Random(1))
    steps = ex.prompt.split(" : ")[1].removesuffix(" :")
    assert [ex.prompt[o] for o, _ in completion.targets(ex)] == list(steps)
    assert [int(label) for _, label in completion.targets(ex)] == [len(set(steps[: i + 1])) for i in range(len(steps))]
    delayed = get_task("delayed:delay=2")
    ex = delayed.generate(__import__("random").Random(2))
    digits = ex.prompt.split(" : ")[1].removesuffix(" :")
    assert [label for _, label in delayed.targets(ex)] == list(digits[:-2])


def test_registers_target_register_a():
    task = get_task("registers")
    seen = 0
    for example in synthetic_examples(task, 40, seed=0):
        targets = task.targets(example)
        writes = example.prompt.removeprefix("regs ").split(" ? ")[0].split(" ")
        assert [example.prompt[o] for o, _ in targets] == [w[2] for w in writes]
        if example.prompt.endswith("? a :"):
            seen += 1
            assert targets[-1][1] == example.answer.strip()
    assert seen > 0


def test_every_state_task_has_targets():
    assert [n for n, t in SYNTHETIC_TASKS.items() if not t.targets(synthetic_examples(t, 1, 0)[0])] == ["addition"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = FullBandLM(FullBandConfig(vocab_size=ByteTokenizer().vocab_size, d_model=32, n_layers=2, n_heads=4,
                                      d_ff=64, max_seq_len=48, init_std=0.1))
    path = tmp_path_factory.mktemp("probe") / "model"
    model.save_pretrained(path)
    ByteTokenizer().save(path / "tokenizer")
    return path


def test_cli_end_to_end(model_dir, tmp_path, capsys, single_thread):
    """Delayed memory with delay 1 (the target is the previous digit): at layer 0 a standard pass sees only
    the current token (chance), while one fused pass feeds in the previous position's top state, which
    even a random model's residual stream ties to that position's token."""
    out = tmp_path / "out"
    argv = ["probe", model_dir, "--task", "synthetic:delayed:delay=1,min_len=8,max_len=16", "--examples", "60",
            "--modes", "standard,fused:1", "--out", out, "--device", "cpu"]
    assert main([str(a) for a in argv]) == 0
    assert "| layer | standard | fused:1 |" in capsys.readouterr().out
    results = json.loads((out / "probe.json").read_text())
    assert (out / "probe.md").is_file() and (out / "probe.png").is_file()
    layers = results["modes"]["standard"]
    assert len(layers) == 3 and len(results["classes"]) == 10
    assert layers[0]["accuracy"] < 0.25  # chance is 0.1
    assert results["modes"]["fused:1"][0]["accuracy"] > 0.6


@pytest.mark.parametrize("argv, message", [
    (["--task", "jsonl:x.jsonl"], "needs a synthetic task"),
    (["--task", "synthetic:addition"], "no per-position targets"),
    (["--task", "synthetic:parity", "--modes", "soft"], "unknown probe mode"),
    (["--task", "synthetic:parity:min_len=60,max_len=64"], "exceeds the model's context"),
])
def test_cli_bad_input(model_dir, tmp_path, capsys, argv, message):
    code = main(["probe", str(model_dir), "--out", str(tmp_path / "o"), "--examples", "8", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err

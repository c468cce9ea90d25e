"""train.length_curriculum (short documents first) and train.schedule exact (K = the batch's longest document)
on datasets of isolated documents: what the loader draws, the K each step runs, exact resume, and the errors
on text streams."""

from __future__ import annotations

import numpy as np
import pytest
import test_train
import torch
from test_train import BATCH, SEQ, read_metrics, steps_of, tiny_config

from fullband.data import TokenLoader, TokenSplit, open_dataset, prepare_dataset
from fullband.data.synthetic import export_jsonl, state_tracking_task
from fullband.errors import ConfigError, DataError
from fullband.train import PassSchedule, train

parity_data = test_train.parity_data  # a text stream (synthetic:parity): no isolated documents

LOADER_SEQ, LOADER_BATCH = 16, 8


def _isolated_split(seed: int = 0, documents: int = 300) -> TokenSplit:
    """Documents of 3..29 tokens back to back, every token distinct, so a row reveals its window."""
    lengths = np.random.default_rng(seed).integers(3, 30, size=documents)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return TokenSplit("train", [np.arange(int(lengths.sum()), dtype=np.uint16)], starts, None, isolate=True)


def _longest_whole_document(split: TokenSplit, start: int, seq_len: int) -> int:
    """The reference: the longest document inside tokens start .. start + seq_len, or seq_len + 1 if none is."""
    ends = np.append(split.doc_starts[1:], len(split))
    whole = [int(e - s) for s, e in zip(split.doc_starts, ends) if s >= start and e <= start + seq_len + 1]
    return max(whole) if whole else seq_len + 1


# ---- the loader ----------------------------------------------------------------------------------


def test_window_lengths_and_the_curriculum_limit():
    split = _isolated_split()
    loader = TokenLoader(split, LOADER_SEQ, LOADER_BATCH, seed=1, curriculum_steps=10)
    starts = split.window_starts(LOADER_SEQ)
    assert loader.longest_documents.tolist() == [_longest_whole_document(split, int(s), LOADER_SEQ) for s in starts]
    low, high = int(loader.longest_documents.min()), int(loader.longest_documents.max())
    limits = [loader.curriculum_limit(s) for s in range(10)]
    assert limits[0] == low and limits[-1] == high == LOADER_SEQ + 1 and limits == sorted(limits)
    assert limits == [low + round((high - low) * s / 9) for s in range(10)]
    for step in range(10):
        windows = loader.next_windows(step)
        assert len(windows) == LOADER_BATCH
        assert loader.longest_documents[windows].max() <= limits[step]
        if (loader.longest_documents <= limits[step]).sum() >= LOADER_BATCH:
            assert len(set(windows.tolist())) == LOADER_BATCH  # without replacement when enough are eligible
    # the curriculum neither moves nor records anything: the state is that of a fresh loader
    assert loader.state_dict() == TokenLoader(split, LOADER_SEQ, LOADER_BATCH, seed=1).state_dict()


def test_after_the_curriculum_the_ordinary_order_follows():
    split = _isolated_split()
    curriculum = TokenLoader(split, LOADER_SEQ, LOADER_BATCH, seed=2, curriculum_steps=5)
    plain = TokenLoader(split, LOADER_SEQ, LOADER_BATCH, seed=2)
    for step in range(5):
        curriculum.next_batch(step)
    for step in range(5, 40):  # several epochs
        a, b = curriculum.next_batch(step), plain.next_batch()
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
    assert curriculum.state_dict() == plain.state_dict()


def test_curriculum_is_a_function_of_seed_step_and_micro_batch():
    split = _isolated_split()

    def draws(seed: int) -> list[list[int]]:
        loader = TokenLoader(split, LOADER_SEQ, LOADER_BATCH, seed=seed, curriculum_steps=6)
        return [loader.next_windows(step, micro).tolist() for step in range(6) for micro in range(2)]

    assert draws(3) == draws(3) and draws(3) != draws(4)
    assert draws(3)[-2] != draws(3)[-1]  # micro-batches of one step differ
    # a loader that starts mid-curriculum (a resumed run) draws the same windows
    late = TokenLoader(split, LOADER_SEQ, LOADER_BATCH, seed=3, curriculum_steps=6)
    assert [late.next_windows(step, micro).tolist() for step in (4, 5) for micro in range(2)] == draws(3)[8:]
    with pytest.raises(ValueError, match="needs the step"):
        late.next_windows()


def test_rank_rows_make_up_the_single_process_batch():
    split = _isolated_split()
    single = TokenLoader(split, LOADER_SEQ, LOADER_BATCH, seed=5, curriculum_steps=4)
    ranks = [TokenLoader(split, LOADER_SEQ, LOADER_BATCH, seed=5, rank=r, world_size=2, curriculum_steps=4)
             for r in range(2)]
    for step in range(8):  # through the curriculum and after it
        full = single.next_batch(step)
        parts = [loader.next_batch(step) for loader in ranks]
        rebuilt = torch.empty_like(full.input_ids)
        for r, part in enumerate(parts):
            rebuilt[r::2] = part.input_ids
        assert torch.equal(rebuilt, full.input_ids)


def test_text_streams_are_refused():
    for option in ({"schedule": "exact"}, {"length_curriculum": 0.5}):
        with pytest.raises(ConfigError, match="needs isolated documents"):
            tiny_config(data={"format": "text"}, train=option)


def test_exact_schedule_has_no_phases_to_draw_from():
    schedule = PassSchedule.parse("exact")
    assert schedule.exact
    for use in (lambda: schedule.passes_for_step(0, 10, 0), schedule.mean_passes, lambda: schedule.max_passes):
        with pytest.raises(ConfigError, match="exact schedule"):
            use()
    assert not PassSchedule.parse("fixed:3").exact


# ---- training runs -------------------------------------------------------------------------------


def _prompt_answer_data(path, moves: tuple[int, int], records: int):
    source = export_jsonl(state_tracking_task("parity", *moves), path / "train.jsonl", records, seed=0)
    return {"source": str(source), "format": "prompt_answer", "val_fraction": 0.1}


@pytest.fixture(scope="module")
def mixed_lengths(tmp_path_factory) -> tuple[dict, object]:
    """Parity records of 1..8 moves (14..21 tokens), prepared once: their data section and directory."""
    root = tmp_path_factory.mktemp("mixed")
    data = _prompt_answer_data(root, (1, 8), 300)
    prepare_dataset(tiny_config(data=data).data, root / "data")
    return data, root / "data"


def test_exact_passes_are_the_longest_document_of_each_step(tmp_path, mixed_lengths):
    data, data_dir = mixed_lengths
    steps, grad_accum = 4, 2
    cfg = tiny_config(data=data, train={"schedule": "exact", "length_curriculum": 0.5, "grad_accum": grad_accum,
                                        "tokens": steps_of(steps, grad_accum), "prefix_mixin": 0.0})
    result = train(cfg, tmp_path / "run", data_dir=data_dir)
    rows = read_metrics(tmp_path / "run")

    split = open_dataset(data_dir).split("train")
    starts = split.window_starts(SEQ)
    reference = TokenLoader(split, SEQ, cfg.train.batch_size, cfg.train.seed, curriculum_steps=2)
    expected = []
    for step in range(steps):
        windows = np.concatenate([reference.next_windows(step, micro) for micro in range(grad_accum)])
        longest = max(_longest_whole_document(split, int(starts[w]), SEQ) for w in windows)
        expected.append(min(SEQ, longest))
    assert [r["passes"] for r in rows] == expected and set(expected) <= set(range(14, 22))
    assert result.compute_tokens == rows[-1]["compute_tokens"] == sum(steps_of(1, grad_accum) * k for k in expected)
    # the curriculum's first step draws windows of the shortest documents only
    assert expected[0] < max(expected)


def test_exact_equals_fixed_k_when_the_longest_document_is_k(tmp_path):
    # Records of exactly 4 moves: every document has 17 tokens (one per window of 33), so exact runs K = 17.
    data = _prompt_answer_data(tmp_path, (4, 4), 80)
    runs = {}
    for schedule in ("exact", "fixed:17"):
        cfg = tiny_config(data=data, model={"feedback_jitter": 0.0},
                          train={"schedule": schedule, "tokens": steps_of(2), "prefix_mixin": 0.0})
        train(cfg, tmp_path / schedule, data_dir=tmp_path / "data")
        runs[schedule] = read_metrics(tmp_path / schedule)
    assert [r["passes"] for r in runs["exact"]] == [17, 17]
    for a, b in zip(runs["exact"], runs["fixed:17"]):
        assert a["loss"] == b["loss"] and a["pass_losses"] == b["pass_losses"]
        # 16 passes already give every trained position its exact value: the 17th changes no loss
        assert a["pass_losses"][-1] == pytest.approx(a["pass_losses"][-2], rel=1e-6)


def test_resume_mid_curriculum_is_bitwise_exact(tmp_path, mixed_lengths):
    data, data_dir = mixed_lengths
    sections = dict(data=data, model={"feedback_jitter": 0.02},
                    train={"schedule": "exact", "length_curriculum": 0.5, "tokens": steps_of(4), "seed": 3,
                           "prefix_mixin": 1.0, "grad_passes": 2, "dtype": "float32"})
    train(tiny_config(**sections), tmp_path / "straight", data_dir=data_dir)
    split = tmp_path / "split"
    first = train(tiny_config(**test_train.merge(sections, {"train": {"stop_after_steps": 1}})), split,
                  data_dir=data_dir)
    assert not first.finished and first.steps == 1  # stopped inside the curriculum (steps 0 and 1)
    assert train(tiny_config(**sections), split, data_dir=data_dir, resume=True).finished
    a, b = read_metrics(tmp_path / "straight"), read_metrics(split)
    assert [r["passes"] for r in a] == [r["passes"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert all(x["pass_losses"] == y["pass_losses"] for x, y in zip(a, b))


@pytest.mark.parametrize("option, message", [({"schedule": "exact"}, "schedule exact needs isolated documents"),
                                             ({"length_curriculum": 0.5}, "length_curriculum needs isolated")])
def test_training_on_a_text_stream_is_refused(tmp_path, parity_data, option, message):
    # data.format auto resolves to text only when the data is prepared: the trainer refuses then.
    with pytest.raises(ConfigError, match=message):
        train(tiny_config(train=option), tmp_path / "run", data_dir=parity_data)


# ---- records longer than a window ----------------------------------------------------------------


def test_cut_documents_counts_what_a_window_loses():
    # documents of 5, 40, 12 and 50 tokens; a window holds seq_len + 1 = 17
    lengths = [5, 40, 12, 50]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    mask = np.zeros(sum(lengths), dtype=np.uint8)
    mask[starts[1] + 30 : starts[1] + 40] = 1  # the 40-token record's targets lie past its window
    mask[starts[3] + 3] = 1  # the 50-token record has one target inside its window ...
    mask[starts[3] + 45] = 1  # ... and one past it
    tokens = [np.arange(sum(lengths), dtype=np.uint16)]
    assert TokenSplit("train", tokens, starts, mask, isolate=True).cut_documents(16) == (2, 1, 50)
    assert TokenSplit("train", tokens, starts, None, isolate=True).cut_documents(16) == (2, 0, 50)
    assert TokenSplit("train", tokens, starts, mask, isolate=True).cut_documents(49) == (0, 0, 50)
    assert TokenSplit("train", tokens, starts, mask, isolate=False).cut_documents(16) == (0, 0, 0)


def _cut_reference(split: TokenSplit, seq_len: int) -> tuple[int, int]:
    """Documents longer than a window, and those with no trained target among its tokens 1..seq_len."""
    ends = np.append(split.doc_starts[1:], len(split))
    long = [(int(s), int(e)) for s, e in zip(split.doc_starts, ends) if e - s > seq_len + 1]
    return len(long), sum(not split.loss_mask[s + 1 : s + seq_len + 1].any() for s, _ in long)


def test_training_on_records_longer_than_a_window_warns_with_the_fix(tmp_path, capsys):
    data = _prompt_answer_data(tmp_path, (10, 25), 120)  # 23..38 tokens: some longer than a window of 33
    train(tiny_config(data=data, train={"tokens": steps_of(1)}), tmp_path / "run", data_dir=tmp_path / "data")
    long, untrained = _cut_reference(open_dataset(tmp_path / "data").split("train"), SEQ)
    assert 0 < untrained <= long
    err = capsys.readouterr().err
    assert f"warning: {long:,} of " in err and f"{untrained:,} of them have no trained target" in err
    assert "Raise train.seq_len to at least" in err


def test_training_on_records_all_longer_than_a_window_is_refused(tmp_path):
    data = _prompt_answer_data(tmp_path, (40, 50), 40)  # every answer lies past the window of 33 tokens
    with pytest.raises(DataError, match="nothing would be trained.*Raise train.seq_len to at least"):
        train(tiny_config(data=data, train={"tokens": steps_of(1)}), tmp_path / "run", data_dir=tmp_path / "data")


def test_bench_runs_fused_auto_of_an_exact_trained_run_to_the_fixed_point(tmp_path, capsys):
    """A run trained with train.schedule exact: `fullband bench --modes fused:auto` without --fused-max-passes
    lets every prompt reach the exact recurrence (the cap is the model's context), not fused(8)."""
    import json

    from fullband.cli import main

    data = _prompt_answer_data(tmp_path, (4, 6), 60)
    train(tiny_config(data=data, train={"schedule": "exact", "tokens": steps_of(1)}), tmp_path / "run",
          data_dir=tmp_path / "data")
    val = export_jsonl(state_tracking_task("parity", 12, 12), tmp_path / "val.jsonl", 4, seed=1)  # 21-token prompts
    base = ["bench", str(tmp_path / "run"), "--task", f"jsonl:{val}", "--modes", "fused:auto", "--device", "cpu",
            "--no-progress", "--no-plots", "--bootstrap", "10"]
    for extra, cap, converged in (([], SEQ, True), (["--fused-max-passes", "2"], 2, False)):
        out = tmp_path / f"bench{cap}"
        assert main(base + ["--out", str(out), *extra]) == 0
        report = json.loads((out / "results.json").read_text())
        assert report["settings"]["fused_max_passes"] == cap
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert [s["fused_converged"] for s in samples] == [converged] * 4
        assert all((s["fused_passes"] <= 21) if converged else s["fused_passes"] == 2 for s in samples)
        assert ("**Warning**" in (out / "results.md").read_text()) == (not converged)
        assert f"decode settings: fused:auto (tol 0.001, at most {cap} passes)" in capsys.readouterr().err
    # `fullband generate --fused-passes auto` takes the same default, and says when the cap cut it off
    prompt = json.loads(val.read_text().splitlines()[0])["prompt"]
    generate = ["generate", str(tmp_path / "run"), "--prompt", prompt, "--mode", "fused", "--fused-passes", "auto",
                "--max-new-tokens", "2", "--device", "cpu"]
    for extra, cut in (([], False), (["--fused-max-passes", "2"], True)):
        assert main(generate + extra) == 0
        err = capsys.readouterr().err
        assert "adaptive fused prefill: " in err and ("cut off at fused_max_passes 2" in err) == cut


@pytest.mark.parametrize("schedule", ["standard", "exact"])
def test_a_steps_loss_is_the_mean_over_its_labels_however_micro_batches_split_it(tmp_path, mixed_lengths, schedule):
    """Prompt-answer records label their answers only, so micro-batches hold different numbers of labels: 8 rows
    in one micro-batch and the same 8 rows in two of 4 give the same losses, gradients and weights (the mean over
    the step's labels, not a mean of micro-batch means)."""
    data, data_dir = mixed_lengths
    steps = 3
    runs = {}
    for batch, grad_accum in ((2 * BATCH, 1), (BATCH, 2)):
        # no jitter: its noise is drawn per (micro-batch, row), which the two splits number differently
        cfg = tiny_config(data=data, model={"feedback_jitter": 0.0},
                          train={"schedule": schedule, "batch_size": batch, "grad_accum": grad_accum,
                                 "tokens": steps_of(steps, 2), "prefix_mixin": 0.0, "dtype": "float32"})
        train(cfg, tmp_path / f"ga{grad_accum}", data_dir=data_dir)
        runs[grad_accum] = read_metrics(tmp_path / f"ga{grad_accum}")
    assert [r["passes"] for r in runs[1]] == [r["passes"] for r in runs[2]]
    for one, two in zip(runs[1], runs[2]):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), (one["step"], one["loss"], two["loss"])
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)

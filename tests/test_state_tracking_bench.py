"""fullband.state_tracking (batches, grading, curriculum) and benchmarks/state_tracking.py --quick end to end."""

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from fullband import state_tracking as core
from fullband.data import ByteTokenizer
from fullband.data.synthetic import state_tracking_task

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "state_tracking.py"
spec = importlib.util.spec_from_file_location("state_tracking", SCRIPT)
st = importlib.util.module_from_spec(spec)
spec.loader.exec_module(st)
DRIFT = Path(__file__).resolve().parents[1] / "benchmarks" / "state_drift.py"
spec = importlib.util.spec_from_file_location("state_drift", DRIFT)
drift = importlib.util.module_from_spec(spec)
spec.loader.exec_module(drift)
FLIPFLOP_WINDOW = Path(__file__).resolve().parents[1] / "benchmarks" / "flipflop_window.py"
spec = importlib.util.spec_from_file_location("flipflop_window", FLIPFLOP_WINDOW)
flipflop_window = importlib.util.module_from_spec(spec)
spec.loader.exec_module(flipflop_window)
SAME_ROWS = Path(__file__).resolve().parents[1] / "benchmarks" / "state_tracking_same_rows.py"
spec = importlib.util.spec_from_file_location("state_tracking_same_rows", SAME_ROWS)
same_rows = importlib.util.module_from_spec(spec)
spec.loader.exec_module(same_rows)


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
    models = tmp_path / "models"
    argv = ["--quick", "--threads", "1", "--tasks", "parity", "--out", str(out), "--plot", str(tmp_path / "st.png"),
            "--save-models", str(models)]
    st.main(argv)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # The kept weights are the model that was graded: reloaded, it answers the same rows the same way.
    saved = sorted(p.name for p in (models / "st").iterdir())
    assert saved == ["parity_s0_baseline", "parity_s0_baseline_compute", "parity_s0_fbt"]
    recipe = core.Recipe(train_len=2, eval_rows=4, multiples=(1, 2))
    assert core.evaluate(core.load_kept_model(models / "st" / "parity_s0_fbt"), "parity", recipe,
                         ("exact", "plain")) == records[0]["eval"]
    assert [r["model"] for r in records] == ["fbt", "baseline", "baseline_compute"]
    fbt, base, compute = records
    assert set(fbt["eval"]["1"]) == {"exact", "plain"} and set(base["eval"]["1"]) == {"plain"}
    assert base["train"]["tokens"] == fbt["train"]["tokens"]  # same batches
    assert compute["train"]["steps"] == round(fbt["train"]["steps"] * fbt["train"]["mean_passes"])
    text = capsys.readouterr().out
    assert "| fbt exact |" in text and "paired: fbt exact − baseline |" in text
    st.main(argv)  # everything is done: nothing is retrained
    assert len(out.read_text().splitlines()) == 3

    # --compare: one row per task and seed, one column per file; "–" where a file lacks that run.
    other = tmp_path / "other.jsonl"
    kept_early = {**fbt, "seed": 8, "train": {**fbt["train"], "kept_step": 1}}  # --keep best kept step 1's model
    other.write_text(json.dumps({**fbt, "seed": 7}) + "\n" + json.dumps(kept_early) + "\n")
    capsys.readouterr()
    st.main(["--compare", f"first={out}", f"second={other}"])
    cell = " / ".join(f"{st.accuracy(fbt['eval'][m]['exact']):.2f}" for m in fbt["eval"])
    assert capsys.readouterr().out.splitlines() == [
        "| task | seed | first | second |", "|---|---|---|---|",
        f"| parity | 0 | {cell} | – |", f"| parity | 7 | – | {cell} |", f"| parity | 8 | – | {cell} (step 1) |"]
    # Several files per label, and the paired difference on the same rows: the same seed-0 record with
    # its first row at 1x L graded the other way.
    flipped = json.loads(json.dumps(fbt))
    exact = flipped["eval"]["1"]["exact"]
    flipped["eval"]["1"]["exact"] = ("0" if exact[0] == "1" else "1") + exact[1:]
    changed = tmp_path / "changed.jsonl"
    changed.write_text(json.dumps(flipped) + "\n")
    st.main(["--compare", f"first={out},{other}", f"second={changed}"])
    lines = capsys.readouterr().out.splitlines()
    assert f"| parity | 7 | {cell} | – |" in lines
    step = (1 if exact[0] == "0" else -1) / len(exact)
    assert lines[-1] == f"| parity | second − first | 1 | {step:.2f} / 0.00 |"
    # Records trained on another length were graded on other rows: no paired difference is made up.
    changed.write_text(json.dumps({**flipped, "train_len": 3}) + "\n")
    st.main(["--compare", f"first={out}", f"second={changed}"])
    assert capsys.readouterr().out.splitlines()[-1] == "| parity | second − first | 1 | not on the same rows |"
    with pytest.raises(SystemExit):
        st.main(["--compare", f"first={tmp_path / 'missing.jsonl'}"])
    assert "--compare: no such file(s)" in capsys.readouterr().err


def test_probe_tasks_have_the_requested_moves():
    rng = random.Random(0)
    completion = core.task_with_moves("completion", 5).generate(rng)
    assert len(completion.prompt.split(" : ")[1].removesuffix(" :")) == 5
    registers = core.task_with_moves("registers", 3).generate(rng)
    assert registers.prompt.count("=") == 3
    delayed = core.task_with_moves("delayed", 2).generate(rng)  # at least delay + 1 = 4 digits
    assert len(delayed.prompt.split(" : ")[1].removesuffix(" :")) == 4


def test_k2_kind_trains_with_two_passes_and_full_attention(single_thread):
    config = st.load_config(st.PRESET_DIR / "state-tracking.yaml")
    recipe = core.Recipe(train_len=2, steps=2, eval_rows=4, multiples=(1,))
    model, info = core.train_model("delayed", "fbt_k2", 0, config, recipe)
    assert info["mean_passes"] == 2 and model.config.sliding_window is None
    model, info = core.train_model("delayed", "fbt", 0, config, recipe)
    assert info["mean_passes"] > 2 and model.config.sliding_window == config.model.sliding_window
    assert len(info["loss_curve"]) == 2  # one mean per step-tenth that holds a step
    assert len(info["grad_norm_max_curve"]) == 2 and min(info["grad_norm_max_curve"]) > 0


def test_window_baseline_is_the_fbt_architecture_run_once_and_is_summarised(tmp_path, capsys, single_thread):
    out = tmp_path / "st.jsonl"
    st.main(["--quick", "--threads", "1", "--tasks", "flipflop", "--models", "fbt,baseline_window", "--out", str(out),
             "--plot", str(tmp_path / "st.png"), "--save-models", str(tmp_path / "models")])
    fbt, windowed = [json.loads(line) for line in out.read_text().splitlines()]
    assert windowed["model"] == "baseline_window" and windowed["train"]["mean_passes"] == 1
    assert windowed["train"]["tokens"] == fbt["train"]["tokens"]  # same batches
    kept = core.load_kept_model(tmp_path / "models" / "st" / "flipflop_s0_baseline_window")
    assert kept.config.sliding_window == st.load_config(st.PRESET_DIR / "state-tracking.yaml").model.sliding_window
    text = capsys.readouterr().out
    assert "| baseline_window plain |" in text and "| paired: fbt exact − baseline_window |" in text


def test_flipflop_visibility_counts_the_tokens_before_the_digit_and_splits_a_run(tmp_path, capsys):
    examples = core.synthetic_examples(core.task_with_moves("flipflop", 12), 50, 10_001)
    # the digit is predicted at the answer's space; " :" and that space sit between it and the last move
    assert flipflop_window.visible_rows("flipflop", 12, 50, 10_001, 3) == [False] * 50
    last_is_write = [ex.prompt[-3] != "." for ex in examples]
    assert flipflop_window.visible_rows("flipflop", 12, 50, 10_001, 4) == last_is_write
    assert 0 < sum(last_is_write) < 50
    assert flipflop_window.visible_rows("flipflop", 12, 50, 10_001, 16) == [True] * 50  # the first move is a write
    record = {"eval": {"1": {"plain": "1100"}}}
    assert flipflop_window.run_split(record, {"1": [True, False, True, False]}) == {"visible": [0.5], "hidden": [0.5]}
    assert flipflop_window.run_split(record, {"1": [True, True, False, False]}) == {"visible": [1.0], "hidden": [0.0]}
    flipflop_window.main(["--quick", "--out", str(tmp_path / "w.json")])
    assert "ceiling without feedback" in capsys.readouterr().out
    assert json.loads((tmp_path / "w.json").read_text())["receptive_field"] == 7


def test_probe_benchmark_quick_writes_layer_accuracies(tmp_path, capsys, single_thread):
    spec = importlib.util.spec_from_file_location("probes", SCRIPT.parent / "probes.py")
    probes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probes)
    out = tmp_path / "probes.jsonl"
    probes.main(["--quick", "--tasks", "delayed", "--out", str(out)])
    (record,) = [json.loads(line) for line in out.read_text().splitlines()[:1]]
    assert set(record["probe"]) == {"standard", "fused:1", "exact"}
    n_layers = st.load_config(st.PRESET_DIR / "state-tracking.yaml").model.n_layers
    assert all(len(v) == n_layers + 1 and all(0 <= a <= 1 for a in v) for v in record["probe"].values())
    assert "| delayed | fbt_k2 |" in capsys.readouterr().out


def test_hold_rows_keep_the_answer_of_their_random_prefix(single_thread):
    from fullband.data.synthetic import get_task

    for task, no_op in core.NO_OP.items():
        example = core.task_with_moves(task, 5).generate(random.Random(3))
        held = example.prompt.removesuffix(" :") + no_op * 20 + " :"
        states = get_task(task).targets(type(example)(held, example.answer))
        assert len(states) == 25 and states[-1][1] == example.answer.strip(), task
    config = st.load_config(st.PRESET_DIR / "state-tracking.yaml")
    recipe = core.Recipe(train_len=2, steps=1, eval_rows=3, multiples=(1, 3))
    model, _ = core.train_model("cycle", "fbt", 0, config, recipe)
    hold = core.evaluate_hold(model, "cycle", recipe)
    assert set(hold) == {"1", "3"} and all(len(bits) == 3 for bits in hold.values())
    assert core.evaluate_hold(model, "s5", recipe) == {}


def test_task_variants_pass_their_options():
    example = core.task_with_moves("cycle:size=3", 6).generate(random.Random(0))
    moves = example.prompt.split(" ")[1]
    assert example.answer == f" {sum({'+': 1, '-': -1, '=': 0}[m] for m in moves) % 3}"
    digits = core.task_with_moves("summod:modulus=3", 40).generate(random.Random(1)).prompt.split(" ")[1]
    assert set(digits) <= {"0", "1", "2"} and len(digits) == 40
    assert core.task_base("cycle:size=3") == "cycle" and core.task_base("s5") == "s5"
    args = st.parse_args(["--tasks", "cycle:size=3,parity", "--summary-only"])
    assert args.tasks == "cycle:size=3,parity"


def test_probe_and_novelty_tell_states_on_the_trained_region_from_states_that_drift():
    torch.manual_seed(0)
    codebook = torch.randn(5, 16, dtype=torch.float64) * 10
    fit_y = torch.randint(0, 5, (400,))
    fit_h = codebook[fit_y] + torch.randn(400, 16, dtype=torch.float64)
    fit_h = torch.cat([fit_h, fit_h[:200]])  # shared prefixes repeat states exactly: they must not zero the scale
    fit_y = torch.cat([fit_y, fit_y[:200]])
    assert drift.Novelty(fit_h)(fit_h[:3]).tolist() == [0.0, 0.0, 0.0]
    y = torch.randint(0, 5, (50, 6))
    offsets = torch.tensor([0.0, 0.0, 5.0, 10.0, 20.0, 40.0], dtype=torch.float64)  # a state that drifts away
    h = codebook[y] + torch.randn(50, 6, 16, dtype=torch.float64) + offsets[None, :, None] * torch.randn(16).abs()
    curves = drift.per_move_curves(h, y, fit_h, fit_y, classes=5)
    assert curves["probe"][:2] == [1.0, 1.0] and curves["probe"][-1] < 0.9
    assert 0.5 < curves["novelty"][0] < 2 and curves["novelty"][1] < 2
    later = curves["novelty"][1:]
    assert all(b > a for a, b in zip(later, later[1:]))


def test_drift_benchmark_quick_reads_saved_models(tmp_path, capsys, single_thread):
    st.main(["--quick", "--threads", "1", "--tasks", "s3", "--models", "fbt", "--out", str(tmp_path / "st.jsonl"),
             "--plot", "", "--save-models", str(tmp_path / "models")])
    out = tmp_path / "drift.jsonl"
    drift.main(["--quick", "--runs", str(tmp_path / "models" / "st"), "--tasks", "s3", "--seeds", "0",
                "--train-len", "2", "--out", str(out), "--plot", str(tmp_path / "drift.png")])
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["moves"] == 4 and (tmp_path / "drift.png").stat().st_size > 0
    assert all(len(record[key]) == 4 for key in ("answer", "probe", "novelty", "novelty_ok"))
    # the answer after all moves is the benchmark's 2× column (the same rows): the two routes agree
    graded = json.loads((tmp_path / "st.jsonl").read_text().splitlines()[0])["eval"]["2"]["exact"]
    assert record["answer"][-1] == record["answer_accuracy"] == st.accuracy(graded)
    assert "| novelty |" in capsys.readouterr().out
    (tmp_path / "models" / "st" / "s3_s0_fbt" / "model.safetensors").write_bytes(b"half a file")
    with pytest.raises(SystemExit, match="not a model kept"):
        drift.main(["--quick", "--runs", str(tmp_path / "models" / "st"), "--tasks", "s3", "--seeds", "0",
                    "--train-len", "2", "--out", str(out), "--plot", ""])


def test_same_rows_regrade_pairs_kept_models_with_the_benchmark_rows(tmp_path, capsys, single_thread):
    bench = tmp_path / "st.jsonl"
    st.main(["--quick", "--threads", "1", "--tasks", "parity", "--models", "fbt", "--out", str(bench), "--plot", "",
             "--save-models", str(tmp_path / "models")])
    out = tmp_path / "same.jsonl"
    argv = ["--quick", "--runs", str(tmp_path / "models" / "st"), "--tasks", "parity", "--seeds", "0",
            "--reference", str(bench), "--out", str(out)]
    same_rows.main(argv + ["--rows-len", "2"])
    # graded on the rows of its own L, a kept model reproduces the benchmark's per-row results, so the
    # paired difference against them is exactly zero
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    graded = json.loads(bench.read_text().splitlines()[0])["eval"]
    assert record["eval"] == {m: r["exact"] for m, r in graded.items()}
    table = capsys.readouterr().out
    assert "| st − reference, same rows | parity | 1 | +0.00 | +0.00 |" in table
    # on the rows of another L the prompts are other ones, with that L's numbers of moves
    same_rows.main(argv[:-4] + ["--rows-len", "3", "--out", str(out)])
    assert "| 3 moves | 6 moves |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not --rows-len 3"):
        same_rows.main(argv + ["--rows-len", "3"])


def test_center_pull_measures_and_moves_the_running_mean_state_of_each_answer():
    labels = torch.full((3, 4), core.IGNORE)
    labels[:, 2:] = 7  # position 2 predicts each row's answer
    hidden = torch.zeros(3, 4, 2, requires_grad=True)
    states = torch.tensor([[1.0, 0.0], [3.0, 0.0], [5.0, 5.0]])
    h = hidden + torch.zeros(3, 4, 2).index_put((torch.arange(3), torch.full((3,), 2)), states)
    centers: dict = {}
    loss = core.center_pull(h, labels, [" a", " a", " b"], centers)
    # first sight of each answer: the target is the batch mean, (2, 0) for " a" and the row itself for " b"
    assert loss.item() == pytest.approx((1 + 1 + 0) / 6)
    assert centers[" a"].tolist() == [2.0, 0.0] and centers[" b"].tolist() == [5.0, 5.0]
    loss.backward()  # the target is held fixed: the gradient only moves the rows' own states
    assert hidden.grad[0, 2].tolist() == pytest.approx([-2 * 1 / 6, 0.0]) and hidden.grad[:, :2].abs().sum() == 0
    # the next batch is pulled to the running mean, which then moves 10% of the way to the batch's mean
    later = torch.zeros(1, 4, 2)
    later[0, 2] = torch.tensor([4.0, 0.0])
    assert core.center_pull(later, labels[:1], [" a"], centers).item() == pytest.approx(4 / 2)
    assert centers[" a"].tolist() == pytest.approx([2.2, 0.0])


def test_center_loss_option_trains_another_model_and_is_recorded(tmp_path, single_thread):
    runs = {}
    for weight in ("0", "1.0"):
        out = tmp_path / f"c{weight}.jsonl"
        st.main(["--quick", "--threads", "1", "--tasks", "s3", "--models", "fbt", "--out", str(out), "--plot", "",
                 "--save-models", str(tmp_path / "models"), "--center-loss", weight])
        runs[weight] = json.loads(out.read_text().splitlines()[0])
    assert "center_loss" not in runs["0"] and runs["1.0"]["center_loss"] == 1.0
    # the loss curve includes the center term itself, so compare what was trained: the kept weights
    weights = {w: core.load_kept_model(tmp_path / "models" / f"c{w}" / "s3_s0_fbt").state_dict() for w in runs}
    assert weights["0"].keys() == weights["1.0"].keys()
    assert any(not torch.equal(weights["0"][k], weights["1.0"][k]) for k in weights["0"])


def test_validation_leaves_training_unchanged_and_best_keeps_the_lowest_loss(single_thread):
    # a learning rate large enough that the validation loss rises again after step 2
    config = st.load_config(st.PRESET_DIR / "state-tracking.yaml", {"train.lr": "0.5", "train.warmup_steps": "1"})
    plain = core.Recipe(train_len=2, steps=6, eval_rows=8, multiples=(1,))
    last, info = core.train_model("parity", "fbt", 0, config, plain)
    assert "val_curve" not in info
    watched = core.Recipe(train_len=2, steps=6, eval_rows=8, multiples=(1,), val_every=2)
    same, watched_info = core.train_model("parity", "fbt", 0, config, watched)
    # the validations draw no random numbers the training uses: the same weights, step for step
    assert all(torch.equal(a, b) for a, b in zip(last.state_dict().values(), same.state_dict().values()))
    assert [v[0] for v in watched_info["val_curve"]] == [2, 4, 6] and watched_info["kept_step"] == 6
    best = core.Recipe(train_len=2, steps=6, eval_rows=8, multiples=(1,), val_every=2, keep="best")
    rows = core.validation_rows("parity", best)
    kept, best_info = core.train_model("parity", "fbt", 0, config, best,
                                       grade_last=lambda m: {"val": core.validate(m, "fbt", *rows)})
    assert best_info["val_curve"] == watched_info["val_curve"]
    # the last model is graded before the kept one replaces it: the same figures as the run that kept the last
    assert best_info["last_step_eval"] == {"val": core.validate(last, "fbt", *rows)}
    losses = {step: loss for step, loss, _ in best_info["val_curve"]}
    assert best_info["kept_step"] == max(s for s in losses if losses[s] == min(losses.values())) < 6
    kept_loss = core.validate(kept, "fbt", *core.validation_rows("parity", best))[0]
    assert kept_loss == pytest.approx(min(losses.values()), rel=1e-3)
    with pytest.raises(ValueError, match="val_every"):
        core.Recipe(keep="best")


def test_benchmark_keeps_best_and_plots_validation(tmp_path, single_thread):
    out, png = tmp_path / "st.jsonl", tmp_path / "val.png"
    # a learning rate so large that the validation loss is lowest before the last step
    st.main(["--quick", "--tasks", "cycle", "--models", "fbt", "--val-every", "1", "--keep", "best", "--out", str(out),
             "--save-models", "", "--plot", "", "--val-plot", str(png), "--set", "train.lr=0.5",
             "--set", "train.warmup_steps=1"])
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["keep"] == "best" and len(record["train"]["val_curve"]) == record["train"]["steps"]
    assert record["train"]["kept_step"] < record["train"]["steps"]
    # the same run's last model is graded on the same rows, in the same modes, and shown beside the kept one
    assert {m: set(v) for m, v in record["eval_last"].items()} == {m: set(v) for m, v in record["eval"].items()}
    assert "the last step's model of the runs that kept an earlier one" in st.summarise(out)
    assert "; last step: " in st.compare({"kept": [out]})
    assert png.stat().st_size > 0
    with pytest.raises(SystemExit):
        st.main(["--quick", "--keep", "best", "--out", str(out)])  # nothing to choose from

"""FullBandLM.compile_recurrence: sequential training's token steps run a chunk of positions per compiled call
(windowed_token_steps) with the loss and every gradient of the Jacobi path (float64, 1e-10), with packed
documents, plain positions and a chunk that does not divide the length, as one graph for every chunk of a
length the chunk divides; a compiler that fails leaves the
steps uncompiled with a warning; the models it cannot run are refused."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from test_sequential_train import SEGMENTS, B, T, _batch, _generators, _loss_and_grads

from fullband.train.objective import multipass_loss, sequential_loss

VARIANTS = {"gate_window4": dict(sliding_window=4), "concat_window3": dict(fusion="concat", sliding_window=3)}


@pytest.fixture(autouse=True)
def fresh_compile_cache(tmp_path, monkeypatch):
    """Each test compiles with its own backend: without a reset, torch.compile would reuse another test's graph
    for the same shapes; and with its own inductor cache directory, so that no trace the user's runs kept is loaded
    and none is left behind."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _jacobi_and_compiled(variant: str, packed: bool, backend: str, chunk: int = 5):
    ids, labels = _batch()
    model = make_model(dtype=torch.float64, feedback_jitter=0.0, **VARIANTS[variant]).train()
    plain_mask = torch.zeros(B, T, dtype=torch.bool)
    plain_mask[1, 7] = True
    recurrence = dict(segment_ids=SEGMENTS if packed else None, plain_mask=plain_mask, prefix_mixin=0.5)
    jacobi = _loss_and_grads(model, multipass_loss(model, ids, labels, T, pass_loss="last",
                                                   generator=_generators(1), **recurrence))
    model.compile_recurrence(chunk, backend=backend)
    compiled = _loss_and_grads(model, sequential_loss(model, ids, labels, generator=_generators(1), **recurrence))
    return model, jacobi, compiled


def _assert_equal(model, jacobi, compiled) -> None:
    (jacobi_loss, jacobi_grads), (loss, grads) = jacobi, compiled
    torch.testing.assert_close(loss, jacobi_loss, rtol=0, atol=1e-10)
    assert grads.keys() == jacobi_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in jacobi_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_steps_have_the_jacobi_loss_and_gradients(single_thread, variant, packed):
    # backend "eager": the chunk function itself, without a compiler's rounding
    _assert_equal(*_jacobi_and_compiled(variant, packed, "eager"))


def test_the_chunk_function_compiles_as_one_graph(single_thread):
    # aot_eager traces the chunks (fullgraph: a graph break would raise) and their backward, without a C++ build
    _assert_equal(*_jacobi_and_compiled("gate_window4", True, "aot_eager", chunk=8))


def test_every_chunk_of_a_length_the_chunk_divides_runs_one_graph(single_thread):
    # The first chunk (no state, no keys before it) in the shapes of the others: one trace and compile a run, not
    # two; a second compile would double the first step's time of every `fullband train` with the preset.
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    _assert_equal(*_jacobi_and_compiled("gate_window4", True, counting_backend, chunk=4))  # T = 12: 3 chunks
    assert len(graphs) == 1


def test_a_failed_compiler_leaves_the_steps_uncompiled_with_a_warning(single_thread):
    def no_compiler(graph, example_inputs):
        raise RuntimeError("no C++ compiler found")

    with pytest.warns(UserWarning, match="torch.compile failed .*the recurrence runs its token steps uncompiled"):
        _assert_equal(*_jacobi_and_compiled("gate_window4", False, no_compiler))


def test_off_and_without_gradients_the_steps_run_one_by_one(single_thread):
    ids, _ = _batch()
    model = make_model(dtype=torch.float64, sliding_window=4)
    expected = model.recurrence(ids).logits
    with torch.no_grad():
        expected_without_gradients = model.recurrence(ids).logits
    model.compile_recurrence(4, backend="eager")
    with torch.no_grad():  # prefill and evaluation: the cache path, not the chunks
        torch.testing.assert_close(model.recurrence(ids).logits, expected_without_gradients, rtol=0, atol=0)
    model.compile_recurrence(0)
    assert model.compiled_steps is None
    torch.testing.assert_close(model.recurrence(ids).logits, expected, rtol=0, atol=0)


def test_on_a_cpu_the_steps_compile_with_inductors_cpp_wrapper(monkeypatch):
    # The real torch.compile builds the function (no compile yet) and checks the option names there, so a misspelt
    # or renamed option fails here rather than at a user's first training step; other backends get no options.
    asked = []
    real_compile = torch.compile

    def recording_compile(function, **kwargs):
        asked.append((kwargs["backend"], kwargs["options"]))
        return real_compile(function, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    model = make_model(sliding_window=4)
    model.compile_recurrence(4)
    model.compile_recurrence(4, backend="aot_eager")
    assert asked == [("inductor", {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}), ("aot_eager", None)]


# What a later process runs: the model of _kept_trace_model, compiled on a cache where an earlier process left its
# trace, on the first batch (its loss and gradients) and on a batch of other shapes (its loss); how many graphs
# dynamo traced for each, and the uncompiled loss of the second.
LATER_PROCESS = """
import sys, torch
from torch._dynamo.utils import counters
sys.path.insert(0, sys.argv[1])
from test_compiled_recurrence import _kept_trace_model, _kept_trace_step
torch.set_num_threads(1)
model = _kept_trace_model()
found = model.compiled_steps.trace_found
first = _kept_trace_step(model, batch=3)
traced_first = counters["stats"]["unique_graphs"]
other = _kept_trace_step(model, batch=2)[0]
traced_other = counters["stats"]["unique_graphs"] - traced_first
model.compile_recurrence(0)
uncompiled = _kept_trace_step(model, batch=2)[0]
torch.save(dict(first=first, traced_first=traced_first, other=other, traced_other=traced_other,
                uncompiled=uncompiled, loaded=counters["dynamo_cache"]["dynamo_cache_hit"], found=found), sys.argv[2])
"""


def _kept_trace_model():
    model = make_model(n_layers=1, sliding_window=3, feedback_jitter=0.0).train()
    model.compile_recurrence(1)
    return model


def _kept_trace_step(model, batch: int):
    ids, labels = (tensor[:batch] for tensor in _batch())
    return _loss_and_grads(model, sequential_loss(model, ids, labels))


def test_a_later_process_loads_the_compiled_steps_instead_of_tracing_them(tmp_path, single_thread):
    # The real inductor with its C++ wrapper, on a one-layer model one position a call (a small graph, built cold in
    # a fresh cache directory). The later process, a real one, must trace nothing for the same shapes, with the
    # loss and gradients bit for bit, and trace a batch of other shapes beside the loaded graph (in torch 2.13 that
    # failed on a name the loaded graph had taken, without CompiledSteps moving dynamo's counter past it).
    import subprocess
    import sys
    from pathlib import Path

    model = _kept_trace_model()
    if not model.compiled_steps.keeps_trace:
        pytest.skip("this torch has no caching precompile to keep a trace on disk")
    assert not model.compiled_steps.trace_found
    loss, grads = _kept_trace_step(model, batch=3)
    assert list((tmp_path / "inductor" / "dynamo").iterdir())  # the trace, written
    done = subprocess.run([sys.executable, "-c", LATER_PROCESS, str(Path(__file__).parent), str(tmp_path / "later.pt")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "is dropped with caching_precompile" not in done.stderr
    later = torch.load(tmp_path / "later.pt")
    assert (later["found"], later["loaded"], later["traced_first"], later["traced_other"]) == (True, 1, 0, 1)
    torch.testing.assert_close(later["first"][0], loss, rtol=0, atol=0)
    assert later["first"][1].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(later["first"][1][name], grad, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(later["other"], later["uncompiled"], rtol=0, atol=1e-5)


def _steps_that_trace(monkeypatch, graphs_stored: bool):
    """The CompiledSteps compile_recurrence builds on a CPU, its compiled function replaced by one that counts a new
    trace as dynamo does, and the compiled graphs the autograd cache stored (or not); and the list of trace writes."""
    from torch._dynamo.utils import counters

    from fullband.compiled_steps import CompiledSteps
    from fullband.model import windowed_token_steps

    steps = CompiledSteps(windowed_token_steps, "inductor", torch.device("cpu"))
    if not steps.keeps_trace:
        pytest.skip("this torch has no caching precompile to keep a trace on disk")

    def tracing(*args):
        counters["stats"]["unique_graphs"] += 1
        counters["aot_autograd"]["autograd_cache_saved"] += graphs_stored
        return args

    writes = []
    steps.compiled = tracing
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: writes.append(1))
    return steps, writes


def test_a_new_trace_is_written_once_with_its_compiled_graphs_and_never_without_them(monkeypatch):
    steps, writes = _steps_that_trace(monkeypatch, graphs_stored=True)
    assert steps("chunk") == ("chunk",) and writes == [1]
    steps.compiled = lambda *args: args  # a call that traces nothing writes nothing
    assert steps("chunk") == ("chunk",) and writes == [1]
    steps, writes = _steps_that_trace(monkeypatch, graphs_stored=False)  # caches bypassed: a trace that would be
    assert steps("chunk") == ("chunk",) and writes == []  # loaded and skipped by every later run


def test_a_trace_that_cannot_be_written_leaves_the_steps_running_with_a_warning(monkeypatch):
    steps, _ = _steps_that_trace(monkeypatch, graphs_stored=True)

    def read_only():
        raise RuntimeError("Failed to save package to /cache/dynamo/x: [Errno 30] Read-only file system")

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", read_only)
    with pytest.warns(UserWarning, match=r"could not keep the compiled steps' trace in .*Read-only file system.*"
                                         r"later runs will trace them again .set TORCHINDUCTOR_CACHE_DIR"):
        assert steps("chunk") == ("chunk",)


def test_a_kept_trace_that_cannot_be_used_is_passed_over_quietly(tmp_path):
    # An unreadable kept trace (a trace of other sources is the same case, found later): the steps will compile at
    # the first step and replace it, and torch's traceback about it reaches no handler.
    import logging

    from torch._dynamo.package import CompilePackage

    from fullband.compiled_steps import CompiledSteps
    from fullband.model import windowed_token_steps

    entry = tmp_path / "inductor" / "dynamo" / CompilePackage.source_id_from_fn(windowed_token_steps) / "entry"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"not a trace")
    heard = []  # torch's loggers do not pass records to the root logger: listen on the one that reports it
    handler = logging.Handler()
    handler.emit = heard.append
    logger = logging.getLogger("torch._dynamo.package")
    logger.addHandler(handler)
    try:
        steps = CompiledSteps(windowed_token_steps, "inductor", torch.device("cpu"))
    finally:
        logger.removeHandler(handler)
    if not steps.keeps_trace:
        pytest.skip("this torch has no caching precompile to keep a trace on disk")
    assert heard == [] and not steps.trace_found
    assert steps.describe().startswith("the steps compile at the first step")


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(), "a layer without a sliding window"),
    (dict(sliding_window=4, qk_norm=True), "qk_norm"),
    (dict(sliding_window=4, n_kv_heads=2), "grouped-query heads"),
    (dict(sliding_window=4, attn_output_gate=True), "attn_output_gate"),
    (dict(sliding_window=4, full_attention_every=2), "a layer without a sliding window"),
])
def test_models_the_compiled_steps_cannot_run_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_model(**overrides).compile_recurrence(8)


@pytest.mark.parametrize("chunk", [-1, True, 2.0])
def test_a_bad_chunk_is_refused(chunk):
    with pytest.raises(ValueError, match="chunk must be 0 .off. or a positive number"):
        make_model(sliding_window=4).compile_recurrence(chunk)


# ---- through `fullband train` (train.compile_recurrence) ----------------------------------------------------------

# The state-tracking preset at a tiny size, 6 steps of 4 windows of 32 tokens, validated at steps 3 and 6.
TINY_PRESET = ["--model.d_model", "16", "--model.d_ff", "32", "--model.n_heads", "2", "--train.batch_size", "4",
               "--train.tokens", str(6 * 4 * 32), "--train.eval_every", "3", "--eval.batches", "1",
               "--eval.batch_size", "4", "--train.progress", "false", "--train.device", "cpu"]
TRAIN_BACKEND = "aot_eager"  # what the trainer's torch.compile runs with here: a traced graph without a C++ build


def _preset_run(tmp_path, name: str, *options: str) -> int:
    """A tiny `fullband train --config state-tracking` run in tmp_path / name: the exit code."""
    from fullband.cli import main
    from fullband.data.synthetic import export_jsonl, state_tracking_task

    source = export_jsonl(state_tracking_task("parity", 1, 8), tmp_path / "train.jsonl", 200, seed=0)
    return main(["train", "--config", "state-tracking", "--data.source", str(source), "--data-dir",
                 str(tmp_path / "data"), "--out-dir", str(tmp_path / name), *TINY_PRESET, *options])


def _train_preset(tmp_path, name: str, *options: str) -> list[list[dict]]:
    """``_preset_run``, which must succeed: its metrics.jsonl and eval.jsonl records."""
    import json

    assert _preset_run(tmp_path, name, *options) == 0
    return [[json.loads(line) for line in (tmp_path / name / log).read_text().splitlines()]
            for log in ("metrics.jsonl", "eval.jsonl")]


def test_fullband_train_runs_the_compiled_steps_with_the_uncompiled_losses(tmp_path, monkeypatch, capsys,
                                                                          single_thread):
    """train.compile_recurrence through the real trainer: every training step's token steps run chunk by chunk
    through the compiled function, with the loss trajectory of the uncompiled steps; validation (no gradients)
    never calls it. The trainer's torch.compile runs with the aot_eager backend here: with inductor (the option's
    own backend) this test passes too, but its cold C++ build takes ~110 s."""
    chunks = []
    real_compile = torch.compile

    def compile_for_the_test(function, **options):
        compiled = real_compile(function, **{**options, "backend": TRAIN_BACKEND, "options": None})  # inductor's

        def counted(*args):
            chunks.append((torch.is_grad_enabled(), args[1].shape[1]))  # args[1]: the chunk's embeddings
            return compiled(*args)
        return counted

    monkeypatch.setattr(torch, "compile", compile_for_the_test)
    metrics, evals = _train_preset(tmp_path, "uncompiled", "--train.compile_recurrence", "0")
    assert chunks == []
    compiled_metrics, compiled_evals = _train_preset(tmp_path, "compiled", "--train.compile_recurrence", "4")
    # What the first step will do, said before it (a cold compile is a minute of silence otherwise)
    assert (f"train.compile_recurrence 4: the steps compile at the first step (a minute or more the first time on a "
            f"CPU), and are kept in {tmp_path / 'inductor'} for later runs") in capsys.readouterr().err
    assert chunks == [(True, 4)] * (6 * 32 // 4)  # every step, 8 chunks of 4 positions, all with gradients
    assert [m["step"] for m in compiled_metrics] == [m["step"] for m in metrics] == list(range(1, 7))
    for compiled, uncompiled in zip(compiled_metrics, metrics):
        assert compiled["passes"] == uncompiled["passes"]
        assert compiled["loss"] == pytest.approx(uncompiled["loss"], rel=0, abs=1e-5)
    assert [e["step"] for e in compiled_evals] == [e["step"] for e in evals] == [3, 6]
    for compiled, uncompiled in zip(compiled_evals, evals):
        assert compiled["loss"]["sequential"] == pytest.approx(uncompiled["loss"]["sequential"], rel=0, abs=1e-5)


def test_fullband_train_refuses_compiled_steps_the_model_cannot_take(tmp_path, capsys, single_thread):
    from fullband.config import build_config
    from fullband.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.compile_recurrence=-1 must be an integer >= 0"):
        build_config({"train": {"compile_recurrence": -1}})
    with pytest.raises(ConfigError, match="train.compile_recurrence expects an integer"):
        build_config({"train": {"compile_recurrence": True}})
    assert _preset_run(tmp_path, "negative", "--train.compile_recurrence", "-1") == 2
    assert "train.compile_recurrence=-1 must be an integer >= 0" in capsys.readouterr().err
    # full attention on every layer: refused before a step is taken, naming the option and the way out
    assert _preset_run(tmp_path, "full_attention", "--model.sliding_window", "none",
                       "--train.compile_recurrence", "8") == 2
    err = capsys.readouterr().err
    assert ("error: train.compile_recurrence=8 cannot run this model's token steps (compile_recurrence: the compiled "
            "steps do not support a layer without a sliding window" in err), err
    assert err.rstrip().endswith("set train.compile_recurrence 0") and "Traceback" not in err
    assert not (tmp_path / "full_attention" / "metrics.jsonl").exists()
    # where the token steps do not run (another schedule), the option has no effect and nothing is refused
    metrics, _ = _train_preset(tmp_path, "standard", "--model.sliding_window", "none", "--train.schedule", "standard",
                               "--train.keep_best", "standard", "--train.compile_recurrence", "8")
    assert len(metrics) == 6

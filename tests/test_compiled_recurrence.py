"""FullBandLM.compile_recurrence: sequential training's token steps run a chunk of positions per compiled call
(windowed_token_steps) with the loss and every gradient of the Jacobi path (float64, 1e-10), with packed
documents, plain positions and a chunk that does not divide the length; a compiler that fails leaves the
steps uncompiled with a warning; the models it cannot run are refused."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from test_sequential_train import SEGMENTS, B, T, _batch, _generators, _loss_and_grads

from fullband.train.objective import multipass_loss, sequential_loss

VARIANTS = {"gate_window4": dict(sliding_window=4), "concat_window3": dict(fusion="concat", sliding_window=3)}


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    """Each test compiles with its own backend: without a reset, torch.compile would reuse another test's graph
    for the same shapes."""
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

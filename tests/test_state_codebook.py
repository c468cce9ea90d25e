"""model.state_codebook (experiment only): the fed state is the nearest of the learnt vectors, the recurrence
computed token by token equals K >= T Jacobi passes with it (loss and every gradient, the codebook's included),
cached decoding equals recomputation, and the codebook is stored with the weights."""

from __future__ import annotations

import torch
from conftest import make_model
from test_sequential_train import SEGMENTS, T, _batch, _generators, _loss_and_grads

from fullband.architectures import load_pretrained
from fullband.generation import generate
from fullband.train.objective import multipass_loss, sequential_loss


def test_the_fed_state_is_a_codebook_vector_with_gradients_to_both():
    model = make_model(dtype=torch.float64, state_codebook=8)
    h = torch.randn(3, 5, model.config.d_model, dtype=torch.float64, requires_grad=True)
    q = model.fusion.quantize(h)
    nearest = torch.cdist(h.reshape(-1, h.shape[-1]), model.fusion.codebook).argmin(-1)
    torch.testing.assert_close(q.reshape(-1, h.shape[-1]), model.fusion.codebook[nearest], rtol=0, atol=1e-12)
    q.pow(2).sum().backward()
    assert h.grad.abs().max() > 0 and model.fusion.codebook.grad.abs().max() > 0


def test_token_steps_equal_the_jacobi_fixed_point(single_thread):
    ids, labels = _batch()
    model = make_model(dtype=torch.float64, feedback_jitter=0.0, sliding_window=4, state_codebook=16).train()
    jacobi = _loss_and_grads(model, multipass_loss(model, ids, labels, T, pass_loss="last", generator=_generators(1),
                                                   segment_ids=SEGMENTS))
    steps = _loss_and_grads(model, sequential_loss(model, ids, labels, generator=_generators(1),
                                                   segment_ids=SEGMENTS))
    torch.testing.assert_close(steps[0], jacobi[0], rtol=0, atol=1e-10)
    assert steps[1]["fusion.codebook"].abs().max() > 0
    for name, grad in jacobi[1].items():
        torch.testing.assert_close(steps[1][name], grad, rtol=0, atol=1e-10, msg=name)


def test_cached_exact_decoding_equals_recomputation_and_storage_keeps_the_codebook(tmp_path):
    model = make_model(dtype=torch.float64, state_codebook=8).eval()
    prompt = [[3, 1, 4, 1, 5]]
    out = generate(model, prompt, 6, mode="fused", fused_passes="exact")
    ids = torch.tensor(prompt)
    for _ in range(6):  # fused:exact recomputed: the exact recurrence over the whole sequence each time
        logits = model.recurrence(ids).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    assert out.tolist()[0] == ids[0, 5:].tolist()
    model.float().save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path)
    torch.testing.assert_close(loaded.fusion.codebook, model.fusion.codebook, rtol=0, atol=0)
    assert loaded.config.state_codebook == 8

"""train.activation_checkpointing: recomputing blocks in the backward changes memory, never results.

float64 tiny models: the multi-pass loss and every parameter's gradient with checkpointing equal those without
(K = 1 and K = 3, jitter and prefix mixin from per-row generators, packed isolated documents), the blocks really
run twice, the generators draw the same numbers, cached and no-grad forwards are not checkpointed, and FSDP2,
torch.compile and the trainer compose with it.
"""

from __future__ import annotations

import socket

import pytest
import test_train
import torch
import torch.utils.checkpoint
from test_train import read_metrics, steps_of, tiny_config

import fullband.model
from fullband.config import build_config, checkpoint_interval
from fullband.errors import ConfigError
from fullband.model import FullBandConfig, FullBandLM
from fullband.train import train
from fullband.train.objective import multipass_loss

parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)

B, T = 3, 12
CONFIG = dict(vocab_size=40, d_model=16, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=T,
              qk_norm=True, attn_output_gate=True, sliding_window=5, full_attention_every=2)


def tiny_model() -> FullBandLM:
    torch.manual_seed(0)
    return FullBandLM(FullBandConfig(**CONFIG)).double().train()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (B, T + 1), generator=g)
    # Packed isolated documents, as the exact schedule trains them: runs of equal ids.
    segments = torch.tensor([[0] * 5 + [1] * 7, [0] * 12, [0] * 3 + [1] * 4 + [2] * 5])
    return ids[:, :-1], ids[:, 1:], segments


def generators():
    return [torch.Generator().manual_seed(100 + row) for row in range(B)]


def count_block_calls(model: FullBandLM) -> list[int]:
    calls = [0] * len(model.layers)
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def loss_and_grads(model: FullBandLM, passes: int, gens=None, **kwargs):
    ids, labels, segments = batch()
    model.zero_grad(set_to_none=True)
    out = multipass_loss(model, ids, labels, passes, segment_ids=segments, prefix_mixin=1.0, jitter=0.05,
                         generator=gens if gens is not None else generators(), **kwargs)
    if "backward_scale" not in kwargs:  # else multipass_loss has backpropagated each pass already
        out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("passes, every", [(1, 1), (3, 1), (3, 2)])
def test_loss_and_every_gradient_equal_without_checkpointing(passes, every):
    model = tiny_model()
    loss, grads = loss_and_grads(model, passes)
    calls = count_block_calls(model)
    model.set_activation_checkpointing(every)
    gens = generators()
    loss_ac, grads_ac = loss_and_grads(model, passes, gens)
    # Checkpointed blocks ran twice per pass (forward + recomputation in the backward), the others once: the
    # option is not silently ignored.
    assert calls == [passes * (2 if (i + 1) % every == 0 else 1) for i in range(len(model.layers))]
    torch.testing.assert_close(loss_ac, loss, rtol=1e-12, atol=0)
    assert grads_ac.keys() == grads.keys() and (passes == 1) == ("fusion.value_proj.weight" not in grads)
    for name in grads:
        torch.testing.assert_close(grads_ac[name], grads[name], rtol=1e-10, atol=1e-14, msg=name)
    # The recomputation drew nothing from the rows' generators: the next draws are those of a run without it.
    reference = generators()
    loss_and_grads(tiny_model(), passes, reference)
    for g, r in zip(gens, reference, strict=True):
        assert torch.equal(g.get_state(), r.get_state())


def test_detached_passes_and_grad_passes_equal_without_checkpointing():
    model = tiny_model()
    for kwargs in ({"detach": True, "backward_scale": 1.0}, {"grad_passes": 1}):
        model.set_activation_checkpointing(0)
        reference = loss_and_grads(model, 3, **kwargs)
        model.set_activation_checkpointing(1)
        loss, grads = loss_and_grads(model, 3, **kwargs)
        torch.testing.assert_close(loss, reference[0], rtol=1e-12, atol=0)
        for name in grads:
            torch.testing.assert_close(grads[name], reference[1][name], rtol=1e-10, atol=1e-14, msg=name)


def test_cached_and_no_grad_forwards_are_not_checkpointed():
    """A block under a KV cache writes the cache: recomputing it would write it twice. Prefill with grad
    enabled (the HF forward may be called so) runs each block once and gives the result of a model without AC."""
    model = tiny_model()
    ids = batch()[0]
    reference = model(ids, use_cache=True)
    model.set_activation_checkpointing(1)
    calls = count_block_calls(model)
    out = model(ids, use_cache=True)
    out.logits.sum().backward()
    assert calls == [1] * len(model.layers)
    assert out.past_key_values.length == T
    torch.testing.assert_close(out.logits, reference.logits, rtol=0, atol=0)
    with torch.no_grad():
        model(ids)
    assert calls == [2] * len(model.layers)


def test_setting_is_parsed_and_checked():
    assert [checkpoint_interval(s) for s in ("none", "full", "selective:1", "selective:3")] == [0, 1, 1, 3]
    for bad in ("true", "selective", "selective:0", "selective:-1", "selective:x", "op"):
        with pytest.raises(ConfigError, match="none, full and selective:N"):
            tiny_config(train={"activation_checkpointing": bad})
    with pytest.raises(ConfigError, match="expects a string"):
        build_config({"train": {"activation_checkpointing": True}})
    with pytest.raises(ValueError, match="every must be 0"):
        tiny_model().set_activation_checkpointing(-1)
    # an interval past the last block would checkpoint nothing: refused, not ignored
    with pytest.raises(ConfigError, match="would checkpoint no block"):
        tiny_config(train={"activation_checkpointing": "selective:3"})  # TINY has 2 layers
    with pytest.raises(ValueError, match="has only 4"):
        tiny_model().set_activation_checkpointing(5)


def test_trainer_run_with_checkpointing_gives_the_same_metrics(tmp_path, parity_data, monkeypatch):
    """Same losses, pass losses and gradient norms, step for step, over K = 1, 2, 3 steps. float32 on the CPU:
    the recomputed forward runs the same kernels on the same inputs, so the values are bitwise equal."""
    checkpointed = []

    def counting_checkpoint(function, *args, **kwargs):
        checkpointed.append(function.layer)
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(fullband.model, "checkpoint", counting_checkpoint)
    schedule = [{"until": 0.25, "passes": {1: 1.0}}, {"until": 1.0, "passes": {2: 0.5, 3: 0.5}}]
    runs, calls = {}, {}
    for setting in ("none", "full", "selective:2"):
        cfg = tiny_config(train={"tokens": steps_of(4), "schedule": schedule, "seed": 1, "prefix_mixin": 1.0,
                                 "activation_checkpointing": setting}, model={"feedback_jitter": 0.02})
        train(cfg, tmp_path / setting.replace(":", "_"), data_dir=parity_data)
        runs[setting] = read_metrics(tmp_path / setting.replace(":", "_"))
        calls[setting], checkpointed[:] = sorted(set(checkpointed)), []
    # the trainer applied the setting: every block (2 layers), the second only, or none; evaluation never
    assert calls == {"none": [], "full": [0, 1], "selective:2": [1]}
    assert {r["passes"] for r in runs["none"]} == {1, 2, 3}
    keys = ("step", "passes", "loss", "pass_losses", "grad_norm")
    for setting in ("full", "selective:2"):
        assert [{k: r[k] for k in keys} for r in runs[setting]] == [{k: r[k] for k in keys} for r in runs["none"]]


def test_composes_with_fsdp2(monkeypatch):
    """AC set before fully_shard, as the trainer does: FSDP2's hooks run inside the checkpointed call and skip
    the recomputation's unshard. One gloo process; the gradients equal the unsharded model's without AC."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    reference = loss_and_grads(tiny_model(), 3)
    dist.init_process_group("gloo")
    try:
        model = tiny_model()
        model.set_activation_checkpointing(1)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        calls = count_block_calls(model)
        loss, grads = loss_and_grads(model, 3)
        grads = {n: g.full_tensor() for n, g in grads.items()}
    finally:
        dist.destroy_process_group()
    assert calls == [6] * len(model.layers)
    torch.testing.assert_close(loss, reference[0], rtol=1e-12, atol=0)
    for name in reference[1]:
        torch.testing.assert_close(grads[name], reference[1][name], rtol=1e-10, atol=1e-14, msg=name)


def test_composes_with_torch_compile():
    """The checkpoint is traced by dynamo as a region to recompute (aot_eager: no C++ compiler needed)."""
    reference = loss_and_grads(tiny_model(), 3)
    model = tiny_model()
    model.set_activation_checkpointing(1)
    model.compile(backend="aot_eager", dynamic=False)  # in place, as the trainer's train.compile does
    loss, grads = loss_and_grads(model, 3)
    torch.testing.assert_close(loss, reference[0], rtol=1e-12, atol=0)
    for name in reference[1]:
        torch.testing.assert_close(grads[name], reference[1][name], rtol=1e-10, atol=1e-14, msg=name)

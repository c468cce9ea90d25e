"""benchmarks/scaling_plan.py (docs/scaling.md): its closed-form parameter count against the instantiated model,
its FLOPs formula against a hand-computed case, the schedule's K shares and MFU mix, the activation profile
against autograd's saved bytes at another depth, length, K and batch, and the paper-7b preset it plans."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.run import get_args_parser

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import scaling_plan  # noqa: E402
from train_step import SavedBytes  # noqa: E402

from fullband.config import load_config  # noqa: E402
from fullband.loading import preset_path  # noqa: E402
from fullband.model import FullBandConfig, FullBandLM  # noqa: E402
from fullband.schedule import PassSchedule  # noqa: E402
from fullband.train.objective import multipass_loss  # noqa: E402

SMALL = dict(vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=80, max_seq_len=64)


@pytest.mark.parametrize("extra", [
    {},
    {"qk_norm": True, "attn_output_gate": True, "qkv_bias": True},
    {"tie_embeddings": False, "fusion": "concat", "head_dim": 12},
    {"fusion": "add", "n_kv_heads": 4},
])
def test_parameter_count_matches_the_model(extra):
    cfg = FullBandConfig(**{**SMALL, **extra})
    model = scaling_plan.meta_model(cfg)
    parts = scaling_plan.parameter_count(cfg)
    assert parts["total"] == model.num_parameters()
    assert parts["fusion"] == model.num_parameters() - model.num_parameters(include_fusion=False)
    # N_matmul: every matrix of the blocks (attention gate included) and the LM head, the weights a token
    # multiplies; norms, biases and the embedding lookup are not matrix products.
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2)
    assert parts["matmul"] == blocks + cfg.vocab_size * cfg.d_model


@pytest.mark.parametrize("preset", ["paper-1b", "paper-7b"])
def test_presets_parameter_count_on_meta(preset):
    cfg = load_config(preset_path(preset)).model
    assert scaling_plan.parameter_count(cfg)["total"] == scaling_plan.meta_model(cfg).num_parameters()


def test_flops_formula_hand_checked():
    # V=10, D=4, L=1, H=2, KV=1 (d_head 2), F=8, T=6. Matrices: W_q 4·4 + W_k 4·2 + W_v 4·2 + W_o 4·4 + MLP 3·4·8
    # = 144, LM head 10·4 = 40: N_matmul = 184. Per pass 6·184 + 12·1·2·2·6 = 1104 + 288 = 1392 per token; each
    # fused pass adds W_U, W_G: 6·2·4² = 192.
    cfg = FullBandConfig(vocab_size=10, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8, max_seq_len=6)
    assert scaling_plan.train_flops_per_token(cfg, 6, 1) == 1392
    assert scaling_plan.train_flops_per_token(cfg, 6, 3) == 3 * 1392 + 2 * 192
    mean = PassSchedule.parse("paper").mean_passes()
    assert mean == pytest.approx(0.75 * 1 + 0.22 * 2 + 0.03 * 3)
    assert scaling_plan.train_flops_per_token(cfg, 6, mean) == pytest.approx(1.28 * 1392 + 0.28 * 192)
    # Full checkpointing adds one forward of the blocks: 2·144 + 4·1·2·2·6 per token per pass.
    assert scaling_plan.recompute_flops_per_token(cfg, 6, 2) == 2 * (288 + 96)


def test_schedule_shares_and_mfu_mix():
    shares = scaling_plan.pass_shares(PassSchedule.parse("paper"))
    assert shares == pytest.approx({1: 0.75, 2: 0.22, 3: 0.03})
    # K=1 steps of 1 s at MFU 0.5, K=2 of 2 s at 0.4, K=3 of 3 s at 0.3: FLOPs / time over the mix.
    mfu = scaling_plan.schedule_mfu({1: 0.5, 2: 0.4, 3: 0.3}, {1: 1.0, 2: 2.0, 3: 3.0}, PassSchedule.parse("paper"))
    expected = (0.75 * 0.5 * 1 + 0.22 * 0.4 * 2 + 0.03 * 0.3 * 3) / (0.75 * 1 + 0.22 * 2 + 0.03 * 3)
    assert mfu == pytest.approx(expected)
    with pytest.raises(ValueError, match="no measurement for K"):
        scaling_plan.schedule_mfu({1: 0.5}, {1: 1.0}, PassSchedule.parse("paper"))


def test_activation_profile_predicts_saved_bytes():
    """The profile is measured at 1-2 layers, 8-16 tokens, K = 1-2, batch 1; it must give what autograd saves at
    another depth, length, K and batch (the plan extrapolates it to 8192 tokens and 24-32 layers)."""
    cfg = FullBandConfig(**SMALL, qk_norm=True, attn_output_gate=True)
    profile = scaling_plan.activation_profile(cfg)
    model = scaling_plan.shallow_model(cfg, 3)
    for layers, tokens, passes, batch in ((3, 24, 3, 2), (2, 40, 1, 1)):
        measured = scaling_plan.saved_bytes(model, layers, tokens, passes, batch)
        predicted = scaling_plan.predicted_saved_bytes(profile, layers, tokens, passes, batch)
        assert predicted == pytest.approx(measured, rel=1e-4), (layers, tokens, passes, batch)
    full = FullBandConfig(**{**SMALL, "n_layers": 3, "qk_norm": True, "attn_output_gate": True})
    assert scaling_plan.activation_bytes(full, profile, 48, 3, False) == pytest.approx(
        scaling_plan.predicted_saved_bytes(profile, 3, 48, 3))
    # With checkpointing: each block's fp32 input per pass, plus one block rebuilt at a time.
    saved = scaling_plan.activation_bytes(full, profile, 48, 3, True)
    without = scaling_plan.activation_bytes(full, profile, 48, 3, False)
    assert without - saved == pytest.approx(48 * (3 * 3 - 1) * profile["layer"] - 48 * 3 * 3 * 4 * 32)


def test_paper_7b_preset_is_a_valid_run_config():
    run = load_config(preset_path("paper-7b"))
    m, t = run.model, run.train
    assert (m.d_model, m.n_layers, m.n_heads, m.d_ff) == (4096, 32, 32, 11008)  # the Llama-2-7B shape
    assert t.seq_len <= m.max_seq_len and t.parallel == "fsdp" and t.activation_checkpointing == "full"
    for gpus in scaling_plan.PLANS["paper-7b"]:
        assert t.batch_size % gpus == 0
    for gpus in scaling_plan.PLANS["paper-1b"]:
        assert load_config(preset_path("paper-1b")).train.batch_size % gpus == 0


def test_gpu_check_report_prints_the_measured_mfu():
    variants = {label: {"passes": k, "mfu": mfu, "step_ms": ms, "tokens_per_s": 1.0, "model_tflops_per_s": 1.0,
                        "peak_memory_gib": None}
                for label, k, mfu, ms in (("baseline", 1, 0.9, 1.0), ("K=1", 1, 0.5, 1.0), ("K=2", 2, 0.4, 2.0),
                                          ("K=3", 3, 0.3, 3.0))}
    train = {"parameters": 1e6, "batch": 1, "seq_len": 8, "peak_tflops": 989.0,
             "runs": {"eager": {"variants": variants, "ratios": {}}, "compiled": {"error": "no compiler"}}}
    expected = scaling_plan.schedule_mfu({1: 0.5, 2: 0.4, 3: 0.3}, {1: 1.0, 2: 2.0, 3: 3.0},
                                         PassSchedule.parse("paper"))
    assert f"measured MFU (eager, paper schedule's 75/22/3 mix of the K = 1, 2, 3 steps): {expected:.4f}" in \
        gpu_check.markdown({"train": train})


def test_slurm_script_launches_one_torchrun_per_node(tmp_path):
    """scripts/slurm/train.sbatch under fake srun/scontrol: the torchrun line it builds parses with torchrun's own
    parser (c10d rendezvous on the first node, nodes × GPUs ranks) and passes fullband train's arguments on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a17\\ngpu-a18\\n'\n")
    (bin_dir / "srun").write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[17-18]",
           "SLURM_JOB_NUM_NODES": "2", "GPUS_PER_NODE": "4", "PYTHON": "/venv/bin/python"}
    script = ROOT / "scripts" / "slurm" / "train.sbatch"
    proc = subprocess.run(["bash", str(script), "--config", "paper-7b", "--out-dir", "/shared/run"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.splitlines()[1:]  # after the job line
    assert args[:4] == ["--kill-on-bad-exit=1", "/venv/bin/python", "-m", "torch.distributed.run"]
    torchrun = get_args_parser().parse_args(args[4:])
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_backend) == ("2", "4", "c10d")
    assert (torchrun.rdzv_endpoint, torchrun.rdzv_id) == ("gpu-a17:29500", "4242")
    assert torchrun.module and torchrun.training_script == "fullband"
    assert torchrun.training_script_args == ["train", "--config", "paper-7b", "--out-dir", "/shared/run"]
    outside = subprocess.run(["bash", str(script), "--config", "x"], env={"PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=30)
    assert outside.returncode == 2 and "not inside a SLURM job" in outside.stderr


def test_fsdp2_saves_what_the_unsharded_model_saves(monkeypatch):
    """docs/scaling.md counts one bf16 copy of every weight per step (autocast's cache) on every GPU, also under
    FSDP2, whose gathered weights are new tensors each time: the saved bytes with fully_shard (one gloo process)
    equal those of the plain model at K = 1, 2, 3, so a pass does not add another copy."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    class Everything(SavedBytes):  # parameters are DTensors under FSDP2: count every saved storage, in both runs
        def __init__(self) -> None:
            self.params, self.live, self.current, self.peak = set(), {}, 0, 0

    def saved(fsdp: bool, passes: int) -> int:
        torch.manual_seed(0)
        model = FullBandLM(FullBandConfig(**SMALL)).train()
        if fsdp:
            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
        ids = torch.randint(0, SMALL["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
        counter = Everything()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = multipass_loss(model, ids, ids, passes)
            out.loss.backward()
        return counter.peak

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    plain = [saved(False, k) for k in (1, 2, 3)]
    dist.init_process_group("gloo")
    try:
        sharded = [saved(True, k) for k in (1, 2, 3)]
    finally:
        dist.destroy_process_group()
    # (test_activation_profile_predicts_saved_bytes shows the plain model's copies are made once for K passes)
    assert sharded == pytest.approx(plain, rel=5e-3)

"""benchmarks/gpu_check.sh without a GPU: it says so and exits 0; and every piece it calls runs on the CPU at
tiny sizes (the FLOPs count is checked against the model's own matrices)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

from fullband.model import FullBandConfig, FullBandLM  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_script_without_cuda_says_it_needs_a_gpu_and_exits_0(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "needs a CUDA GPU" in proc.stdout
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_flops_count_matches_the_models_matrices():
    cfg = FullBandConfig(vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=80, max_seq_len=64)
    model = FullBandLM(cfg)
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2)
    fusion = sum(p.numel() for n, p in model.named_parameters() if n.startswith("fusion.") and p.ndim == 2)
    matrix = blocks + cfg.vocab_size * cfg.d_model  # the tied LM head is a matmul too
    attention = 12 * cfg.n_layers * cfg.d_model * 64
    assert gpu_check.model_flops_per_token(cfg, 64, 1) == 6 * matrix + attention
    assert gpu_check.model_flops_per_token(cfg, 64, 3) == 3 * (6 * matrix + attention) + 2 * 6 * fusion


def test_train_piece_on_cpu(tmp_path):
    assert gpu_check.main(["train", "--device", "cpu", "--tiny", "--no-compile", "--steps", "1", "--warmup", "0",
                           "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "train.json").read_text())
    eager = result["runs"]["eager"]
    assert set(eager["variants"]) == {"baseline", "K=1", "K=2", "K=3"}
    for v in eager["variants"].values():
        assert v["tokens_per_s"] > 0 and 0 < v["mfu"] < 1
    assert set(eager["ratios"]) == {"K2/K1 step time", "K3/K1 step time", "K1/baseline step time"}


def test_hf_piece_on_cpu_agrees_with_transformers(tmp_path):
    pytest.importorskip("transformers")
    assert gpu_check.main(["hf", "--device", "cpu", "--tiny", "--dtype", "float32", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "hf.json").read_text())
    for row in result["results"].values():
        assert row["greedy_tokens_equal_to_hf"] == 1.0  # same converted weights, same greedy tokens
        assert row["hf_generate_ms_per_token"] > 0 and row["fullband_soft_ms_per_token"] > 0


def test_dist_piece_and_report_on_cpu(tmp_path, monkeypatch):
    with socket.socket() as s:  # a free port for the one-process gloo group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    assert gpu_check.main(["dist-worker", "--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "dist.json").read_text())
    assert result["all_reduce_ok"] and "error" not in result
    for parallel in ("ddp", "fsdp"):
        assert result[parallel]["ranks_agree"] and result[parallel]["finite"]
    assert result["ddp"]["losses"] == pytest.approx(result["fsdp"]["losses"], rel=1e-5)

    (tmp_path / "info.json").write_text(json.dumps(gpu_check.cmd_info(None)))
    (tmp_path / "hf_failed.json").write_text(json.dumps({"exit_code": 124, "timed_out": True, "summary": "x"}))
    assert gpu_check.main(["report", "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"info", "dist", "hf_failed"} <= set(merged)
    table = (tmp_path / "gpu_check.md").read_text()
    assert "Two processes on one GPU" in table and "hf: exit 124 (time limit)" in table

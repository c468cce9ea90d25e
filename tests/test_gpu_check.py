"""benchmarks/gpu_check.sh without a GPU: it says so and exits 0; and every piece it calls runs on the CPU at
tiny sizes (the FLOPs count is checked against the model's own matrices)."""

from __future__ import annotations

import json
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


def test_unknown_part_is_refused_by_name():
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "trian"], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 2
    assert "unknown part 'trian'" in proc.stderr and "train" in proc.stderr


def test_dry_run_runs_every_part_through_the_script_on_cpu(tmp_path):
    """The script itself, end to end, as it runs on a GPU: every part, its time limit, its JSON, the report;
    two real ranks for DDP and FSDP2."""
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    merged = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not [name for name in merged if name.endswith("_failed")], proc.stdout[-3000:]
    assert merged["tests_float32"]["exit_code"] == 0 and merged["tests_bf16"]["exit_code"] == 0
    assert "passed" in merged["tests_float32"]["summary"]

    eager = merged["train"]["runs"]["eager"]
    assert set(eager["variants"]) == {"baseline", "K=1", "K=2", "K=3"}
    for v in eager["variants"].values():
        assert v["tokens_per_s"] > 0 and 0 < v["mfu"] < 1
    assert set(eager["ratios"]) == {"K2/K1 step time", "K3/K1 step time", "K1/baseline step time"}

    assert {"FBT (preset)", "transformer", "LSTM"} <= set(merged["exact"]["results"])
    assert [(r["model"], r["batch"]) for r in gpu_check.decode_rows(merged["decode"])] == [("d128-L2", 1),
                                                                                          ("d128-L2", 2)]
    for row in merged["hf"]["results"].values():
        assert row["greedy_tokens_equal_to_hf"] == 1.0  # same converted weights, same greedy tokens

    dist = merged["dist_gloo"]
    assert dist["world_size"] == 2 and dist["all_reduce_ok"] and "error" not in dist
    for parallel in ("ddp", "fsdp"):
        assert dist[parallel]["ranks_agree"] and dist[parallel]["finite"]
    assert dist["ddp"]["losses"] == pytest.approx(dist["fsdp"]["losses"], rel=1e-5)

    report = (tmp_path / "gpu_check.md").read_text()
    for heading in ("## Training", "## Exact-recurrence training step", "## benchmarks/decode.py",
                    "## Decoding against Hugging Face generate", "## Two processes on one device, gloo"):
        assert heading in report


def _decode_part(per_batch: dict[int, tuple[float, float]], fusion_share: float) -> dict:
    """A decode.json with per-token (standard, soft) seconds per batch."""
    def mode(seconds: float, ratio: float) -> dict:
        return {"per_token_s": {"median": seconds}, "per_token_ratio": {"median": ratio, "min": ratio, "max": ratio}}

    batches = {str(b): {"modes": {"standard": mode(std, 1.0), "soft": mode(soft, soft / std)}}
               for b, (std, soft) in per_batch.items()}
    return {"settings": {"dtype": "bfloat16", "prompt_len": 64, "new_tokens": 128, "repeats": 3},
            "results": {"d512-L6": {"macs_per_token": {"fusion_share": fusion_share}, "batches": batches}}}


def test_report_names_the_figures_far_from_expectations():
    train = {"runs": {"compiled": {"variants": {"K=1": {"mfu": 0.31}}}}}
    flat = _decode_part({1: (0.0040, 0.0046), 64: (0.0042, 0.0043)}, fusion_share=0.02)
    found = gpu_check.expectations({"train": train, "decode": flat})
    assert len(found) == 3
    assert "31.0%, under 40%" in found[0]
    assert "1.150× standard" in found[1] and "per-call overhead" in found[1]  # 15% for 2% of the arithmetic
    assert "batch 1 and 4.20 ms at batch 64" in found[2] and "CUDA graph" in found[2]

    healthy = _decode_part({1: (0.0040, 0.0041), 64: (0.0400, 0.0410)}, fusion_share=0.02)
    train["runs"]["compiled"]["variants"]["K=1"]["mfu"] = 0.45
    assert gpu_check.expectations({"train": train, "decode": healthy}) == []


def test_report_lists_a_part_that_failed(tmp_path):
    (tmp_path / "info.json").write_text(json.dumps(gpu_check.cmd_info(None)))
    (tmp_path / "hf_failed.json").write_text(json.dumps({"exit_code": 124, "timed_out": True, "summary": "x"}))
    assert gpu_check.main(["report", "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"info", "hf_failed", "expectations"} <= set(merged)
    assert "- hf: exit 124 (time limit): x" in (tmp_path / "gpu_check.md").read_text()

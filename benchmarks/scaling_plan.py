"""The costed plan of docs/scaling.md: parameters, training FLOPs per token, memory per GPU under FSDP2,
GPU-hours and checkpoint size for the ``paper-1b`` and ``paper-7b`` presets, printed as the doc's markdown
tables and written to JSON. Every number comes from the code or from a measurement made here:

- parameters: the preset's model instantiated on the ``meta`` device (no memory), checked against the
  closed-form count of ``parameter_count``;
- FLOPs: ``train_flops_per_token``, the PaLM model-FLOPs convention (Chowdhery et al. 2022, App. B):
  6·N_matmul + 12·L·H·d_head·T per token per pass, plus 6·2·D² for the fusion's W_U and W_G in fused passes;
- activations: autograd's saved tensors counted (``train_step.SavedBytes``) in one forward of the multi-pass
  objective under bf16 autocast, at the preset's real widths and vocabulary but a few tokens, on the CPU; the
  bytes per token per layer come from differences (2 layers - 1 layer, 16 tokens - 8 tokens), so they hold at
  any sequence length for attention that saves O(T) (flash / memory-efficient SDPA);
- weights, gradients and optimizer state: the trainer's dtypes (fp32 parameters and gradients, Muon momentum or
  AdamW moments in fp32) sharded over N GPUs by FSDP2.

Usage:
    python benchmarks/scaling_plan.py                      # both presets: ~50 s, 15 GB of memory (the 7B profile)
    python benchmarks/scaling_plan.py --mfu 0.43           # GPU-hours at the MFU gpu_check.sh measured too
    python benchmarks/scaling_plan.py --presets paper-1b   # one preset
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from train_step import SavedBytes

from fullband.config import RunConfig, load_config
from fullband.loading import preset_path
from fullband.model import FullBandConfig, FullBandLM
from fullband.schedule import PassSchedule
from fullband.train.objective import multipass_loss

# Dense bf16 tensor-core peaks (the datasheets print 1,979 TFLOP/s "with sparsity", twice the dense rate):
# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM), NVIDIA H200 Tensor Core GPU datasheet (H200 SXM).
GPUS = {"H100 SXM 80GB": {"peak_tflops": 989.4, "memory_gib": 80 * 1e9 / 2**30},
        "H200 SXM 141GB": {"peak_tflops": 989.4, "memory_gib": 141 * 1e9 / 2**30}}
ASSUMED_MFU = 0.40
# GPUs per plan: a divisor of train.batch_size (the loader gives every rank the same number of rows).
PLANS = {"paper-1b": [12, 36], "paper-7b": [64]}
# An assumption, not a measurement: sustained write bandwidth of one node to a parallel file system.
NODE_WRITE_GB_S = 2.0
GPUS_PER_NODE = 8
PROFILE_TOKENS = (8, 16)


# ---- parameters ----------------------------------------------------------------------------------


def parameter_count(cfg: FullBandConfig) -> dict[str, int]:
    """The model's parameters by part, in closed form (``test_scaling_plan`` checks it against the model)."""
    D, H, KV, hd, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.d_ff, cfg.vocab_size
    attention = D * H * hd + 2 * D * KV * hd + H * hd * D  # W_q, W_k, W_v, W_o
    attention += (H * hd + 2 * KV * hd) * cfg.qkv_bias + 2 * hd * cfg.qk_norm + D * H * cfg.attn_output_gate
    mlp = 3 * D * F
    block = attention + mlp + 2 * D  # + the two RMSNorm weights
    fusion = {"gate": 2 * D * D + 2 * D, "concat": 2 * D * D + D, "add": D * D}[cfg.fusion]
    parts = {"embedding": V * D, "blocks": cfg.n_layers * block, "final_norm": D, "fusion": fusion,
             "lm_head": 0 if cfg.tie_embeddings else V * D}
    parts["total"] = sum(parts.values())
    parts["block"] = block
    # Weights that are matrix products per token (the embedding lookup is not; the tied LM head is)
    parts["matmul"] = cfg.n_layers * (attention - (H * hd + 2 * KV * hd) * cfg.qkv_bias - 2 * hd * cfg.qk_norm + mlp)
    parts["matmul"] += V * D
    parts["fusion_matmul"] = {"gate": 2 * D * D, "concat": 2 * D * D, "add": D * D}[cfg.fusion]
    return parts


def meta_model(cfg: FullBandConfig) -> FullBandLM:
    with torch.device("meta"):
        return FullBandLM(cfg)


def optimizer_bytes(model: FullBandLM, run: RunConfig) -> int:
    """fp32 optimizer state as train/optim.py builds it: Muon keeps one momentum buffer per hidden matrix and
    AdamW two moments per other parameter; with optimizer adamw every parameter has two moments."""
    total = 0
    for name, p in model.named_parameters():
        hidden_matrix = p.ndim == 2 and not name.startswith(("embed", "lm_head"))
        total += p.numel() * (4 if run.train.optimizer == "muon" and hidden_matrix else 8)
    return total


# ---- FLOPs ---------------------------------------------------------------------------------------


def train_flops_per_token(cfg: FullBandConfig, seq_len: int, passes: float) -> float:
    """Model FLOPs of training per token (forward + backward) for ``passes`` passes (a mean is allowed: the cost
    is linear in K). Per pass: 6·N_matmul (Kaplan et al. 2020, §2.1: 2N forward, twice that backward) plus the
    attention scores and values, 12·L·H·d_head·T (PaLM, App. B: causal masking and windows not discounted);
    every pass after the first adds the fusion's D×D products, 6·2·D² for the gate. Activation recomputation
    is not counted (model FLOPs, not hardware FLOPs)."""
    parts = parameter_count(cfg)
    per_pass = 6 * parts["matmul"] + 12 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len
    return passes * per_pass + (passes - 1) * 6 * parts["fusion_matmul"]


def recompute_flops_per_token(cfg: FullBandConfig, seq_len: int, passes: float) -> float:
    """Extra hardware FLOPs of full activation checkpointing: one more forward of every block per pass."""
    parts = parameter_count(cfg)
    block_matmul = parts["matmul"] - cfg.vocab_size * cfg.d_model
    return passes * (2 * block_matmul + 4 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len)


def pass_shares(schedule: PassSchedule) -> dict[int, float]:
    """The share of steps with each K over the whole run (the paper schedule: 0.75, 0.22, 0.03)."""
    shares: dict[int, float] = {}
    start = 0.0
    for phase in schedule.phases:
        for k, p in phase.passes:
            shares[k] = shares.get(k, 0.0) + (phase.until - start) * p
        start = phase.until
    return shares


def schedule_mfu(mfu_by_passes: dict[int, float], step_s_by_passes: dict[int, float], schedule: PassSchedule) -> float:
    """MFU of a run with the schedule's mix of K-pass steps: its model FLOPs over its time,
    sum_K share_K·MFU_K·t_K / sum_K share_K·t_K (each step's FLOPs are MFU_K·t_K·peak)."""
    shares = pass_shares(schedule)
    missing = set(shares) - set(mfu_by_passes)
    if missing:
        raise ValueError(f"no measurement for K = {sorted(missing)}")
    time_spent = sum(share * step_s_by_passes[k] for k, share in shares.items())
    return sum(share * mfu_by_passes[k] * step_s_by_passes[k] for k, share in shares.items()) / time_spent


# ---- activations ---------------------------------------------------------------------------------


def shallow_model(cfg: FullBandConfig, n_layers: int) -> FullBandLM:
    """``cfg``'s model with ``n_layers`` blocks, its weights allocated but not initialised (zeros): the saved
    bytes depend on shapes, not values, and a 7B embedding is not worth initialising."""
    model = meta_model(FullBandConfig.from_dict({**cfg.to_dict(), "n_layers": n_layers})).to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model.train()


def saved_bytes(model: FullBandLM, n_layers: int, tokens: int, passes: int, batch: int = 1) -> int:
    """Bytes autograd saves in one forward of the ``passes``-pass objective under bf16 autocast through the
    first ``n_layers`` blocks of ``model`` (one model serves every depth: a 7B model is built once). The graph
    is dropped without a backward."""
    blocks = model.layers
    model.layers = blocks[:n_layers]
    try:
        ids = torch.zeros(batch, tokens, dtype=torch.long)
        counter = SavedBytes(model)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = multipass_loss(model, ids, ids, passes, prefix_mixin=1.0)
            del out
    finally:
        model.layers = blocks
    return counter.peak


def activation_profile(cfg: FullBandConfig, tokens: tuple[int, int] = PROFILE_TOKENS) -> dict[str, float]:
    """Saved bytes per token (batch 1): per block and pass, outside the blocks per pass (embedding, final norm,
    logits, loss), and per fused pass for the fusion; plus the bytes independent of the token count (the bf16
    weight copies autocast makes and the matmuls save). From saved_bytes at two depths, two lengths and K = 1, 2."""
    t1, t2 = tokens
    model = shallow_model(cfg, 2)
    one = {t: saved_bytes(model, 1, t, 1) for t in tokens}
    two = {t: saved_bytes(model, 2, t, 1) for t in tokens}
    fused = {t: saved_bytes(model, 1, t, 2) for t in tokens}
    layer = ((two[t2] - two[t1]) - (one[t2] - one[t1])) / (t2 - t1)
    outside = (one[t2] - one[t1]) / (t2 - t1) - layer
    fusion = (fused[t2] - fused[t1]) / (t2 - t1) - 2 * (layer + outside)
    layer_fixed = (two[t1] - one[t1]) - layer * t1
    fixed = one[t1] - (layer + outside) * t1 - layer_fixed
    fusion_fixed = fused[t1] - one[t1] - (layer + outside + fusion) * t1  # the fusion's bf16 weight copies
    return {"layer": layer, "outside": outside, "fusion": fusion, "layer_fixed": layer_fixed, "fixed": fixed,
            "fusion_fixed": fusion_fixed, "tokens": list(tokens)}


def predicted_saved_bytes(profile: dict, n_layers: int, tokens: int, passes: int, batch: int = 1) -> float:
    """What ``saved_bytes`` gives for this depth, length, K and batch, from the profile (fixed bytes are shared
    by the passes: autocast casts each weight once per forward)."""
    per_token = passes * (n_layers * profile["layer"] + profile["outside"]) + (passes - 1) * profile["fusion"]
    fixed = n_layers * profile["layer_fixed"] + profile["fixed"] + (passes > 1) * profile["fusion_fixed"]
    return per_token * tokens * batch + fixed


def activation_bytes(cfg: FullBandConfig, profile: dict, tokens: int, passes: int, checkpointing: bool) -> float:
    """Peak activation bytes of one micro-batch of ``tokens`` tokens (batch × seq_len) on a GPU, gradients through
    all K passes. With full checkpointing each block keeps its fp32 input (4·D bytes per token) and one block's
    activations are rebuilt at a time in the backward; the autocast weight copies and the sliding-window mask
    (bool, T² per sequence, shared by the layers and passes) are added either way."""
    layer = 4 * cfg.d_model if checkpointing else profile["layer"]
    per_token = passes * (cfg.n_layers * layer + profile["outside"]) + (passes - 1) * profile["fusion"]
    extra = profile["layer"] * tokens if checkpointing else 0.0
    fixed = cfg.n_layers * profile["layer_fixed"] + profile["fixed"] + (passes > 1) * profile["fusion_fixed"]
    return per_token * tokens + extra + fixed


# ---- the plan ------------------------------------------------------------------------------------


def plan(preset: str, mfu: float | None) -> dict:
    run = load_config(preset_path(preset))
    cfg, t = run.model, run.train
    parts = parameter_count(cfg)
    model = meta_model(cfg)
    counted = model.num_parameters()
    if counted != parts["total"]:
        raise RuntimeError(f"{preset}: closed-form parameter count {parts['total']} != the model's {counted}")
    schedule = PassSchedule.parse(t.schedule)
    mean_passes = schedule.mean_passes()
    flops = {f"K={k}": train_flops_per_token(cfg, t.seq_len, k) for k in (1, 2, 3)}
    flops["schedule mean"] = train_flops_per_token(cfg, t.seq_len, mean_passes)
    flops["schedule mean, + full AC recomputation"] = (flops["schedule mean"]
                                                        + recompute_flops_per_token(cfg, t.seq_len, mean_passes))
    total_flops = flops["schedule mean"] * t.tokens
    compute = {}
    for gpu, spec in GPUS.items():
        rates = {"assumed": ASSUMED_MFU, **({"measured": mfu} if mfu else {})}
        compute[gpu] = {name: {"mfu": rate, "gpu_hours": total_flops / (rate * spec["peak_tflops"] * 1e12) / 3600}
                        for name, rate in rates.items()}
    started = time.perf_counter()
    profile = activation_profile(cfg)
    profile_s = time.perf_counter() - started
    opt_bytes = optimizer_bytes(model, run)
    root = parts["embedding"] + parts["final_norm"] + parts["fusion"] + parts["lm_head"]
    memory = {}
    for n in PLANS[preset]:
        if t.batch_size % n:
            raise RuntimeError(f"{preset}: {n} GPUs do not divide train.batch_size={t.batch_size}")
        micro = t.batch_size // n
        tokens = micro * t.seq_len
        window_mask = micro * t.seq_len**2 if cfg.sliding_window and cfg.sliding_window < t.seq_len else 0
        gib = {
            "weights (fp32, sharded)": 4 * parts["total"] / n,
            "gradients (fp32, sharded)": 4 * parts["total"] / n,
            "optimizer (fp32, sharded)": opt_bytes / n,
            # FSDP2 keeps the root module (embedding, fusion, final norm) unsharded from forward to backward, and
            # gathers a block's fp32 weights (plus the prefetched next block's) and reduce-scatters its gradient.
            "unsharded root weights + gradients": 8 * root,
            "gathered blocks (2 blocks + 1 gradient)": 3 * 4 * parts["block"],
        }
        for k in (1, 3):
            for ac in (False, True):
                label = f"activations K={k}, {'full AC' if ac else 'no AC'}"
                gib[label] = activation_bytes(cfg, profile, tokens, k, ac) + window_mask
        gib = {key: value / 2**30 for key, value in gib.items()}
        states = sum(v for key, v in gib.items() if not key.startswith("activations"))
        totals = {f"total K={k}, {ac}": states + gib[f"activations K={k}, {ac}"]
                  for k in (1, 3) for ac in ("no AC", "full AC")}
        memory[f"{n} GPUs"] = {"micro_batch_per_gpu": micro, "gib": gib, "totals_gib": totals}
    checkpoint_bytes = 4 * parts["total"] + opt_bytes
    nodes = {n: math.ceil(n / GPUS_PER_NODE) for n in PLANS[preset]}
    # Training time between two saves (train.ckpt_every steps) on H100s at the assumed MFU, to weigh the save against.
    step_flops = flops["schedule mean"] * t.batch_size * t.grad_accum * t.seq_len
    h100 = GPUS["H100 SXM 80GB"]["peak_tflops"] * 1e12 * ASSUMED_MFU
    return {
        "preset": preset,
        "model": cfg.to_dict(),
        "train": {k: getattr(t, k) for k in ("seq_len", "batch_size", "grad_accum", "tokens", "optimizer")},
        "schedule": t.schedule if isinstance(t.schedule, str) else "custom",
        "mean_passes": mean_passes,
        "parameters": parts,
        "parameters_from_meta_model": counted,
        "flops_per_token": flops,
        "total_training_flops": total_flops,
        "compute": compute,
        "activation_profile": profile,
        "activation_profile_s": profile_s,
        "optimizer_bytes": opt_bytes,
        "memory": memory,
        "checkpoint": {
            "bytes": checkpoint_bytes,
            "save_s_one_writer": checkpoint_bytes / (NODE_WRITE_GB_S * 1e9),
            "save_s_all_nodes": {f"{n} GPUs ({nodes[n]} nodes)": checkpoint_bytes / (nodes[n] * NODE_WRITE_GB_S * 1e9)
                                 for n in PLANS[preset]},
            "ckpt_every": t.ckpt_every,
            "train_s_between_saves": {f"{n} GPUs": t.ckpt_every * step_flops / (n * h100) for n in PLANS[preset]},
        },
    }


# ---- output --------------------------------------------------------------------------------------


def fmt(value: float, unit: str = "") -> str:
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}".strip()
    return f"{value:.3g} {unit}".strip()


def markdown(plans: list[dict], mfu: float | None) -> str:
    names = [p["preset"] for p in plans]
    out = ["### Parameters", "", "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in ("total", "embedding", "blocks", "block", "fusion", "matmul"):
        label = {"total": "total", "embedding": "embedding (tied LM head)", "blocks": "blocks",
                 "block": "one block", "fusion": "fusion (W_U, W_G, 2 norms)",
                 "matmul": "N_matmul (blocks' matrices + LM head)"}[key]
        out.append(f"| {label} | " + " | ".join(f"{p['parameters'][key]:,}" for p in plans) + " |")
    out += ["", "### Training FLOPs per token (model FLOPs, forward + backward)", "",
            "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in plans[0]["flops_per_token"]:
        label = key.replace("schedule mean", f"paper schedule (mean K = {plans[0]['mean_passes']:.2f})")
        label = label.replace(", + full AC recomputation", " + full-AC recomputation (hardware FLOPs)")
        out.append(f"| {label} | " + " | ".join(f"{fmt(p['flops_per_token'][key], 'FLOP')}" for p in plans) + " |")
    out.append("| tokens (train.tokens) | " + " | ".join(f"{p['train']['tokens'] / 1e9:.0f}B" for p in plans) + " |")
    out.append("| total training FLOPs | " + " | ".join(f"{p['total_training_flops']:.3g} FLOP" for p in plans) + " |")
    out += ["", "### GPU-hours", "", "| GPU | MFU | " + " | ".join(names) + " |", "|---|---" + "|---" * len(names)
            + "|"]
    for gpu in GPUS:
        rows = [("assumed", f"{ASSUMED_MFU:.0%} (assumed)")]
        rows.append(("measured", f"{mfu:.1%} (measured)") if mfu else
                    (None, "measured: `--mfu` from benchmarks/gpu_check.sh"))
        for key, label in rows:
            cells = [f"{p['compute'][gpu][key]['gpu_hours']:,.0f}" if key else "fill in" for p in plans]
            out.append(f"| {gpu} | {label} | " + " | ".join(cells) + " |")
    for p in plans:
        capacity = ", ".join(f"{gpu}: {spec['memory_gib']:.1f} GiB" for gpu, spec in GPUS.items())
        out += ["", f"### Memory per GPU, {p['preset']} (GiB; FSDP2, bf16 autocast, fp32 weights, "
                f"seq_len {p['train']['seq_len']}; {capacity})", ""]
        plans_n = list(p["memory"])
        out += ["| | " + " | ".join(f"{n}, micro-batch {p['memory'][n]['micro_batch_per_gpu']}" for n in plans_n)
                + " |", "|---" * (len(plans_n) + 1) + "|"]
        for key in p["memory"][plans_n[0]]["gib"]:
            out.append(f"| {key} | " + " | ".join(f"{p['memory'][n]['gib'][key]:.1f}" for n in plans_n) + " |")
        for key in p["memory"][plans_n[0]]["totals_gib"]:
            out.append(f"| **{key}** | " + " | ".join(f"**{p['memory'][n]['totals_gib'][key]:.1f}**"
                                                     for n in plans_n) + " |")
    out += ["", "### Activation profile (saved bytes per token, bf16 autocast, measured on the CPU)", "",
            "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key, label in (("layer", "per block and pass"), ("outside", "outside the blocks, per pass (logits, loss)"),
                       ("fusion", "fusion, per fused pass")):
        out.append(f"| {label} | " + " | ".join(f"{p['activation_profile'][key]:,.0f}" for p in plans) + " |")
    out.append("| per block and pass / (2·D) | " + " | ".join(
        f"{p['activation_profile']['layer'] / (2 * p['model']['d_model']):.1f}" for p in plans) + " |")
    out += ["", "### Checkpoint (fp32 weights + optimizer state)", "", "| | " + " | ".join(names) + " |",
            "|---" * (len(names) + 1) + "|"]
    out.append("| size | " + " | ".join(f"{p['checkpoint']['bytes'] / 1e9:.1f} GB" for p in plans) + " |")
    out.append(f"| one writer at {NODE_WRITE_GB_S:g} GB/s (assumed) | " + " | ".join(
        f"{p['checkpoint']['save_s_one_writer']:.0f} s" for p in plans) + " |")
    out.append("| every node writing its shards (DCP) | " + " | ".join(
        "; ".join(f"{k}: {v:.0f} s" for k, v in p["checkpoint"]["save_s_all_nodes"].items()) for p in plans) + " |")
    out.append(f"| training between saves (train.ckpt_every steps, H100 at {ASSUMED_MFU:.0%} MFU) | " + " | ".join(
        f"{p['checkpoint']['ckpt_every']} steps: " + "; ".join(
            f"{k}: {v / 60:.0f} min" for k, v in p["checkpoint"]["train_s_between_saves"].items()) for p in plans)
        + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PLANS), choices=list(PLANS))
    p.add_argument("--mfu", type=float, default=None,
                   help="measured MFU (a fraction): gpu_check.sh's 'measured MFU' line; adds GPU-hours at it")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--out", default="benchmarks/results/scaling_plan.json")
    args = p.parse_args(argv)
    if args.mfu is not None and not 0 < args.mfu <= 1:
        p.error(f"--mfu is a fraction in (0, 1], e.g. 0.43; got {args.mfu}")
    torch.set_num_threads(args.threads)
    plans = [plan(name, args.mfu) for name in args.presets]
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"# Scaling plan\n\ncommand: `{command}`; torch {torch.__version__}\n")
    print(markdown(plans, args.mfu))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "scaling_plan", "command": command, "torch": torch.__version__,
                               "assumptions": {"mfu": ASSUMED_MFU, "gpus": GPUS, "node_write_gb_s": NODE_WRITE_GB_S,
                                               "gpus_per_node": GPUS_PER_NODE},
                               "plans": plans}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

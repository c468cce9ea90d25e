"""The Python half of benchmarks/gpu_check.sh: each subcommand measures one thing and writes one JSON file
into --out; ``report`` merges them into gpu_check.json and a markdown table (gpu_check.md).

Subcommands:

- ``info``: GPU name, torch, CUDA and cuDNN versions.
- ``train``: training throughput of a ~125M-parameter model (GPT-2-small shape, SwiGLU, vocab 50,304),
  baseline (an ordinary transformer step) and FBT with K = 1, 2, 3 passes, bf16 autocast, with and
  without ``torch.compile``: tokens/s, model FLOPs utilisation, peak memory, K2/K1 and K3/K1.
- ``hf``: per-token greedy decode time of fullband (standard, soft) and Hugging Face ``generate`` on the
  same random Llama weights (converted with ``fullband.hf.convert_from_hf``), and whether the greedy
  tokens agree.
- ``dist-worker``: run under ``torchrun --nproc_per_node=2``: an all-reduce between two processes on one GPU
  (``--backend nccl`` or ``gloo``), then a few DDP and FSDP2 multi-pass training steps; rank 0 writes the result.
- ``report``: merge every JSON in --out, with the figures far from what a user expects named
  (``expectations``): MFU under 40% at 125M compiled, soft decoding over 5% slower per token than standard,
  a decode step that costs about the same at batch 64 as at batch 1 (per-step overhead dominating).

The exact-recurrence part and the decode part are benchmarks/state_tracking_models.py and benchmarks/decode.py,
which write their own JSON into the same folder; the report reads them.

Model FLOPs (per token, per pass; the usual 6·N + attention count, ``scaling_plan.train_flops_per_token``):
6·(N_matrix + V·D) for the weight matrices and the LM head, plus 12·L·D·T for attention scores and values
(forward + backward; causal masking not discounted), plus 6·2·D² for the fusion in passes ≥ 2. MFU divides by
the GPU's dense bf16 peak (``PEAK_BF16_TFLOPS`` by name, e.g. 989 TFLOP/s for an H100 SXM or an H200;
``--peak-tflops`` to set it). The report's "measured MFU" line is the paper schedule's 75/22/3 mix of the
K = 1, 2, 3 steps, the figure ``scaling_plan.py --mfu`` takes (docs/scaling.md).

``--device cpu --tiny`` runs every piece on tiny sizes (``gpu_check.sh --dry-run`` and the CPU test do).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from scaling_plan import schedule_mfu
from scaling_plan import train_flops_per_token as model_flops_per_token
from train_step import forward_backward

from fullband.model import FullBandConfig, FullBandLM
from fullband.schedule import PassSchedule
from fullband.storage import load_pretrained

# dense bf16 peak, TFLOP/s, by a part of the GPU's name (the first that matches; NVIDIA's data sheets)
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0,
                    "B200": 2250.0, "A100": 312.0, "L40S": 362.0}
DEFAULT_PEAK_TFLOPS = 989.0
MODEL_125M = dict(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, d_ff=2048)
TINY_MODEL = dict(vocab_size=256, d_model=32, n_layers=2, n_heads=2, d_ff=64)
# label -> (train_step variant, passes)
TRAIN_VARIANTS = {"baseline": ("plain", 1), "K=1": ("K=1", 1), "K=2": ("K=2", 2), "K=3": ("K=3", 3)}


def write_json(out: Path, name: str, payload: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def sync_for(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


# ---- info ----------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    return info


# ---- training throughput -------------------------------------------------------------------------


def measure_train(model_kwargs: dict, batch: int, seq: int, device: torch.device, steps: int, warmup: int,
                  compile_model: bool, peak_tflops: float) -> dict:
    sync = sync_for(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    results = {}
    for label, (variant, passes) in TRAIN_VARIANTS.items():
        torch.manual_seed(0)
        cfg = FullBandConfig(max_seq_len=seq, **model_kwargs)
        model = FullBandLM(cfg).to(device).train()
        if compile_model:
            model.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
        data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
        ids, targets = data[:, :-1].to(device), data[:, 1:].to(device)
        generator = torch.Generator(device=device).manual_seed(0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        started = time.perf_counter()
        for step in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with autocast:
                forward_backward(model, ids, targets, variant, generator)
            opt.step()
            sync()
            if step >= warmup:
                times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        flops = model_flops_per_token(cfg, seq, passes) * batch * seq
        results[label] = {
            "passes": passes,
            "step_ms": round(step_s * 1e3, 3),
            "tokens_per_s": round(batch * seq / step_s, 1),
            "model_tflops_per_s": round(flops / step_s / 1e12, 2),
            "mfu": float(f"{flops / step_s / (peak_tflops * 1e12):.4g}"),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
            "wall_s_incl_warmup": round(time.perf_counter() - started, 1),
        }
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    k1 = results["K=1"]["step_ms"]
    ratios = {f"K{k}/K1 step time": round(results[f"K={k}"]["step_ms"] / k1, 3) for k in (2, 3)}
    ratios["K1/baseline step time"] = round(k1 / results["baseline"]["step_ms"], 3)
    return {"variants": results, "ratios": ratios}


def peak_tflops(device: torch.device) -> tuple[float, str]:
    """The device's dense bf16 peak in TFLOP/s and where the figure comes from."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for key, peak in PEAK_BF16_TFLOPS.items():
        if key in name:
            return peak, f"{name}: {key} dense bf16"
    return DEFAULT_PEAK_TFLOPS, f"{name}: not in PEAK_BF16_TFLOPS, assumed an H100 SXM's dense bf16"


def cmd_train(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    peak, peak_source = (args.peak_tflops, "--peak-tflops") if args.peak_tflops else peak_tflops(device)
    model_kwargs = TINY_MODEL if args.tiny else MODEL_125M
    batch, seq = (2, 16) if args.tiny else (args.batch, args.seq)
    n_params = FullBandLM(FullBandConfig(max_seq_len=seq, **model_kwargs)).num_parameters()
    payload = {"model": model_kwargs, "parameters": n_params, "batch": batch, "seq_len": seq,
               "dtype": "bf16 autocast", "steps": args.steps, "warmup": args.warmup,
               "peak_tflops": peak, "peak_source": peak_source, "runs": {}}
    for compile_model in ([False] if args.no_compile else [False, True]):
        key = "compiled" if compile_model else "eager"
        try:
            payload["runs"][key] = measure_train(model_kwargs, batch, seq, device, args.steps, args.warmup,
                                                 compile_model, peak)
        except Exception as exc:  # a failing compile must not hide the eager figures
            payload["runs"][key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        write_json(Path(args.out), "train", payload)  # the eager figures survive a time limit hit while compiling
    return payload


# ---- decoding against Hugging Face generate ------------------------------------------------------


def cmd_hf(args: argparse.Namespace) -> dict:
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    from fullband.generation import generate
    from fullband.hf import convert_from_hf

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = sync_for(device)
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2) \
        if args.tiny else dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                               num_attention_heads=16, num_key_value_heads=8)
    prompt_len, new_tokens = (8, 8) if args.tiny else (args.prompt_len, args.new_tokens)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(max_position_embeddings=4096, **shape))
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(Path(tmp) / "llama")
        convert_from_hf(Path(tmp) / "llama", Path(tmp) / "fb")
        fb = load_pretrained(Path(tmp) / "fb", device=device, dtype=dtype).eval()
    hf = hf.to(device=device, dtype=dtype).eval()

    def timed(fn) -> tuple[float, torch.Tensor]:
        fn()  # warm-up (kernels, allocator)
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return time.perf_counter() - t0, out

    results = {}
    for batch in ([1, 2] if args.tiny else args.batch):
        ids = torch.randint(0, shape["vocab_size"], (batch, prompt_len), generator=torch.Generator().manual_seed(1))
        ids = ids.to(device)
        mask = torch.ones_like(ids)
        row = {}
        with torch.no_grad():
            hf_s, hf_out = timed(lambda ids=ids, mask=mask: hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0))
            hf_tokens = hf_out[:, prompt_len:]
            row["hf_generate_ms_per_token"] = round(hf_s / new_tokens * 1e3, 3)
            for mode in ("standard", "soft"):
                s, tokens = timed(lambda m=mode, ids=ids: generate(fb, ids, new_tokens, mode=m))
                row[f"fullband_{mode}_ms_per_token"] = round(s / new_tokens * 1e3, 3)
                if mode == "standard":
                    row["greedy_tokens_equal_to_hf"] = round(float((tokens == hf_tokens).float().mean()), 4)
        row["fullband_standard/hf"] = round(row["fullband_standard_ms_per_token"] / row["hf_generate_ms_per_token"], 3)
        results[f"batch {batch}"] = row
    return {"model": shape, "dtype": args.dtype, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "note": "time per generated token including the prefill (one warm-up call first); greedy",
            "results": results}


# ---- two processes on one GPU: NCCL, DDP, FSDP2 --------------------------------------------------


def cmd_dist_worker(args: argparse.Namespace) -> dict | None:
    import torch.distributed as dist

    from fullband.train.teardown import destroy_process_groups, prepare_process_group

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    backend = args.backend if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result: dict = {"backend": backend, "world_size": world, "device": str(device)}
    prepare_process_group()
    try:
        dist.init_process_group(backend)
        value = torch.tensor([rank + 1.0], device=device)
        dist.all_reduce(value)
        result["all_reduce_ok"] = float(value) == world * (world + 1) / 2
        for parallel in ("ddp", "fsdp"):
            result[parallel] = _dist_steps(parallel, device, rank, world, args.tiny)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"rank {rank}: {result['error']}", file=sys.stderr, flush=True)  # in the log even if teardown hangs
    finally:
        if dist.is_initialized():
            destroy_process_groups()
    return result if rank == 0 else None


def _dist_steps(parallel: str, device: torch.device, rank: int, world: int, tiny: bool) -> dict:
    """Three K=2 multi-pass steps on the same batch in every rank: the ranks' losses and a parameter checksum
    must agree (DDP averages identical gradients; FSDP2 shards them)."""
    import torch.distributed as dist

    from fullband.train.objective import MultipassObjective

    torch.manual_seed(0)
    # no jitter on the fed state: every rank's passes are then the same arithmetic
    size = TINY_MODEL if tiny else dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, d_ff=768)
    cfg = FullBandConfig(max_seq_len=64, feedback_jitter=0.0, **size)
    model = FullBandLM(cfg).to(device).train()
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        objective = MultipassObjective(model)
    else:
        from torch.nn.parallel import DistributedDataParallel

        # as the trainer does: the multi-pass loss goes through DDP's forward, so its hooks average gradients
        objective = DistributedDataParallel(MultipassObjective(model), find_unused_parameters=True,
                                            device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        out = objective(data[:, :-1], data[:, 1:], 2)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    with torch.no_grad():
        checksum = sum(float((p.full_tensor() if hasattr(p, "full_tensor") else p).double().sum())
                       for p in model.parameters())
    gathered = [None] * world
    dist.all_gather_object(gathered, {"losses": losses, "checksum": checksum})
    agree = all(g["losses"] == gathered[0]["losses"] and abs(g["checksum"] - gathered[0]["checksum"]) < 1e-6
                for g in gathered)
    return {"losses": losses, "ranks_agree": agree, "finite": all(map(lambda v: v == v and abs(v) < 1e9, losses))}


# ---- report --------------------------------------------------------------------------------------

def cmd_report(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    parts = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem != "gpu_check"}
    parts["expectations"] = expectations(parts)
    (out / "gpu_check.json").write_text(json.dumps(parts, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(parts))
    print(markdown(parts))
    return {}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def decode_rows(decode: dict) -> list[dict]:
    """One row per model and batch of benchmarks/decode.py's JSON: per-token ms and soft/standard."""
    rows = []
    for model, body in decode["results"].items():
        for batch, result in body["batches"].items():
            modes = result["modes"]
            rows.append({"model": model, "batch": int(batch), "fusion_share": body["macs_per_token"]["fusion_share"],
                         "standard_ms": modes["standard"]["per_token_s"]["median"] * 1e3,
                         "soft_ms": modes["soft"]["per_token_s"]["median"] * 1e3,
                         "soft_over_standard": modes["soft"]["per_token_ratio"]})
    return rows


def expectations(parts: dict) -> list[str]:
    """The figures far from what a user expects, each with the figure and what would fix it."""
    found = []
    compiled = parts.get("train", {}).get("runs", {}).get("compiled", {})
    if "variants" in compiled:
        mfu = compiled["variants"]["K=1"]["mfu"]
        if mfu < 0.40:
            found.append(f"training MFU at 125M, compiled, K=1: {mfu:.1%}, under 40%; not diagnosed here: the "
                         "candidates are the attention kernels, the LM head's cross-entropy over 50,304 logits and "
                         "the batch of 16 rows (a profile of the compiled step tells which)")
    rows = decode_rows(parts["decode"]) if "decode" in parts else []
    for row in rows:
        ratio = row["soft_over_standard"]["median"]
        if ratio > 1.05:
            share = row["fusion_share"]
            cause = ("the fusion's kernels cost more than their arithmetic (per-call overhead): running the step "
                     "as one CUDA graph, or the GLU as one fused kernel, would remove it"
                     if ratio - 1 > 2 * share else "that is the fusion's own arithmetic")
            found.append(f"soft decoding {ratio:.3f}× standard per token ({row['model']}, batch {row['batch']}), "
                         f"the fusion {share:.1%} of the step's multiply-adds: {cause}")
    by_model: dict[str, dict[int, float]] = {}
    for row in rows:
        by_model.setdefault(row["model"], {})[row["batch"]] = row["standard_ms"]
    for model, per_batch in by_model.items():
        low, high = min(per_batch), max(per_batch)
        if high >= 8 * low and per_batch[high] < 1.5 * per_batch[low]:
            found.append(f"{model}: a standard decode step takes {per_batch[low]:.2f} ms at batch {low} and "
                         f"{per_batch[high]:.2f} ms at batch {high}: per-step overhead (Python, kernel launches), "
                         "not the GPU's work, sets the time; capturing the step in a CUDA graph "
                         "(torch.compile mode='reduce-overhead') would remove most of it")
    return found


def markdown(parts: dict) -> str:
    lines = ["# GPU check", ""]
    info = parts.get("info", {})
    lines.append(f"GPU: {info.get('gpu', 'none')}; torch {info.get('torch')}, CUDA {info.get('cuda')}, "
                 f"cuDNN {info.get('cudnn')}, NCCL {info.get('nccl')}, Python {info.get('python')}")
    for name in ("tests_float32", "tests_bf16"):
        if name in parts:
            t = parts[name]
            limit = " (time limit)" if t.get("timed_out") else ""
            lines.append(f"- equivalence tests ({name[6:]}): exit {t.get('exit_code')}{limit}: {t.get('summary', '')}")
    train = parts.get("train")
    if train:
        lines += ["", f"## Training, {train['parameters'] / 1e6:.1f}M parameters, batch {train['batch']} × "
                  f"{train['seq_len']} tokens, bf16 autocast; MFU against {train['peak_tflops']} TFLOP/s "
                  f"({train.get('peak_source', 'dense bf16')})", "",
                  "| run | variant | tokens/s | step ms | model TFLOP/s | MFU | peak GiB |",
                  "|---|---|---|---|---|---|---|"]
        for run, body in train["runs"].items():
            if "error" in body:
                lines.append(f"| {run} | error: {body['error'][:200]} | | | | | |")
                continue
            for label, v in body["variants"].items():
                lines.append(f"| {run} | {label} | {v['tokens_per_s']:,.0f} | {v['step_ms']} | "
                             f"{v['model_tflops_per_s']} | {v['mfu']:.1%} | {v['peak_memory_gib']} |")
            lines.append(f"| {run} | ratios | {', '.join(f'{k} {r}' for k, r in body['ratios'].items())} | | | | |")
        lines += ["", measured_mfu_line(train)]
    exact = parts.get("exact")
    if exact:
        results = exact["results"]
        lines += ["", f"## Exact-recurrence training step against one pass (state-tracking preset, batch "
                  f"{exact['batch'][0]} × {exact['batch'][1] - 1} tokens, {exact['steps']} steps × "
                  f"{exact['repeats']} repetitions; ratios paired within a repetition, median (min–max))", "",
                  "| model | ms per step | × the transformer's (one pass) | grading s |", "|---|---|---|---|"]
        one_pass = results["transformer"]["step_s"]
        for name, r in results.items():
            ratio = spread([a / b for a, b in zip(r["step_s"], one_pass)])
            lines.append(f"| {name} | {1e3 * statistics.median(r['step_s']):.2f} | {ratio} | "
                         f"{statistics.median(r['grade_s']):.3f} |")
        if "compile_chunk" in exact:  # state_tracking_models.py records it only when it compiled the steps
            lines.append(f"\ncompiled {exact.get('compile_chunk')} positions per call; compiling took "
                         f"{exact.get('compile_s', 0):.0f} s (two steps)")
    decode = parts.get("decode")
    if decode:
        settings = decode["settings"]
        lines += ["", f"## benchmarks/decode.py ({settings['dtype']}, prompt {settings['prompt_len']}, "
                  f"{settings['new_tokens']} new tokens, {settings['repeats']} repetitions)", "",
                  "| model | batch | standard ms/token | soft ms/token | soft / standard, paired |",
                  "|---|---|---|---|---|"]
        for row in decode_rows(decode):
            r = row["soft_over_standard"]
            lines.append(f"| {row['model']} | {row['batch']} | {row['standard_ms']:.3f} | {row['soft_ms']:.3f} | "
                         f"{r['median']:.3f} ({r['min']:.3f}–{r['max']:.3f}) |")
    hf = parts.get("hf")
    if hf:
        lines += ["", f"## Decoding against Hugging Face generate ({hf['dtype']}, prompt {hf['prompt_len']}, "
                  f"{hf['new_tokens']} new tokens, ms per token incl. prefill)", "",
                  "| batch | HF generate | fullband standard | fullband soft | standard/HF | greedy tokens equal |",
                  "|---|---|---|---|---|---|"]
        for batch, r in hf["results"].items():
            lines.append(f"| {batch} | {r['hf_generate_ms_per_token']} | {r['fullband_standard_ms_per_token']} | "
                         f"{r['fullband_soft_ms_per_token']} | {r['fullband_standard/hf']} | "
                         f"{r['greedy_tokens_equal_to_hf']:.0%} |")
    for backend in ("nccl", "gloo"):
        dist_part = parts.get(f"dist_{backend}")
        if dist_part:
            lines += ["", f"## Two processes on one device, {backend}", "", "```", json.dumps(dist_part, indent=1),
                      "```"]
    failed = {name: part for name, part in parts.items() if name.endswith("_failed")}
    if failed:
        lines += ["", "## Parts that failed or timed out", ""]
        for name, part in failed.items():
            lines.append(f"- {name[:-7]}: exit {part['exit_code']}{' (time limit)' if part['timed_out'] else ''}: "
                         f"{part['summary']}")
    if parts.get("expectations"):
        lines += ["", "## Far from what a user expects", ""] + [f"- {e}" for e in parts["expectations"]]
    return "\n".join(lines) + "\n"


def measured_mfu_line(train: dict) -> str:
    """The MFU docs/scaling.md asks for: the paper schedule's mix of K = 1, 2, 3 steps, compiled if that ran."""
    runs = {name: body for name, body in train["runs"].items() if "error" not in body}
    if not runs:
        return "measured MFU: none (every training run failed)"
    name = "compiled" if "compiled" in runs else next(iter(runs))
    variants = {v["passes"]: v for label, v in runs[name]["variants"].items() if label != "baseline"}
    mfu = schedule_mfu({k: v["mfu"] for k, v in variants.items()}, {k: v["step_ms"] for k, v in variants.items()},
                       PassSchedule.parse("paper"))
    return (f"measured MFU ({name}, paper schedule's 75/22/3 mix of the K = 1, 2, 3 steps): {mfu:.4f}; "
            f"docs/scaling.md: `python benchmarks/scaling_plan.py --mfu {mfu:.4f}`")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["info", "train", "hf", "dist-worker", "report"])
    p.add_argument("--out", default="benchmarks/results/gpu", help="directory for the JSON files")
    p.add_argument("--name", default=None, help="JSON file name (default: the command)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU test)")
    p.add_argument("--steps", type=int, default=100, help="train: measured steps per variant")
    p.add_argument("--warmup", type=int, default=10, help="train: warm-up steps per variant (compilation)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="train: batch (16); hf: batches (1 8 64)")
    p.add_argument("--seq", type=int, default=1024, help="train: sequence length")
    p.add_argument("--no-compile", action="store_true", help="train: eager only")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="train: the GPU's dense bf16 peak (default: by its name, PEAK_BF16_TFLOPS)")
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="dist-worker: process group backend")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="hf: weights dtype")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available() and args.command != "report":
        print("gpu_check: CUDA is not available; use --device cpu --tiny to exercise the code", file=sys.stderr)
        return 2
    if args.command == "train":
        args.batch = (args.batch or [16])[0]
    elif args.command == "hf":
        args.batch = args.batch or [1, 8, 64]
    command = {"info": cmd_info, "train": cmd_train, "hf": cmd_hf, "dist-worker": cmd_dist_worker,
               "report": cmd_report}[args.command]
    payload = command(args)
    if payload:
        default_name = f"dist_{args.backend}" if args.command == "dist-worker" else args.command
        print(write_json(Path(args.out), args.name or default_name, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Save and load time and peak memory per rank of the trainer's two checkpoint formats under FSDP2, on the CPU.

- ``full`` (``train.checkpoint_format: full``): every rank takes part in gathering the whole model and
  optimizer state onto rank 0 (``full_state_dict=True, cpu_offload=True``), which writes ``model.safetensors``
  and ``optimizer.pt``; on resume every rank reads both files whole and keeps its shard.
- ``dcp`` (``train.checkpoint_format: dcp``): every rank writes its own shards with
  ``torch.distributed.checkpoint`` and hashes them for the manifest; on resume every rank reads only the
  pieces of its shards.

Both go through the trainer's own code (``CheckpointManager.save`` and ``.load``), atomic temporary
directory, sha256 manifest and fsync included. A model of ~300M parameters (d_model 1024, 16 layers,
d_ff 4096, vocabulary 32000) is sharded with ``fully_shard`` per block over ``--nproc`` gloo processes, with
AdamW state (one step on zero gradients). The formats are interleaved: each repetition saves and loads
both, in an order rotated from repetition to repetition. Memory per rank per phase: the high-water mark
``VmHWM`` is reset (``/proc/self/clear_refs``, after ``malloc_trim``) before the phase and read after it;
reported as the peak and as the peak above the resident size before the phase (what the checkpoint costs on
top of training).
Loads read a checkpoint just written, so from the page cache for both formats.

Usage:
    python benchmarks/checkpoint.py            # ~300M parameters, 2 processes, 3 repetitions (~2 min)
    python benchmarks/checkpoint.py --quick    # a tiny model: a smoke run (< 1 min)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import machine_info
from torch.distributed.fsdp import fully_shard

from fullband.config import RunConfig
from fullband.decoding import DecodeSettings
from fullband.model import FullBandConfig, FullBandLM
from fullband.storage import list_checkpoints
from fullband.train.checkpoint import CheckpointManager
from fullband.train.optim import build_optimizers

SIZES = {
    "300M": {"d_model": 1024, "n_layers": 16, "n_heads": 16, "d_ff": 4096, "vocab_size": 32000},
    "quick": {"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 512, "vocab_size": 1000},
}
FORMATS = ("full", "dcp")
LIBC = ctypes.CDLL("libc.so.6")  # malloc_trim (glibc, Linux: /proc/self/clear_refs is Linux-only too)


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measure(fn, *args) -> dict:
    """Wall time of ``fn(*args)`` (between barriers: the slowest rank's), this rank's peak RSS and its rise."""
    dist.barrier()
    # Hand memory freed by earlier phases back to the OS first: glibc keeps it resident otherwise, and a
    # phase after a large one would start from (and hide its peak inside) the earlier phase's leftovers.
    LIBC.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_mib("VmRSS")
    started = time.perf_counter()
    fn(*args)
    dist.barrier()
    seconds = time.perf_counter() - started
    peak = _status_mib("VmHWM")
    return {"s": seconds, "peak_rss_mib": peak, "peak_rss_delta_mib": peak - before}


def _manager(model, out_dir: Path, tokenizer_dir: Path, fmt: str) -> CheckpointManager:
    """The trainer's checkpoint manager for ``fmt``: the benchmark runs the trainer's own checkpoint code on a large
    model without preparing data or training it."""
    return CheckpointManager(out_dir, fmt, model.config, DecodeSettings(), tokenizer_dir, keep=1,
                             world_size=dist.get_world_size(), is_main=dist.get_rank() == 0, log=lambda _: None)


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = FullBandLM(FullBandConfig(max_seq_len=512, **SIZES[args.size]))
    params = sum(p.numel() for p in model.parameters())
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    cfg = RunConfig().train
    optimizers = build_optimizers(model, cfg)
    for p in model.parameters():  # AdamW state (exp_avg, exp_avg_sq, step) for every parameter
        p.grad = torch.zeros_like(p)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    root = Path(args.workdir)
    tokenizer = root / "data" / "tokenizer"
    if rank == 0:
        tokenizer.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list]] = {f: {"save": [], "load": [], "bytes": []} for f in FORMATS}
    for rep in range(args.repeats):
        order = FORMATS if rep % 2 == 0 else FORMATS[::-1]
        for fmt in order:
            out_dir = root / f"run-{fmt}"
            manager = _manager(model, out_dir, tokenizer, fmt)
            results[fmt]["save"].append(_measure(manager.save, model, optimizers, {"step": rep + 1}))
            checkpoint = list_checkpoints(out_dir)[-1]
            results[fmt]["load"].append(_measure(manager.load, model, optimizers, checkpoint))
            results[fmt]["bytes"].append(sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"params": params, "ranks": gathered}))
    dist.barrier()
    del model, optimizers
    dist.destroy_process_group()


def summarise(raw: dict) -> dict:
    """Per format and phase: the time (median, min over repetitions; identical on every rank between
    barriers, rank 0's) and per rank the largest peak RSS and rise over the repetitions."""
    out = {}
    for fmt in FORMATS:
        entry = {"bytes_on_disk": raw["ranks"][0][fmt]["bytes"][-1]}
        for phase in ("save", "load"):
            times = [m["s"] for m in raw["ranks"][0][fmt][phase]]
            entry[phase] = {
                "s": {"median": statistics.median(times), "min": min(times), "all": times},
                "peak_rss_mib": [max(m["peak_rss_mib"] for m in r[fmt][phase]) for r in raw["ranks"]],
                "peak_rss_delta_mib": [max(m["peak_rss_delta_mib"] for m in r[fmt][phase]) for r in raw["ranks"]],
            }
        out[fmt] = entry
    return out


def table(results: dict) -> str:
    lines = ["| format | phase | s, median | s, best | dcp / full (best) | peak RSS per rank, MiB "
             "| peak RSS rise per rank, MiB | on disk, MiB |", "|---|---|---|---|---|---|---|---|"]
    for fmt in FORMATS:
        for phase in ("save", "load"):
            r = results[fmt][phase]
            ratio = r["s"]["min"] / results["full"][phase]["s"]["min"]
            lines.append(
                f"| {fmt} | {phase} | {r['s']['median']:.2f} | {r['s']['min']:.2f} | {ratio:.2f} "
                f"| {' / '.join(f'{v:.0f}' for v in r['peak_rss_mib'])} "
                f"| {' / '.join(f'{v:.0f}' for v in r['peak_rss_delta_mib'])} "
                f"| {results[fmt]['bytes_on_disk'] / 2**20:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 repetition: a smoke run (< 1 min)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default 3; quick 1)")
    p.add_argument("--nproc", type=int, default=2, help="gloo processes (FSDP2 ranks), default 2")
    p.add_argument("--workdir", default=None, help="where the checkpoints are written (default: a temporary "
                                                   "directory, removed afterwards)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/checkpoint[_quick].json)")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_size", dest="size", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", dest="result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker:
        worker(args)
        return
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.out is None:
        args.out = "benchmarks/results/checkpoint" + ("_quick" if args.quick else "") + ".json"
    size = "quick" if args.quick else "300M"
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="fullband-ckpt-bench-"))
    result = workdir / "raw.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--_worker", "--_size", size, "--_result", str(result), "--workdir", str(workdir),
               "--repeats", str(args.repeats)]
    started = time.time()
    try:
        subprocess.run(command, env=env, check=True)
        raw = json.loads(result.read_text())
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.time() - started
    results = summarise(raw)

    machine = machine_info(1, "cpu")
    shown = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"# checkpoint benchmark\n\ncommand: `{shown}`\n")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs, torch {machine['torch']}\n")
    print(f"{raw['params'] / 1e6:.0f} M parameters + AdamW state, FSDP2 over {args.nproc} gloo processes "
          f"(1 thread each); {args.repeats} interleaved repetitions. Times are between barriers (the slowest "
          "rank); peak RSS per rank (rank 0 / rank 1 / ...) is the phase's high-water mark, its rise the peak "
          "above the resident size before the phase.\n")
    print(table(results))
    print(f"\nwall time {elapsed:.1f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "checkpoint",
        "command": shown,
        "machine": machine,
        "settings": {"size": size, "model": SIZES[size], "params": raw["params"], "nproc": args.nproc,
                     "repeats": args.repeats, "quick": args.quick},
        "wall_s": elapsed,
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

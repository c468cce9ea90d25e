"""``fullband bench``: accuracy, pass@k and generated length per task x decode mode x temperature."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fullband.bench.runner import BenchSettings, parse_modes, parse_temperatures, run_bench
from fullband.bench.sandbox import ALLOW_FLAG, GUARD, Limits, bubblewrap_problem
from fullband.bench.tasks import HumanEvalTask, make_task
from fullband.cli_options import add_device_options, model_dtype
from fullband.errors import ConfigError
from fullband.generation import decode_settings
from fullband.loading import load_model
from fullband.storage import ModelDir, RunDir


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="generation benchmarks: accuracy, pass@k and trace length per decode mode and temperature",
        description="Generate answers in each decode mode and temperature, score them and write results.json, "
        "results.md, samples.jsonl, accuracy.png and lengths.png. Rerunning with the same --out resumes.",
    )
    p.add_argument("model", help="run directory, checkpoint, model directory or exported Hugging Face directory")
    p.add_argument("--task", action="append", required=True, metavar="TASK",
                   help="synthetic:<name>[:opts], jsonl:PATH, rg:<name>[:key=value,...] or humaneval (repeatable)")
    p.add_argument("--modes",
                   help="comma-separated: standard, soft, fused (the model's stored passes), fused:N, fused:auto, "
                   "fused:exact (default: the decode mode stored with the model, from how it was trained)")
    p.add_argument("--temperatures", default="0", help="comma-separated, 0 = greedy (default: 0)")
    p.add_argument("--samples", type=int, default=1, help="samples per problem at temperatures > 0 (default: 1)")
    p.add_argument("--k", default="1", help="comma-separated k of pass@k, each <= --samples (default: 1)")
    p.add_argument("--limit", type=int, help="only the first M problems of each task")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (reused to resume)")
    p.add_argument("--match", choices=["exact", "math"], default="exact",
                   help="jsonl tasks: exact final answer, or math-verify equivalence (default: exact)")
    p.add_argument("--max-new-tokens", type=int, help="cap on generated tokens (default: per task)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch (default: 16)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass at temperatures > 0")
    p.add_argument("--seed", type=int, default=0, help="sampling, reasoning-gym and bootstrap seed (default: 0)")
    p.add_argument("--data-seed", type=int,
                   help="synthetic tasks: data.seed of the held-out split (default: the run's, else 0)")
    p.add_argument("--val-examples", type=int,
                   help="synthetic tasks: data.synthetic_val_examples (default: the run's, else 500)")
    p.add_argument("--fused-tol", metavar="TOL",
                   help="fused:auto: stop at this relative state change (default: the model's stored setting)")
    p.add_argument("--fused-max-passes", metavar="N",
                   help="fused:auto: at most this many passes (default: the model's stored setting: its context for a "
                   "run trained with train.schedule exact)")
    p.add_argument("--timeout", type=float, default=10.0, help="humaneval: wall seconds per program (default: 10)")
    p.add_argument("--workers", type=int, help="humaneval: programs run in parallel (default: CPU count)")
    p.add_argument(ALLOW_FLAG, action="store_true",
                   help="humaneval: where the bubblewrap sandbox cannot run, run model-written code anyway with "
                   "resource limits and a cut network only, able to read, change and delete your files (default: "
                   "refuse). Only inside a disposable container or VM")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default: 1000)")
    add_device_options(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="skip accuracy.png and lengths.png")
    p.set_defaults(func=run)
    return p


def run_data_settings(run: RunDir | None) -> dict[str, Any]:
    """data.seed and data.synthetic_val_examples of the run the model was trained in, if known."""
    data = run.config_section("data") if run is not None else {}
    return {k: data[k] for k in ("seed", "synthetic_val_examples") if isinstance(data.get(k), int)}


def _ints(text: str, name: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise ConfigError(f"{name} needs integers >= 1, got {text!r}")
    return values


def run(args: argparse.Namespace) -> None:
    temperatures = parse_temperatures(args.temperatures)
    ks = _ints(args.k, "--k")
    for name in ("samples", "limit", "max_new_tokens", "batch_size", "workers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if ks[-1] > args.samples and any(t > 0 for t in temperatures):
        raise ConfigError(f"pass@{ks[-1]} needs --samples >= {ks[-1]} (got {args.samples})")
    model_dir = ModelDir.open(args.model)
    # Modes from the stored settings before the weights are read: a bad mode fails before the model is loaded.
    base = model_dir.decode.with_overrides(fused_tol=args.fused_tol, fused_max_passes=args.fused_max_passes)
    modes = parse_modes(args.modes or base.label, base)
    recorded = run_data_settings(model_dir.run)
    data_seed = args.data_seed if args.data_seed is not None else recorded.get("seed", 0)
    val_examples = args.val_examples or recorded.get("synthetic_val_examples", 500)
    # Tasks first: a missing package or a sandbox that cannot run fails before the model is loaded.
    tasks = [make_task(spec, match=args.match, seed=data_seed if spec.startswith("synthetic:") else args.seed,
                       val_examples=val_examples, rg_size=args.limit or 100, limits=Limits(timeout=args.timeout),
                       workers=args.workers, allow_unsandboxed=args.allow_unsandboxed_code) for spec in args.task]
    if len({t.name for t in tasks}) != len(tasks):
        raise ConfigError("the same --task is given twice")
    if any(isinstance(t, HumanEvalTask) and t.isolation == GUARD for t in tasks):
        print(f"warning: model-written code runs WITHOUT a sandbox ({ALLOW_FLAG}), with resource limits only: "
              f"{bubblewrap_problem()}", file=sys.stderr)
    model, tokenizer = load_model(model_dir, args.device, model_dtype(args))
    for mode in modes:
        decode_settings(model, mode)  # a mode the model cannot decode in (a baseline's soft) fails before any task runs
    print("decode settings: " + ", ".join(m.describe() for m in modes), file=sys.stderr)
    settings = BenchSettings(
        model=str(Path(args.model).resolve()), modes=[m.label for m in modes], temperatures=temperatures,
        samples=args.samples, ks=ks, limit=args.limit, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, seed=args.seed, top_p=args.top_p, fused_tol=base.fused_tol,
        fused_max_passes=base.fused_max_passes, bootstrap=args.bootstrap,
        extra={"match": args.match, "data_seed": data_seed, "val_examples": val_examples},
    )
    run_bench(model, tokenizer, tasks, settings, args.out, progress=not args.no_progress, plots=not args.no_plots)
    print((Path(args.out) / "results.md").read_text())

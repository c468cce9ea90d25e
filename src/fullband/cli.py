"""The ``fullband`` command. Options of the config sections are derived from the dataclasses in
``fullband.config`` and given as ``--section.field value``."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from fullband import chat_cli, lm_eval_cli, sft
from fullband.bench import cli as bench_cli
from fullband.cli_options import (
    add_config_options,
    add_decode_options,
    add_device_options,
    add_sampling_options,
    add_validation_data_options,
    decode_from_args,
    decode_overrides,
    model_dtype,
    sampling_params,
    write_answer,
)
from fullband.config import RunConfig, load_config
from fullband.data import prepare_dataset
from fullband.errors import FullbandError
from fullband.eval import evaluate, format_eval_table
from fullband.generation import generate_stream
from fullband.hf import convert_from_hf, export_hf
from fullband.loading import encode_prompt, load_model, load_model_and_data, preset_path
from fullband.rl import cli as rl_cli
from fullband.serve import cli as serve_cli
from fullband.storage import consolidate, verify
from fullband.tools import jacobi, probe
from fullband.tools.demo import run_demo
from fullband.train import train

# What a user can fix: fullband's own errors (a config, data, checkpoint, request or setting that cannot be used) and
# the operating system's about the files and devices a command names (missing, unreadable, no space). They print as
# one paragraph; anything else is a bug in fullband and keeps its traceback.
USER_ERRORS = (FullbandError, OSError)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    overrides = {k: v for k, v in vars(args).items() if "." in k}
    overrides.update(args.unknown_overrides)  # unknown --section.field: build_config explains
    return load_config(preset_path(args.config) if args.config else None, overrides)


def cmd_prepare(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    # Progress of a long prepare (work units tokenized or kept on resume, splits written) on stderr.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("prepare: %(message)s"))
    data_log = logging.getLogger("fullband.data")
    data_log.addHandler(handler)
    data_log.setLevel(logging.INFO)
    try:
        dataset = prepare_dataset(config.data, args.out, overwrite=args.overwrite, workers=args.workers)
    finally:
        data_log.removeHandler(handler)
    for name, info in dataset.manifest["splits"].items():
        print(f"{name}: {info['tokens']:,} tokens in {info['documents']:,} documents")
    print(f"tokenizer: {dataset.manifest['tokenizer']['kind']} (vocab {dataset.vocab_size}); wrote {args.out}")


def cmd_train(args: argparse.Namespace) -> None:
    saved = Path(args.out_dir) / "config.yaml"
    if args.resume and args.config is None and saved.is_file():
        args.config = str(saved)  # resume with the run's own config; --section.field overrides still apply
    config = config_from_args(args)
    result = train(config, args.out_dir, data_dir=args.data_dir, resume=args.resume, init_from=args.init_from)
    if int(os.environ.get("RANK", "0")) != 0:
        return  # under torchrun, rank 0 reports
    print(f"steps {result.steps}, tokens {result.tokens:,}, token-equivalent compute {result.compute_tokens:,}"
          f" (tokens × passes), skipped steps {result.skipped_steps}")
    if result.final_eval is not None:
        print(format_eval_table({"model": result.final_eval}))


def cmd_eval(args: argparse.Namespace) -> None:
    model, dataset, model_dir, _ = load_model_and_data(args.checkpoint, args.data_dir, args.device, model_dtype(args))
    seq_len = args.seq_len or min(model.config.max_seq_len, 256)
    batches = dataset.split(args.split).eval_batches(seq_len, args.batch_size, args.batches)
    result = evaluate(model, batches, args.fused_passes, sequential=not args.no_sequential)
    print(format_eval_table({str(model_dir): result}))
    print("Jacobi ||h(k) - h(k-1)|| / ||h||: " + ", ".join(f"k={k}: {v:.4f}" for k, v in result.jacobi_delta.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))


def cmd_generate(args: argparse.Namespace) -> None:
    model, tokenizer = load_model(args.checkpoint, args.device, model_dtype(args))
    settings = decode_from_args(model, args)
    prompt = encode_prompt(tokenizer, args.prompt)
    stats: dict[str, Any] = {}
    sampling = sampling_params(args, args.max_new_tokens, [tokenizer.eos_id])
    ends = set(sampling.stop_token_ids)
    stream = generate_stream(model, [prompt], sampling=sampling, decode=settings, stats=stats)
    first = next(stream, None)  # bad arguments fail here, before anything is printed
    if settings.mode == "fused" and settings.fused_passes == "auto" and stats:
        cut = "" if stats["fused_converged"][0] else (
            f" (cut off at fused_max_passes {settings.fused_max_passes} with the states still changing by more than "
            f"fused_tol {settings.fused_tol:g}: fused({settings.fused_max_passes}), not the converged prefill)")
        print(f"adaptive fused prefill: {stats['fused_passes'][0]} fused passes{cut}", file=sys.stderr)
    sys.stdout.write(args.prompt)
    write_answer(itertools.chain([first] if first is not None else [], stream), tokenizer, ends, args.stream)


def cmd_demo(args: argparse.Namespace) -> None:
    run_demo(Path(args.out_dir), quick=args.quick)


def cmd_convert(args: argparse.Namespace) -> None:
    out = convert_from_hf(args.from_hf, args.out, gguf_file=args.gguf_file)
    print(f"wrote {out}")
    # Say it where the user looks: the weights are the pretrained model's, the fusion is not trained.
    print(
        "stored decode mode: standard (the pretrained model, exactly). Its fusion weights are untrained, so soft "
        "and fused decoding need mid-training with feedback first: fullband train --init-from "
        f"{out} --train.schedule paper (add --model.fusion add --model.fusion_init identity to start every mode "
        "at the pretrained model; docs/real_model.md)"
    )


def cmd_consolidate(args: argparse.Namespace) -> None:
    print(f"wrote {consolidate(args.checkpoint, args.out)}")


def cmd_verify(args: argparse.Namespace) -> None:
    for checkpoint in verify(args.path):
        print(f"ok {checkpoint}")


def cmd_export_hf(args: argparse.Namespace) -> None:
    print(f"wrote {export_hf(args.checkpoint, args.out, **decode_overrides(args))}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fullband", allow_abbrev=False,
        description="Full-bandwidth transformers: train, evaluate, generate, convert. "
        "Config options are --section.field VALUE (sections: model, data, train, eval).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare", help="tokenize a corpus into packed shards with a manifest")
    add_config_options(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output directory of the prepared dataset")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset prepared from another config")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="tokenizing processes (default 1); the output is the same bytes for any N. Re-running "
                        "after an interruption keeps the finished work units")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="train with the scheduled multi-pass objective (torchrun for several processes)")
    add_config_options(p)
    p.add_argument("--out-dir", required=True, metavar="DIR", help="run directory: config, checkpoints, metrics")
    p.add_argument("--data-dir", metavar="DIR",
                   help="prepared dataset directory (default OUT_DIR/data; prepared if missing)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in OUT_DIR (default config: OUT_DIR/config.yaml)")
    p.add_argument("--init-from", metavar="CHECKPOINT",
                   help="mid-training: start from a (standard) checkpoint's weights, fusion weights fresh")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="validation loss per decode mode and per number of fused passes")
    add_validation_data_options(p, batches=8)
    p.add_argument("--fused-passes", type=int, default=3, help="report fused(1..n) (default: 3)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="generate text in standard, soft or fused mode")
    p.add_argument("checkpoint", help="run directory, checkpoint or model directory")
    p.add_argument("--prompt", required=True, help="prompt text")
    add_decode_options(p, "fullband generate")
    add_sampling_options(p, "default: 200")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    add_device_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="train a small standard transformer and a small FBT on the CPU and compare")
    p.add_argument("--out-dir", default="runs/demo", help="where to write runs, table, samples and plot")
    p.add_argument("--quick", action="store_true", help="a much shorter run (smoke test, ~1 minute)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("convert", help="import a local Hugging Face Llama/Qwen2/Qwen3/Mistral checkpoint")
    p.add_argument("--from-hf", required=True, metavar="SRC", help="local HF model directory")
    p.add_argument("--gguf-file", metavar="NAME.gguf",
                   help="convert this GGUF file inside SRC (read and dequantized by transformers; needs `gguf`)")
    p.add_argument("--out", required=True, metavar="DST", help="fullband model directory to write")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export-hf", help="export to a transformers directory (trust_remote_code)")
    p.add_argument("checkpoint", help="run directory, checkpoint or model directory")
    p.add_argument("--out", required=True, metavar="DST", help="directory to write")
    add_decode_options(p, "the export's generate()")
    p.set_defaults(func=cmd_export_hf)

    p = sub.add_parser("consolidate", help="write a checkpoint's model (a DCP checkpoint's shards included) as a "
                                           "model directory with one model.safetensors")
    p.add_argument("checkpoint", help="run directory (its newest valid checkpoint), checkpoint or model directory")
    p.add_argument("--out", required=True, metavar="DIR", help="model directory to write (new or empty)")
    p.set_defaults(func=cmd_consolidate)

    p = sub.add_parser("verify", help="check the sha256 of every file of a run's checkpoints (or of one checkpoint) "
                                      "against their manifests; loading a model checks only sizes and headers")
    p.add_argument("path", help="run directory (every checkpoint and best/) or one checkpoint")
    p.set_defaults(func=cmd_verify)

    for module in (lm_eval_cli, jacobi, bench_cli, probe, serve_cli, sft, rl_cli, chat_cli):
        module.add_parser(sub)
    for subparser in sub.choices.values():
        subparser.allow_abbrev = False  # --train.token must not silently mean --train.tokens
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.unknown_overrides = {}
    while rest:
        option = rest.pop(0)
        if (not option.startswith("--") or "." not in option or args.command not in ("train", "prepare", "sft")
                or not rest):
            parser.error(f"unrecognized argument {option!r}")
        args.unknown_overrides[option[2:]] = rest.pop(0)
    try:
        args.func(args)
    except USER_ERRORS as exc:
        print(f"fullband {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

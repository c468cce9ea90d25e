"""``fullband sft MODEL``: instruction tuning, i.e. ``fullband train --init-from MODEL`` with the defaults it needs
(docs/instruction-tuning.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from fullband.cli_options import add_config_options
from fullband.config import build_config, read_sections
from fullband.errors import ConfigError
from fullband.eval import format_eval_table
from fullband.loading import preset_path
from fullband.storage import ModelDir
from fullband.train import train

SFT_DEFAULTS: dict[str, dict[str, Any]] = {
    "data": {"format": "chat"},
    "train": {"schedule": "fixed:3", "init_fusion": "auto"},
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:

    p = subparsers.add_parser(
        "sft", help="instruction-tune a model on chat records (train --init-from with 3 passes, chat format)")
    p.add_argument("model", help="run directory, checkpoint or model directory to fine-tune")
    add_config_options(p)
    p.add_argument("--out-dir", required=True, metavar="DIR", help="run directory: config, checkpoints, metrics")
    p.add_argument("--data-dir", metavar="DIR", help="prepared dataset directory (default OUT_DIR/data)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT_DIR")
    p.set_defaults(func=run)
    return p


def sft_raw_config(model_dir: ModelDir, config_file: Path | None = None) -> dict[str, dict[str, Any]]:
    """The nested config of an SFT run of ``model_dir`` before command-line overrides (see the module doc)."""
    raw: dict[str, dict[str, Any]] = {}
    run_config = model_dir.run.config_file if model_dir.run is not None else None
    if run_config is not None and run_config.is_file():
        # The run's data section describes its pretraining corpus, not the chat data.
        raw = {k: dict(v or {}) for k, v in read_sections(run_config).items() if k in ("model", "train", "eval")}
    for section, values in SFT_DEFAULTS.items():
        raw.setdefault(section, {}).update(values)
    tokenizer_dir = model_dir.tokenizer
    if tokenizer_dir is None or tokenizer_dir == model_dir.path:  # an export's tokenizer.json is not a fullband one
        raise ConfigError(f"{model_dir.path} has no tokenizer saved with it; SFT needs the model's tokenizer "
                          "(a run, checkpoint or model directory written by fullband or `fullband convert`)")
    raw["data"]["tokenizer"] = str(tokenizer_dir)
    if config_file is not None:
        for section, values in read_sections(config_file).items():
            if not isinstance(values, dict):
                raise ConfigError(f"{config_file}: section {section!r} must be a mapping of field: value")
            raw.setdefault(section, {}).update(values)
    return raw


def run(args: argparse.Namespace) -> None:

    model_dir = ModelDir.open(args.model, hashes=True)  # weights to train on: hashed
    overrides = {k: v for k, v in vars(args).items() if "." in k}
    overrides.update(getattr(args, "unknown_overrides", {}))
    saved = Path(args.out_dir) / "config.yaml"
    if args.resume and args.config is None and saved.is_file():
        config = build_config(read_sections(saved), overrides, source=str(saved))
    else:
        raw = sft_raw_config(model_dir, preset_path(args.config) if args.config else None)
        if "source" not in raw["data"] and "data.source" not in overrides:
            raise ConfigError("give the chat data with --data.source FILE.jsonl (records with `messages`, or "
                              "`prompt` and `answer` with --data.format prompt_answer)")
        config = build_config(raw, overrides, source="fullband sft")
    result = train(config, args.out_dir, data_dir=args.data_dir, resume=args.resume, init_from=model_dir)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(f"steps {result.steps}, tokens {result.tokens:,}, token-equivalent compute {result.compute_tokens:,}"
          f" (tokens × passes)")
    if result.final_eval is not None:
        print(f"validation loss on the trained tokens ({result.final_eval.tokens:,} targets) per decode mode:")
        print(format_eval_table({"model": result.final_eval}))

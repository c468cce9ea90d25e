"""``fullband rl MODEL --out-dir DIR --rl.data FILE.jsonl``: GRPO with verifiable rewards (``fullband.rl``).

Options are the fields of ``fullband.rl.trainer.RLConfig``, from ``--config FILE`` (YAML, a section ``rl:``, or the
name of a bundled recipe in fullband/rl/presets/) and ``--rl.field VALUE``, as ``fullband train`` takes its sections.
See docs/rl.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fullband.cli_options import add_field_options
from fullband.config import read_sections
from fullband.errors import ConfigError
from fullband.rl.trainer import RLConfig, build_rl_config, resumed_config, run_rl

PRESET_DIR = Path(__file__).parent / "presets"


def config_path(name: str) -> Path:
    """A YAML path as given, or the bundled recipe of that name (``state-tracking``)."""
    path = Path(name)
    if not path.exists() and (PRESET_DIR / f"{name}.yaml").is_file():
        return PRESET_DIR / f"{name}.yaml"
    return path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "rl", help="GRPO on prompt -> verifiable-answer records, rollouts scored in the mode that sampled them")
    p.add_argument("model", nargs="?", help="run directory, checkpoint or model directory to start from "
                   "(or rl.model; not needed with --resume)")
    p.add_argument("--config", metavar="FILE", help="YAML file with a section rl: {field: value}, or a bundled "
                   f"recipe: {', '.join(sorted(f.stem for f in PRESET_DIR.glob('*.yaml')))}")
    p.add_argument("--out-dir", required=True, metavar="DIR", help="run directory: config, checkpoints, metrics")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT_DIR")
    add_field_options(p.add_argument_group("rl options"), "rl", [RLConfig])
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> None:
    overrides = {k: v for k, v in vars(args).items() if k.startswith("rl.")}
    if args.model:
        overrides["rl.model"] = args.model
    out_dir = Path(args.out_dir)
    if args.resume and (out_dir / "config.yaml").is_file():
        if args.config:
            raise ConfigError("--resume continues with the config saved in OUT_DIR; give no --config (change only "
                              "logging and pacing options with --rl.field)")
        cfg = resumed_config(out_dir, overrides)
    else:
        raw = read_sections(config_path(args.config)) if args.config else {}
        cfg = build_rl_config(raw, overrides, source=args.config or "fullband rl")
    result = run_rl(cfg, out_dir, resume=args.resume)
    line = f"steps {result.steps}; checkpoints, metrics.jsonl and eval.jsonl in {result.out_dir}"
    if result.final_accuracy is not None:
        line += f"; held-out greedy accuracy {result.final_accuracy:.3f}"
    print(line)

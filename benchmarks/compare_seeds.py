"""Baseline vs FBT over several seeds, same token budget: validation loss per decode mode, mean and
spread. Prints a markdown table and writes JSON.

    python benchmarks/compare_seeds.py --seeds 0 1 2 --out benchmarks/results/compare_seeds.json
    python benchmarks/compare_seeds.py --set model.embed_norm=true --work-dir runs/cs_embed_norm \
        --out benchmarks/results/compare_seeds_embed_norm.json

Each (schedule, seed) is one `fullband train` run with the given preset (default: the demo's `cpu`);
``--set section.field=VALUE`` (repeatable) changes a config field of both models, e.g. a recipe option.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from fullband.config import load_config
from fullband.loading import PRESET_DIR
from fullband.train import train

SCHEDULES = {"baseline": "standard", "fbt": "paper"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--work-dir", default="runs/compare_seeds")
    parser.add_argument("--out", default="benchmarks/results/compare_seeds.json")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="config override for both models (repeatable)")
    args = parser.parse_args()
    extra = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            parser.error(f"--set expects SECTION.FIELD=VALUE, got {item!r}")
        extra[key] = value

    work = Path(args.work_dir)
    losses: dict[str, dict[str, list[float]]] = {name: {} for name in SCHEDULES}
    runs = []
    for seed in args.seeds:
        for name, schedule in SCHEDULES.items():
            overrides = {
                "train.schedule": schedule,
                "train.seed": str(seed),
                "train.progress": "false",
                "train.log_every": "100000",
                **extra,
            }
            config = load_config(PRESET_DIR / f"{args.preset}.yaml", overrides)
            started = time.perf_counter()
            result = train(config, work / f"{name}-seed{seed}", data_dir=work / "data")
            runs.append(
                {
                    "model": name,
                    "seed": seed,
                    "loss": result.final_eval.loss,
                    "compute_tokens": result.compute_tokens,
                    "seconds": round(time.perf_counter() - started, 1),
                }
            )
            for mode, value in result.final_eval.loss.items():
                losses[name].setdefault(mode, []).append(value)

    modes = list(losses["fbt"])
    lines = [f"| model ({len(args.seeds)} seeds) | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for name, per_mode in losses.items():
        cells = []
        for mode in modes:
            values = per_mode[mode]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.4f} ± {spread:.4f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(f"preset {args.preset}, seeds {args.seeds}; mean ± sample std of validation loss (nats/token)\n")
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"preset": args.preset, "overrides": extra, "seeds": args.seeds, "runs": runs, "table": table},
                   indent=2)
    )


if __name__ == "__main__":
    main()

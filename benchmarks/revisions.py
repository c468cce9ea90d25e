"""Before/after a change: one of this folder's benchmarks run on another fullband source tree (``--before-src``, e.g.
an earlier revision's ``src``) and on this checkout's, alternately, in fresh processes, and the paired ratio
after / before of each of its headline figures per round: median and min–max over the rounds.

Each round runs the benchmark once per tree, in an order that alternates from round to round, so machine noise
(other processes on a shared CPU) hits both alike; a ratio is taken within a round.

Usage:
    mkdir /tmp/before && git archive REV src | tar -x -C /tmp/before
    python benchmarks/revisions.py decode --before-src /tmp/before/src --rounds 3 -- --models d128-L2 --repeats 3
    python benchmarks/revisions.py train_step --before-src /tmp/before/src -- --sizes tiny --variants K1 K3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from common import machine_info, write_record

HERE = Path(__file__).resolve().parent
AFTER_SRC = HERE.parent / "src"


def decode_figures(result: dict) -> dict[str, float]:
    """Per-token decode time (median over the benchmark's repetitions) of every model, batch and mode."""
    return {f"{model} b{batch} {mode} per-token s": cell["per_token_s"]["median"]
            for model, r in result["results"].items() for batch, b in r["batches"].items()
            for mode, cell in b["modes"].items()}


def train_step_figures(result: dict) -> dict[str, float]:
    """Step time (median) of every size and variant."""
    return {f"{size} {variant} step s": cell["step_s"]["median"]
            for size, r in result["results"].items() for variant, cell in r["variants"].items()}


FIGURES: dict[str, Callable[[dict], dict[str, float]]] = {"decode": decode_figures, "train_step": train_step_figures}


def run_once(benchmark: str, src: Path, args: list[str], out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE)])}
    subprocess.run([sys.executable, str(HERE / f"{benchmark}.py"), *args, "--out", str(out)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return FIGURES[benchmark](json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("benchmark", choices=sorted(FIGURES))
    p.add_argument("--before-src", type=Path, required=True, help="the other source tree (a checkout's src)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/revisions_BENCHMARK.json)")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, rest = p.parse_args(argv[:cut]), argv[cut + 1:]  # after "--": the benchmark's own arguments
    if not (args.before_src / "fullband" / "__init__.py").is_file():
        p.error(f"--before-src {args.before_src} holds no fullband package (give the tree's src directory)")
    trees = {"before": args.before_src.resolve(), "after": AFTER_SRC}
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            rounds.append({name: run_once(args.benchmark, trees[name], rest, Path(tmp) / f"{name}{i}.json")
                           for name in order})
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    table = {}
    print(f"| {args.benchmark} figure | before (median) | after (median) | after / before: median (min–max) |")
    print("|---|---|---|---|")
    for key in rounds[0]["before"]:
        before = [r["before"][key] for r in rounds]
        after = [r["after"][key] for r in rounds]
        ratios = [a / b for a, b in zip(after, before)]
        table[key] = {"before": before, "after": after, "ratio": ratios}
        print(f"| {key} | {statistics.median(before):.6f} | {statistics.median(after):.6f} | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) |")
    out = Path(args.out or HERE / "results" / f"revisions_{args.benchmark}.json")
    write_record(out, {"benchmark": f"revisions {args.benchmark}", "command": " ".join(sys.argv),
                       "machine": machine_info(int(os.environ.get("OMP_NUM_THREADS", "0") or 0), "cpu"),
                       "before_src": str(args.before_src), "rounds": args.rounds, "figures": table})


if __name__ == "__main__":
    main()

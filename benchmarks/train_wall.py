"""The exact recurrence's training time against one pass, through `fullband train` itself: the `state-tracking`
preset on S5 records of 1..16 moves for ``--steps`` steps (default 200), as it ships (``exact``: the recurrence token
by token, its steps compiled 8 positions a call) and as one pass of the same model and batches (``one pass``:
``--train.schedule standard``, a transformer step). Validation is off in both (``--train.eval_every 0
--train.keep_best ''``), so what differs is the training step alone.

Each run is a fresh `fullband train` process; the variants alternate, in an order swapped every round, after one
untimed run of each (``--warm``), which leaves the recurrence's compiled chunk in inductor's on-disk cache as a
user's earlier runs would (a first run on a machine compiles it cold: its time is printed). Per run:

- ``step ms``: the mean of the per-step times (differences of metrics.jsonl's ``elapsed_s``, rounded there to the
  millisecond) after the first ``--skip`` steps;
- ``first step s``: the first step, which holds the compile of the recurrence's chunk (on a warm cache: dynamo's
  trace and the compiled graphs' load);
- ``train s``: ``elapsed_s`` at the last step (every step, the compile included);
- ``process s``: the process's wall time (imports, data, compile, the final evaluation, the checkpoint).

Ratios exact / one pass are paired within a round: median (min–max). The losses of a variant must be the same in
every round (same seed and records): the last column says whether they are, bit for bit (the record keeps each
run's ``losses_sha256``, to compare runs at two commits). With ``--uncompiled`` the
preset's steps also run uncompiled (``--train.compile_recurrence 0``), and the largest difference between its
losses and the compiled run's is printed: the same arithmetic, rounded differently.

Usage:
    python benchmarks/train_wall.py                   # 200 steps, 3 rounds, 1 thread a run
    python benchmarks/train_wall.py --steps 50 --rounds 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine_info, write_record

from fullband.data.synthetic import export_jsonl, state_tracking_task

VARIANTS = {"exact": [], "one pass": ["--train.schedule", "standard"],
            "exact, uncompiled": ["--train.compile_recurrence", "0"]}


def run(variant: str, records: Path, out_dir: Path, steps: int, threads: int) -> dict:
    """One `fullband train` run of a variant; its per-step times and losses from metrics.jsonl."""
    command = [sys.executable, "-m", "fullband", "train", "--config", "state-tracking", "--data.source", str(records),
               "--out-dir", str(out_dir), "--train.tokens", str(steps * 32 * 32), "--train.progress", "false",
               "--train.eval_every", "0", "--train.keep_best", "", "--train.seed", "0", *VARIANTS[variant]]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"fullband train ({variant}) failed:\n{done.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = [m["elapsed_s"] for m in metrics]
    return {"step_s": [b - a for a, b in zip(elapsed, elapsed[1:])], "train_s": elapsed[-1], "process_s": wall,
            "losses": [m["loss"] for m in metrics]}


def digest(losses: list[float]) -> str:
    """The sha256 of a run's losses, every step, as logged: equal digests, the same losses bit for bit (a run at
    another commit compares with this one's by its digest)."""
    return hashlib.sha256(json.dumps(losses).encode()).hexdigest()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps a run (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each variant, alternating (default 3)")
    p.add_argument("--skip", type=int, default=10, help="first steps left out of the step mean (default 10)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (default 1)")
    p.add_argument("--warm", type=int, default=1, help="untimed runs of each variant first (default 1)")
    p.add_argument("--uncompiled", action="store_true", help="also run the preset's steps uncompiled")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/train_wall.json"))
    args = p.parse_args(argv)
    if args.steps <= args.skip + 1:
        p.error(f"--steps {args.steps} leaves no step after --skip {args.skip}")
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    machine = machine_info(args.threads, "cpu")
    print(f"# the exact recurrence's training time against one pass, `fullband train`\n\ncommand: `{command}`\n\n"
          f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores visible, torch {machine['torch']}, "
          f"{args.threads} thread(s) a run\n")
    names = list(VARIANTS) if args.uncompiled else ["exact", "one pass"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        records = export_jsonl(state_tracking_task("s5", 1, 16), Path(tmp) / "s5.jsonl", 20_000, seed=0)
        for round_ in range(args.warm):
            for name in names:
                warm = run(name, records, Path(tmp) / f"warm_{names.index(name)}_{round_}", args.steps,
                           args.threads)
                print(f"untimed run: {name}: train {warm['train_s']:.1f} s, process {warm['process_s']:.1f} s",
                      flush=True)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[: round_ % len(names)]:
                runs[name].append(run(name, records, Path(tmp) / f"run_{names.index(name)}_{round_}", args.steps,
                                      args.threads))
                step_ms = 1000 * statistics.mean(runs[name][-1]["step_s"][args.skip:])
                print(f"round {round_}: {name}: step {step_ms:.1f} ms, train {runs[name][-1]['train_s']:.1f} s, "
                      f"process {runs[name][-1]['process_s']:.1f} s", flush=True)
    measures = {"step ms": lambda r: 1000 * statistics.mean(r["step_s"][args.skip:]),
                "first step s": lambda r: r["train_s"] - sum(r["step_s"]),
                "train s": lambda r: r["train_s"], "process s": lambda r: r["process_s"]}
    summary = {}
    print("\n| variant | " + " | ".join(f"{m}, median (min–max)" for m in measures) + " | losses equal across rounds |")
    print("|---|" + "---|" * (len(measures) + 1))
    for name in names:
        row = {m: [f(r) for r in runs[name]] for m, f in measures.items()}
        same = all(r["losses"] == runs[name][0]["losses"] for r in runs[name])
        summary[name] = {**row, "losses_equal": same}
        print(f"| {name} | " + " | ".join(f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})"
                                          for v in row.values()) + f" | {'yes' if same else 'no'} |")
    ratios = {m: [a / b for a, b in zip(summary["exact"][m], summary["one pass"][m])] for m in measures}
    print("| exact / one pass, paired | " + " | ".join(
        f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})" for v in ratios.values()) + " | |")
    if args.uncompiled:
        compiled, uncompiled = runs["exact"][0]["losses"], runs["exact, uncompiled"][0]["losses"]
        gaps = [abs(a - b) for a, b in zip(compiled, uncompiled)]
        first = next((step for step, gap in enumerate(gaps, 1) if gap > 1e-4), None)
        summary["loss_gap_compiled_uncompiled"] = {"first_20_max": max(gaps[:20]), "first_step_above_1e-4": first}
        print(f"\nlosses, compiled against uncompiled: largest difference over the first 20 steps "
              f"{max(gaps[:20]):.2e}; first step more than 1e-4 apart: {first or 'none'}")
    record = {"benchmark": "train_wall", "command": command, "machine": machine, "steps": args.steps,
              "skip": args.skip, "rounds": args.rounds, "warm": args.warm, "summary": summary, "ratios": ratios,
              "runs": {name: [{k: v for k, v in r.items() if k != "losses"} | {"first_losses": r["losses"][:20],
                                                                               "losses_sha256": digest(r["losses"])}
                              for r in rs] for name, rs in runs.items()}}
    return write_record(args.out, record)


if __name__ == "__main__":
    main()

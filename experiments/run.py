"""The one runner of the experiments: a named sweep of experiments/sweeps.py, job by job, through the product's
own front doors only (`fullband train` to train, `fullband bench` to grade state tracking), each job's result
merged into the sweep's results file as soon as it is graded.

    python -m experiments.run --list                      # the sweeps and how many of their jobs are done
    python -m experiments.run len16 --lanes 2             # every job not in results/len16.json, two at a time
    python -m experiments.run len16 --only s5:2 cycle:0   # some jobs
    python -m experiments.run preset_fresh --dry-run      # the commands it would run, nothing run
    python -m experiments.run preset_fresh --train-only   # train every job not done, grade none (rerun to grade)

A job already in the results file is skipped; a job whose run directory exists continues from its last
checkpoint (`fullband train --resume`; a finished run's resume does nothing) and `fullband bench` resumes its
own --out, so a killed runner is rerun with the same command. Runs live in --runs-dir (default runs/, not
committed): runs/SWEEP/JOB/ (the run, its bench/ and its log JOB.log beside it). Each lane is one process at a
time with OMP_NUM_THREADS=1 unless set, so --lanes N uses N cores.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from experiments.state_tracking.table import read_run, sort_key
from experiments.state_tracking.tasks import export_records, export_rows
from experiments.sweeps import ARMS, ROOT, SWEEPS, LMSweep, StateTrackingSweep
from fullband.config import load_config
from fullband.loading import PRESET_DIR

Sweep = StateTrackingSweep | LMSweep


def flags(overrides: dict[str, str]) -> list[str]:
    return [item for key, value in overrides.items() for item in (f"--{key}", value)]


def job_dir(sweep: Sweep, job: tuple[str, int], runs_dir: Path) -> Path:
    """runs/SWEEP/VARIANT_sSEED, with a task variant's option characters ("cycle:size=3") made path-safe."""
    variant, seed = job
    safe = re.sub(r"[^\w.@-]", "_", variant)
    return runs_dir / sweep.name / f"{safe}_s{seed}"


def parse_arm(arm: str) -> tuple[str, float]:
    name, _, mult = arm.partition("@")
    if name not in ARMS:
        raise SystemExit(f"unknown LM arm {name!r}; choose from {', '.join(ARMS)} (NAME@X for X × the tokens)")
    return name, float(mult) if mult else 1.0


class Runner:
    """Runs the jobs of one sweep: skip what the results file holds, train (resuming), grade, merge."""

    def __init__(self, sweep: Sweep, runs_dir: Path, results: Path | None = None, python: str = sys.executable,
                 dry_run: bool = False, train_only: bool = False):
        self.sweep, self.runs_dir, self.python, self.dry_run = sweep, runs_dir, python, dry_run
        self.train_only = train_only  # state tracking: train, grade nothing, merge nothing (an LM run is its grade)
        self.results = results or sweep.results
        self._merge_lock = threading.Lock()  # lanes are threads of this process; flock guards other processes

    # -- the results file -------------------------------------------------------------------------------------
    def records(self) -> list[dict]:
        if not self.results.is_file():
            return []
        text = self.results.read_text()
        if isinstance(self.sweep, LMSweep):
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return json.loads(text)

    def key(self, record: dict) -> tuple[str, int]:
        return (record["arm"], record["seed"]) if isinstance(self.sweep, LMSweep) else (record["task"], record["seed"])

    def done(self) -> set[tuple[str, int]]:
        return {self.key(r) for r in self.records()}

    def merge(self, record: dict) -> None:
        """Put `record` in the results file in place of any record of the same job, written whole (a reader, or a
        kill, never sees half a file), under a lock shared with every other runner of the same file (kept in the
        runs directory, which is not committed, beside the runs that write it)."""
        self.results.parent.mkdir(parents=True, exist_ok=True)
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        lock = self.runs_dir / f".{self.results.name}.lock"
        with self._merge_lock, lock.open("w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            records = [r for r in self.records() if self.key(r) != self.key(record)] + [record]
            partial = self.results.with_name(self.results.name + ".partial")
            if isinstance(self.sweep, LMSweep):
                partial.write_text("".join(json.dumps(r) + "\n" for r in records))
            else:
                partial.write_text(json.dumps(sorted(records, key=sort_key)) + "\n")
            partial.replace(self.results)

    # -- running ---------------------------------------------------------------------------------------------
    def call(self, argv: list[str], log: Path) -> None:
        if self.dry_run:
            print(" ".join(argv))
            return
        env = {"OMP_NUM_THREADS": "1", **os.environ}
        with log.open("a") as out:
            out.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n")
            out.flush()
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {' '.join(argv[:4])} ... (the log: {log})")

    def train_command(self, run: Path, seed: int, preset: str, overrides: dict[str, str],
                      extra: list[str]) -> list[str]:
        resume = ["--resume"] if (run / "config.yaml").is_file() else []
        return [self.python, "-m", "fullband", "train", "--config", preset, "--out-dir", str(run),
                "--train.seed", str(seed), "--train.progress", "false", *extra, *flags(overrides), *resume]

    def run_state_tracking(self, task: str, seed: int) -> dict | None:
        sweep = self.sweep
        run = job_dir(sweep, (task, seed), self.runs_dir)
        data_dir = run.with_name(run.name + ".data")
        log = run.with_name(run.name + ".log")
        lengths = [m * sweep.moves for m in sweep.lengths]
        vals: dict[str, str] = {}
        if self.dry_run:
            tests = {str(n): str(data_dir / f"test{n}.jsonl") for n in lengths}
            train_file = str(data_dir / "train.jsonl")
        else:
            run.parent.mkdir(parents=True, exist_ok=True)
            data = export_records(task, seed, sweep.moves, sweep.records, lengths, sweep.test_rows, sweep.test_seed,
                                  data_dir)
            tests, train_file = data["tests"], data["train"]
            if sweep.val_seed is not None:
                vals = export_rows(task, lengths, sweep.test_rows, sweep.val_seed, data_dir, prefix="val")
        # a checkpoint every 500 steps (the sweep's overrides may change it): what a killed run resumes from; with
        # `along`, one every `along` steps, all kept, each graded below
        checkpoints = (["--train.ckpt_every", str(sweep.along), "--train.keep_checkpoints", "1000"] if sweep.along
                       else ["--train.ckpt_every", "500"])
        self.call(self.train_command(run, seed, sweep.preset, sweep.overrides,
                                     ["--data.source", train_file, "--train.log_every", "50", *checkpoints]), log)
        if self.train_only:
            return None
        along = self.grade_along(run, vals, log) if sweep.along else None
        model = run / "best" if (run / "best").is_dir() or self.dry_run else run
        tasks = [item for files in (tests, vals) for n in lengths if str(n) in files
                 for item in ("--task", f"jsonl:{files[str(n)]}")]
        self.call([self.python, "-m", "fullband", "bench", str(model), *tasks, "--modes", sweep.modes,
                   "--fused-max-passes", "1024", "--fused-tol", "0", "--out", str(run / "bench"), "--no-progress",
                   "--no-plots"], log)
        if self.dry_run:
            return None
        record = read_run(run, task, seed, tests, sweep.modes.split(","), vals)
        record["data"] = {k: data[k] for k in ("records", "dropped_test_prompts", "test_rows", "test_seed")}
        if along is not None:
            record["along"] = along
        return record

    def grade_along(self, run: Path, vals: dict[str, str], log: Path) -> list[dict] | None:
        """Every kept checkpoint of `run` graded by `fullband bench` (fused:exact) on the validation rows at the
        sweep's `along_lengths`: [{"step": N, "val": {moves: accuracy}}] in step order."""
        sweep = self.sweep
        if sweep.val_seed is None:
            raise ValueError(f"sweep {sweep.name}: along needs val_seed (it grades validation rows)")
        lengths = [str(m * sweep.moves) for m in sweep.along_lengths]
        if not set(sweep.along_lengths) <= set(sweep.lengths):
            raise ValueError(f"sweep {sweep.name}: along_lengths {sweep.along_lengths} must be among its lengths "
                             f"{sweep.lengths} (the validation rows graded along are the sweep's own)")
        tasks = [item for n in lengths for item in ("--task", f"jsonl:{vals[n]}")] if vals else []
        checkpoints = sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        # one process grades them all (experiments/bench_each.py): a bench per checkpoint would start Python each time
        commands = [["bench", str(checkpoint / "model"), *tasks, "--modes", "fused:exact", "--fused-max-passes",
                     "1024", "--fused-tol", "0", "--out", str(run / "along" / checkpoint.name), "--no-progress",
                     "--no-plots"] for checkpoint in checkpoints
                    if not (run / "along" / checkpoint.name / "results.json").is_file()]
        if commands:
            self.call([self.python, "-m", "experiments.bench_each", *map(json.dumps, commands)], log)
        if self.dry_run:
            return None
        curve = []
        for checkpoint in checkpoints:
            results = json.loads((run / "along" / checkpoint.name / "results.json").read_text())["results"]
            curve.append({"step": int(checkpoint.name.split("_")[1]),
                          "val": {n: results[f"jsonl:{vals[n]}"]["fused:exact"]["0.0"]["accuracy"] for n in lengths}})
        return curve

    def run_lm(self, arm: str, seed: int) -> dict | None:
        sweep = self.sweep
        name, mult = parse_arm(arm)
        run = job_dir(sweep, (arm, seed), self.runs_dir)
        preset_tokens = load_config(PRESET_DIR / f"{sweep.preset}.yaml").train.tokens
        tokens = int(sweep.overrides.get("train.tokens") or preset_tokens)
        overrides = {**ARMS[name], **sweep.overrides, "train.tokens": str(round(tokens * mult))}
        started = time.perf_counter()
        if not self.dry_run:
            run.parent.mkdir(parents=True, exist_ok=True)
        # one prepared corpus for every arm and seed of the sweep (the data do not depend on either)
        self.call(self.train_command(run, seed, sweep.preset, overrides,
                                     ["--data-dir", str(run.parent / "data"), "--train.log_every", "100000"]),
                  run.with_name(run.name + ".log"))
        if self.dry_run:
            return None
        evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines() if line.strip()]
        metrics = {m["step"]: m for m in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                                          if line.strip())}
        last = max(metrics)
        record = {"arm": arm, "name": name, "mult": mult, "seed": seed, "overrides": ARMS[name],
                  "tokens": metrics[last]["tokens"], "compute_tokens": metrics[last]["compute_tokens"],
                  "loss": next(e["loss"] for e in evals if e["step"] == last),
                  "seconds": round(time.perf_counter() - started, 1), "run_dir": str(run), "sets": sweep.overrides}
        if "train.eval_every" in sweep.overrides:
            record["curve"] = [{"step": e["step"], "tokens": metrics[e["step"]]["tokens"],
                                "compute_tokens": metrics[e["step"]]["compute_tokens"], "loss": e["loss"]}
                               for e in evals]
        return record

    def run_job(self, job: tuple[str, int]) -> str | None:
        """Train, grade and merge one job; the error text if it failed (the other lanes go on)."""
        variant, seed = job
        print(f"== {self.sweep.name} {variant} seed {seed} ({time.strftime('%H:%M:%S')})", file=sys.stderr,
              flush=True)
        try:
            if isinstance(self.sweep, LMSweep):
                record = self.run_lm(variant, seed)
            else:
                record = self.run_state_tracking(variant, seed)
        except (RuntimeError, OSError, KeyError, ValueError) as err:
            return f"{variant} seed {seed}: {err}"
        if record is not None:
            self.merge(record)
            print(f"   {variant} seed {seed}: merged into {self.results}", file=sys.stderr, flush=True)
        return None

    def run(self, jobs: list[tuple[str, int]], lanes: int) -> list[tuple[str, int]]:
        """Every job of `jobs` not yet in the results file, `lanes` at a time; returns the jobs it ran. Exits
        non-zero, naming each failed job and its log, if any failed."""
        held = self.done()
        todo = [job for job in jobs if job not in held]
        for job in jobs:
            if job in held:
                print(f"   {self.sweep.name} {job[0]} seed {job[1]}: in {self.results}, skipped", file=sys.stderr)
        with ThreadPoolExecutor(max_workers=max(1, lanes)) as pool:
            failures = [f for f in pool.map(self.run_job, todo) if f]
        if failures:
            raise SystemExit("failed:\n  " + "\n  ".join(failures))
        return todo


def parse_jobs(sweep: Sweep, only: list[str]) -> list[tuple[str, int]]:
    jobs = sweep.jobs()
    if not only:
        return jobs
    chosen = []
    for item in only:
        variant, sep, seed = item.rpartition(":")
        if not sep or not seed.isdigit() or (variant, int(seed)) not in jobs:
            raise SystemExit(f"--only {item!r}: not a job of {sweep.name} (VARIANT:SEED, one of "
                             f"{' '.join(f'{v}:{s}' for v, s in jobs)})")
        chosen.append((variant, int(seed)))
    return chosen


def main(argv: list[str] | None = None) -> list[tuple[str, int]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", nargs="?", help="a sweep of experiments/sweeps.py")
    p.add_argument("--list", action="store_true", help="list the sweeps and how many of their jobs are done")
    p.add_argument("--lanes", type=int, default=1, help="jobs at a time (one core each; default 1)")
    p.add_argument("--only", nargs="+", default=[], metavar="VARIANT:SEED", help="only these jobs of the sweep")
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs", help="where the runs go (default runs/)")
    p.add_argument("--dry-run", action="store_true", help="print the commands of the jobs not done; run nothing")
    p.add_argument("--train-only", action="store_true",
                   help="state tracking: train the jobs not done, grade and merge none (rerun without it to grade)")
    args = p.parse_args(argv)
    if args.list or not args.sweep:
        for sweep in SWEEPS.values():
            done = len(set(sweep.jobs()) & Runner(sweep, args.runs_dir).done())
            print(f"{sweep.name:18} {done:3}/{len(sweep.jobs()):<3} {sweep.results.relative_to(ROOT)}: {sweep.doc}")
        return []
    if args.sweep not in SWEEPS:
        p.error(f"unknown sweep {args.sweep!r}; choose from {', '.join(SWEEPS)}")
    if args.lanes < 1:
        p.error("--lanes must be at least 1")
    sweep = SWEEPS[args.sweep]
    runner = Runner(sweep, args.runs_dir, dry_run=args.dry_run, train_only=args.train_only)
    return runner.run(parse_jobs(sweep, args.only), args.lanes)


if __name__ == "__main__":
    main()

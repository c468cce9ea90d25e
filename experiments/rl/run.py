"""Does ``fullband rl`` lift an FBT's held-out accuracy in every seed, without collapse, with answers that end?

Tasks (``fullband.data.synthetic``, final answer only, one digit, chance 0.2): ``summod``, sum mod 5 of 1..8 digits
(``summod 3024332 :`` -> `` 2``), the task the recipe is chosen on; ``cycle``, the position after 1..8 moves on a
cycle of 5 (``cycle ++-= :`` -> `` 1``), the second task, fixed before any of its results were seen. Per task: 8,000
training records (seed 0); 200 test records (seed 1000) and 200 validation records (seed 2000) whose prompts are not
training prompts, and no validation prompt is a test prompt.

Per task and seed, one job at a time (``OMP_NUM_THREADS=1``):

1. SFT: ``fullband train --config state-tracking`` on the training records, stopped after ``SFT_STEPS`` steps of the
   preset stretched to 1,600 steps (the constant learning-rate phase, the length curriculum still at short records),
   where the FBT has learnt the format but not the task.
2. "rl": ``fullband rl`` from that checkpoint with the recipe (``RECIPE``), in the stored decode mode (fused:exact):
   greedy test accuracy before the first step and every 25 steps (eval.jsonl), the validation accuracy at the end,
   and ``fullband bench`` on the final model at its default budget for the test records.
3. "more_sft", the control: the SFT run continued for as long as the RL run trained (its steps' wall time, start-up
   and evaluation left out, divided by the SFT's own seconds per step), graded by the same function.

The recipe is chosen among ``CANDIDATES`` on the validation records of summod with seeds 100 and 101 (none of the
seeds the results report), the test records unseen: arms "cand_NAME"; ``select_recipe`` states the rule.

Usage (from the repository root):
    python -m experiments.rl.run --runs runs/rl_exp --task summod                   # every job not yet in results/
    python -m experiments.rl.run --runs runs/rl_exp --task summod --seeds 100,101 \
        --arms cand_cosine_lr1e-3,cand_cosine_lr2e-3,cand_constant_lr1e-3                # the selection first
    python -m experiments.rl.run --table                                             # the tables from results/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from experiments.stats import fmt
from fullband.data.synthetic import state_tracking_task, synthetic_examples
from fullband.decoding import DecodeSettings
from fullband.loading import load_model
from fullband.rl.rewards import ExactMatchReward
from fullband.rl.trainer import greedy_accuracy, read_records

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SEEDS = tuple(range(10))
SELECTION_SEEDS = (100, 101)
TASKS = ("summod", "cycle")
SFT_STEPS = 150
SFT_TOKENS = 1_638_400  # the preset's schedule over 1,600 steps of 32 x 32 tokens; stopped at SFT_STEPS
TRAIN_RECORDS, HELD_OUT_RECORDS, TEST_SEED, VALIDATION_SEED = 8000, 200, 1000, 2000
MAX_NEW_TOKENS = 16  # fullband bench's default for these records: room for " 2", its newline and more
GOAL = 0.30  # the lift each seed should reach
# What every RL arm shares: 32 prompts x 8 rollouts a step, held-out accuracy every 25 steps.
RL_COMMON = ["--rl.prompts_per_step", "32", "--rl.group_size", "8", "--rl.max_new_tokens", str(MAX_NEW_TOKENS),
             "--rl.eval_every", "25", "--rl.progress", "false"]
# The candidates compared on validation prompts (select_recipe picks one): the new recipe at two peak rates, and
# the earlier experiment's constant rate 1e-3 without dynamic sampling (with the answers' end now graded).
SCHEDULED = ["--rl.steps", "200", "--rl.lr_schedule", "cosine", "--rl.warmup_steps", "10", "--rl.min_lr_ratio", "0.1",
             "--rl.dynamic_sampling", "true", "--rl.refill_rounds", "2"]
CANDIDATES = {
    "cosine_lr1e-3": [*SCHEDULED, "--rl.lr", "1e-3"],
    "cosine_lr2e-3": [*SCHEDULED, "--rl.lr", "2e-3"],
    "constant_lr1e-3": ["--rl.steps", "200", "--rl.lr", "1e-3"],
}
SELECTION_TASK = "summod"
CONTROL = "more_sft"


def fullband(*args: str, log: Path) -> float:
    """Run ``python -m fullband ARGS`` single-threaded, output appended to ``log``; return its wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"$ fullband {' '.join(args)}\n")
        out.flush()
        subprocess.run([sys.executable, "-m", "fullband", *args], check=True, env=env, stdout=out,
                       stderr=subprocess.STDOUT)
    return time.perf_counter() - start


def write_records(path: Path, examples) -> None:
    path.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in examples))


def prepare_data(runs: Path, task_name: str) -> dict[str, Path]:
    """train.jsonl, test.jsonl and validation.jsonl of a task; held-out prompts are not training prompts, and
    validation prompts are not test prompts."""
    files = {split: runs / task_name / f"{split}.jsonl" for split in ("train", "test", "validation")}
    if not files["validation"].is_file():
        task = state_tracking_task(task_name, 1, 8)
        records = synthetic_examples(task, TRAIN_RECORDS, 0)
        seen = {ex.prompt for ex in records}
        test = [ex for ex in synthetic_examples(task, 4 * HELD_OUT_RECORDS, TEST_SEED) if ex.prompt not in seen]
        seen |= {ex.prompt for ex in test[:HELD_OUT_RECORDS]}
        validation = [ex for ex in synthetic_examples(task, 8 * HELD_OUT_RECORDS, VALIDATION_SEED)
                      if ex.prompt not in seen]
        validation = list({ex.prompt: ex for ex in validation}.values())  # one record per prompt
        files["train"].parent.mkdir(parents=True, exist_ok=True)
        write_records(files["train"], records)
        write_records(files["test"], test[:HELD_OUT_RECORDS])
        write_records(files["validation"], validation[:HELD_OUT_RECORDS])
    return files


def sft_arguments(seed: int, train: Path, sft_dir: Path, steps: int) -> list[str]:
    return ["train", "--config", "state-tracking", "--data.source", str(train), "--out-dir", str(sft_dir),
            "--train.seed", str(seed), "--train.tokens", str(SFT_TOKENS), "--train.stop_after_steps", str(steps),
            "--train.compile_recurrence", "0", "--train.progress", "false", "--train.eval_every", "50"]


def checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def sft(runs: Path, task: str, seed: int, files: dict[str, Path]) -> tuple[Path, float]:
    """The seed's SFT run (made once, shared by every arm) and its seconds per step."""
    sft_dir = runs / task / f"sft_seed{seed}"
    if not checkpoint(sft_dir, SFT_STEPS).is_dir():
        shutil.rmtree(sft_dir, ignore_errors=True)
        sft_dir.mkdir(parents=True)
        fullband(*sft_arguments(seed, files["train"], sft_dir, SFT_STEPS), log=sft_dir / "log.txt")
    last = json.loads((sft_dir / "metrics.jsonl").read_text().splitlines()[SFT_STEPS - 1])
    return sft_dir, last["elapsed_s"] / SFT_STEPS


def grade(model_dir: Path, records_file: Path) -> float:
    """Greedy accuracy of a checkpoint as ``fullband rl`` grades it (an answer must end within MAX_NEW_TOKENS)."""
    torch.set_num_threads(1)
    model, tokenizer = load_model(model_dir, "cpu")
    return greedy_accuracy(model, tokenizer, read_records(records_file), ExactMatchReward(), DecodeSettings.of(model),
                           MAX_NEW_TOKENS)


def bench(model_dir: Path, test: Path, out: Path, log: Path) -> float:
    """``fullband bench`` accuracy of a model on the test records at bench's default budget (greedy)."""
    shutil.rmtree(out, ignore_errors=True)
    fullband("bench", str(model_dir), "--task", f"jsonl:{test}", "--out", str(out), "--batch-size", "64", log=log)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return sum(r["correct"] for r in rows) / len(rows)


def save_result(task: str, name: str, record: dict, files: dict[str, Path]) -> None:
    out = RESULTS / task / name
    out.mkdir(parents=True, exist_ok=True)
    for target, source in files.items():
        shutil.copy(source, out / target)
    (out / "result.json").write_text(json.dumps(record, indent=1) + "\n")


def select_recipe() -> str:
    """The candidate with the highest mean final validation accuracy over the selection seeds, ties to the one whose
    worst seed is best (every candidate must have run on every selection seed)."""
    scores = {}
    for name in CANDIDATES:
        paths = [RESULTS / SELECTION_TASK / f"cand_{name}_seed{seed}" / "result.json" for seed in SELECTION_SEEDS]
        missing = [p.parent.name for p in paths if not p.is_file()]
        if missing:
            raise SystemExit(f"no recipe chosen yet: run the candidates first ({', '.join(missing)} missing)")
        after = [json.loads(p.read_text())["after"] for p in paths]
        scores[name] = (sum(after) / len(after), min(after))
    return max(scores, key=scores.get)


def run_rl_arm(runs: Path, task: str, arm: str, seed: int, files: dict[str, Path]) -> dict:
    """The recipe ("rl": evaluated on test, then validation and bench at the end) or a candidate ("cand_NAME":
    evaluated on validation only)."""
    selecting = arm.startswith("cand_")
    recipe = arm.removeprefix("cand_") if selecting else select_recipe()
    options = CANDIDATES[recipe]
    sft_dir, _ = sft(runs, task, seed, files)
    job = runs / task / f"{arm}_seed{seed}"
    job.mkdir(parents=True, exist_ok=True)
    rl_dir, log = job / "rl", job / "log.txt"
    watched = files["validation"] if selecting else files["test"]
    fullband("rl", str(checkpoint(sft_dir, SFT_STEPS)), "--out-dir", str(rl_dir), "--resume", "--rl.data",
             str(files["train"]), "--rl.val_data", str(watched), "--rl.seed", str(seed), *RL_COMMON, *options, log=log)
    evals = [json.loads(line) for line in (rl_dir / "eval.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = [e["accuracy"] for e in evals]
    record = {"task": task, "arm": arm, "seed": seed, "decode": evals[0]["decode"], "sft_steps": SFT_STEPS,
              "rl_steps": evals[-1]["step"], "graded_on": watched.stem, "before": accuracy[0], "after": accuracy[-1],
              "best": max(accuracy), "curve": {e["step"]: e["accuracy"] for e in evals},
              "rl_train_seconds": round(sum(m["step_s"] for m in metrics), 1), "recipe": recipe, "options": options}
    if not selecting:
        final = rl_dir  # the run directory: its newest checkpoint, as a user would bench it
        record["validation_after"] = grade(checkpoint(rl_dir, evals[-1]["step"]), files["validation"])
        record["bench_after"] = bench(final, files["test"], job / "bench", log)
    save_result(task, f"{arm}_seed{seed}", record, {name: rl_dir / name for name in ("eval.jsonl", "metrics.jsonl",
                                                                                        "config.yaml")})
    return record


def run_control(runs: Path, task: str, seed: int, files: dict[str, Path]) -> dict:
    """The seed's SFT continued for the RL run's training wall time, graded before and after like the RL run."""
    rl = json.loads((RESULTS / task / f"rl_seed{seed}" / "result.json").read_text())
    source, step_seconds = sft(runs, task, seed, files)
    steps = max(1, round(rl["rl_train_seconds"] / step_seconds))
    sft_dir = runs / task / f"{CONTROL}_seed{seed}"
    end = checkpoint(sft_dir, SFT_STEPS + steps)
    if not end.is_dir():
        shutil.rmtree(sft_dir, ignore_errors=True)
        shutil.copytree(source, sft_dir)
        fullband(*sft_arguments(seed, files["train"], sft_dir, steps), "--resume", log=sft_dir / "log.txt")
    record = {"task": task, "arm": CONTROL, "seed": seed, "decode": rl["decode"], "sft_steps": SFT_STEPS,
              "more_sft_steps": steps, "sft_seconds_per_step": round(step_seconds, 4),
              "matched_rl_train_seconds": rl["rl_train_seconds"], "graded_on": "test",
              "before": grade(checkpoint(source, SFT_STEPS), files["test"]), "after": grade(end, files["test"]),
              "validation_after": grade(end, files["validation"])}
    save_result(task, f"{CONTROL}_seed{seed}", record, {"metrics.jsonl": sft_dir / "metrics.jsonl"})
    return record


def task_tables(task: str) -> str:
    rows = {}
    for path in sorted((RESULTS / task).glob("*/result.json")):
        record = json.loads(path.read_text())
        rows.setdefault(record["arm"], []).append(record)
    lines = [f"### {task}", "", "| arm | seeds | graded on | before | after | after − before (paired) | seeds "
             f"lifting ≥ {GOAL:.2f} | worst lift | largest drop from the run's best |", "|---" * 9 + "|"]
    for arm, mine in sorted(rows.items(), key=lambda kv: (kv[0] == CONTROL, kv[0])):
        mine.sort(key=lambda r: r["seed"])
        before, after = [r["before"] for r in mine], [r["after"] for r in mine]
        lift = [a - b for a, b in zip(after, before)]
        drop = max((r["best"] - r["after"] for r in mine), default=0.0) if "best" in mine[0] else None
        lines.append(f"| {arm} | {len(mine)} | {mine[0]['graded_on']} | {fmt(before)} | {fmt(after)} | "
                     f"{fmt(lift, '+.3f')} | {sum(x >= GOAL for x in lift)} of {len(mine)} | {min(lift):+.3f} | "
                     f"{'' if drop is None else f'{drop:.3f}'} |")
    rl, control = rows.get("rl", []), {r["seed"]: r for r in rows.get(CONTROL, [])}
    if rl:
        lines += ["", "| seed | before | RL: best (step) | RL: after | lift | validation | bench (default budget) | "
                  "bench − eval | more SFT (steps): after | RL − more SFT |", "|---" * 10 + "|"]
        for r in sorted(rl, key=lambda r: r["seed"]):
            best_step = max(r["curve"], key=lambda s: (r["curve"][s], -int(s)))
            c = control.get(r["seed"])
            more = f"{c['after']:.3f} ({c['more_sft_steps']})" if c else ""
            versus = f"{r['after'] - c['after']:+.3f}" if c else ""
            lines.append(f"| {r['seed']} | {r['before']:.3f} | {r['best']:.3f} ({best_step}) | {r['after']:.3f} | "
                         f"{r['after'] - r['before']:+.3f} | {r['validation_after']:.3f} | {r['bench_after']:.3f} | "
                         f"{r['bench_after'] - r['after']:+.3f} | {more} | {versus} |")
        paired = [r["after"] - control[r["seed"]]["after"] for r in rl if r["seed"] in control]
        if len(paired) > 1:
            lines += ["", f"RL − more SFT at the same training wall time, paired over {len(paired)} seeds: "
                      f"{fmt(paired, '+.3f')}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=Path("runs/rl_exp"), help="run directories (not committed)")
    p.add_argument("--table", action="store_true", help="print the tables of the results so far")
    p.add_argument("--task", choices=TASKS, default=TASKS[0])
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--arms", default=f"rl,{CONTROL}", help=f"rl, {CONTROL}, cand_NAME ({', '.join(CANDIDATES)})")
    args = p.parse_args(argv)
    if not args.table:
        files = prepare_data(args.runs, args.task)
        for seed in (int(s) for s in args.seeds.split(",")):
            for arm in args.arms.split(","):
                if (RESULTS / args.task / f"{arm}_seed{seed}" / "result.json").is_file():
                    continue
                if arm == CONTROL:
                    record = run_control(args.runs, args.task, seed, files)
                else:
                    record = run_rl_arm(args.runs, args.task, arm, seed, files)
                print(json.dumps(record), flush=True)
    print("\n\n".join(task_tables(task) for task in TASKS if (RESULTS / task).is_dir()))


if __name__ == "__main__":
    main()

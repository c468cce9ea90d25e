"""What the state-tracking experiments share: the tasks at an exact number of moves, the records the runner
trains and grades on, the batches the analyses feed a kept model, and the per-row grades they compare.

Training records hold 1..L moves; test rows hold exactly L, 2L, 4L and 8L moves, drawn from their own seed
(``test_seed + moves``), so every run of a task is graded on the same rows and differences can be paired.
The trainer holds out a share of the training records for validation (``data.val_fraction``), so a
training record whose prompt is also a test prompt would make a test row a validation row as well (at
L = 16, 98 of flip-flop's 200 test rows at 1× did): ``export_records`` drops those records.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from fullband.data import ByteTokenizer, Example
from fullband.data.synthetic import SyntheticTask, state_tracking_task, synthetic_examples
from fullband.errors import FullbandError
from fullband.loading import load_model
from fullband.model import FullBandLM

IGNORE = -100


def task_base(name: str) -> str:
    """"cycle" of a task variant "cycle:size=3" (options separated by ";")."""
    return name.partition(":")[0]


def task_with_moves(name: str, moves: int) -> SyntheticTask:
    """The state-tracking task with exactly `moves` moves; a variant is `name:key=value;key=value`
    (e.g. "cycle:size=3")."""
    base, _, options = name.partition(":")
    return state_tracking_task(base, moves, moves, options=options.replace(";", ","))


def _write_jsonl(rows: list[Example], path: Path) -> None:
    """Written whole (a temporary file, then renamed): a killed preparation leaves no half file behind."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps({"prompt": ex.prompt, "answer": ex.answer}) + "\n" for ex in rows))
    partial.replace(path)


def export_records(task: str, seed: int, moves: int, records: int, lengths: list[int], test_rows: int,
                   test_seed: int, out: Path) -> dict:
    """The training records (1..`moves` moves, seed `seed`) and the test rows at each of `lengths` (exactly that
    many moves, seed `test_seed + length`) of one run, as `fullband train` and `fullband bench` read them:
    out/train.jsonl and out/test{length}.jsonl. A training record whose prompt is a test prompt is dropped, so
    neither the trainer's validation rows (a share of train.jsonl) nor its training rows repeat a test row.
    Files already there are kept (a rerun prepares nothing); returns the manifest (out/data.json)."""
    manifest_path = out / "data.json"
    if manifest_path.is_file():
        return json.loads(manifest_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    tests = export_rows(task, lengths, test_rows, test_seed, out)
    test_prompts = {json.loads(line)["prompt"] for path in tests.values() for line in Path(path).open()}
    base, _, options = task.partition(":")
    train_task = state_tracking_task(base, 1, moves, options=options.replace(";", ","))
    # drawn one at a time from the generator synthetic_examples(train_task, records, seed) would use, and written
    # as drawn: an equal-compute baseline asks for millions of records
    rng, kept = random.Random(seed), 0
    partial = out / "train.jsonl.partial"
    with partial.open("w") as f:
        for _ in range(records):
            ex = train_task.generate(rng)
            if ex.prompt not in test_prompts:
                f.write(json.dumps({"prompt": ex.prompt, "answer": ex.answer}) + "\n")
                kept += 1
    partial.replace(out / "train.jsonl")
    manifest = {"task": task, "seed": seed, "moves": moves, "records": kept, "dropped_test_prompts": records - kept,
                "test_rows": test_rows, "test_seed": test_seed, "train": str(out / "train.jsonl"), "tests": tests}
    partial = manifest_path.with_name(manifest_path.name + ".partial")
    partial.write_text(json.dumps(manifest, indent=1) + "\n")
    partial.replace(manifest_path)  # last: its presence means every file above is whole
    return manifest


def export_rows(task: str, lengths: list[int], rows: int, seed: int, out: Path, prefix: str = "test") -> dict[str, str]:
    """`rows` rows of exactly each of `lengths` moves (seed `seed + length`) as out/PREFIX{length}.jsonl, the files
    `fullband bench` grades as `jsonl:PATH`; {length: path}."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for length in lengths:
        path = out / f"{prefix}{length}.jsonl"
        if not path.is_file():  # written whole or not at all, and the same rows every time
            _write_jsonl(synthetic_examples(task_with_moves(task, length), rows, seed + length), path)
        paths[str(length)] = str(path)
    return paths


def encode_batch(examples: list[Example], tok: ByteTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """[bos] prompt answer \\n for rows of equal length; labels on the answer and its newline only."""
    rows, labels = [], []
    for ex in examples:
        prompt, answer = tok.encode(ex.prompt), tok.encode(ex.answer + "\n")
        rows.append([tok.bos_id, *prompt, *answer])
        # label at position i is token i+1: the answer tokens are predicted from the position before each
        labels.append([IGNORE] * len(prompt) + answer + [IGNORE])
    if len({len(r) for r in rows}) != 1:
        raise ValueError("a batch must hold rows of one length (same number of moves)")
    return torch.tensor(rows), torch.tensor(labels)


def answer_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) bool: every answer token (not the closing newline) is the argmax, i.e. greedy decoding
    reproduces the answer."""
    graded = labels != IGNORE
    graded[:, -2] = False  # the position predicting the newline: the answer ends before it
    right = (logits.argmax(-1) == labels) | ~graded
    return right.all(dim=1)


def load_run_model(path: str | Path) -> FullBandLM:
    """The model of a `fullband train` run (OUT_DIR, OUT_DIR/best, a checkpoint or a model directory), in eval
    mode on the CPU; a half-written or foreign directory exits with a message that names it."""
    try:
        return load_model(path, device="cpu")[0]
    except (FileNotFoundError, ValueError, FullbandError) as err:
        raise SystemExit(f"{path}: not a model written by fullband train ({err})") from err


def write_analysis(records: list[dict], path: str | Path) -> None:
    """The records of an analysis of trained models, one JSON line each, written whole; none at all exits with
    what to run first."""
    if not records:
        raise SystemExit("no trained model found: train them first (python -m experiments.run SWEEP)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


def paired_difference(a: str, b: str) -> float:
    """The mean over the same rows of (correct_a − correct_b), from two per-row grade strings ("1" = correct)."""
    return sum(int(x) - int(y) for x, y in zip(a, b, strict=True)) / len(a)

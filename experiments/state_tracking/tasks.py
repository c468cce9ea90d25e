"""What the state-tracking experiments share: the tasks at an exact number of moves, the records the runner
trains and grades on, the batches the analyses feed a kept model, and the per-row grades they compare.

Training records hold 1..L moves; test rows hold exactly L, 2L, 4L and 8L moves, drawn from their own seed
(``test_seed + moves``), so every run of a task is graded on the same rows and differences can be paired.
The trainer holds out a share of the training records for validation (``data.val_fraction``), so a
training record whose prompt is also a test prompt would make a test row a validation row as well (at
L = 16, 98 of flip-flop's 200 test rows at 1× did): ``export_records`` drops those records.

Beside fullband's tasks (``fullband.data.synthetic``), the lab has S5 with a larger one-token move alphabet,
"s5x32" and "s5x120" (``S5Alphabet``): the same word problem with 32 or all 120 elements of S5 as moves.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from fullband.data import ByteTokenizer, Example
from fullband.data.synthetic import S5, SyntheticTask, state_tracking_task, synthetic_examples
from fullband.errors import ConfigError, FullbandError
from fullband.loading import load_model
from fullband.model import FullBandLM

IGNORE = -100


def task_base(name: str) -> str:
    """"cycle" of a task variant "cycle:size=3" (options separated by ";")."""
    return name.partition(":")[0]


# --- S5 with a larger move alphabet (issue 52, "A harder S5") -----------------------------------------------
# Each move is one byte of the byte tokenizer (UTF-8: a byte is one ASCII character, 0x00-0x7F; anything above takes
# two), and no move is a character of the prompt's own ("s5", the space, ':'). In this order: the five generators with
# their letters of the word problem "s5" (a..d swap entries (0 1)..(3 4), e shifts x -> x+1), so an s5 prompt is an
# s5x32 and an s5x120 prompt with the same answer; then the other lowercase letters, the uppercase letters, the digits
# and the punctuation (91 printable characters in all, s5x32 uses the first 32: a-r, t-z, A-G); last, for s5x120
# only, 29 control characters: 0x00-0x09, 0x0E-0x1F and 0x7F. That is every ASCII byte but the space, ':', 's', '5'
# and 0x0A-0x0D (the line breaks \n, \v, \f, \r): 128 - 8 = 120, so no set of 120 single bytes avoids control
# characters. A record stores them escaped (json.dumps writes \u0000-\u001f and \u007f: a .jsonl line is printable
# ASCII), and nothing between the .jsonl and the token ids strips, splits or normalises the inside of a prompt
# (fullband.data.sources and fullband.bench.tasks read a line with json.loads; fullband.data.chat.encode_record and
# fullband.loading.encode_prompt encode it byte for byte; \t and 0x1C-0x1F, whitespace to Python's str.split, are
# never split on), so every move is one token: tests/test_experiments_s5_alphabet.py checks it through them.
ALPHABET_CHARS = ("abcde" + "fghijklmnopqrtuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "012346789"
                  + "!\"#$%&'()*+,-./;<=>?@[\\]^_`{|}~"
                  + "".join(map(chr, [*range(0x00, 0x0A), *range(0x0E, 0x20), 0x7F])))
# The 32 moves of s5x32: the 5 generators (so the 32 generate all of S5) and 27 of the other 115 elements, drawn as
#   random.Random(ALPHABET_SEED).sample(sorted(the 115 in one-line notation), 27), then sorted,
# written out here so that the alphabet never changes (the test draws them again and compares).
ALPHABET_SEED = 32
S5X32_DRAWN = ("01234", "01342", "01432", "02143", "02413", "03124", "03241", "04132", "04231", "10432", "12043",
               "12430", "14032", "14302", "14320", "20413", "23410", "24031", "24103", "24301", "24310", "30124",
               "30214", "31240", "34120", "34201", "40132")
ALPHABET_TASKS = {"s5x32": 32, "s5x120": 120}


@functools.cache
def s5_alphabet(size: int) -> MappingProxyType[str, tuple[int, ...]]:
    """The moves of S5 with `size` moves (32 or 120): character -> permutation in one-line notation. The
    generators first (a..e, as in s5), then the other moves in lexicographic order, on ALPHABET_CHARS in order."""
    gens = [tuple(g) for g in S5().group_generators()]
    if size == 32:
        others = [tuple(int(x) for x in p) for p in S5X32_DRAWN]
    elif size == 120:
        others = sorted(p for p in itertools.permutations(range(5)) if p not in gens)
    else:
        raise ConfigError(f"S5 alphabets have 32 or 120 moves, not {size}")
    return MappingProxyType(dict(zip(ALPHABET_CHARS, gens + others, strict=False)))


@dataclass(frozen=True)
class S5Alphabet(SyntheticTask):
    """S5's word problem with `size` one-character moves (``s5_alphabet``), final answer only, e.g. s5x32
    `s5 aQx :` -> ` 20413`: the state starts at the identity and each move p maps every entry x of the state to
    p[x] (as fullband's S5), the answer is the final state in one-line notation. Drawn as S5 draws its words:
    the number of moves, then each move uniformly from the alphabet."""

    name = "s5"  # the prompt's name: none of its characters is a move
    size: int = 32
    min_steps: int = 1
    max_steps: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ConfigError(f"S5 alphabet task: need 1 <= min_steps <= max_steps, got {self.min_steps}, "
                              f"{self.max_steps}")
        s5_alphabet(self.size)  # 32 or 120

    def generate(self, rng: random.Random) -> Example:
        chars = ALPHABET_CHARS[: self.size]
        moves = "".join(chars[rng.randrange(self.size)] for _ in range(rng.randint(self.min_steps, self.max_steps)))
        return Example(f"{self.name} {moves} :", " " + self._states(moves)[-1])

    def _states(self, moves: str) -> list[str]:
        alphabet, state, states = s5_alphabet(self.size), list(range(5)), []
        for move in moves:
            p = alphabet[move]
            state = [p[x] for x in state]
            states.append("".join(map(str, state)))
        return states

    def targets(self, example: Example) -> list[tuple[int, str]]:
        """The state after each move, at the move's character."""
        start = len(self.name) + 1
        moves = example.prompt[start:].removesuffix(" :")
        return [(start + i, state) for i, state in enumerate(self._states(moves))]


def state_task(name: str, min_moves: int, max_moves: int) -> SyntheticTask:
    """The state-tracking task `name` with `min_moves..max_moves` moves, final answer only: a task of fullband's
    (a variant is `name:key=value;key=value`, e.g. "cycle:size=3") or an S5 alphabet of the lab's ("s5x32",
    "s5x120", which take no options)."""
    base, _, options = name.partition(":")
    if base in ALPHABET_TASKS:
        if options:
            raise ConfigError(f"{name!r}: the S5 alphabet tasks take no options")
        return S5Alphabet(size=ALPHABET_TASKS[base], min_steps=min_moves, max_steps=max_moves)
    return state_tracking_task(base, min_moves, max_moves, options=options.replace(";", ","))


def task_with_moves(name: str, moves: int) -> SyntheticTask:
    """The state-tracking task with exactly `moves` moves; a variant is `name:key=value;key=value`
    (e.g. "cycle:size=3"); "s5x32" and "s5x120" are S5 with 32 and 120 one-character moves."""
    return state_task(name, moves, moves)


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
    train_task = state_task(task, 1, moves)
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

"""S5 with a larger one-token move alphabet (experiments/state_tracking/tasks.py, "s5x32" and "s5x120"): the
alphabets, one byte token per move through fullband's own readers, answers that are the composition of the
moves, records fixed by their seed, and the sweeps that train on them."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from experiments.state_tracking import tasks as core
from experiments.sweeps import DELTA, EXACT_MODES, LSTM, SWEEPS
from fullband.bench.tasks import JsonlTask
from fullband.data import ByteTokenizer, DataConfig, open_dataset, prepare_dataset
from fullband.data.chat import encode_record
from fullband.data.sources import iter_documents
from fullband.data.synthetic import state_tracking_task, synthetic_examples
from fullband.errors import ConfigError
from fullband.loading import encode_prompt

SIZES = {"s5x32": 32, "s5x120": 120}
GENERATORS = {"a": (1, 0, 2, 3, 4), "b": (0, 2, 1, 3, 4), "c": (0, 1, 3, 2, 4), "d": (0, 1, 2, 4, 3),
              "e": (1, 2, 3, 4, 0)}


def compose(word: str, alphabet) -> str:
    """The final state by permutation matrices, not by the task's own loop: P[p[x], x] = 1 sends entry x to p[x],
    the word's map is P_k ... P_1, and the state (the identity mapped by each move in turn) reads column i."""
    total = np.eye(5, dtype=int)
    for move in word:
        matrix = np.zeros((5, 5), dtype=int)
        matrix[list(alphabet[move]), range(5)] = 1
        total = matrix @ total
    return "".join(str(int(np.argmax(total[:, i]))) for i in range(5))


def moves_of(prompt: str) -> str:
    assert prompt.startswith("s5 ") and prompt.endswith(" :")
    return prompt[3:-2]


@pytest.mark.parametrize("name,size", SIZES.items())
def test_the_alphabets_are_distinct_single_bytes_that_are_not_the_prompts_own(name, size):
    alphabet = core.s5_alphabet(size)
    assert len(alphabet) == size == len(set(alphabet.values())) == core.ALPHABET_TASKS[name]
    assert "".join(alphabet) == core.ALPHABET_CHARS[:size]
    assert all(len(c.encode("utf-8")) == 1 for c in alphabet)
    assert not set(alphabet) & set("s5 :\n\r\x0b\x0c")
    # the generators keep their letters of the word problem s5
    assert {c: alphabet[c] for c in "abcde"} == GENERATORS
    assert {tuple(g) for g in state_tracking_task("s5", 1, 1).group_generators()} == set(GENERATORS.values())
    assert all(sorted(p) == list(range(5)) for p in alphabet.values())
    if size == 120:
        assert set(alphabet.values()) == set(itertools.permutations(range(5)))
    else:  # printable: the control characters are needed only for 120
        assert all(c.isascii() and c.isprintable() for c in alphabet)
    assert len(core.ALPHABET_CHARS) == len(set(core.ALPHABET_CHARS)) == 120
    with pytest.raises(ConfigError):
        core.s5_alphabet(64)
    with pytest.raises(ConfigError, match="no options"):
        core.task_with_moves(f"{name}:size=3", 4)


def test_the_32_moves_are_the_generators_and_a_seeded_draw_and_generate_s5():
    gens = [tuple(g) for g in state_tracking_task("s5", 1, 1).group_generators()]
    others = sorted("".join(map(str, p)) for p in itertools.permutations(range(5)) if p not in gens)
    drawn = tuple(sorted(random.Random(core.ALPHABET_SEED).sample(others, 27)))
    assert core.S5X32_DRAWN == drawn
    moves = list(core.s5_alphabet(32).values())
    assert moves[:5] == gens and moves[5:] == [tuple(map(int, p)) for p in drawn]
    # the closure of the 32 moves under composition is all of S5
    reached, frontier = {tuple(range(5))}, [tuple(range(5))]
    while frontier:
        state = frontier.pop()
        for p in moves:
            nxt = tuple(p[x] for x in state)
            if nxt not in reached:
                reached.add(nxt)
                frontier.append(nxt)
    assert len(reached) == 120


@pytest.mark.parametrize("name", SIZES)
def test_answers_are_the_composition_of_the_moves_and_targets_the_running_state(name):
    alphabet = core.s5_alphabet(SIZES[name])
    task = core.task_with_moves(name, 16)
    seen = set()
    for ex in synthetic_examples(task, 400, 3):
        word = moves_of(ex.prompt)
        assert len(word) == 16 and set(word) <= set(alphabet)
        assert ex.answer == " " + compose(word, alphabet)
        targets = task.targets(ex)
        assert [ex.prompt[i] for i, _ in targets] == list(word)
        assert [state for _, state in targets] == [compose(word[: i + 1], alphabet) for i in range(16)]
        seen |= set(word)
    assert seen == set(alphabet)  # every move is drawn
    # a word of the 5-generator problem reads the same in the larger alphabets
    for ex in synthetic_examples(state_tracking_task("s5", 1, 16), 100, 4):
        assert ex.answer == " " + compose(moves_of(ex.prompt), alphabet)
        assert core.S5Alphabet(size=SIZES[name]).targets(ex)[-1][1] == ex.answer.strip()


@pytest.mark.parametrize("name", SIZES)
def test_records_are_fixed_by_their_seed(name, tmp_path):
    lengths = [4, 8]
    first = core.export_records(name, 7, 4, 300, lengths, 20, 50_000, tmp_path / "a")
    again = core.export_records(name, 7, 4, 300, lengths, 20, 50_000, tmp_path / "b")
    other = core.export_records(name, 8, 4, 300, lengths, 20, 50_000, tmp_path / "c")
    for f in ["train.jsonl", "test4.jsonl", "test8.jsonl"]:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert (tmp_path / "a" / "train.jsonl").read_bytes() != (tmp_path / "c" / "train.jsonl").read_bytes()
    assert (tmp_path / "a" / "test8.jsonl").read_bytes() == (tmp_path / "c" / "test8.jsonl").read_bytes()
    assert first["records"] == again["records"] and other["task"] == name
    train = [json.loads(line) for line in (tmp_path / "a" / "train.jsonl").open()]
    assert {len(moves_of(r["prompt"])) for r in train} == {1, 2, 3, 4}
    assert synthetic_examples(core.task_with_moves(name, 8), 20, 50_008) == [
        core.Example(**json.loads(line)) for line in (tmp_path / "a" / "test8.jsonl").open()]
    assert synthetic_examples(core.task_with_moves(name, 8), 5, 1) != synthetic_examples(
        core.task_with_moves(name, 8), 5, 2)


def test_every_move_is_one_token_through_the_trainers_and_benchs_readers(tmp_path):
    """Records holding every one of the 120 characters, control characters included, read back by the trainer's
    path (.jsonl -> iter_documents -> encode_record -> prepared shards) and the bench's (JsonlTask ->
    encode_prompt): the prompt's tokens are its bytes, one per move, unchanged."""
    tok = ByteTokenizer()
    rng = random.Random(0)
    words = [core.ALPHABET_CHARS[i: i + 16] for i in range(0, 120, 16)]
    words += ["".join(rng.sample(core.ALPHABET_CHARS, 16)) for _ in range(20)]
    assert set("".join(words)) == set(core.ALPHABET_CHARS)
    alphabet = core.s5_alphabet(120)
    records = [{"prompt": f"s5 {w} :", "answer": " " + compose(w, alphabet)} for w in words]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    text = path.read_text()
    # json.dumps escapes every control character, DEL too (\u007f), so each record is one line of printable ASCII
    assert {c for c in text if not c.isprintable()} == {"\n"}
    assert len(text.splitlines()) == len(records)

    def check(prompt_ids: list[int], record: dict) -> None:
        word = moves_of(record["prompt"])
        assert len(prompt_ids) == len("s5 ") + len(word) + len(" :")
        assert prompt_ids[3:-2] == [ord(c) for c in word] and all(i < 128 for i in prompt_ids[3:-2])

    cfg = DataConfig(source=str(path), format="prompt_answer", val_fraction=0.3)
    read = {}
    for split in ("train", "val"):
        for _, doc in iter_documents(cfg, split):
            read[doc["prompt"]] = doc
            ids, mask = encode_record(tok, doc)
            assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
            check(ids[1: 1 + len(doc["prompt"])], doc)
            assert tok.decode(ids[1:-1]) == doc["prompt"] + doc["answer"]
            assert sum(mask) == len(doc["answer"]) + 1
    assert read == {r["prompt"]: r for r in records}
    ds = prepare_dataset(cfg, tmp_path / "ds")
    assert open_dataset(tmp_path / "ds").manifest == ds.manifest
    prepared = {}
    for split in ("train", "val"):
        tokens = ds.split(split)
        bounds = [*tokens.doc_starts.tolist(), len(tokens)]
        for lo, hi in zip(bounds, bounds[1:]):
            text = tok.decode(tokens.tokens(lo, hi).tolist())
            prepared[text] = hi - lo
    assert prepared == {r["prompt"] + r["answer"]: 1 + len(r["prompt"]) + len(r["answer"]) + 1 for r in records}
    bench = JsonlTask(str(path), "exact")
    problems = bench.problems(None)
    assert [p.prompt for p in problems] == [r["prompt"] for r in records]
    for problem, record in zip(problems, records):
        ids = encode_prompt(tok, problem.prompt)
        assert ids[0] == tok.bos_id
        check(ids[1:], record)
    assert bench.score(problems, [r["answer"] + "\n" for r in records]) == [1.0] * len(records)


def test_the_alphabet_sweeps():
    delta4 = {**DELTA, "model.householder_steps": "4", "model.d_ff": "16"}
    for name, overrides, modes in (("alphabet_fbt", {}, EXACT_MODES), ("alphabet_lstm", LSTM, "standard"),
                                   ("alphabet_delta4", delta4, "standard")):
        sweep = SWEEPS[name]
        assert sweep.tasks == ("s5x32", "s5x120") and sweep.seeds == (10, 11, 12)
        assert sweep.overrides == overrides and sweep.modes == modes and sweep.preset == "state-tracking"
        assert (sweep.test_seed, sweep.val_seed, sweep.lengths, sweep.moves) == (50_000, 30_000, (1, 2, 4, 8), 16)
        assert sweep.results.name == f"{name}.json" and not sweep.into

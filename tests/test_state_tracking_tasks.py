import json
import random

import pytest

from fullband.data.synthetic import (
    S3,
    S5,
    STATE_TRACKING_TASKS,
    export_jsonl,
    final_answer,
    get_task,
    state_tracking_task,
    synthetic_examples,
)
from fullband.errors import ConfigError


def _moves(prompt: str) -> str:
    return prompt.split(" ")[1]


def _compose(perms: list[list[int]], n: int) -> str:
    state = list(range(n))
    for p in perms:
        state = [p[x] for x in state]
    return "".join(map(str, state))


def test_final_answers_match_independent_formulas():
    """Each final answer recomputed from the prompt in a different way than the generator does."""
    for ex in synthetic_examples(state_tracking_task("parity", 1, 40), 200, seed=1):
        assert ex.answer == f" {_moves(ex.prompt).count('1') % 2}"
    for ex in synthetic_examples(state_tracking_task("summod", 1, 40), 200, seed=2):
        assert ex.answer == f" {sum(map(int, _moves(ex.prompt))) % 5}"
    for ex in synthetic_examples(state_tracking_task("flipflop", 1, 40), 200, seed=3):
        assert ex.answer == " " + _moves(ex.prompt).replace(".", "")[-1]
    for ex in synthetic_examples(state_tracking_task("cycle", 1, 40), 200, seed=4):
        moves = _moves(ex.prompt)
        assert ex.answer == f" {(moves.count('+') - moves.count('-')) % 5}"
    for name, task in (("s3", S3()), ("s5", S5())):
        gens = task.group_generators()
        for ex in synthetic_examples(state_tracking_task(name, 1, 40), 100, seed=5):
            perms = [gens["abcde".index(c)] for c in _moves(ex.prompt)]
            assert ex.answer == " " + _compose(perms, task.degree)


@pytest.mark.parametrize("task,size", [(S3(), 6), (S5(), 120)])
def test_generators_reach_the_whole_group(task, size):
    """The letters generate all of S3 / S5, so the final state can be any of 6 / 120 elements."""
    n = task.degree
    seen, frontier = {tuple(range(n))}, [tuple(range(n))]
    while frontier:
        state = frontier.pop()
        for g in task.group_generators():
            nxt = tuple(g[x] for x in state)
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert len(seen) == size


@pytest.mark.parametrize("name", sorted(STATE_TRACKING_TASKS))
def test_lengths_formats_and_trace_control(name):
    final = synthetic_examples(state_tracking_task(name, 5, 9), 100, seed=6)
    traced = synthetic_examples(state_tracking_task(name, 5, 9, trace=True), 100, seed=6)
    for a, b in zip(final, traced):
        assert 5 <= len(_moves(a.prompt)) <= 9 and a.prompt.endswith(" :")
        assert a.prompt == b.prompt  # same draws: the trace is the only difference
        if name != "parity":  # parity's trace is its running bit string, whose last bit is the answer
            assert final_answer(b.answer) == final_answer(a.answer)
            assert b.answer.count(" ") - 2 == len(_moves(a.prompt))  # one state per move, then "=> final"
        else:
            assert b.answer[-1] == a.answer[-1] and len(b.answer) == len(_moves(a.prompt)) + 1


def test_flipflop_gaps_and_write_rate():
    moves = "".join(_moves(ex.prompt) for ex in synthetic_examples(state_tracking_task("flipflop", 64, 64), 200, 7))
    writes = sum(c in "01" for c in moves) / len(moves)
    assert 0.08 < writes < 0.14  # 10% writes plus the first move of each sequence


def test_export_jsonl_round_trip(tmp_path):
    task = state_tracking_task("cycle", 3, 6)
    path = export_jsonl(task, tmp_path / "sub" / "val.jsonl", 20, seed=9)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["prompt"], r["answer"]) for r in rows] == [(e.prompt, e.answer) for e in synthetic_examples(task, 20, 9)]
    assert sorted(p.name for p in path.parent.iterdir()) == ["val.jsonl"]


def test_interrupted_export_leaves_no_half_written_file(tmp_path, monkeypatch):
    import fullband.data.synthetic as synthetic

    def examples_then_interrupt(task, n, seed):
        yield from synthetic_examples(task, 3, seed)
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "synthetic_examples", examples_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        export_jsonl(state_tracking_task("parity", 2, 4), tmp_path / "val.jsonl", 20, seed=0)
    assert not (tmp_path / "val.jsonl").exists()


def test_bad_options_are_clear_errors():
    with pytest.raises(ConfigError, match="not a state-tracking task"):
        state_tracking_task("addition", 1, 4)
    with pytest.raises(ConfigError, match="modulus must be 2..10"):
        get_task("summod:modulus=11")
    with pytest.raises(ConfigError, match="need 1 <= min_len <= max_len"):
        state_tracking_task("cycle", 5, 4)
    assert get_task("s5:generators=true").generate(random.Random(0)).prompt.startswith("s5 ")

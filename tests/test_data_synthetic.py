import random

import pytest

from fullband.data import (
    SYNTHETIC_TASKS,
    ByteTokenizer,
    DataConfig,
    get_task,
    synthetic_examples,
    synthetic_val_set,
)
from fullband.data.sources import iter_documents
from fullband.errors import ConfigError


def _corrupt(answer: str) -> str:
    """Change the graded part of an answer: flip its last character to a different digit."""
    last = answer.rstrip()[-1]
    return answer.rstrip()[:-1] + ("1" if last != "1" else "2")


@pytest.mark.parametrize("name", sorted(SYNTHETIC_TASKS))
def test_checker_accepts_truth_rejects_corruption(name):
    task = SYNTHETIC_TASKS[name]
    for ex in synthetic_examples(task, 50, seed=3):
        assert task.check(ex, ex.answer)
        assert task.check(ex, ex.answer + "\nparity 0101 : junk after the newline")
        assert not task.check(ex, _corrupt(ex.answer))
        assert not task.check(ex, "")


@pytest.mark.parametrize("name", sorted(SYNTHETIC_TASKS))
def test_generation_is_seeded_and_fits_256_byte_context(name):
    a = synthetic_examples(name, 300, seed=7)
    assert a == synthetic_examples(name, 300, seed=7)
    assert a != synthetic_examples(name, 300, seed=8)
    assert max(len(ByteTokenizer().encode(ex.text)) for ex in a) + 2 <= 256
    assert all(ex.text.endswith("\n") and ex.text.count("\n") == 1 for ex in a)


def test_task_semantics():
    rng = random.Random(0)
    p = SYNTHETIC_TASKS["parity"].generate(rng)
    bits = p.prompt.split()[1]
    assert p.answer.strip() == "".join(str(bits[: i + 1].count("1") % 2) for i in range(len(bits)))

    a = SYNTHETIC_TASKS["addition"].generate(rng)
    x, y = map(int, a.prompt.split()[1].split("+"))
    assert a.answer.rsplit("=>", 1)[1].strip() == str(x + y)

    r = SYNTHETIC_TASKS["registers"].generate(rng)
    writes, query = r.prompt.removeprefix("regs ").split(" ? ")
    assert r.answer.strip() == dict(w.split("=") for w in writes.split())[query.removesuffix(" :")]

    s = SYNTHETIC_TASKS["s5"].generate(rng)
    state = list(range(5))
    for perm in s.prompt.split()[1:-1]:
        state = [int(perm[x]) for x in state]
    assert s.answer.rsplit("=>", 1)[1].strip() == "".join(map(str, state))


def test_task_options():
    task = get_task("parity:min_len=3,max_len=3")
    assert all(len(ex.prompt.split()[1]) == 3 for ex in synthetic_examples(task, 20, 0))
    assert "=>" not in get_task("s5:trace=false").generate(random.Random(0)).answer
    with pytest.raises(ConfigError, match="Options of 'parity'"):
        get_task("parity:bogus=1")
    with pytest.raises(ConfigError, match="min_len <= max_len"):
        get_task("parity:min_len=9,max_len=3")


def test_synthetic_source_splits_use_different_seeds():
    cfg = DataConfig(source="synthetic:registers", synthetic_train_examples=300, synthetic_val_examples=50)
    train = [t for _, t in iter_documents(cfg, "train")]
    val = [t for _, t in iter_documents(cfg, "val")]
    assert len(val) == 50 and 0 < len(train) <= 300
    val_prompts = {t.split(":")[0] for t in val}
    assert not any(t.split(":")[0] in val_prompts for t in train)  # held-out prompts
    task, examples = synthetic_val_set(cfg)
    assert task.name == "registers" and val == [ex.text for ex in examples]
    capped = DataConfig(**{**cfg.to_dict(), "max_train_bytes": 1000})
    assert [t for _, t in iter_documents(capped, "val")] == val  # val set never capped
    capped_train = [t for _, t in iter_documents(capped, "train")]
    assert capped_train == train[: len(capped_train)] and sum(map(len, capped_train)) <= 1000
    assert [t for _, t in iter_documents(DataConfig(source=cfg.source, seed=1, synthetic_val_examples=50),
                                         "val")] != val

"""experiments/rl_smollm2: its splits are disjoint and sized as its README says, the reward grades the replies the
README names, and the table pairs each seed's before and after."""

import json

from experiments.rl_smollm2 import run as smol
from fullband.rl.rewards import make_reward


def test_the_splits_are_disjoint_and_fixed(tmp_path):
    files = smol.prepare_data(tmp_path, "add30")
    splits = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in files.items()}
    assert [len(splits[n]) for n in ("validation", "test", "train")] == [200, 200, 500]
    prompts = {n: {r["prompt"] for r in rows} for n, rows in splits.items()}
    assert sum(map(len, prompts.values())) == 900 and len(set.union(*prompts.values())) == 900
    for row in splits["test"]:
        a, b = (int(x) for x in row["prompt"].removeprefix("What is ").partition("?")[0].split(" + "))
        assert 1 <= a <= 30 and 1 <= b <= 30 and row["answer"] == str(a + b)
    again = smol.prepare_data(tmp_path / "again", "add30")
    assert all(again[n].read_text() == files[n].read_text() for n in files)


def test_the_reward_grades_the_last_integer():
    reward = make_reward(smol.REWARD)
    replies = ["42", "17 + 25 = 42", "The answer is 42.", "42 is not right, it is 41", "forty-two", "17 + 25 =\n42"]
    assert reward(replies, ["42"] * len(replies)) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_the_table_pairs_before_and_after(tmp_path):
    for seed, after in ((0, 0.5), (1, 0.6), (2, 0.7)):
        (tmp_path / f"seed{seed}").mkdir()
        (tmp_path / f"seed{seed}" / "result.json").write_text(json.dumps(
            {"seed": seed, "steps": 24, "before": 0.4, "after": after, "prompts": 200, "decode": "standard",
             "rl_step_seconds": 900}))
    text = smol.table(tmp_path)
    assert "| 2 | 24 | 0.400 | 0.700 | +0.300 | 900 |" in text
    assert "before: 0.400 in every seed" in text and "paired: +0.200 [-0.048, +0.448]" in text

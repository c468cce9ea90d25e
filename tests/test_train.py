"""Training loop: metrics, exact resume across a change of the pass count, grad accumulation.

Also holds the tiny-run helpers the other ``test_train_*`` modules import (``from test_train import ...``).
Every run here is tiny (d_model 32, 2 layers, seq_len 32, batch 4, a handful of steps) and deterministic.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from fullband.config import RunConfig, build_config
from fullband.storage import list_checkpoints
from fullband.train import PassSchedule, train

SEQ, BATCH = 32, 4

TINY: dict = {
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64, "max_seq_len": SEQ},
    "data": {"source": "synthetic:parity", "tokenizer": "byte", "synthetic_train_examples": 200,
             "synthetic_val_examples": 20},
    "train": {"seq_len": SEQ, "batch_size": BATCH, "tokens": 4 * SEQ * BATCH, "warmup_steps": 2, "lr": 3e-3,
              "progress": False, "log_every": 1000, "device": "cpu", "schedule": "standard"},
    "eval": {"batches": 1, "batch_size": 4, "fused_passes": 1, "sequential": False},
}

# K = 1 for the first half of the run, then K = 2 or 3: the K phase changes in the middle.
SWITCH_SCHEDULE = [{"until": 0.5, "passes": {1: 1.0}}, {"until": 1.0, "passes": {2: 0.5, 3: 0.5}}]


def merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for section, body in extra.items():
        out.setdefault(section, {}).update(body)
    return out


def tiny_raw(**sections: dict) -> dict:
    """The TINY config as nested dicts with ``section={field: value}`` updates."""
    return merge(TINY, sections)


def tiny_config(**sections: dict) -> RunConfig:
    return build_config(tiny_raw(**sections))


def steps_of(steps: int, grad_accum: int = 1) -> int:
    """train.tokens for exactly ``steps`` optimizer steps of the tiny batch."""
    return steps * SEQ * BATCH * grad_accum


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line]


def write_yaml(path: Path, raw: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def parity_data(tmp_path_factory) -> Path:
    """A prepared synthetic:parity dataset (byte tokenizer) shared by the tests that use TINY's data."""
    from fullband.data import prepare_dataset

    path = tmp_path_factory.mktemp("parity") / "data"
    prepare_dataset(tiny_config().data, path)
    return path


# ---- metrics.jsonl -------------------------------------------------------------------------------


def test_metrics_jsonl_fields_per_step(tmp_path, parity_data):
    cfg = tiny_config(train={"tokens": steps_of(4), "schedule": SWITCH_SCHEDULE, "warmup_steps": 2})
    result = train(cfg, tmp_path / "run", data_dir=parity_data)
    rows = read_metrics(tmp_path / "run")
    assert result.finished and result.steps == 4 and result.skipped_steps == 0
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["tokens"] for r in rows] == [steps_of(i) for i in range(1, 5)]
    schedule = PassSchedule.parse(SWITCH_SCHEDULE)
    assert [r["passes"] for r in rows] == [schedule.passes_for_step(s, 4, 0) for s in range(4)]
    assert [r["passes"] for r in rows][:2] == [1, 1] and all(r["passes"] >= 2 for r in rows[2:])
    for r in rows:
        assert {"step", "tokens", "loss", "passes", "pass_losses", "lr"} <= set(r)
        assert len(r["pass_losses"]) == r["passes"]
        assert r["skipped"] is False
        # Eq. 12 with λ = 1: L = L1 + mean(L2..LK)
        later = r["pass_losses"][1:]
        expected = r["pass_losses"][0] + (sum(later) / len(later) if later else 0.0)
        assert r["loss"] == pytest.approx(expected, rel=1e-6)
    # compute_tokens counts tokens × passes
    assert rows[-1]["compute_tokens"] == sum(steps_of(1) * r["passes"] for r in rows) == result.compute_tokens
    # warmup 2 steps then wsd: the last 25% (1 step) decays to 0 at the end
    lrs = [r["lr"] for r in rows]
    assert lrs[0] == pytest.approx(1.5e-3) and lrs[1] == pytest.approx(3e-3) and lrs[2] == pytest.approx(3e-3)
    assert lrs[3] == pytest.approx(0.0)
    # the final evaluation was written
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == 4 and set(evals[-1]["loss"]) == {"standard", "fused(1)"}


# ---- exact resume --------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_resume_is_bitwise_exact_across_a_k_phase_change(tmp_path, parity_data, grad_accum, device):
    n = 3
    # On a GPU (FULLBAND_TEST_DEVICE) in float32: kernels such as the embedding backward accumulate in a
    # nondeterministic order there, so equality is up to float32 rounding rather than bitwise.
    sections = dict(
        train={"tokens": steps_of(2 * n, grad_accum), "grad_accum": grad_accum, "schedule": SWITCH_SCHEDULE,
               "prefix_mixin": 1.0, "warmup_steps": 2, "seed": 3, "device": str(device), "dtype": "float32"},
        model={"feedback_jitter": 0.02},
    )
    same = (lambda x, y: x == y) if device.type == "cpu" else (lambda x, y: x == pytest.approx(y, rel=1e-4, abs=1e-6))
    schedule = PassSchedule.parse(SWITCH_SCHEDULE)
    ks = [schedule.passes_for_step(s, 2 * n, 3) for s in range(2 * n)]
    assert ks[:n] == [1] * n and set(ks[n:]) == {2, 3}, ks  # the phase changes right after step n

    straight = tmp_path / "straight"
    train(tiny_config(**sections), straight, data_dir=parity_data)

    split = tmp_path / "split"
    first = train(tiny_config(**merge(sections, {"train": {"stop_after_steps": n}})), split, data_dir=parity_data)
    assert not first.finished and first.steps == n
    assert [p.name for p in list_checkpoints(split)] == [f"step_{n:08d}"]
    second = train(tiny_config(**sections), split, data_dir=parity_data, resume=True)
    assert second.finished and second.steps == 2 * n

    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in b] == list(range(1, 2 * n + 1))
    assert [r["passes"] for r in a] == [r["passes"] for r in b] == ks
    assert same([r["loss"] for r in a], [r["loss"] for r in b])
    assert all(same(x["pass_losses"], y["pass_losses"]) for x, y in zip(a, b))
    assert [r["lr"] for r in a] == [r["lr"] for r in b]
    # and the final weights are identical
    from safetensors.torch import load_file

    wa = load_file(str(list_checkpoints(straight)[-1] / "model" / "model.safetensors"))
    wb = load_file(str(list_checkpoints(split)[-1] / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        if device.type == "cpu":
            assert bool((wa[k] == wb[k]).all()), k
        else:
            assert same(wa[k].flatten().tolist(), wb[k].flatten().tolist()), k


def test_resume_of_a_finished_run_does_nothing_more(tmp_path, parity_data):
    cfg = tiny_config(train={"tokens": steps_of(2)})
    train(cfg, tmp_path / "run", data_dir=parity_data)
    before = read_metrics(tmp_path / "run")
    again = train(tiny_config(train={"tokens": steps_of(2)}), tmp_path / "run", data_dir=parity_data, resume=True)
    assert again.finished and again.steps == 2
    assert read_metrics(tmp_path / "run") == before


def test_a_fresh_run_drops_log_lines_of_an_attempt_that_died_before_its_first_checkpoint(tmp_path, parity_data):
    run = tmp_path / "run"
    run.mkdir()
    stale = {"step": 1, "tokens": 1, "loss": 123.0, "passes": 1, "pass_losses": [123.0], "lr": 0.0}
    (run / "metrics.jsonl").write_text(json.dumps(stale) + "\n" + json.dumps({**stale, "step": 2}) + "\n")
    (run / "eval.jsonl").write_text(json.dumps({"step": 2, "loss": {"standard": 9.0}}) + "\n")
    train(tiny_config(train={"tokens": steps_of(2)}), run, data_dir=parity_data)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] != 123.0 for r in rows)
    assert [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()] == [2]

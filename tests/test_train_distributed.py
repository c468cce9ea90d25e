"""Two CPU processes under torch.distributed.run (gloo) give the same per-step losses as one process with
the same global batch, for DDP (with activation checkpointing) and FSDP2, including fused steps with prefix
mixin and jitter; DCP checkpoints resume at another world size (2 -> 1, 1 -> 2) as the uninterrupted run; the
sequential exact mode under DDP equals one Jacobi process on records whose ranks hold different numbers of labels."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import test_train
import torch
from test_train import BATCH, read_metrics, steps_of, tiny_raw, write_yaml
from test_train_curriculum import _prompt_answer_data

from fullband.config import build_config
from fullband.storage import ModelDir, list_checkpoints
from fullband.train import PassSchedule, train

STEPS = 5
# one K = 1 step, then K = 2 or 3; seed 1 draws both 2 and 3 (asserted below)
SCHEDULE = [{"until": 0.2, "passes": {1: 1.0}}, {"until": 1.0, "passes": {2: 0.5, 3: 0.5}}]
SEED = 1

parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)


def _raw(parallel: str, grad_accum: int = 1, **train_fields) -> dict:
    return tiny_raw(
        train={"tokens": steps_of(STEPS, grad_accum), "grad_accum": grad_accum, "schedule": SCHEDULE, "seed": SEED,
               "prefix_mixin": 1.0, "parallel": parallel, "warmup_steps": 1, "lr_schedule": "constant",
               **train_fields},
        model={"feedback_jitter": 0.02},
    )


def _torchrun(config, out_dir, data_dir, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "fullband", "train", "--config", str(config), "--out-dir", str(out_dir),
               "--data-dir", str(data_dir), *extra]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def fsdp_two_processes(tmp_path_factory, parity_data) -> Path:
    """An uninterrupted 2-process FSDP run (one torchrun launch, shared by two tests)."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    _torchrun(write_yaml(tmp / "config.yaml", _raw("fsdp")), tmp / "dist", parity_data)
    return tmp / "dist"


@pytest.mark.parametrize("parallel, grad_accum", [("ddp", 2), ("fsdp", 1)])
def test_two_processes_match_one(tmp_path, parity_data, parallel, grad_accum, request):
    ks = [PassSchedule.parse(SCHEDULE).passes_for_step(s, STEPS, SEED) for s in range(STEPS)]
    assert ks[0] == 1 and {2, 3} <= set(ks), ks
    raw = _raw(parallel, grad_accum)
    assert raw["train"]["batch_size"] == BATCH  # the global batch: 2 rows per rank
    if parallel == "fsdp":
        dist_dir = request.getfixturevalue("fsdp_two_processes")
    else:
        dist_dir = tmp_path / "dist"
        # Every block checkpointed in the two processes only: DDP's one backward per micro-batch through the
        # recomputed blocks gives the gradients of one process without checkpointing.
        _torchrun(write_yaml(tmp_path / "config.yaml", raw), dist_dir, parity_data,
                  "--train.activation_checkpointing", "full")

    single = train(build_config(raw), tmp_path / "single", data_dir=parity_data)
    assert single.finished
    one, two = read_metrics(tmp_path / "single"), read_metrics(dist_dir)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))  # rank 0 alone writes metrics
    assert [r["passes"] for r in one] == [r["passes"] for r in two] == ks
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert b["pass_losses"] == pytest.approx(a["pass_losses"], rel=1e-5, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6)
    # the distributed run wrote one complete checkpoint (under FSDP by default DCP shards, one per rank) whose
    # weights match the single process's
    newest = list_checkpoints(dist_dir)[-1]
    assert (newest / "dcp" / "__1_0.distcp").is_file() == (parallel == "fsdp")
    wa = ModelDir.open(list_checkpoints(tmp_path / "single")[-1] / "model").read_weights()
    wb = ModelDir.open(newest / "model").read_weights()
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k] - wb[k]).abs().max() < 1e-4, k


def test_fsdp_dcp_checkpoints_resume_at_another_world_size(tmp_path, parity_data, fsdp_two_processes):
    """An FSDP run's DCP checkpoint (the default format under fsdp) resumes with 1 process (2 -> 1), and a
    1-process run's with 2 (1 -> 2): every step's K, loss and pass losses equal the uninterrupted run's, so no
    batch was lost or repeated, and the final weights agree. Resumed with 2 processes (2 -> 2), the run is the
    uninterrupted 2-process run bit for bit."""

    def raw(stop: int = 0) -> dict:
        return _raw("fsdp", stop_after_steps=stop)

    single = train(build_config(raw()), tmp_path / "single", data_dir=parity_data)
    assert single.finished
    reference = read_metrics(tmp_path / "single")
    # 2 -> 1: stopped after 3 steps (fused steps done: the fusion weights have optimizer state), and killed
    # while writing its next checkpoint (a partial temporary directory), resumed in one process.
    _torchrun(write_yaml(tmp_path / "stop3.yaml", raw(stop=3)), tmp_path / "two_one", parity_data)
    checkpoint = list_checkpoints(tmp_path / "two_one")[-1]
    assert sorted(p.name for p in (checkpoint / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    partial = tmp_path / "two_one" / "checkpoints" / ".tmp-step_00000004" / "dcp"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"partial")
    shutil.copytree(tmp_path / "two_one", tmp_path / "two_two")
    resumed = train(build_config(raw()), tmp_path / "two_one", data_dir=parity_data, resume=True)
    assert resumed.finished and resumed.steps == STEPS
    # 1 -> 2: stopped after the first step (K = 1: the fusion weights have no optimizer state yet), resumed
    # under torchrun with 2 processes.
    train(build_config(raw(stop=1)), tmp_path / "one_two", data_dir=parity_data)
    _torchrun(write_yaml(tmp_path / "full.yaml", raw()), tmp_path / "one_two", parity_data, "--resume")
    # 2 -> 2
    _torchrun(tmp_path / "full.yaml", tmp_path / "two_two", parity_data, "--resume")

    uninterrupted = read_metrics(fsdp_two_processes)
    assert [(r["loss"], r["pass_losses"], r["grad_norm"]) for r in read_metrics(tmp_path / "two_two")] == [
        (r["loss"], r["pass_losses"], r["grad_norm"]) for r in uninterrupted]
    theirs = ModelDir.open(list_checkpoints(tmp_path / "two_two")[-1] / "model").read_weights()
    ours = ModelDir.open(list_checkpoints(fsdp_two_processes)[-1] / "model").read_weights()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)

    weights = ModelDir.open(list_checkpoints(tmp_path / "single")[-1] / "model").read_weights()
    for run in ("two_one", "one_two"):
        metrics = read_metrics(tmp_path / run)
        assert [r["step"] for r in metrics] == list(range(1, STEPS + 1)), run
        assert [r["passes"] for r in metrics] == [r["passes"] for r in reference], run
        for a, b in zip(reference, metrics):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), (run, a["step"], a["loss"], b["loss"])
            assert b["pass_losses"] == pytest.approx(a["pass_losses"], rel=1e-5, abs=1e-6), (run, a["step"])
        last = list_checkpoints(tmp_path / run)[-1]
        assert json.loads((last / "trainer_state.json").read_text())["loader"] == json.loads(
            (list_checkpoints(tmp_path / "single")[-1] / "trainer_state.json").read_text())["loader"]
        theirs = ModelDir.open(last / "model").read_weights()
        assert theirs.keys() == weights.keys()
        for k in weights:
            assert (theirs[k] - weights[k]).abs().max() < 1e-4, (run, k)


def test_sequential_exact_mode_under_ddp_equals_one_jacobi_process(tmp_path):
    """train.exact_mode sequential runs T model forwards before one backward inside the DDP-wrapped objective:
    under two processes its steps equal one process's Jacobi steps (packed prompt-answer records, grad
    accumulation, prefix mixin). The records label their answers only, so the ranks' micro-batches hold different
    numbers of labels: equal losses and gradients also show that a step averages over all its labels, not over
    each rank's mean."""
    data = _prompt_answer_data(tmp_path, (1, 8), 120)

    def raw(mode: str) -> dict:
        return tiny_raw(data=data, model={"feedback_jitter": 0.0, "sliding_window": 4},
                        train={"schedule": "exact", "exact_mode": mode, "pass_loss": "last", "prefix_mixin": 1.0,
                               "grad_accum": 2, "tokens": steps_of(2, 2), "warmup_steps": 1})

    _torchrun(write_yaml(tmp_path / "sequential.yaml", raw("sequential")), tmp_path / "sequential", tmp_path / "data")
    train(build_config(raw("jacobi")), tmp_path / "jacobi", data_dir=tmp_path / "data")
    one, two = read_metrics(tmp_path / "jacobi"), read_metrics(tmp_path / "sequential")
    assert [r["passes"] for r in one] == [r["passes"] for r in two]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_fsdp_finds_the_tensors_of_the_models_output():
    """FSDP2 unshards a module's parameters before their backward through hooks on the tensors of its output;
    torch 2.11 finds them with pytree, where an unregistered dataclass is one leaf: a multi-pass step under
    fully_shard then fails in its backward ("storage of size 0"). torch 2.13 passes either way, so this checks
    the registration itself."""
    from fullband.model import ModelOutput

    logits, hidden = torch.zeros(1, 2, 3, requires_grad=True), torch.zeros(1, 2, 4, requires_grad=True)
    leaves, _ = torch.utils._pytree.tree_flatten(ModelOutput(logits=logits, hidden=hidden))
    assert any(leaf is logits for leaf in leaves) and any(leaf is hidden for leaf in leaves)

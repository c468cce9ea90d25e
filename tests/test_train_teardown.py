"""Distributed runs leave no collective worker thread behind: once ``train()`` returns under torchrun, the
gloo process group is really destroyed, so no thread can touch Python during interpreter shutdown, which used
to abort rank 0 now and then (SIGABRT, "terminate called without an active exception").

FSDP2 is the case tested: it holds the group through both kinds of reference that used to outlive
``destroy_process_group`` (``torch.distributed.nn`` defaults and DTensor caches; see fullband.train.teardown).
One run per process: a second ``init_process_group`` in the same torchrun workers is not what is tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_train
from test_train import steps_of, tiny_raw, write_yaml

parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)

# Runs train() in each rank, then writes the threads left in the process to a file of its own: the ranks share
# one stdout, where two reports can interleave into a single line.
SCRIPT = """
import json, os, sys
import torch
import yaml
from fullband.config import build_config
from fullband.train import train

torch.set_num_threads(1)
config, out_dir, data_dir, report_dir = sys.argv[1:5]
train(build_config(yaml.safe_load(open(config))), out_dir, data_dir=data_dir)
names = []
for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/comm") as f:
        names.append(f.read().strip())
with open(os.path.join(report_dir, "threads_" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(sorted(names), f)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc (Linux)")
def test_no_process_group_thread_survives_training(tmp_path, parity_data):
    raw = tiny_raw(train={"tokens": steps_of(2), "parallel": "fsdp", "schedule": "fixed:2"})
    config = write_yaml(tmp_path / "fsdp.yaml", raw)
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
               str(config), str(tmp_path / "run"), str(parity_data), str(tmp_path)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = sorted(tmp_path.glob("threads_*.json"))
    assert [r.name for r in reports] == ["threads_0.json", "threads_1.json"], proc.stdout[-3000:]
    for report in reports:
        rank, names = report.stem.split("_")[1], json.loads(report.read_text())
        # gloo's workers are named pt_gloo_runloop and gloo_tcp_loop
        assert not [n for n in names if "gloo" in n], f"rank {rank}: threads left: {names}"

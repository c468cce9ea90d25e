"""train.grad_passes reaches the objective: gradient only through the last N passes of each step."""

import pytest
import torch
from safetensors.torch import load_file
from test_train import steps_of, tiny_config

from fullband.config import build_config
from fullband.errors import ConfigError
from fullband.storage import list_checkpoints
from fullband.train import train


def _weights(run) -> dict[str, torch.Tensor]:
    return load_file(str(list_checkpoints(run)[-1] / "model" / "model.safetensors"))


def _run(tmp_path, name: str, grad_passes: int):
    config = tiny_config(train={"schedule": "fixed:3", "tokens": steps_of(2), "grad_passes": grad_passes})
    train(config, tmp_path / name, data_dir=tmp_path / "data")
    return _weights(tmp_path / name)


def test_grad_passes_all_equals_default_and_fewer_changes_the_update(tmp_path, single_thread):
    default = _run(tmp_path, "default", 0)
    same = _run(tmp_path, "all", 3)
    truncated = _run(tmp_path, "last1", 1)
    for name, w in default.items():
        torch.testing.assert_close(same[name], w, rtol=0, atol=0)
    assert any(not torch.equal(truncated[name], w) for name, w in default.items())


def test_negative_grad_passes_is_a_config_error():
    with pytest.raises(ConfigError, match="train.grad_passes=-1 must be >= 0"):
        build_config({"train": {"grad_passes": -1}})

"""A run written before ``ModelDir`` (by the code of commit 547dd1b) opens and decodes exactly as it did then.

``tests/data/run_547dd1b`` is that code's output, kept as it was written: a run directory with one checkpoint
(model/ with config.json, model.safetensors, generation_config.json storing soft decoding, tokenizer/; a manifest),
and ``expected.json``, the tokens that code's ``generate`` gave in the stored mode and three others. It was made by
building a seeded 2-layer model and writing it with that commit's ``train.checkpoint._write_model_dir`` and
``_seal``, then decoding with its ``load_model`` and ``generate``."""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from fullband.cli import main
from fullband.decoding import DecodeSettings
from fullband.generation import generate
from fullband.loading import encode_prompt, load_model
from fullband.storage import ModelDir

OLD_RUN = Path(__file__).parent / "data" / "run_547dd1b"
EXPECTED = json.loads((OLD_RUN / "expected.json").read_text())


@pytest.fixture
def old_run(tmp_path) -> Path:
    return shutil.copytree(OLD_RUN, tmp_path / "run")


def test_an_old_run_opens_with_its_stored_settings(old_run):
    model_dir = ModelDir.open(old_run, hashes=True)  # its manifest's sizes and sums still hold
    assert model_dir.path == old_run / "checkpoints" / "step_00000003" / "model"
    assert model_dir.decode == DecodeSettings("soft")
    assert model_dir.tokenizer == model_dir.path / "tokenizer" and model_dir.run.path == old_run


@pytest.mark.parametrize("label", sorted(EXPECTED["tokens"]))
def test_an_old_run_decodes_the_same_tokens(old_run, label):
    model, tokenizer = load_model(old_run, device="cpu")
    stored = DecodeSettings.of(model)
    settings = stored if label == "stored" else stored.with_label(label)
    prompt = encode_prompt(tokenizer, EXPECTED["prompt"])
    assert generate(model, [prompt], EXPECTED["max_new_tokens"], decode=settings)[0].tolist() == \
        EXPECTED["tokens"][label]


def test_fullband_generate_on_an_old_run_prints_the_same_text(old_run):
    _, tokenizer = load_model(old_run, device="cpu")
    stdout = io.StringIO()
    with redirect_stdout(stdout):
        assert main(["generate", str(old_run), "--prompt", EXPECTED["prompt"], "--max-new-tokens",
                     str(EXPECTED["max_new_tokens"]), "--device", "cpu"]) == 0
    assert stdout.getvalue().rstrip("\n") == EXPECTED["prompt"] + tokenizer.decode(EXPECTED["tokens"]["stored"])

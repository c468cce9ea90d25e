"""A run written before ``ModelDir`` (by the code of commit 547dd1b) opens and decodes exactly as it did then.

``tests/data/run_547dd1b`` is that code's output, kept as it was written: a run directory with one checkpoint
(model/ with config.json, model.safetensors, generation_config.json storing soft decoding, tokenizer/; a manifest),
and ``expected.json``, the tokens that code's ``generate`` gave in the stored mode and three others. It was made by
building a seeded 2-layer model and writing it with that commit's ``train.checkpoint._write_model_dir`` and
``_seal``, then decoding with its ``load_model`` and ``generate``.

An ``export-hf`` directory written before its decode settings moved from the top of its config.json into its
generation_config.json (commit b13343a) opens in the same mode too: ``export_as_written_before`` writes one."""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

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


def export_as_written_before(export: Path, dst: Path) -> Path:
    """A copy of ``export`` laid out as ``export-hf`` wrote it up to commit b13343a: the decode settings at the top
    of config.json, Hugging Face's token ids alone in generation_config.json."""
    dst = shutil.copytree(export, dst)
    generation = json.loads((dst / "generation_config.json").read_text())
    decode = {name: generation.pop(name) for name in DecodeSettings().to_dict()}
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **decode}, indent=2))
    (dst / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return dst


def test_an_export_written_before_decodes_in_its_stored_mode(old_run, tmp_path):
    """Through ModelDir and through transformers' generate() (this version's remote code reading the old layout)."""
    transformers = pytest.importorskip("transformers")
    from fullband.hf import export_hf

    old = export_as_written_before(export_hf(old_run, tmp_path / "exp"), tmp_path / "old_exp")
    assert json.loads((old / "config.json").read_text())["decode_mode"] == "soft"
    assert "decode_mode" not in json.loads((old / "generation_config.json").read_text())
    assert ModelDir.open(old).decode == DecodeSettings("soft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(old, trust_remote_code=True).eval()
    _, tokenizer = load_model(old_run, device="cpu")
    prompt = encode_prompt(tokenizer, EXPECTED["prompt"])
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=EXPECTED["max_new_tokens"], do_sample=False,
                      return_dict_in_generate=True)
    assert out.past_key_values.settings.to_dict() == DecodeSettings("soft").to_dict()  # the export's own class
    assert out.sequences[0, len(prompt):].tolist() == EXPECTED["tokens"]["stored"]

"""Export a fullband model directory as a Hugging Face ``trust_remote_code`` model directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from fullband.architectures import FBT, load_pretrained, stored_arch
from fullband.decoding import DecodeSettings
from fullband.errors import CheckpointError
from fullband.hf.convert import GENERATION_CONFIG, TOKENIZER_FILES
from fullband.hf.tokenizer_export import generation_ids, saved_tokenizer, write_tokenizer_files
from fullband.loading import fill_decode_defaults
from fullband.model import ordinary_file_mode
from fullband.storage import resolve_model_dir

_HERE = Path(__file__).resolve().parent
MODEL_SOURCE = _HERE.parent / "model.py"
MODEL_FILE = "fullband_model.py"
# model.py imports these relatively (and nothing else of the package): they ship beside it under their own names.
MODEL_DEPENDENCIES = ("kv_cache.py",)
# The modeling code's own copy of fullband's decode settings (it imports fullband_model.py, fullband's package only
# inside try/except).
DECODING_SOURCE, DECODING_FILE = _HERE.parent / "decoding.py", "fullband_decoding.py"
MODULE_FILES = ("configuration_fullband.py", "modeling_fullband.py")
AUTO_MAP = {
    "AutoConfig": "configuration_fullband.FullBandHFConfig",
    "AutoModelForCausalLM": "modeling_fullband.FullBandForCausalLM",
}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from exc


def _stored_dtype(model_dir: Path):
    """The dtype the weights were saved in (the export keeps it), or None if unreadable."""
    from safetensors import safe_open

    path = model_dir / "model.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        name = "embed.weight" if "embed.weight" in f.keys() else next(iter(f.keys()))
        return f.get_tensor(name).dtype


def export_hf(
    source: str | os.PathLike,
    dst: str | os.PathLike,
    decode_mode: str | None = None,
    fused_passes: int | str | None = None,
    fused_tol: float | None = None,
    fused_max_passes: int | None = None,
) -> Path:
    """Write ``dst`` so that ``AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True)`` loads the
    fullband model of ``source`` (a run directory, checkpoint or model directory): an HF config
    (``model_type="fullband"``, ``auto_map``), safetensors weights, the modeling code and the tokenizer files of
    the model's ``tokenizer/``. The model's stored decode settings, with the fields given here replaced, become
    the defaults of ``generate()``."""
    import torch
    from transformers import GenerationConfig

    from fullband.hf.configuration_fullband import FullBandHFConfig
    from fullband.hf.modeling_fullband import FullBandForCausalLM

    model_dir, dst = resolve_model_dir(source), Path(dst)
    if stored_arch(model_dir) != FBT:
        raise CheckpointError(f"fullband export-hf exports model.arch fbt only (its remote code is the transformer's); "
                              f"{model_dir} is arch {stored_arch(model_dir)!r}")
    try:
        dtype = _stored_dtype(model_dir)
        model = load_pretrained(model_dir, dtype=dtype)
        dtype = model.embed.weight.dtype
    except FileNotFoundError as exc:
        raise CheckpointError(str(exc)) from exc
    except ValueError as exc:
        raise CheckpointError(f"cannot export {model_dir}: {exc}") from exc
    fill_decode_defaults(model, model_dir)
    settings = DecodeSettings.of(model).with_overrides(decode_mode=decode_mode, fused_passes=fused_passes,
                                                       fused_tol=fused_tol, fused_max_passes=fused_max_passes)

    tokenizer_dir = model_dir / "tokenizer"
    generation = {}
    if (tokenizer_dir / GENERATION_CONFIG).is_file():
        generation = _read_json(tokenizer_dir / GENERATION_CONFIG)
    own_tokenizer = saved_tokenizer(tokenizer_dir)  # byte/BPE, chat tokens: Hugging Face files written below
    generation = {**generation, **generation_ids(own_tokenizer)}
    special = {k: generation.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}

    config = FullBandHFConfig(
        fullband=model.config.to_dict(),
        **settings.to_dict(),
        architectures=["FullBandForCausalLM"],
        auto_map=dict(AUTO_MAP),
        dtype=dtype,
        **special,
    )
    with torch.device("meta"):
        hf_model = FullBandForCausalLM(config)
    hf_model = hf_model.to_empty(device="cpu").to(dtype)
    hf_model.model.load_state_dict(model.state_dict())
    hf_model.model.inv_freq.copy_(model.inv_freq)
    if generation:
        generation = {k: v for k, v in generation.items() if k != "transformers_version"}
        hf_model.generation_config = GenerationConfig.from_dict(generation)
    else:
        hf_model.generation_config = GenerationConfig.from_model_config(config)

    dst.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(dst)
    for weights in dst.glob("*.safetensors"):  # one file or shards; safetensors writes them with mode 0600
        os.chmod(weights, ordinary_file_mode())
    config_path = dst / "config.json"
    saved = _read_json(config_path)
    saved["auto_map"] = dict(AUTO_MAP)
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    for name in MODULE_FILES:
        shutil.copyfile(_HERE / name, dst / name)
    shutil.copyfile(MODEL_SOURCE, dst / MODEL_FILE)
    shutil.copyfile(DECODING_SOURCE, dst / DECODING_FILE)
    for name in MODEL_DEPENDENCIES:
        shutil.copyfile(MODEL_SOURCE.parent / name, dst / name)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, dst / name)
    write_tokenizer_files(own_tokenizer, dst, model.config.max_seq_len)
    return dst

"""Export a fullband model directory as a Hugging Face ``trust_remote_code`` model directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from fullband.errors import CheckpointError
from fullband.generation import decode_settings
from fullband.hf.convert import GENERATION_CONFIG, copy_tokenizer_files
from fullband.hf.tokenizer_export import generation_ids, saved_tokenizer, write_tokenizer_files
from fullband.model import FullBandLM, ordinary_file_mode
from fullband.storage import ModelDir, read_json

_HERE = Path(__file__).resolve().parent
# The files an export ships beside its weights (name in the export: source). The modeling code imports fullband's
# own model.py and decoding.py relatively, as fullband_model.py and fullband_decoding.py (fullband's package only
# inside try/except); model.py imports kv_cache.py and compiled_steps.py relatively, and nothing else of the package.
SHIPPED_CODE = {
    "configuration_fullband.py": _HERE / "configuration_fullband.py",
    "modeling_fullband.py": _HERE / "modeling_fullband.py",
    "fullband_model.py": _HERE.parent / "model.py",
    "kv_cache.py": _HERE.parent / "kv_cache.py",
    "compiled_steps.py": _HERE.parent / "compiled_steps.py",
    "fullband_decoding.py": _HERE.parent / "decoding.py",
}
AUTO_MAP = {
    "AutoConfig": "configuration_fullband.FullBandHFConfig",
    "AutoModelForCausalLM": "modeling_fullband.FullBandForCausalLM",
}


def export_weights(model: FullBandLM) -> dict[str, torch.Tensor]:
    """The model's weights under the names of an export (``FullBandForCausalLM`` holds ``FullBandLM`` under
    ``model``), as its safetensors file and the vLLM plugin's ``load_weights`` take them."""
    return {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}


def export_hf(
    source: str | os.PathLike, dst: str | os.PathLike, decode_mode: str | None = None,
    fused_passes: int | str | None = None, fused_tol: float | None = None, fused_max_passes: int | None = None
) -> Path:
    """Write ``dst`` so that ``AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True)`` loads the model of
    ``source``; its stored decode settings, with the fields given here replaced, become ``generate()``'s defaults."""
    from transformers import GenerationConfig

    from fullband.hf.configuration_fullband import FullBandHFConfig

    model_dir, dst = ModelDir.open(source), Path(dst)
    model = model_dir.load()  # in the dtype it is stored in, which the export keeps
    if not isinstance(model, FullBandLM):
        raise CheckpointError(f"fullband export-hf exports model.arch fbt only (its remote code is the transformer's); "
                              f"{model_dir.path} is arch {model.config.arch!r}")
    settings = decode_settings(model, decode_mode=decode_mode, fused_passes=fused_passes, fused_tol=fused_tol,
                               fused_max_passes=fused_max_passes)
    tokenizer_dir = model_dir.path / "tokenizer"
    generation = {}
    if (tokenizer_dir / GENERATION_CONFIG).is_file():
        generation = read_json(tokenizer_dir / GENERATION_CONFIG)
    own_tokenizer = saved_tokenizer(tokenizer_dir)  # byte/BPE, chat tokens: Hugging Face files written below
    generation = {**generation, **generation_ids(own_tokenizer)}
    special = {k: generation.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}

    config = FullBandHFConfig(
        fullband=model.config.to_dict(),
        architectures=["FullBandForCausalLM"],
        auto_map=dict(AUTO_MAP),
        dtype=model.embed.weight.dtype,
        **special,
    )
    # The decode settings beside Hugging Face's token ids, where transformers loads them into model.generation_config
    # (which drops fields it does not know from a file marked _from_model_config).
    for key in ("transformers_version", "_from_model_config"):
        generation.pop(key, None)
    generation_config = GenerationConfig.from_dict({**generation, **settings.to_dict()})

    # The tokenizer's own files; the generation_config.json that comes with them is replaced by the merged one.
    copy_tokenizer_files(tokenizer_dir, dst)
    dst.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(dst)
    generation_config.save_pretrained(dst)
    # The names FullBandForCausalLM gives the weights (FullBandLM under `model`); safetensors writes mode 0600.
    # Shards and their index from an earlier export into dst would otherwise be loaded instead.
    for stale in dst.glob("model*.safetensors*"):
        stale.unlink()
    weights = dst / "model.safetensors"
    save_file(export_weights(model), weights, {"format": "pt"})
    os.chmod(weights, ordinary_file_mode())
    for name, code in SHIPPED_CODE.items():
        shutil.copyfile(code, dst / name)
    write_tokenizer_files(own_tokenizer, dst, model.config.max_seq_len)
    return dst

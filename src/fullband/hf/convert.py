"""Import a Hugging Face Llama-family checkpoint (safetensors or GGUF) into a fullband model directory with fresh
fusion weights. Anything fullband cannot represent exactly is refused with a ``ConfigError`` naming the field, never
approximated (docs/huggingface.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from fullband.decoding import DecodeSettings
from fullband.errors import CheckpointError, ConfigError
from fullband.model import FullBandConfig, FullBandLM
from fullband.storage import read_safetensors

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Files of a Hugging Face tokenizer (and the generation defaults that go with it), carried along verbatim.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG = "generation_config.json"

# Checked in config.json itself: transformers would fill them in with its defaults.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# The scaling fields fullband implements, per RoPE type ("default": no scaling).
_ROPE_FIELDS = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
# Hugging Face tensor names -> FullBandLM's, applied in order; a name no rule fits is refused as unmodelled.
_RENAMES = (
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".mlp_norm."),
    (r"\.self_attn\.", ".attn."),
)


def _refuse(src: Path, message: str) -> ConfigError:
    return ConfigError(f"cannot import {src}: {message}")


def _transformers_config(src: Path, cfg: dict[str, Any]) -> Any:
    """The ``PreTrainedConfig`` transformers builds from ``cfg``: the model class's defaults for what config.json
    leaves out, the RoPE parameters standardized (legacy ``rope_theta`` + ``rope_scaling`` included) and, for Qwen,
    ``layer_types`` derived from ``use_sliding_window`` and ``max_window_layers``."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise ConfigError("importing a Hugging Face checkpoint reads its config.json with transformers: "
                          "pip install 'fullband[hf]'") from exc
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(cfg["model_type"], **fields)
    except Exception as exc:  # its validators raise ValueError, KeyError, TypeError and huggingface_hub's own errors
        raise _refuse(src, f"transformers refuses its config.json: {exc}") from exc


def _rope(src: Path, hf: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of transformers' standardized ``rope_parameters``."""
    params = hf.rope_parameters or {}
    per_layer_type = {k: v for k, v in params.items() if isinstance(v, dict)}
    if per_layer_type:  # e.g. {"full_attention": {...}, "sliding_attention": {...}}
        if len({json.dumps(v, sort_keys=True) for v in per_layer_type.values()}) != 1:
            raise _refuse(src, f"rope_parameters differ per layer type ({sorted(per_layer_type)}); fullband uses one "
                          "RoPE for all layers")
        params = next(iter(per_layer_type.values()))
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise _refuse(src, f"partial_rotary_factor={partial!r}: fullband rotates the whole head (1.0 only)")
    theta, rope_type = float(params["rope_theta"]), params.get("rope_type", "default")
    if rope_type not in _ROPE_FIELDS:
        raise _refuse(
            src,
            f"RoPE scaling type {rope_type!r} (rope_scaling / rope_parameters) is not implemented by fullband; "
            "supported: 'default' (none), 'linear' and 'llama3'. Converting would change the model's positions.",
        )
    if rope_type == "default":
        return theta, None
    # transformers has checked that the fields are there
    scaling = {"rope_type": rope_type, **{k: float(params[k]) for k in _ROPE_FIELDS[rope_type]}}
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings", hf.max_position_embeddings)
        scaling["original_max_position_embeddings"] = int(original)
    return theta, scaling


def _sliding(src: Path, hf: Any, n_layers: int) -> tuple[int | None, int]:
    """(sliding_window, full_attention_every) reproducing exactly which layers use the window."""
    window = getattr(hf, "sliding_window", None)
    if hf.model_type == "llama":
        return None, 0
    if hf.model_type == "mistral":
        # Mistral applies its window (if any) to every layer; it ignores `layer_types`.
        sliding = [window is not None] * n_layers
    else:  # qwen2 / qwen3: transformers checked `layer_types` (one per layer) or derived it
        unknown = sorted(set(hf.layer_types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise _refuse(src, f"layer_types={hf.layer_types!r}: only 'full_attention'/'sliding_attention'")
        sliding = [t == "sliding_attention" for t in hf.layer_types]
        if any(sliding) and window is None:
            raise _refuse(src, "layer_types has sliding_attention layers but sliding_window is null")
    if not any(sliding):
        return None, 0
    if not isinstance(window, int) or window < 1:
        raise _refuse(src, f"sliding_window={window!r} must be a positive integer")
    for every in [0, *range(2, n_layers + 1)]:
        candidate = FullBandConfig(sliding_window=window, full_attention_every=every, n_layers=n_layers)
        if [candidate.layer_is_sliding(i) for i in range(n_layers)] == sliding:
            return window, every
    pattern = "".join("S" if s else "F" for s in sliding)
    raise _refuse(
        src,
        f"the sliding-window layout {pattern} (S = window of {window}, F = full attention; from layer_types / "
        "max_window_layers) cannot be expressed by fullband, which supports a window on every layer, optionally "
        "with every n-th layer full (full_attention_every)",
    )


def hf_config_to_fullband(cfg: dict[str, Any], src: str | os.PathLike = "<config>") -> FullBandConfig:
    """Map a Hugging Face ``config.json`` dict onto a :class:`FullBandConfig`, refusing what cannot be
    represented exactly."""
    src = Path(src)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _refuse(
            src,
            f"model_type={model_type!r} (architectures {cfg.get('architectures')}) is not supported; "
            f"fullband imports the Llama family: {', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise _refuse(src, f"config.json lacks {missing}")
    if cfg.get("quantization_config"):
        raise _refuse(src, "quantized checkpoints (quantization_config) are not supported; use unquantized weights")
    hf = _transformers_config(src, cfg)
    if hf.hidden_act != "silu":
        raise _refuse(src, f"hidden_act={hf.hidden_act!r}: fullband's MLP is SwiGLU with silu only")
    if getattr(hf, "mlp_bias", False):
        raise _refuse(src, "mlp_bias=true: fullband's MLP has no biases")
    if model_type in ("llama", "qwen3") and hf.attention_bias:
        raise _refuse(
            src,
            "attention_bias=true biases q/k/v *and* o_proj; fullband models q/k/v biases only (qkv_bias), "
            "not an output-projection bias",
        )
    theta, scaling = _rope(src, hf)
    window, every = _sliding(src, hf, hf.num_hidden_layers)
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is not None and head_dim * hf.num_attention_heads == hf.hidden_size:
        head_dim = None  # the default
    try:
        return FullBandConfig(
            vocab_size=hf.vocab_size,
            d_model=hf.hidden_size,
            n_layers=hf.num_hidden_layers,
            n_heads=hf.num_attention_heads,
            n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=head_dim,
            d_ff=hf.intermediate_size,
            max_seq_len=hf.max_position_embeddings,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(hf.rms_norm_eps),
            qk_norm=model_type == "qwen3",
            qkv_bias=model_type == "qwen2",
            sliding_window=window,
            full_attention_every=every,
            tie_embeddings=bool(hf.tie_word_embeddings),
        )
    except ValueError as exc:
        raise _refuse(src, str(exc)) from exc


def _weight_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    single = src / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({src / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"cannot import {src}: shards named in {index.name} are missing: {absent}")
        return files
    if single.is_file():
        return [single]
    others = sorted(p.name for p in src.glob("*.safetensors"))
    if others:
        return [src / name for name in others]
    if any(src.glob("*.bin")) or any(src.glob("*.pt")):
        raise CheckpointError(
            f"cannot import {src}: only pickle weights (*.bin/*.pt) found; fullband reads safetensors only. "
            "Re-save with transformers: model.save_pretrained(dir, safe_serialization=True)"
        )
    raise CheckpointError(f"cannot import {src}: no model.safetensors or model.safetensors.index.json")


def _load_gguf(src: Path, gguf_file: str) -> tuple[FullBandConfig, Iterable[tuple[str, torch.Tensor]]]:
    """The config and (float32, dequantized) tensors of ``src/gguf_file`` as transformers loads them; an
    architecture fullband cannot represent is refused before the weights are read."""
    path = src / gguf_file
    if not path.is_file():
        raise CheckpointError(f"cannot import {path}: no such GGUF file (--gguf-file names a file inside --from-hf)")
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            "--gguf-file reads GGUF through transformers, which needs the `transformers` and `gguf` packages: "
            "pip install 'fullband[hf]'"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        hf_config = AutoConfig.from_pretrained(src, gguf_file=gguf_file)
    except (ValueError, KeyError, OSError) as exc:
        raise _refuse(path, f"transformers cannot read this GGUF file ({exc})") from exc
    cfg = hf_config.to_dict()
    # transformers dequantizes every GGUF tensor on load: what fullband receives is unquantized.
    cfg.pop("quantization_config", None)
    config = hf_config_to_fullband(cfg, path)
    # config=: the GGUF's metadata is parsed once more for the weights otherwise (seconds for a 49k vocabulary)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32, config=hf_config)
    return config, model.state_dict().items()


def hf_to_fullband_model(
    src: str | os.PathLike, dtype: torch.dtype | None = None, gguf_file: str | None = None
) -> FullBandLM:
    """Build a :class:`FullBandLM` holding the weights of the Hugging Face directory ``src`` (or of the GGUF
    file ``gguf_file`` inside it); the fusion weights are freshly initialised."""
    src = Path(src)
    if gguf_file is not None:
        config, tensors = _load_gguf(src, gguf_file)
        src = src / gguf_file
    else:
        config_path = src / "config.json"
        if not config_path.is_file():
            raise CheckpointError(
                f"cannot import {src}: config.json is missing (expected a Hugging Face model directory, or "
                "name a GGUF file inside it with --gguf-file)"
            )
        config = hf_config_to_fullband(json.loads(config_path.read_text()), src)
        tensors = [item for path in _weight_files(src) for item in read_safetensors(path).items()]
    state, hf_names = {}, {}
    for hf_name, tensor in tensors:
        if hf_name.endswith("rotary_emb.inv_freq") or (hf_name == "lm_head.weight" and config.tie_embeddings):
            continue  # a buffer some old checkpoints saved (recomputed from the config); the tied head is the embedding
        name = hf_name
        for pattern, replacement in _RENAMES:
            name = re.sub(pattern, replacement, name)
        state[name], hf_names[name] = tensor, hf_name
    model = FullBandLM(config)
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("fusion.")}
    unexpected = [hf_names[name] for name in sorted(set(state) - set(expected))]
    if unexpected:
        raise _refuse(
            src,
            f"the checkpoint holds tensors fullband does not model (a bias or norm?): {unexpected[:8]}"
            + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""),
        )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"cannot import {src}: the checkpoint lacks {missing[:8]} (total {len(missing)})")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"cannot import {src}: {hf_names[name]} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy the Hugging Face tokenizer files (and generation_config.json) of ``src`` into ``dst``; nothing is
    created when ``src`` has no tokenizer file."""
    names = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not names:
        return
    if (src / GENERATION_CONFIG).is_file():
        names.append(GENERATION_CONFIG)
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(src / name, dst / name)


def convert_from_hf(src: str | os.PathLike, dst: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    gguf_file: str | None = None) -> Path:
    """Convert the local Hugging Face directory ``src`` (Llama, Qwen2, Qwen3 or Mistral) into the fullband model
    directory ``dst``, ready for ``fullband train --init-from``; ``gguf_file``: a GGUF file inside ``src`` instead
    (dequantized by transformers). ``dtype``: the weights' (default float32)."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise CheckpointError(f"cannot import {src}: not a directory")
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ConfigError(f"dtype={dtype!r} is not a torch dtype (e.g. float32, bfloat16, float16)")
        dtype = getattr(torch, dtype)
    model = hf_to_fullband_model(src, dtype=dtype, gguf_file=gguf_file)
    # A pretrained transformer's fusion is untrained: soft or fused decoding would feed its states through a
    # random gate, so the converted model decodes in standard mode until it is trained with feedback.
    model.decode_settings = DecodeSettings("standard")
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    if gguf_file is not None:
        # The tokenizer transformers rebuilds from the GGUF metadata (vocabulary, merges, special tokens, chat
        # template), saved as Hugging Face tokenizer files.
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(src, gguf_file=gguf_file).save_pretrained(dst / "tokenizer")
    else:
        copy_tokenizer_files(src, dst / "tokenizer")
    return dst

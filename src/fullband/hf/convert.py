"""Import a Hugging Face Llama-family checkpoint (Llama, Qwen2, Qwen3, Mistral) into a fullband model directory.

Reads ``config.json`` and the safetensors weights (one file or an index with shards) directly, without
``transformers``, maps every tensor onto :class:`fullband.model.FullBandLM` and adds freshly initialised
fusion weights. A GGUF file (``gguf_file``) is read through transformers' own GGUF loading instead, which
dequantizes its weights and rebuilds its config and tokenizer (chat template included); the same mapping and
refusals then apply. Anything fullband cannot represent exactly (a RoPE scaling type it does not implement, a
bias it does not model, a sliding-window layout it cannot express, ...) is refused with a
:class:`fullband.errors.ConfigError` that names the field — never silently approximated.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from fullband.decoding import DecodeSettings
from fullband.errors import CheckpointError, ConfigError
from fullband.model import FullBandConfig, FullBandLM

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

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _refuse(src: Path, message: str) -> ConfigError:
    return ConfigError(f"cannot import {src}: {message}")


def _get(cfg: dict[str, Any], key: str) -> Any:
    """``key`` as transformers reads ``cfg``: its value, or the default of the model class (``AutoConfig``) where
    config.json leaves it out."""
    if key in cfg:
        return cfg[key]
    return getattr(_transformers_config(json.dumps(cfg, sort_keys=True)), key, None)


@functools.lru_cache(maxsize=4)
def _transformers_config(cfg_json: str) -> Any:
    """The ``PretrainedConfig`` transformers builds from a config.json (cached: one build per checkpoint)."""
    from transformers import AutoConfig

    fields = json.loads(cfg_json)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _rope(src: Path, cfg: dict[str, Any], max_positions: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the transformers 5.x ``rope_parameters`` or the legacy
    ``rope_theta`` + ``rope_scaling`` keys."""
    params = cfg.get("rope_parameters")
    legacy = cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise _refuse(src, f"rope_parameters={params!r} is not a dict")
    if params and any(isinstance(v, dict) for v in params.values()):
        # Nested per layer type, e.g. {"full_attention": {...}, "sliding_attention": {...}}.
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) != 1:
            raise _refuse(
                src,
                f"rope_parameters differ per layer type ({sorted(params)}); fullband uses one RoPE for all layers",
            )
        params = next(iter(params.values()))
    scaling: dict[str, Any] = dict(params or legacy or {})
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = cfg.get("rope_theta", 10000.0)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    partial = scaling.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse(src, f"partial_rotary_factor={partial!r}: fullband rotates the whole head (1.0 only)")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        if "factor" not in scaling:
            raise _refuse(src, "rope scaling type 'linear' without a 'factor'")
        return float(theta), {"rope_type": "linear", "factor": float(scaling["factor"])}
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in scaling]
        if missing:
            raise _refuse(src, f"rope scaling type 'llama3' lacks {missing}")
        return float(theta), {
            "rope_type": "llama3",
            "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_position_embeddings": int(
                scaling.get(
                    "original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_positions)
                )
            ),
        }
    raise _refuse(
        src,
        f"RoPE scaling type {rope_type!r} (rope_scaling / rope_parameters) is not implemented by fullband; "
        "supported: 'default' (none), 'linear' and 'llama3'. Converting would change the model's positions.",
    )


def _sliding(src: Path, cfg: dict[str, Any], n_layers: int) -> tuple[int | None, int]:
    """(sliding_window, full_attention_every) reproducing exactly which layers use the window."""
    model_type = cfg["model_type"]
    window = _get(cfg, "sliding_window")
    if model_type == "llama":
        return None, 0
    if model_type == "mistral":
        # Mistral applies its window (if any) to every layer; it ignores `layer_types`.
        if window is None:
            return None, 0
        sliding = [True] * n_layers
    else:  # qwen2 / qwen3
        if not _get(cfg, "use_sliding_window"):
            window = None
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            first_windowed = _get(cfg, "max_window_layers")
            layer_types = [
                "sliding_attention" if window is not None and i >= first_windowed else "full_attention"
                for i in range(n_layers)
            ]
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown or len(layer_types) != n_layers:
            raise _refuse(src, f"layer_types={layer_types!r}: only 'full_attention'/'sliding_attention', one per layer")
        sliding = [t == "sliding_attention" for t in layer_types]
        if not any(sliding):
            return None, 0
        if window is None:
            raise _refuse(src, "layer_types has sliding_attention layers but sliding_window is null")
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
    act = _get(cfg, "hidden_act")
    if act != "silu":
        raise _refuse(src, f"hidden_act={act!r}: fullband's MLP is SwiGLU with silu only")
    if _get(cfg, "mlp_bias"):
        raise _refuse(src, "mlp_bias=true: fullband's MLP has no biases")
    qkv_bias = model_type == "qwen2"
    if model_type in ("llama", "qwen3") and _get(cfg, "attention_bias"):
        raise _refuse(
            src,
            "attention_bias=true biases q/k/v *and* o_proj; fullband models q/k/v biases only (qkv_bias), "
            "not an output-projection bias",
        )
    n_layers = int(cfg["num_hidden_layers"])
    max_positions = int(_get(cfg, "max_position_embeddings"))
    theta, scaling = _rope(src, cfg, max_positions)
    window, every = _sliding(src, cfg, n_layers)
    n_heads = int(cfg["num_attention_heads"])
    head_dim = _get(cfg, "head_dim")
    d_model = int(cfg["hidden_size"])
    if head_dim is not None and int(head_dim) == d_model // n_heads and d_model % n_heads == 0:
        head_dim = None
    try:
        return FullBandConfig(
            vocab_size=int(cfg["vocab_size"]),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=_get(cfg, "num_key_value_heads") or n_heads,
            head_dim=None if head_dim is None else int(head_dim),
            d_ff=int(cfg["intermediate_size"]),
            max_seq_len=max_positions,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(_get(cfg, "rms_norm_eps")),
            qk_norm=model_type == "qwen3",
            qkv_bias=qkv_bias,
            sliding_window=window,
            full_attention_every=every,
            tie_embeddings=bool(_get(cfg, "tie_word_embeddings")),
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


def _map_name(name: str, config: FullBandConfig) -> str | None:
    """HF tensor name -> FullBandLM state-dict name; None for tensors to skip."""
    if name.endswith("rotary_emb.inv_freq"):
        return None  # a buffer some old checkpoints saved; recomputed from the config
    if name == "lm_head.weight":
        return None if config.tie_embeddings else "lm_head.weight"
    if name.startswith("model."):
        name = name[len("model.") :]
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name == "norm.weight":
        return "norm.weight"
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "layers":
        i, rest = parts[1], ".".join(parts[2:])
        renames = {
            "input_layernorm.weight": "attn_norm.weight",
            "post_attention_layernorm.weight": "mlp_norm.weight",
        }
        if rest in renames:
            return f"layers.{i}.{renames[rest]}"
        if rest.startswith("self_attn."):
            return f"layers.{i}.attn.{rest[len('self_attn.') :]}"
        if rest.startswith("mlp."):
            return f"layers.{i}.{rest}"
    return "?" + name


def _map_state(
    src: Path, config: FullBandConfig, tensors: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """HF-named tensors -> a FullBandLM state dict (without fusion weights); refuses tensors fullband does not
    model."""
    state: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for name, tensor in tensors:
        target = _map_name(name, config)
        if target is None:
            continue
        if target.startswith("?"):
            unknown.append(name)
            continue
        state[target] = tensor
    if unknown:
        raise _refuse(
            src,
            f"the checkpoint holds tensors fullband does not model: {unknown[:8]}"
            + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""),
        )
    return state


def _safetensors(src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in _weight_files(src):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"cannot import {src}: {path.name} is unreadable or truncated: {exc}") from exc


def load_hf_state_dict(src: Path, config: FullBandConfig) -> dict[str, torch.Tensor]:
    return _map_state(src, config, _safetensors(src))


def _load_gguf(src: Path, gguf_file: str) -> tuple[FullBandConfig, dict[str, torch.Tensor]]:
    """The config and (float32, dequantized) state dict of ``src/gguf_file`` as transformers loads it; an
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
    return config, _map_state(path, config, model.state_dict().items())


def hf_to_fullband_model(
    src: str | os.PathLike, dtype: torch.dtype | None = None, gguf_file: str | None = None
) -> FullBandLM:
    """Build a :class:`FullBandLM` holding the weights of the Hugging Face directory ``src`` (or of the GGUF
    file ``gguf_file`` inside it); the fusion weights are freshly initialised."""
    src = Path(src)
    if gguf_file is not None:
        config, state = _load_gguf(src, gguf_file)
        src = src / gguf_file
    else:
        config_path = src / "config.json"
        if not config_path.is_file():
            raise CheckpointError(
                f"cannot import {src}: config.json is missing (expected a Hugging Face model directory, or "
                "name a GGUF file inside it with --gguf-file)"
            )
        config = hf_config_to_fullband(json.loads(config_path.read_text()), src)
        state = load_hf_state_dict(src, config)
    model = FullBandLM(config)
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("fusion.")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise _refuse(
            src,
            f"tensors {unexpected[:8]} have no place in the fullband model (a bias or norm fullband does not model?)",
        )
    if missing:
        raise CheckpointError(f"cannot import {src}: the checkpoint lacks {missing[:8]} (total {len(missing)})")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"cannot import {src}: {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the Hugging Face tokenizer files (and generation_config.json) of ``src`` into ``dst``; returns
    the names copied. Nothing is created when ``src`` has no tokenizer file."""
    names = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not names:
        return []
    if (src / GENERATION_CONFIG).is_file():
        names.append(GENERATION_CONFIG)
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(src / name, dst / name)
    return names


def save_gguf_tokenizer(src: Path, gguf_file: str, dst: Path) -> list[str]:
    """The tokenizer transformers rebuilds from the GGUF metadata (vocabulary, merges, special tokens, chat
    template), saved as Hugging Face tokenizer files in ``dst``; returns the names written."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    dst.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(dst)
    return sorted(p.name for p in dst.iterdir())


def convert_from_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    gguf_file: str | None = None,
) -> Path:
    """Convert the local Hugging Face directory ``src`` (Llama, Qwen2, Qwen3 or Mistral; config.json +
    safetensors, sharded or not) into the fullband model directory ``dst`` (config.json +
    model.safetensors, tokenizer files under ``dst/tokenizer/``), ready for ``fullband train --init-from``.

    ``gguf_file`` names a GGUF file inside ``src`` to convert instead (read and dequantized by transformers,
    which needs the ``gguf`` package; its tokenizer and chat template come from the GGUF metadata).
    ``dtype`` (e.g. "bfloat16") stores the weights in that dtype; by default float32.
    Raises :class:`fullband.errors.ConfigError` for architectures or options fullband cannot represent.
    """
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
    DecodeSettings("standard").store_in(model)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    if gguf_file is not None:
        save_gguf_tokenizer(src, gguf_file, dst / "tokenizer")
    else:
        copy_tokenizer_files(src, dst / "tokenizer")
    return dst

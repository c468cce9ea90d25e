"""Hugging Face interop: import (logit equality per family, refusals, shards, tokenizer) and export
(trust_remote_code load, generate() in the three decode modes, round trip, beams and sampling)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from fullband.errors import ConfigError  # noqa: E402
from fullband.generation import generate as fb_generate  # noqa: E402
from fullband.hf import convert_from_hf, export_hf, register  # noqa: E402
from fullband.kv_cache import KVCache  # noqa: E402
from fullband.model import FullBandConfig, FullBandLM  # noqa: E402
from fullband.storage import load_pretrained  # noqa: E402

HF_CACHE_KEY = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
VOCAB = 101
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _llama(**kw):
    return LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_key_value_heads": 2, **kw}))


FAMILIES = {
    "llama_gqa": lambda: _llama(),
    "llama_tied_llama3_rope": lambda: _llama(
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama_linear_rope": lambda: _llama(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen2_qkv_bias": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2_sliding_every_2nd_full": lambda: Qwen2ForCausalLM(
        Qwen2Config(
            **{**SMALL, "num_hidden_layers": 4},
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
    ),
    "qwen3_qk_norm_head_dim": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16)),
    "mistral_sliding_window": lambda: MistralForCausalLM(
        MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=4)
    ),
}


def _biases_nonzero(model):
    # transformers initialises biases to zero; random ones make the q/k/v bias mapping observable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _save_hf(tmp_path: Path, name: str, **save_kw) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = _biases_nonzero(FAMILIES[name]()).eval()
    src = tmp_path / f"hf_{name}"
    model.save_pretrained(src, **save_kw)
    return src, model


def _hf_cache(out):
    return getattr(out, HF_CACHE_KEY)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_logits_match_hf_full_and_cached(tmp_path, family):
    src, hf = _save_hf(tmp_path, family)
    dst = convert_from_hf(src, tmp_path / "fb")
    fb = load_pretrained(dst).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(fb(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)

        # Cached: prefill 7 tokens, then 5 single-token steps, against transformers' own cached decode.
        cache = KVCache(fb.config, 2, 12)
        ours = fb(ids[:, :7], past_key_values=cache, use_cache=True)
        theirs = hf(ids[:, :7], use_cache=True)
        torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=0)
        hf_cache = _hf_cache(theirs)
        for t in range(7, 12):
            ours = fb(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            theirs = hf(ids[:, t : t + 1], use_cache=True, **{HF_CACHE_KEY: hf_cache})
            hf_cache = _hf_cache(theirs)
            torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=0)
    # Fresh fusion weights, everything else is the HF model's.
    assert fb.fusion.value_proj.weight.abs().sum() > 0
    config = json.loads((dst / "config.json").read_text())
    if family.startswith("mistral"):
        assert config["sliding_window"] == 4 and config["full_attention_every"] == 0
    if family.startswith("qwen2_sliding"):
        assert config["sliding_window"] == 3 and config["full_attention_every"] == 2


def test_import_sharded_safetensors(tmp_path):
    src, hf = _save_hf(tmp_path, "llama_gqa", max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").is_file()
    assert len(list(src.glob("model-*.safetensors"))) > 1
    fb = load_pretrained(convert_from_hf(src, tmp_path / "fb")).eval()
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(fb(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)


def _edit_config(src: Path, **changes) -> None:
    path = src / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 1e4}, "'dynamic'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type='gpt2'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_import_refuses_unsupported(tmp_path, changes, needle):
    src, _ = _save_hf(tmp_path, "llama_gqa")
    _edit_config(src, **changes)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        convert_from_hf(src, tmp_path / "fb")
    assert not (tmp_path / "fb").exists()


def test_import_refuses_sliding_layout_fullband_cannot_express(tmp_path):
    src, _ = _save_hf(tmp_path, "qwen2_qkv_bias")
    # Qwen2's max_window_layers layout: the first layer full, the rest windowed (F S S S).
    _edit_config(
        src,
        num_hidden_layers=2,
        use_sliding_window=True,
        sliding_window=3,
        layer_types=["full_attention", "sliding_attention"],
    )
    with pytest.raises(ConfigError, match="sliding-window layout FS"):
        convert_from_hf(src, tmp_path / "fb")


def test_import_refuses_unmodelled_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    src, _ = _save_hf(tmp_path, "llama_gqa")
    state = load_file(src / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="o_proj.bias"):
        convert_from_hf(src, tmp_path / "fb")


def _tiny_tokenizer(directory: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(40)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(directory)
    return tok


def test_tokenizer_carried_through_convert_and_export(tmp_path):
    src, hf = _save_hf(tmp_path, "llama_gqa")
    tok = _tiny_tokenizer(src)
    hf.generation_config.save_pretrained(src)
    dst = convert_from_hf(src, tmp_path / "fb")
    assert (dst / "tokenizer" / "tokenizer.json").is_file()
    assert (dst / "tokenizer" / "generation_config.json").is_file()
    exp = export_hf(dst, tmp_path / "exp")
    loaded = AutoTokenizer.from_pretrained(exp, trust_remote_code=True)
    assert loaded("w1 w5 w7").input_ids == tok("w1 w5 w7").input_ids
    config = json.loads((exp / "config.json").read_text())
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 1
    # One generation_config.json: the source's token-id defaults (kept in fb/tokenizer/) and the decode settings.
    generation = json.loads((exp / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["decode_mode"] == "standard"
    assert not {"decode_mode", "fused_passes", "fused_tol", "fused_max_passes"} & set(config)


def test_no_tokenizer_dir_without_tokenizer_files(tmp_path):
    src, _ = _save_hf(tmp_path, "llama_gqa")
    dst = convert_from_hf(src, tmp_path / "fb")
    assert not (dst / "tokenizer").exists()


# --------------------------------------------------------------------------------------------------
# Export


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A converted Qwen3 model (GQA, QK-norm) with a sliding window on every 2nd layer, exported."""
    tmp = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(
        Qwen3Config(
            **{**SMALL, "num_hidden_layers": 2},
            num_key_value_heads=2,
            head_dim=8,
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
        )
    )
    hf.save_pretrained(tmp / "src")
    convert_from_hf(tmp / "src", tmp / "fb")
    fb = load_pretrained(tmp / "fb").eval()
    with torch.no_grad():  # make the fusion matter: larger fed-back values than the init
        fb.fusion.value_proj.weight.mul_(20)
    fb.save_pretrained(tmp / "fb")
    exp = export_hf(tmp / "fb", tmp / "exp")
    model = AutoModelForCausalLM.from_pretrained(exp, trust_remote_code=True).eval()
    return tmp, fb, exp, model


def test_export_layout_and_remote_code(exported):
    tmp, fb, exp, model = exported
    config = json.loads((exp / "config.json").read_text())
    assert config["model_type"] == "fullband"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_fullband.FullBandForCausalLM"
    for name in ("model.safetensors", "modeling_fullband.py", "configuration_fullband.py", "fullband_model.py",
                 "kv_cache.py", "compiled_steps.py"):
        assert (exp / name).is_file(), name
    assert type(model).__module__.startswith("transformers_modules")  # the copied code, not the package
    from transformers.dynamic_module_utils import get_imports

    assert "fullband" not in get_imports(exp / "fullband_model.py")
    assert "fullband" not in get_imports(exp / "kv_cache.py")
    assert "fullband" not in get_imports(exp / "compiled_steps.py")
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fb(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["standard", "soft", "fused"])
def test_export_greedy_generate_matches_fullband(exported, mode):
    _, fb, _, model = exported
    torch.manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,)).tolist() for n in (9, 4, 6)]
    ref = fb_generate(fb, prompts, 8, mode=mode, fused_passes=2)
    # The same prompts left-padded, as a tokenizer with padding_side="left" would give them.
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, decode_mode=mode, fused_passes=2, pad_token_id=0
    )
    assert torch.equal(out[:, width:], ref)
    # Unpadded single prompt.
    single = torch.tensor([prompts[0]])
    out = model.generate(single, max_new_tokens=8, do_sample=False, decode_mode=mode, fused_passes=2)
    assert torch.equal(out[:, single.shape[1] :], fb_generate(fb, single, 8, mode=mode, fused_passes=2))


def test_modes_differ(exported):
    _, fb, _, model = exported
    ids = torch.randint(3, VOCAB, (1, 6))
    outs = {
        m: model.generate(ids, max_new_tokens=10, do_sample=False, decode_mode=m)[0].tolist()
        for m in ("standard", "soft")
    }
    assert outs["standard"] != outs["soft"]  # the feedback is live, not silently dropped


def test_export_round_trip_preserves_logits(exported, tmp_path):
    _, _, _, model = exported
    model.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "fullband_model.py").is_file()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", trust_remote_code=True).eval()
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_register_loads_without_remote_code(exported):
    _, fb, exp, _ = exported
    register()
    register()  # idempotent
    from fullband.hf.modeling_fullband import FullBandForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exp).eval()
    assert type(model) is FullBandForCausalLM
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fb(ids).logits, atol=1e-5, rtol=0)


def test_sampling_num_return_sequences(exported):
    _, _, _, model = exported
    ids = torch.randint(3, VOCAB, (2, 5))
    for mode in ("soft", "fused"):
        torch.manual_seed(0)
        out = model.generate(
            ids, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, num_return_sequences=3, decode_mode=mode
        )
        assert out.shape == (6, 11)
        assert torch.equal(out[:, :5], ids.repeat_interleave(3, dim=0))


def test_beam_search(exported, tmp_path):
    _, fb, _, model = exported
    ids = torch.randint(3, VOCAB, (2, 5))
    for mode in ("standard", "soft", "fused"):
        out = model.generate(
            ids, max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False, decode_mode=mode
        )
        assert out.shape == (4, 10)
    # One beam is greedy search: the beam path must agree with fullband's greedy decode.
    out = model.generate(ids, max_new_tokens=5, num_beams=1, do_sample=False, decode_mode="soft")
    assert torch.equal(out[:, 5:], fb_generate(fb, ids, 5, mode="soft"))


def test_beam_search_standard_matches_source_llama(tmp_path):
    src, hf = _save_hf(tmp_path, "llama_gqa")
    exp = export_hf(convert_from_hf(src, tmp_path / "fb"), tmp_path / "exp")
    model = AutoModelForCausalLM.from_pretrained(exp, trust_remote_code=True).eval()
    ids = torch.randint(3, VOCAB, (2, 6))
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(model.generate(ids, decode_mode="standard", **kw), hf.generate(ids, **kw))


def test_generate_refusals(exported):
    _, _, _, model = exported
    from transformers import DynamicCache

    ids = torch.randint(3, VOCAB, (1, 4))
    with pytest.raises(ValueError, match="decode_mode"):
        model.generate(ids, max_new_tokens=2, decode_mode="jacobi")
    with pytest.raises(ValueError, match="use_cache"):
        model.generate(ids, max_new_tokens=2, decode_mode="soft", use_cache=False)
    with pytest.raises(ValueError, match="FullBandCache"):
        model.generate(ids, max_new_tokens=2, **{HF_CACHE_KEY: DynamicCache()})
    # Standard mode without a cache recomputes the prefix each step and gives the same tokens.
    a = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    b = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_import_fullband_hf_does_not_import_transformers():
    code = "import sys, fullband, fullband.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_convert_and_export_keep_bfloat16(tmp_path):
    from safetensors import safe_open

    src, _ = _save_hf(tmp_path, "llama_gqa")
    dst = convert_from_hf(src, tmp_path / "fb", dtype="bfloat16")
    exp = export_hf(dst, tmp_path / "exp", decode_mode="soft", fused_passes=2)
    with safe_open(str(exp / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embed.weight").dtype == torch.bfloat16
    generation = json.loads((exp / "generation_config.json").read_text())
    assert generation["decode_mode"] == "soft" and generation["fused_passes"] == 2
    with pytest.raises(ConfigError, match="dtype"):
        convert_from_hf(src, tmp_path / "fb2", dtype="bf16")


def test_a_converted_model_decodes_in_standard_mode_until_trained(tmp_path):
    """Its fusion was never trained: every door's default is standard, stored with the weights; an export may
    choose other defaults, including fused:auto, which its generate() then runs."""
    from fullband.decoding import DecodeSettings

    src, _ = _save_hf(tmp_path, "llama_gqa")
    dst = convert_from_hf(src, tmp_path / "fb")
    assert json.loads((dst / "generation_config.json").read_text())["decode_mode"] == "standard"
    model = load_pretrained(dst).eval()
    assert DecodeSettings.of(model) == DecodeSettings("standard")
    exp = export_hf(dst, tmp_path / "exp", decode_mode="fused", fused_passes="auto", fused_max_passes=5)
    generation = json.loads((exp / "generation_config.json").read_text())
    assert (generation["decode_mode"], generation["fused_passes"], generation["fused_max_passes"]) == \
        ("fused", "auto", 5)
    assert "decode_mode" not in json.loads((exp / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(exp, trust_remote_code=True)
    assert hf.generation_config.decode_mode == "fused"  # where a transformers user looks for generation defaults
    ids = torch.randint(3, VOCAB, (1, 6))
    out = hf.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    ref = fb_generate(model, ids, 4, mode="fused", fused_passes="auto", fused_max_passes=5)
    assert torch.equal(out.sequences[:, 6:], ref)
    # By value: the export's remote code has its own copy of the DecodeSettings class (fullband_decoding.py).
    assert out.past_key_values.settings.to_dict() == DecodeSettings("fused", "auto", fused_max_passes=5).to_dict()
    with pytest.raises(ConfigError, match="fused_passes must be an integer >= 1, 'auto' or 'exact', got 0"):
        export_hf(dst, tmp_path / "bad", fused_passes=0)


def test_forward_without_cache_fused_passes_match_multipass(exported):
    _, fb, _, model = exported
    ids = torch.randint(3, VOCAB, (2, 8))
    with torch.no_grad():
        ours = model(ids, decode_mode="fused", fused_passes=2).logits
        torch.testing.assert_close(ours, fb.multipass(ids, passes=3).logits[-1], atol=1e-5, rtol=0)


def test_identity_fusion_start_is_the_converted_model_in_every_mode(tmp_path):
    """fusion add + fusion_init identity on a converted (tiny random Llama) model: at step 0, fused(n) prefill
    logits, the exact sequential recurrence and soft/fused greedy tokens are the standard model's (float64), and
    the standard logits are transformers'. The paper's gate start, on the same weights, is not: it feeds the
    state through random weights."""
    from fullband.generation import sequential_forward

    src, hf = _save_hf(tmp_path, "llama_gqa")
    dst = convert_from_hf(src, tmp_path / "fb")
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    logits = {}
    for fusion, init in (("add", "identity"), ("gate", "random")):
        model = load_pretrained(dst).double().eval()
        config = FullBandConfig.from_dict({**model.config.to_dict(), "fusion": fusion, "fusion_init": init})
        start = FullBandLM(config).double().eval()
        trunk = {k: v for k, v in model.state_dict().items() if not k.startswith("fusion.")}
        start.load_state_dict(trunk, strict=False)
        with torch.no_grad():
            standard = start(ids).logits
            fused = start.prefill(ids, fused_passes=3).logits
            sequential, _ = sequential_forward(start, ids)
        logits[fusion] = (standard, fused, sequential)
        if fusion == "add":
            # 1e-6, not float64's 1e-12: both compute RoPE angles in float32 (fullband keeps inv_freq float32).
            torch.testing.assert_close(standard, hf.double()(ids).logits, atol=1e-6, rtol=0)
            torch.testing.assert_close(fused, standard, atol=0, rtol=0)
            torch.testing.assert_close(sequential, standard, atol=1e-12, rtol=0)
            plain = fb_generate(start, ids, 6, mode="standard")
            for mode in ("soft", "fused"):
                assert torch.equal(fb_generate(start, ids, 6, mode=mode, fused_passes=2), plain), mode
    standard, fused, sequential = logits["gate"]
    assert (fused - standard).abs().max() > 1e-3 and (sequential - standard).abs().max() > 1e-3


def test_identity_fusion_init_needs_add():
    with pytest.raises(ValueError, match="fusion_init.*'identity' needs fusion='add'"):
        FullBandConfig(fusion="gate", fusion_init="identity")
    with pytest.raises(ValueError, match="fusion_init.*allowed values: random, identity"):
        FullBandConfig(fusion="add", fusion_init="zero")


def test_gguf_file_errors_are_clear(tmp_path, monkeypatch):
    from fullband.errors import CheckpointError

    with pytest.raises(CheckpointError, match="no such GGUF file"):
        convert_from_hf(tmp_path, tmp_path / "out", gguf_file="absent.gguf")
    (tmp_path / "model.gguf").write_bytes(b"not a gguf file")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"needs the `transformers` and `gguf` packages: pip install 'fullband\[hf"):
        convert_from_hf(tmp_path, tmp_path / "out", gguf_file="model.gguf")
    monkeypatch.undo()
    if real_find_spec("gguf") is not None:
        with pytest.raises(ConfigError, match="transformers cannot read this GGUF file"):
            convert_from_hf(tmp_path, tmp_path / "out", gguf_file="model.gguf")


def test_convert_command_says_which_mode_it_stores(tmp_path, capsys):
    from fullband.cli import main

    src, _ = _save_hf(tmp_path, "llama_gqa")
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "fb")]) == 0
    out = capsys.readouterr().out
    assert "stored decode mode: standard" in out and "--model.fusion_init identity" in out
    assert main(["convert", "--from-hf", str(src), "--gguf-file", "absent.gguf", "--out", str(tmp_path / "x")]) == 2
    assert "no such GGUF file" in capsys.readouterr().err

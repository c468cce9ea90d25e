"""Hugging Face tokenizers for exports of fullband-trained models (byte and BPE tokenizers)."""

import json
import random

import pytest
import torch

from fullband.data.chat import apply_chat_template, end_of_turn_ids
from fullband.data.tokenizers import BPETokenizer, ByteTokenizer
from fullband.generation import generate
from fullband.hf import export_hf
from fullband.loading import encode_prompt
from fullband.model import FullBandConfig, FullBandLM

transformers = pytest.importorskip("transformers")

TEXTS = ["def f(x):\n    return x * 2\n", "Grüße, 世界! ✓ 🚀", "  leading spaces\tand tabs\r\n", "a<bos>b<|im_end|>c"]


def _random_text(rng: random.Random, n: int) -> str:
    pools = [(32, 127), (0xA0, 0x2FF), (0x370, 0x52F), (0x4E00, 0x4FFF), (0x1F300, 0x1F5FF), (9, 14)]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        chars.append(chr(rng.randrange(lo, hi)))
    return "".join(chars)


def _texts() -> list[str]:
    rng = random.Random(0)
    return TEXTS + [_random_text(rng, rng.randrange(1, 60)) for _ in range(60)]


def _bpe() -> BPETokenizer:
    return BPETokenizer.train(_texts() * 3, vocab_size=400)


TOKENIZERS = {
    "byte": ByteTokenizer,
    "byte-chat": lambda: ByteTokenizer().with_chat_tokens(),
    "bpe": _bpe,
    "bpe-chat": lambda: _bpe().with_chat_tokens(),
}


def _export(tmp_path, tok, name="exp"):
    torch.manual_seed(0)
    model = FullBandLM(FullBandConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                                      max_seq_len=128)).eval()
    with torch.no_grad():
        model.fusion.value_proj.weight.mul_(20)  # make the fed-back state matter, so the modes differ
    model.save_pretrained(tmp_path / "fb")
    tok.save(tmp_path / "fb" / "tokenizer")
    return model, export_hf(tmp_path / "fb", tmp_path / name)


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_hf_tokenizer_encodes_and_decodes_as_fullband(tmp_path, kind):
    tok = TOKENIZERS[kind]()
    _, exp = _export(tmp_path, tok)
    hf = transformers.AutoTokenizer.from_pretrained(exp, trust_remote_code=True)
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert len(hf) == tok.vocab_size
    for text in _texts():
        ids = tok.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf(text)["input_ids"] == encode_prompt(tok, text)
        decoded = tok.decode(ids)
        assert hf.decode(encode_prompt(tok, text) + [tok.eos_id], skip_special_tokens=True) == decoded
        # Special-token strings in text are special tokens (dropped when decoding) except in the plain byte tokenizer.
        assert decoded == text or (kind != "byte" and "<" in text)
    generation = json.loads((exp / "generation_config.json").read_text())
    assert generation["bos_token_id"] == tok.bos_id and generation["pad_token_id"] == tok.pad_id
    if tok.has_chat_tokens:
        end = tok.token_to_id("<|im_end|>")
        assert generation["eos_token_id"] == [tok.eos_id, end]
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße ✓\n x"},
                    {"role": "assistant", "content": " ok\n\nfine"}, {"role": "user", "content": "again"}]
        for gen_prompt in (True, False):
            assert hf.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=True,
                                          return_dict=False) == apply_chat_template(tok, messages, gen_prompt)
    else:
        assert generation["eos_token_id"] == tok.eos_id and hf.chat_template is None


@pytest.mark.parametrize("kind", ["byte", "bpe-chat"])
def test_pipeline_generates_as_fullband_in_every_mode(tmp_path, kind):
    tok = TOKENIZERS[kind]()
    model, exp = _export(tmp_path, tok)
    pipe = transformers.pipeline("text-generation", model=str(exp), trust_remote_code=True)
    prompt = "def add(a, b):"
    outputs = {}
    for mode in ("standard", "soft", "fused"):
        want = generate(model, [encode_prompt(tok, prompt)], 12, mode=mode, fused_passes=2, eos_token_id=tok.eos_id)
        got = pipe(prompt, max_new_tokens=12, do_sample=False, decode_mode=mode, fused_passes=2,
                   eos_token_id=tok.eos_id, return_tensors=True)[0]["generated_token_ids"]
        prompt_len = len(encode_prompt(tok, prompt))
        assert list(got[:prompt_len]) == encode_prompt(tok, prompt)
        assert list(got[prompt_len:]) == want[0].tolist()[: len(got) - prompt_len]
        outputs[mode] = list(got[prompt_len:])
        text = pipe(prompt, max_new_tokens=12, do_sample=False, decode_mode=mode, fused_passes=2,
                    eos_token_id=tok.eos_id)[0]["generated_text"]
        assert text == prompt + tok.decode(outputs[mode])
    assert outputs["standard"] != outputs["soft"]
    if tok.has_chat_tokens:  # a chat model's pipeline takes messages and answers with the built-in template
        messages = [{"role": "user", "content": "def add(a, b):"}]
        reply = pipe(messages, max_new_tokens=12, do_sample=False, decode_mode="soft")[0]["generated_text"][-1]
        ids = generate(model, [apply_chat_template(tok, messages)], 12, mode="soft")[0].tolist()
        stop = next((i for i, t in enumerate(ids) if t in end_of_turn_ids(tok)), len(ids))
        assert reply == {"role": "assistant", "content": tok.decode(ids[:stop])}


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
          " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _hf_bpe(specials: list[str], **names):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=350, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_texts() + [f"{a}+{b}" for a in range(10) for b in range(10)], trainer)
    return backend, transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **names)


def test_a_tokenizers_own_chat_template_is_used_with_its_assistant_spans(tmp_path):
    from fullband.data.chat import encode_record
    from fullband.data.tokenizers import HFTokenizer

    backend, hf = _hf_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>",
                          pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    hf.save_pretrained(tmp_path / "tok")
    tok = HFTokenizer(tmp_path / "tok")
    assert tok.chat_template is not None and tok.with_chat_tokens() is tok  # nothing added: it has a template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße?"},
                {"role": "assistant", "content": "Hallo ✓"}, {"role": "user", "content": "again"},
                {"role": "assistant", "content": "ok\n\nfine"}]
    # The same ids as transformers renders, behind the bos every fullband prompt starts with.
    for gen_prompt in (True, False):
        want = hf.apply_chat_template(messages[:4], add_generation_prompt=gen_prompt, tokenize=True, return_dict=False)
        assert apply_chat_template(tok, messages[:4], gen_prompt) == [tok.bos_id, *want]
    ids, mask = encode_record(tok, {"messages": messages})
    trained = backend.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == "Hallo ✓<|im_end|>\nok\n\nfine<|im_end|>\n"
    assert ids[-1] == tok.eos_id and not mask[-1]
    assert tok.token_to_id("<|im_end|>") in end_of_turn_ids(tok)
    assert tok.encode("\n")[0] not in end_of_turn_ids(tok)  # the template's "\n" after <|im_end|> is no stop


def test_sft_of_a_converted_hugging_face_model(tmp_path, capsys):
    """A Llama with a tokenizer without chat template: the built-in template's tokens are added to it and the
    vocabulary grows; its fusion weights start fresh (no run trained them); the tuned model chats."""
    from fullband.cli import main
    from fullband.data import load_tokenizer
    from fullband.hf import convert_from_hf
    from fullband.storage import list_checkpoints

    _, hf_tok = _hf_bpe(["<s>", "</s>", "<pad>"], bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))
    llama.save_pretrained(tmp_path / "src")
    hf_tok.save_pretrained(tmp_path / "src")
    convert_from_hf(tmp_path / "src", tmp_path / "fb")
    records = [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
               for a in range(10) for b in range(10)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "sft"
    assert main(["sft", str(tmp_path / "fb"), "--data.source", str(tmp_path / "chat.jsonl"), "--out-dir", str(out),
                 "--train.seq_len", "32", "--train.batch_size", "4", "--train.tokens", "256", "--train.device", "cpu",
                 "--train.progress", "false", "--eval.batches", "1", "--eval.batch_size", "4",
                 "--eval.sequential", "false"]) == 0
    model_dir = list_checkpoints(out)[-1] / "model"
    tok = load_tokenizer(model_dir / "tokenizer")
    assert tok.has_chat_tokens and tok.vocab_size == len(hf_tok) + 2
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == len(hf_tok) + 2
    assert "fusion weights freshly initialised" in capsys.readouterr().err
    assert main(["chat", str(out), "--message", "1+2", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("you> 1+2\nassistant> ")
    # Its export carries the built-in template and stops at <|im_end|>.
    exp = export_hf(model_dir, tmp_path / "exp")
    hf = transformers.AutoTokenizer.from_pretrained(exp, trust_remote_code=True)
    messages = [{"role": "user", "content": "3+4"}]
    assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) == \
        apply_chat_template(tok, messages)
    generation = json.loads((exp / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.eos_id, tok.token_to_id("<|im_end|>")]

"""Loss masks, isolated documents and the record formats (chat, prompt_answer) of prepared data."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fullband.data import DataConfig, open_dataset, prepare_dataset
from fullband.data.chat import apply_chat_template, encode_record, end_of_turn_ids
from fullband.data.shards import IGNORE_INDEX, make_batch
from fullband.data.sources import resolve_format
from fullband.data.tokenizers import ByteTokenizer
from fullband.errors import ConfigError, DataError
from fullband.generation import sequential_forward
from fullband.model import FullBandConfig, FullBandLM


def _tiny_model(**overrides) -> FullBandLM:
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64)
    return FullBandLM(FullBandConfig(**{**cfg, **overrides})).double().eval()


def _token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 5, "full_attention_every": 2}])
@pytest.mark.parametrize("passes", [1, 2, 3])
def test_packed_documents_score_as_if_alone(passes, overrides):
    model = _tiny_model(**overrides)
    gen = torch.Generator().manual_seed(1)
    lengths = [[7, 12, 5], [4, 4, 16]]
    docs = [[torch.randint(0, 40, (n + 1,), generator=gen) for n in row] for row in lengths]
    ids = torch.stack([torch.cat([d[:-1] for d in row]) for row in docs])
    segments = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    packed = model.multipass(ids, passes, segment_ids=segments)
    for b, row in enumerate(docs):
        start = 0
        for doc in row:
            n = len(doc) - 1
            alone = model.multipass(doc[None, :-1], passes)
            for k in range(passes):
                got = _token_losses(packed.logits[k][b : b + 1, start : start + n], doc[None, 1:])
                want = _token_losses(alone.logits[k], doc[None, 1:])
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
            start += n
    if passes > 1 or overrides:
        return
    # The exact recurrence (what soft decoding computes) isolates documents the same way.
    plain = torch.zeros_like(segments, dtype=torch.bool)
    plain[:, 1:] = segments[:, 1:] != segments[:, :-1]
    logits, _ = sequential_forward(model, ids, plain_mask=plain, segment_ids=segments)
    doc = docs[1][2]
    alone, _ = sequential_forward(model, doc[None, :-1])
    torch.testing.assert_close(logits[1:2, 8:], alone, rtol=1e-10, atol=1e-10)


def test_segment_ids_cannot_be_combined_with_a_cache():
    model = _tiny_model()
    with pytest.raises(ValueError, match="KV cache"):
        model(torch.zeros(1, 4, dtype=torch.long), segment_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=True)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _conversation(i: int) -> dict:
    return {"messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": f"What is {i} + {i}? é"},
        {"role": "assistant", "content": f"{2 * i}."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes ✓"},
    ]}


def _spans_from_mask(split, trained) -> list[list[int]]:
    """The trained token runs of a split's stream, decoded (each run ends with its end token)."""
    tokens = split.tokens(0, len(split))
    runs, current = [], []
    for t, m in zip(tokens, trained):
        if m:
            current.append(int(t))
        elif current:
            runs.append(current)
            current = []
    return runs


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_chat_loss_mask_is_the_assistant_turns(tmp_path, tokenizer):
    records = [_conversation(i) for i in range(60)]
    src = _write_jsonl(tmp_path / "chat.jsonl", records)
    ds = prepare_dataset(DataConfig(source=str(src), tokenizer=tokenizer, bpe_vocab_size=300, val_fraction=0.2),
                         tmp_path / "data")
    assert ds.manifest["record_format"] == "chat" and ds.manifest["isolate_documents"] is True
    tok = ds.tokenizer
    assert tok.has_chat_tokens
    end = tok.token_to_id("<|im_end|>")
    split = ds.split("train")
    runs = _spans_from_mask(split, np.asarray(split.loss_mask))
    # Every trained run is exactly one assistant turn, ending with its end-of-turn token.
    assert len(runs) == 2 * split.num_documents
    assert all(run[-1] == end for run in runs)
    answers = {tok.decode(run[:-1]) for run in runs}
    assert "Yes ✓" in answers and answers <= {"Yes ✓"} | {f"{2 * i}." for i in range(60)}
    # Token by token: the stream is each record's encoding, the mask its assistant spans.
    first = split.tokens(0, int(split.doc_starts[1]))
    ids, mask = encode_record(tok, _conversation(int(_first_doc_index(split, tok))))
    assert first.tolist() == ids and np.asarray(split.loss_mask[: len(ids)]).astype(bool).tolist() == mask


def _first_doc_index(split, tok) -> int:
    text = tok.decode(split.tokens(0, int(split.doc_starts[1])).tolist())
    return int(text.split("What is ")[1].split(" ")[0])


def test_batches_pack_whole_documents_and_follow_the_mask(tmp_path):
    rng = np.random.default_rng(0)
    # Documents of 6 to ~40 tokens; one longer than a window.
    records = [{"prompt": f"{i}*{i}=", "answer": "x" * int(rng.integers(1, 30))} for i in range(300)]
    records[5]["answer"] = "y" * 60
    src = _write_jsonl(tmp_path / "pa.jsonl", records)
    ds = prepare_dataset(DataConfig(source=str(src), val_fraction=0.1), tmp_path / "data")
    assert ds.manifest["record_format"] == "prompt_answer"
    split = ds.split("train")
    tokens, mask, starts = split.tokens(0, len(split)), np.asarray(split.loss_mask), split.doc_starts
    ends = np.append(starts[1:], len(split))
    doc_of = np.searchsorted(starts, np.arange(len(split)), side="right") - 1
    seq_len = 32
    windows = split.window_starts(seq_len)
    assert set(windows) <= set(starts)  # every window starts at a document start
    batch = make_batch(split, windows, seq_len)
    trained = np.zeros(len(split), dtype=int)
    for r, s in enumerate(windows):
        for t in range(seq_len):
            i, j = s + t, s + t + 1
            d = doc_of[i]
            whole = starts[d] >= s and ends[d] <= s + seq_len + 1
            expected = int(tokens[j]) if mask[j] and doc_of[j] == d and (whole or starts[d] == s) else IGNORE_INDEX
            assert int(batch.targets[r, t]) == expected
            trained[j] += expected != IGNORE_INDEX
            assert int(batch.segment_ids[r, t]) == d - doc_of[s]
            assert bool(batch.plain_mask[r, t]) == (t == 0 or starts[d] == i)
    # One epoch trains every answer token once, except past a window's end in the over-long document and
    # the documents after the last window that fits.
    last_doc = doc_of[windows[-1] + seq_len]
    for d in range(last_doc):
        span = range(starts[d] + 1, ends[d])
        expected = [int(mask[j]) if ends[d] - starts[d] <= seq_len + 1 or j <= starts[d] + seq_len else 0
                    for j in span]
        assert trained[list(span)].tolist() == expected, d
    # The answer and its end-of-document token are the trained tokens of each document.
    ids, answer_mask = encode_record(ds.tokenizer, {"prompt": "3*3=", "answer": "9"})
    assert [i for i, m in zip(ids, answer_mask) if m] == [ord("9"), ds.tokenizer.eos_id]


def test_text_sources_keep_every_target_and_no_segments(tmp_path):
    src = _write_jsonl(tmp_path / "t.jsonl", [{"text": f"document {i} " * 5} for i in range(50)])
    ds = prepare_dataset(DataConfig(source=str(src)), tmp_path / "data")
    assert ds.manifest["record_format"] == "text" and "loss_mask" not in ds.manifest["splits"]["train"]
    batch = next(ds.split("train").eval_batches(16, 2))
    assert batch.segment_ids is None and bool((batch.targets != IGNORE_INDEX).all())
    isolated = prepare_dataset(DataConfig(source=str(src), isolate_documents=True), tmp_path / "iso")
    assert next(isolated.split("train").eval_batches(16, 2)).segment_ids is not None


def test_synthetic_prompt_answer_holds_the_same_tokens(tmp_path):
    text = prepare_dataset(DataConfig(source="synthetic:addition", synthetic_train_examples=200,
                                      synthetic_val_examples=20), tmp_path / "text")
    pa = prepare_dataset(DataConfig(source="synthetic:addition", synthetic_train_examples=200,
                                    synthetic_val_examples=20, format="prompt_answer"), tmp_path / "pa")
    assert text.manifest["record_format"] == "text"
    a, b = text.split("train"), pa.split("train")
    assert a.tokens(0, len(a)).tolist() == b.tokens(0, len(b)).tolist()
    assert 0 < np.asarray(b.loss_mask).mean() < 1


def test_format_detection_and_errors(tmp_path):
    chat = _write_jsonl(tmp_path / "c.jsonl", [_conversation(1)])
    assert resolve_format(DataConfig(source=str(chat))) == "chat"
    pa = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "b", "id": 3}])
    assert resolve_format(DataConfig(source=str(pa))) == "prompt_answer"
    assert resolve_format(DataConfig(source="synthetic:addition")) == "text"
    with pytest.raises(ConfigError, match="data.format"):
        DataConfig(format="sharegpt")
    txt = tmp_path / "a.txt"
    txt.write_text("hello\n" * 10)
    with pytest.raises(ConfigError, match="plain text"):
        resolve_format(DataConfig(source=str(txt), format="chat"))
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 40)
    with pytest.raises(DataError, match="no assistant message"):
        prepare_dataset(DataConfig(source=str(bad)), tmp_path / "bad")
    wrong_role = _write_jsonl(tmp_path / "role.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match="role"):
        prepare_dataset(DataConfig(source=str(wrong_role)), tmp_path / "role")
    no_answer = _write_jsonl(tmp_path / "na.jsonl", [{"prompt": "x", "answer": 3}])
    with pytest.raises(DataError, match="'answer'"):
        prepare_dataset(DataConfig(source=str(no_answer), format="prompt_answer"), tmp_path / "na")


def test_datasets_of_the_previous_format_version_are_refused(tmp_path):
    src = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}", "answer": "x"} for i in range(40)])
    prepare_dataset(DataConfig(source=str(src)), tmp_path / "data")
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    manifest["version"] = 1
    (tmp_path / "data" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="format version 2.*overwrite"):
        open_dataset(tmp_path / "data")


def test_builtin_chat_template_and_end_of_turn():
    tok = ByteTokenizer().with_chat_tokens()
    messages = [{"role": "user", "content": "Hi <|im_end|>"}]
    ids = apply_chat_template(tok, messages)
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    # Special token strings in text are special tokens, as in Hugging Face tokenizers.
    expected = [tok.bos_id, start, *b"user\nHi ", end, end, *b"\n", start, *b"assistant\n"]
    assert ids == expected
    assert apply_chat_template(tok, messages, add_generation_prompt=False) == expected[:-11]
    assert end_of_turn_ids(tok) == [end, tok.eos_id]
    with pytest.raises(DataError, match="chat tokens"):
        apply_chat_template(ByteTokenizer(), messages)
    with pytest.raises(DataError, match="role"):
        apply_chat_template(tok, [{"role": "robot", "content": "x"}])

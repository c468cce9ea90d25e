"""Instruction tuning: --init-from an FBT keeps its fusion weights, chat tokens grow the vocabulary,
`fullband sft` defaults (chat format, three passes), and `fullband chat`."""

from __future__ import annotations

import json

import pytest
import test_train
import torch
import yaml
from safetensors.torch import load_file
from test_train import steps_of, tiny_config

from fullband.cli import main
from fullband.data import load_tokenizer
from fullband.data.chat_examples import synthetic_chat_records
from fullband.data.synthetic import write_jsonl
from fullband.storage import list_checkpoints
from fullband.train import train

parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)


@pytest.fixture(scope="module")
def fbt_run(tmp_path_factory, parity_data):
    run = tmp_path_factory.mktemp("fbt") / "run"
    train(tiny_config(train={"tokens": steps_of(2), "schedule": "fixed:2"}), run, data_dir=parity_data)
    return run


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    # Conversations short enough for the tiny model's 32-token windows (the built-in template adds 23 tokens).
    records = [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": f"{a + b}"}]}
               for a in range(10) for b in range(10)]
    return write_jsonl(records, tmp_path_factory.mktemp("chat") / "chat.jsonl")


def test_synthetic_chat_records_are_valid_conversations():
    records = synthetic_chat_records(50, seed=3)
    assert records == synthetic_chat_records(50, seed=3)
    for r in records:
        roles = [m["role"] for m in r["messages"]]
        turns = roles[1:] if roles[0] == "system" else roles
        assert turns in (["user", "assistant"], ["user", "assistant", "user", "assistant"])
        question, answer = r["messages"][roles.index("user")]["content"], r["messages"][roles.index("assistant")]
        assert question.startswith("Solve this ") and answer["content"].startswith("The answer is ")


def _weights(run):
    return load_file(str(list_checkpoints(run)[-1] / "model" / "model.safetensors"))


@pytest.mark.parametrize("init_fusion", ["auto", "reset"])
def test_sft_of_an_fbt_keeps_its_fusion_and_adds_chat_tokens(fbt_run, chat_file, tmp_path, init_fusion):
    source = _weights(fbt_run)
    tokenizer_dir = list_checkpoints(fbt_run)[-1] / "model" / "tokenizer"
    # lr 0: the checkpoint holds the initial weights of the fine-tuning run.
    cfg = tiny_config(data={"source": str(chat_file), "format": "chat", "tokenizer": str(tokenizer_dir)},
                      train={"tokens": steps_of(1), "schedule": "fixed:3", "lr": 0.0, "init_fusion": init_fusion})
    result = train(cfg, tmp_path / "sft", init_from=fbt_run)
    start = _weights(tmp_path / "sft")
    assert start["embed.weight"].shape[0] == 261  # 259 bytes and framing tokens + <|im_start|>, <|im_end|>
    torch.testing.assert_close(start["embed.weight"][:259], source["embed.weight"], rtol=0, atol=0)
    mean = source["embed.weight"].mean(dim=0)
    for row in (259, 260):
        torch.testing.assert_close(start["embed.weight"][row], mean)
    for k in source:
        if k.startswith("fusion."):  # trained in the source run (matrices and norms), so reset changes them
            assert torch.equal(start[k], source[k]) == (init_fusion == "auto"), k
        elif k != "embed.weight":
            assert torch.equal(start[k], source[k]), k
    tok = load_tokenizer(list_checkpoints(tmp_path / "sft")[-1] / "model" / "tokenizer")
    assert tok.has_chat_tokens and tok.vocab_size == 261
    # Validation scores the assistant tokens only, in every decode mode.
    assert set(result.final_eval.loss) == {"standard", "fused(1)"}
    assert 0 < result.final_eval.tokens < cfg.eval.batch_size * cfg.train.seq_len


def test_sft_command_defaults_and_chat(fbt_run, chat_file, tmp_path, capsys):
    out = tmp_path / "sft"
    code = main(["sft", str(fbt_run), "--data.source", str(chat_file), "--out-dir", str(out),
                 "--train.tokens", str(steps_of(2)), "--eval.fused_passes", "2"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "trained tokens" in printed and "fused(2)" in printed
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["schedule"] == "fixed:3" and saved["data"]["format"] == "chat"
    assert saved["train"]["seq_len"] == test_train.SEQ  # the source run's training settings carry over
    assert [json.loads(line)["passes"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [3, 3]

    code = main(["chat", str(out), "--message", "1+2", "--max-new-tokens", "4", "--mode", "fused", "--device", "cpu"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "you> 1+2" and lines[1].startswith("assistant> ") and len(lines) == 2
    # A second turn does not fit the tiny model's 32 positions: a clear error after the first answer.
    assert main(["chat", str(out), "--message", "1+2", "--message", "3+4", "--device", "cpu"]) == 2
    assert "max_seq_len is 32: start a new conversation" in capsys.readouterr().err


def test_sft_errors_are_clear(fbt_run, tmp_path, capsys):
    assert main(["sft", str(fbt_run), "--out-dir", str(tmp_path / "x")]) == 2
    assert "--data.source" in capsys.readouterr().err
    # A model that was never instruction-tuned has no chat template to chat with.
    assert main(["chat", str(fbt_run), "--message", "hi", "--device", "cpu"]) == 2
    assert "fullband train --data.format chat" in capsys.readouterr().err

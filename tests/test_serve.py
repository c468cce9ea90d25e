"""``fullband serve`` end to end: the official ``openai`` client against a real uvicorn server started on a free
port of 127.0.0.1, serving a tiny float64 model saved by the test (float64 so that greedy choices are not
flipped by the rounding differences between batch shapes)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from conftest import make_model
from serve_helpers import Server, ThreadServer, save_model

from fullband.data.chat import apply_chat_template, end_of_turn_ids
from fullband.data.tokenizers import ByteTokenizer
from fullband.generation import generate
from fullband.loading import encode_prompt

MODES = [("standard", 1), ("soft", 1), ("fused", 1), ("fused", 2), ("fused", "auto")]
TOK = ByteTokenizer(chat=True)  # the byte tokenizer with the built-in chat template's tokens
NAME = "tiny"


@pytest.fixture(scope="module")
def model():
    # init_std 0.1 (conftest's): the random fed-back state map contracts, so float64 rounding differences between
    # batch shapes stay at 1e-15 over a generation (with 0.3 they grow tenfold per step and flip near-ties).
    return make_model(seed=5, dtype=torch.float64, vocab_size=TOK.vocab_size, d_model=48, n_heads=4, n_kv_heads=2,
                      max_seq_len=160)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    srv = Server(save_model(model, root / NAME, TOK), root / "server.log", "--max-batch", "6", "--dtype", "float64")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def expected_text(model, prompt: str, max_tokens: int, mode: str, passes: int) -> tuple[str, str]:
    """(text, finish_reason) of fullband.generation.generate for the same request."""
    tokens = generate(model, [encode_prompt(TOK, prompt)], max_tokens, mode=mode, fused_passes=passes,
                      eos_token_id=TOK.eos_id)[0].tolist()
    if TOK.eos_id in tokens:
        return TOK.decode(tokens[: tokens.index(TOK.eos_id)]), "stop"
    return TOK.decode(tokens), "length"


def complete(client, prompt, max_tokens=20, mode="soft", passes=1, **kwargs):
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"decode_mode": mode, "fused_passes": passes}, **kwargs)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    health = server.health()
    assert health["status"] == "ok" and health["max_batch"] == 6 and health["max_model_len"] == 160


@pytest.mark.parametrize("mode,passes", MODES)
def test_completion_equals_generate(client, model, mode, passes, single_thread):
    out = complete(client, "def f(x):", 24, mode, passes)
    text, finish = expected_text(model, "def f(x):", 24, mode, passes)
    assert out.choices[0].text == text and out.choices[0].finish_reason == finish
    assert out.usage.prompt_tokens == len(encode_prompt(TOK, "def f(x):"))
    assert out.usage.completion_tokens == (24 if finish == "length" else len(TOK.encode(text)) + 1)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_concurrent_clients_equal_one_at_a_time_in_every_mode(client, model, server, single_thread):
    """The required test: requests of all modes served concurrently (so they share batches, join and leave
    at different steps) give the same greedy text as one at a time, and as generate()."""
    jobs = [(f"{'ab' * i}x = {i}", 8 + 5 * i % 23, *MODES[i % len(MODES)]) for i in range(12)]
    alone = [complete(client, p, n, m, k).choices[0].text for p, n, m, k in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: complete(client, *job).choices[0].text, jobs))
    assert together == alone
    assert alone == [expected_text(model, p, n, m, k)[0] for p, n, m, k in jobs]
    health = server.health()
    assert health["running"] == 0 and health["peak_batch"] > 1  # the concurrent requests did share batches


def test_streaming_matches_and_ends_with_done(client, server):
    full = complete(client, "import os", 30, "fused", 2)
    chunks = list(complete(client, "import os", 30, "fused", 2, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    chat_like = {"model": NAME, "prompt": "import os", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=chat_like, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert len(lines) == 5 + 1  # one chunk per token


def test_n_and_seeded_sampling(client):
    def sample(seed, n=3, prompt="class A:"):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=1.0, top_p=0.95,
                                        n=n, seed=seed)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = sample(11)
    assert len(first) == 3 and len(set(first)) > 1  # seed s + j per choice: the choices differ
    assert sample(11) == first  # and are reproducible
    # Seeded results do not depend on what else is in the batch.
    with ThreadPoolExecutor(4) as pool:
        crowd = [pool.submit(sample, s, 2, "x" * (s + 1)) for s in range(3)]
        again = pool.submit(sample, 11)
        assert again.result() == first
        [c.result() for c in crowd]
    assert sample(12) != first
    # Streamed, the choices' chunks interleave and carry their index.
    streamed = ["", "", ""]
    for chunk in client.completions.create(model=NAME, prompt="class A:", max_tokens=16, temperature=1.0,
                                           top_p=0.95, n=3, seed=11, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == first


def test_stop_strings(client, model, single_thread):
    text, _ = expected_text(model, "for i in", 40, "soft", 1)
    stop = text[10:13]
    cut = text.index(stop)
    out = complete(client, "for i in", 40, stop=[stop, "\u2603never"])
    assert out.choices[0].text == text[:cut] and out.choices[0].finish_reason == "stop"
    streamed = list(complete(client, "for i in", 40, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(client, model):
    out = complete(client, "while", 6, "soft", logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(len(top) <= 3 for top in lp.top_logprobs)
    with torch.no_grad():
        first = model.prefill(torch.tensor([encode_prompt(TOK, "while")])).logits[0, -1].log_softmax(-1)
    top3 = first.topk(3).values.tolist()
    assert lp.token_logprobs[0] == pytest.approx(top3[0], abs=1e-9)  # greedy: the most likely token
    # Tokens that decode to the same text (e.g. lone UTF-8 bytes) share a key, so only check membership.
    assert all(any(abs(v - t) < 1e-9 for t in top3) for v in lp.top_logprobs[0].values())


@pytest.mark.parametrize("body,param,message", [
    ({"decode_mode": "jacobi"}, "decode_mode", "unknown decode_mode"),
    ({"fused_passes": 0, "decode_mode": "fused"}, "fused_passes",
     "fused_passes must be an integer >= 1, 'auto' or 'exact'"),
    ({"fused_passes": "many"}, "fused_passes", "fused_passes must be an integer >= 1, 'auto' or 'exact', got 'many'"),
    # The server's settings (here the model's stored ones) bound the passes one request may run.
    ({"fused_passes": 9, "decode_mode": "fused"}, "fused_passes", "fused_passes must be at most 8 here"),
    ({"fused_passes": "auto", "decode_mode": "fused", "fused_max_passes": 9}, "fused_max_passes",
     "fused_max_passes must be at most 8 here"),
    ({"fused_tol": -1}, "fused_tol", "fused_tol must be a number >= 0"),
    ({"max_tokens": 155}, "max_tokens", "exceeds the model's context length 160"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"n": 7}, "n", "max batch 6"),
    ({"logprobs": 9}, "logprobs", "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop"),
    ({"prompt": [300]}, None, "outside the model's vocabulary"),
])
def test_bad_requests_get_400(client, server, body, param, message):
    request = {"model": NAME, "prompt": "x" * 10, "max_tokens": 4, **body}
    response = httpx.post(server.url + "/v1/completions", json=request, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    extra = {k: request.pop(k) for k in ("decode_mode", "fused_passes", "fused_tol", "fused_max_passes")
             if k in request}
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(**request, extra_body=extra)


def test_malformed_json_unknown_model_and_routes(client, server):
    response = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    nulls = {"model": NAME, "prompt": "x", "max_tokens": 2, "temperature": None, "top_p": None, "n": None,
             "stop": None, "seed": None, "stream": None, "logprobs": None, "decode_mode": None}
    response = httpx.post(server.url + "/v1/completions", json=nulls, timeout=30)
    assert response.status_code == 200 and len(response.json()["choices"]) == 1  # null = the default
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert httpx.get(server.url + "/v1/nothing", timeout=30).json()["error"]["type"] == "not_found_error"
    assert complete(client, "still alive", 3).choices[0].finish_reason in ("stop", "length")


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3 + 3?"}]


def expected_chat(model, messages, max_tokens: int, mode: str, passes: int) -> tuple[str, str]:
    tokens = generate(model, [apply_chat_template(TOK, messages)], max_tokens, mode=mode,
                      fused_passes=passes)[0].tolist()
    ends = [i for i, t in enumerate(tokens) if t in end_of_turn_ids(TOK)]
    return (TOK.decode(tokens[: ends[0]]), "stop") if ends else (TOK.decode(tokens), "length")


@pytest.mark.parametrize("mode,passes", MODES)
def test_chat_equals_generate(client, model, mode, passes, single_thread):
    out = client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=30, temperature=0,
                                         extra_body={"decode_mode": mode, "fused_passes": passes})
    text, finish = expected_chat(model, CONVERSATION, 30, mode, passes)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text and out.choices[0].finish_reason == finish
    assert out.usage.prompt_tokens == len(apply_chat_template(TOK, CONVERSATION))


def test_chat_streaming_n_and_logprobs(client, model):
    full = client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    # Without max_tokens a chat answer may run to the end of the context.
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    sampled = client.chat.completions.create(model=NAME, messages=messages, n=2, seed=3, temperature=1.0,
                                             logprobs=True, top_logprobs=2)
    assert len(sampled.choices) == 2 and sampled.choices[0].message.content != sampled.choices[1].message.content
    assert sum(len(c.logprobs.content) for c in sampled.choices) == sampled.usage.completion_tokens
    for choice in sampled.choices:
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
        room = model.config.max_seq_len - sampled.usage.prompt_tokens
        assert choice.finish_reason == "stop" or (choice.finish_reason == "length"
                                                  and len(choice.logprobs.content) == room)
    with pytest.raises(openai.BadRequestError, match="message"):
        client.chat.completions.create(model=NAME, messages=[], max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}], max_tokens=3)


# ---- a server with one slot and no queue: 429 and disconnects -------------------------------------------------


@pytest.fixture(scope="module")
def busy_server():
    # Slow enough (a few milliseconds per token even on an idle machine) that a 900-token request is still
    # running while the test acts on it.
    big = make_model(seed=1, vocab_size=256 + 3, d_model=512, n_layers=6, n_heads=8, d_ff=1024, max_seq_len=1024)
    srv = ThreadServer(big, ByteTokenizer(), NAME, max_batch=1, max_queue=0)  # plain bytes: no chat template
    yield srv
    srv.close()


def test_queue_full_429_and_disconnect_cancels(busy_server, single_thread):
    # ignore_eos: a random model may end its answer early (this one, greedy, after 33 tokens on some CPUs),
    # and the test needs the 900-token request to be still running while it acts on it.
    body = {"model": NAME, "prompt": "a", "max_tokens": 900, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", busy_server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert busy_server.health()["running"] == 1
        refused = httpx.post(busy_server.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "busy" in refused.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=busy_server.url + "/v1", api_key="unused", max_retries=0).completions.create(
                model=NAME, prompt="b", max_tokens=3)
    # The client went away mid-stream: its sequence is cancelled and the slot frees.
    deadline = time.monotonic() + 10
    while busy_server.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    health = busy_server.health()
    assert health["running"] == 0 and health["cancelled"] == 1 and health["completed"] == 0
    out = httpx.post(busy_server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
    assert out.status_code == 200 and json.loads(out.text)["choices"][0]["finish_reason"] in ("stop", "length")

    # A client that gives up on a non-streamed answer cancels it too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(busy_server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    deadline = time.monotonic() + 10
    while busy_server.health()["cancelled"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    health = busy_server.health()
    assert health["cancelled"] == 2 and health["running"] == 0 and health["completed"] == 1


def test_chat_without_template_is_refused(busy_server):
    assert busy_server.health()["chat"] is False
    client = openai.OpenAI(base_url=busy_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="instruction-tun"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)

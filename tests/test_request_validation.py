"""One check of a request's parameters (``fullband.sampling.check_request``) for every door: a refusal names its
parameter as data (``RequestError.param``), never as text to be matched, and ``generate``, the server's engine and
the HTTP API refuse the same request under the same parameter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_model
from fastapi.testclient import TestClient

from fullband.data.tokenizers import ByteTokenizer
from fullband.engine import Engine, Sequence
from fullband.generation import generate
from fullband.loading import encode_prompt
from fullband.sampling import LogitsAdjustments, RequestError, RequestLimits, SamplingParams, check_request
from fullband.serve.app import create_app

TOK = ByteTokenizer(chat=True)
CONTEXT = 40


@pytest.fixture(scope="module")
def model():
    return make_model(seed=0, vocab_size=TOK.vocab_size, max_seq_len=CONTEXT)


def refused(call) -> RequestError:
    with pytest.raises(RequestError) as info:
        call()
    return info.value


# (the request's fields and prompts, the parameter check_request names, a part of the message)
CASES = [
    (dict(max_tokens=0), "max_tokens", "max_tokens must be >= 1, got 0"),
    (dict(temperature=-0.5), "temperature", "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature", "temperature must be >= 0"),
    (dict(top_k=0), "top_k", "top_k must be >= 1, or None for every token"),
    (dict(top_p=0.0), "top_p", "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p", "top_p must be in (0, 1]"),
    (dict(min_tokens=5), "min_tokens", "min_tokens (5) must be at most max_tokens (4)"),
    (dict(logit_bias={999: 1.0}), "logit_bias", "logit_bias: token id 999"),
    (dict(stop_token_ids=[999]), "stop_token_ids", "stop_token_ids: token id 999 is outside"),
    (dict(stop_token_ids=[True]), "stop_token_ids", "stop_token_ids must hold integer token ids"),
    (dict(logprobs=21), "logprobs", "logprobs must be between 0 and 20"),
    (dict(prompts=[[1, 999]]), "prompt", "token id 999 is outside the model's vocabulary"),
    (dict(prompts=torch.tensor([[1, -1]])), "prompt", "token id -1 is outside the model's vocabulary"),
    (dict(prompts=[[]]), "prompt", "the prompt is empty"),
    (dict(prompts=[[1] * (CONTEXT - 3)]), "max_tokens", f"exceeds the model's context length {CONTEXT}"),
    (dict(prompts=torch.ones(2, CONTEXT - 3, dtype=torch.long)), "max_tokens", "exceeds"),
]


@pytest.mark.parametrize("kwargs,param,message", CASES)
def test_each_refusal_names_its_parameter(model, kwargs, param, message):
    args = {"prompts": [[1, 2, 3]], "max_tokens": 4, **kwargs}
    prompts = args.pop("prompts")
    error = refused(lambda: check_request(model.config, prompts, SamplingParams(**args)))
    assert error.param == param and message in str(error), (error.param, str(error))
    assert isinstance(error, ValueError)  # callers that catch ValueError (the command line) still do


def test_limits_set_a_door_s_bounds_and_names(model):
    api = RequestLimits(max_temperature=2, max_logprobs=5, logprobs_name="top_logprobs", top_k_every=(-1, 0),
                        max_tokens_name="max_new_tokens", context_name="max_seq_len", min_max_tokens=0)
    check = lambda **kw: check_request(model.config, [[1, 2]], SamplingParams(**{"max_tokens": 4, **kw}), api)  # noqa: E731
    check(top_k=-1, max_tokens=0, temperature=2, logprobs=5)
    assert refused(lambda: check(temperature=2.5)).args[0] == "temperature must be in [0, 2] (0 = greedy), got 2.5"
    error = refused(lambda: check(logprobs=6))
    assert (error.param, str(error)) == ("top_logprobs", "top_logprobs must be between 0 and 5, got 6")
    assert "top_k must be >= 1, or -1 or 0 for every token, got -2" in str(refused(lambda: check(top_k=-2)))
    error = refused(lambda: check(max_tokens=-1))
    assert (error.param, str(error)) == ("max_new_tokens", "max_new_tokens must be >= 0, got -1")
    error = refused(lambda: check(max_tokens=CONTEXT))
    assert error.param == "max_new_tokens" and "plus max_new_tokens (40) = 42 exceeds the model's max_seq_len 40" \
        in str(error)


@pytest.mark.parametrize("kwargs,param", [
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9}, "min_tokens"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {3: 101}}, "logit_bias"), ({"logit_bias": {3: 1, "3": 2}}, "logit_bias"),
    ({"logit_bias": {999: 1}}, "logit_bias"),
])
def test_the_sampling_fields_name_themselves(kwargs, param):
    assert refused(lambda: LogitsAdjustments.of(TOK.vocab_size, 8, **kwargs)).param == param


# The same bad request at the three doors: generate's keyword arguments, the engine's parameters (built unchecked,
# as a caller may), the API's body fields, and the parameter they name (generate's, the engine's and the API's).
DOORS = [
    ({"temperature": -1.0}, SamplingParams(4, temperature=-1.0), {"temperature": -1}, "temperature", "temperature"),
    ({"top_p": 0.0}, SamplingParams(4, top_p=0.0), {"top_p": 0}, "top_p", "top_p"),
    ({"min_tokens": 5}, SamplingParams(4, min_tokens=5), {"min_tokens": 5},
     "min_tokens", "min_tokens"),
    ({"stop_token_ids": [999]}, SamplingParams(4, stop_token_ids=(999,)), {"stop_token_ids": [999]},
     "stop_token_ids", "stop_token_ids"),
    ({"logit_bias": {999: 1.0}}, SamplingParams(4, logit_bias={999: 1.0}),
     {"logit_bias": {"999": 1}}, "logit_bias", "logit_bias"),
    ({"max_new_tokens": CONTEXT}, SamplingParams(CONTEXT), {"max_tokens": CONTEXT}, "max_new_tokens",
     "max_tokens"),
]


@pytest.mark.parametrize("generate_kwargs,params,body,generate_param,param", DOORS)
def test_generate_the_engine_and_the_api_refuse_alike(model, generate_kwargs, params, body, generate_param, param):
    prompt = encode_prompt(TOK, "hi")  # as the API encodes its prompt
    from_generate = refused(lambda: generate(model, [prompt], **{"max_new_tokens": 4, **generate_kwargs}))
    assert from_generate.param == generate_param
    engine = Engine(model)
    from_engine = refused(lambda: engine.submit([Sequence(prompt, params, print)]))
    assert from_engine.param == param and engine.stats()["waiting"] == 0
    with TestClient(create_app(Engine(model), TOK, "m")) as client:
        for path, extra in (("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            response = client.post(path, json={"model": "m", "max_tokens": 4, **extra, **body})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param, error
            # The same prompt and budget: the engine's words, but for the API's own temperature range, OpenAI's.
            if path == "/v1/completions" and param != "temperature":
                assert error["message"] == str(from_engine), (error, str(from_engine))


def test_the_api_s_own_rules(model):
    with TestClient(create_app(Engine(model), TOK, "m")) as client:
        def error(path: str, **body) -> dict:
            response = client.post(path, json={"model": "m", "max_tokens": 2, **body})
            assert response.status_code == 400, response.text
            return response.json()["error"]

        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert error("/v1/chat/completions", top_logprobs=2, **chat)["param"] == "top_logprobs"  # without logprobs
        assert error("/v1/chat/completions", logprobs=True, top_logprobs=21, **chat)["param"] == "top_logprobs"
        assert error("/v1/completions", prompt="hi", logprobs=6)["param"] == "logprobs"
        assert error("/v1/completions", prompt="hi", temperature=2.5)["message"].startswith(
            "temperature must be in [0, 2]")
        assert error("/v1/completions", prompt="hi", top_k=-2)["param"] == "top_k"
        assert error("/v1/completions", prompt=[[1, 999]])["param"] == "prompt"
        assert error("/v1/completions", prompt="hi", decode_mode="fused", fused_passes=99)["param"] == "fused_passes"
        for top_k in (-1, 0):  # every token, as in vLLM
            body = {"model": "m", "prompt": "hi", "max_tokens": 2, "top_k": top_k}
            assert client.post("/v1/completions", json=body).status_code == 200
    every = SamplingParams(max_tokens=2, top_k=-1)
    assert every.sampled_top_k is None and dataclasses.replace(every, seed=1).sampled_top_k is None
    check_request(model.config, [[1]], every, RequestLimits(top_k_every=(-1, 0)))  # the server's: every token
    assert refused(lambda: check_request(model.config, [[1]], every)).param == "top_k"  # not every door means all

"""The OpenAI and vLLM sampling fields (``fullband.sampling``): each one against a reference on the same logits
(transformers' logits processors where one exists, the OpenAI formula otherwise), applied by the one decode loop in
every decode mode through ``generate``, the server's engine (rows of one batch with different fields), ``fullband
serve`` and ``fullband generate`` / ``chat``; and a server that refuses, with a 400 naming it, every field it does
not implement, and answers a barrage of malformed requests with clear 4xx errors before serving normally again."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from conftest import make_model
from serve_helpers import ThreadServer, save_model
from test_serve_page import browser  # noqa: F401 (the headless browser fixture; skips when there is none)
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from fullband import engine, generation
from fullband.cli import main
from fullband.data.chat import apply_chat_template, end_of_turn_ids
from fullband.data.tokenizers import ByteTokenizer
from fullband.decoding import DecodeSettings
from fullband.engine import Engine, Sequence
from fullband.generation import generate, score_continuations
from fullband.loading import encode_prompt
from fullband.sampling import BatchAdjuster, LogitsAdjustments, SamplingParams

TOK = ByteTokenizer(chat=True)
V = TOK.vocab_size
NAME = "tiny"
MODES = [("standard", {"mode": "standard"}), ("soft", {"mode": "soft"}),
         ("fused:1", {"mode": "fused", "fused_passes": 1}), ("fused:auto", {"mode": "fused", "fused_passes": "auto"}),
         ("fused:exact", {"mode": "fused", "fused_passes": "exact"})]
# Strong enough to change greedy tokens of the tiny model in every mode; the bias favours a byte the model rarely
# picks and pushes away the one it picks most.
# The bias as JSON keys it: strings.
JSON_BIAS = {str(k): v for k, v in {ord("e"): 4.0, ord(" "): -3.0}.items()}
FIELDS = {"logit_bias": {ord("e"): 4.0, ord(" "): -3.0}, "presence_penalty": 1.5, "frequency_penalty": 0.7,
          "repetition_penalty": 1.6, "min_tokens": 0}
PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def model():
    return make_model(seed=5, dtype=torch.float64, vocab_size=V, d_model=48, n_heads=4, n_kv_heads=2, max_seq_len=160)


def reference_adjust(logits: torch.Tensor, prompt: list[int], generated: list[int], fields: dict,
                     end_ids: list[int]) -> torch.Tensor:
    """(V,) logits adjusted by transformers' processors (min_tokens, logit_bias, repetition) and the OpenAI formula
    (presence and frequency over the generated tokens), in vLLM's order."""
    ids = torch.tensor([prompt + generated])
    scores = logits.clone().unsqueeze(0)
    if fields.get("min_tokens", 0) and end_ids:
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), fields["min_tokens"], end_ids)(ids, scores)
    if fields.get("logit_bias"):
        scores = SequenceBiasLogitsProcessor([[[int(t)], b] for t, b in fields["logit_bias"].items()])(ids, scores)
    if fields.get("repetition_penalty", 1.0) != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(fields["repetition_penalty"])(ids, scores)
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.shape[-1]).to(scores.dtype)
    present = (counts > 0).to(scores.dtype)
    scores = scores - fields.get("frequency_penalty", 0.0) * counts - fields.get("presence_penalty", 0.0) * present
    return scores[0]


def adjusted_by_fullband(logits: torch.Tensor, prompt: list[int], generated: list[int], fields: dict,
                         end_ids: list[int]) -> torch.Tensor:
    adjustments = LogitsAdjustments.of(logits.shape[-1], None, **fields)
    adjuster = BatchAdjuster([adjustments], torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.bool),
                             [end_ids], logits.shape[-1])
    for token in generated:
        adjuster.record(torch.tensor([token]))
    return adjuster.adjust(logits.unsqueeze(0))[0]


# ---- each field against its reference, on the same logits ---------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 1.7}, {"repetition_penalty": 0.6}, {"logit_bias": {3: 100.0, 7: -100.0, 11: 2.5}},
    {"presence_penalty": 1.2}, {"presence_penalty": -2.0}, {"frequency_penalty": 0.9}, {"frequency_penalty": -1.1},
    {"min_tokens": 5}, {**FIELDS, "min_tokens": 3},
], ids=lambda f: ",".join(f))
def test_each_field_equals_its_reference(fields):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 40, (9,), generator=g).tolist()  # FIELDS biases two tokens of the byte vocabulary
    generated: list[int] = []
    end_ids = [2, 5]
    changed = 0
    for _ in range(8):  # the history grows: tokens repeat (a small pool), including end tokens and prompt tokens
        logits = torch.randn(V, generator=g, dtype=torch.float64) * 3
        expected = reference_adjust(logits, prompt, generated, fields, end_ids)
        got = adjusted_by_fullband(logits, prompt, generated, fields, end_ids)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        changed += not torch.equal(got, logits)
        generated.append(int(torch.randint(0, 12, (1,), generator=g)))
    assert changed >= 5  # presence needs a history, min_tokens ends after 5 steps


def test_neutral_fields_leave_the_logits_untouched():
    logits = torch.randn(2, 30, dtype=torch.float32)
    adjuster = BatchAdjuster([LogitsAdjustments()] * 2, torch.zeros(2, 3, dtype=torch.long),
                             torch.ones(2, 3, dtype=torch.bool), [(1,), (1,)], 30)
    assert adjuster.adjust(logits) is logits and adjuster.history is None


def test_rows_of_a_batch_with_different_fields_equal_each_row_alone():
    g = torch.Generator().manual_seed(1)
    rows = [LogitsAdjustments(), LogitsAdjustments.of(V, None, **{**FIELDS, "min_tokens": 2}),
            LogitsAdjustments.of(V, None, repetition_penalty=0.5, logit_bias={"4": -7}),
            LogitsAdjustments.of(V, None, frequency_penalty=2, min_tokens=4)]
    ends = [(1,), (2, 3), (), (4,)]
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 6, 1, 4)]
    ids, mask = engine.left_pad(prompts)
    batch = BatchAdjuster(rows, ids, mask, ends, V)
    alone = [BatchAdjuster([r], torch.tensor([p]), torch.ones(1, len(p), dtype=torch.bool), [e], V)
             for r, p, e in zip(rows, prompts, ends)]
    for _ in range(6):
        logits = torch.randn(len(rows), V, generator=g, dtype=torch.float64)
        got = batch.adjust(logits)
        for i, one in enumerate(alone):
            assert torch.equal(got[i], one.adjust(logits[i : i + 1])[0]), i
        tokens = torch.randint(0, 8, (len(rows),), generator=g)
        batch.record(tokens)
        for i, one in enumerate(alone):
            one.record(tokens[i : i + 1])
    # Rows leave and join as in the engine: still each row alone.
    batch.select([3, 1])
    batch.extend(BatchAdjuster([rows[2]], torch.tensor([prompts[2]]), torch.ones(1, 1, dtype=torch.bool), [ends[2]], V))
    fresh = BatchAdjuster([rows[2]], torch.tensor([prompts[2]]), torch.ones(1, 1, dtype=torch.bool), [ends[2]], V)
    logits = torch.randn(3, V, generator=g, dtype=torch.float64)
    got = batch.adjust(logits)
    for i, one in enumerate([alone[3], alone[1], fresh]):
        assert torch.equal(got[i], one.adjust(logits[i : i + 1])[0]), i

    # A batch without penalties that penalised rows join, and the other way round.
    def single(i: int) -> BatchAdjuster:
        return BatchAdjuster([rows[i]], torch.tensor([prompts[i]]), torch.ones(1, len(prompts[i]), dtype=torch.bool),
                             [ends[i]], V)

    for order in ([0, 1, 3], [1, 0, 2]):
        batch, alone = single(order[0]), [single(i) for i in order]
        for i in order[1:]:
            tokens = torch.randint(0, 8, (len(batch.rows),), generator=g)
            batch.record(tokens)
            for k, one in enumerate(alone[: len(batch.rows)]):
                one.record(tokens[k : k + 1])
            batch.extend(single(i))
        logits = torch.randn(len(order), V, generator=g, dtype=torch.float64)
        got = batch.adjust(logits)
        for k, one in enumerate(alone):
            assert torch.equal(got[k], one.adjust(logits[k : k + 1])[0]), (order, k)


@pytest.mark.parametrize("kwargs,message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": True}, "frequency_penalty must be a number"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
    ({"min_tokens": 9}, "min_tokens (9) must be at most max_tokens (8)"),
    ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {V: 1}}, f"logit_bias: token id {V} is outside the model's vocabulary"),
    ({"logit_bias": {3: 101}}, "logit_bias of token 3 must be a number in [-100, 100]"),
    ({"logit_bias": {3: 1, "3": 2}}, "logit_bias names token 3 twice"),
])
def test_out_of_range_fields_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError) as info:
        LogitsAdjustments.of(V, 8, **kwargs)
    assert message in str(info.value)


# ---- the decode loop: generate in every mode ------------------------------------------------------------------


def decode_logits(model, monkeypatch, prompt: list[int], tokens: list[int], mode_kwargs: dict) -> torch.Tensor:
    """(N, V): the raw logits the decode loop computes before each of ``tokens`` (score_continuations runs the
    decode loop of generate_stream with the tokens fed back)."""
    stepped, whole = [], []  # the engine's steps (feedback modes); standard mode's one call over the continuation
    real_sample, real_scores = engine.sample_rows, generation._token_scores
    monkeypatch.setattr(engine, "sample_rows", lambda logits, *a: stepped.append(logits[0]) or real_sample(logits, *a))
    monkeypatch.setattr(generation, "_token_scores", lambda logits, *a: whole.append(logits[0]) or real_scores(logits,
                                                                                                                *a))
    score_continuations(model, [prompt], [tokens], scoring="decode", **mode_kwargs)
    monkeypatch.undo()
    return torch.stack(stepped) if stepped else whole[0]


@pytest.mark.parametrize("label,mode_kwargs", MODES, ids=[m for m, _ in MODES])
def test_generate_applies_the_fields_in_every_mode(model, monkeypatch, label, mode_kwargs, single_thread):
    prompt = encode_prompt(TOK, PROMPT)
    tokens = generate(model, [prompt], 14, eos_token_id=TOK.eos_id, **mode_kwargs, **FIELDS)[0].tolist()
    plain = generate(model, [prompt], 14, eos_token_id=TOK.eos_id, **mode_kwargs)[0].tolist()
    assert tokens != plain, label  # the fields change this mode's greedy tokens
    logits = decode_logits(model, monkeypatch, prompt, tokens, mode_kwargs)
    for step, token in enumerate(tokens):
        expected = reference_adjust(logits[step], prompt, tokens[:step], FIELDS, [TOK.eos_id])
        assert int(expected.argmax()) == token, (label, step)


@pytest.mark.parametrize("label,mode_kwargs", MODES, ids=[m for m, _ in MODES])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_and_stop_token_ids_in_every_mode(model, label, mode_kwargs, temperature, single_thread):
    """A bias of +100 makes a stop token certain; min_tokens keeps it out for exactly that many steps."""
    prompt = encode_prompt(TOK, PROMPT)
    stop = ord("q")
    common = dict(temperature=temperature, seed=3, stop_token_ids=[stop], **mode_kwargs)
    tokens = generate(model, [prompt, prompt[:3]], 20, logit_bias={stop: 100}, min_tokens=5, **common)
    assert tokens.shape == (2, 6) and (tokens[:, 5] == stop).all() and (tokens[:, :5] != stop).all(), tokens
    # A row stops at the first occurrence of a stop token (here the third token it would generate).
    free = generate(model, [prompt], 20, **{**common, "stop_token_ids": []})[0].tolist()
    cut = free.index(free[2]) + 1
    stopped = generate(model, [prompt], 20, **{**common, "stop_token_ids": [free[2]]})[0].tolist()
    assert stopped == free[:cut]
    if temperature == 0:  # in a batch (whose random draws differ), it repeats its stop token while others go on
        rows = generate(model, [prompt, prompt[:3]], 20, **{**common, "stop_token_ids": [free[2]]})
        assert rows.shape[1] > cut and rows[0, :cut].tolist() == free[:cut] and (rows[0, cut:] == free[2]).all()


def test_greedy_fields_through_generate_in_a_batch_equal_each_row_alone(model, single_thread):
    prompts = [encode_prompt(TOK, PROMPT), encode_prompt(TOK, "x = 1"), encode_prompt(TOK, "a")]
    batch = generate(model, prompts, 10, mode="soft", **FIELDS)
    for i, prompt in enumerate(prompts):
        assert batch[i].tolist() == generate(model, [prompt], 10, mode="soft", **FIELDS)[0].tolist()


def test_generate_refuses_bad_fields(model):
    with pytest.raises(ValueError, match="stop_token_ids: token id 999 is outside"):
        generate(model, [[1, 2]], 3, stop_token_ids=[999])
    with pytest.raises(ValueError, match="min_tokens .4. must be at most max_tokens .3."):
        generate(model, [[1, 2]], 3, min_tokens=4)


# ---- the engine: rows with different fields in one batch --------------------------------------------------------


def engine_sequence(prompt: list[int], mode_kwargs: dict, max_tokens: int, sink, stop_token_ids=(),
                    **fields) -> Sequence:
    decode = DecodeSettings(mode_kwargs["mode"], mode_kwargs.get("fused_passes", 1))
    return Sequence(prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=tuple(stop_token_ids), **fields),
                    sink, decode)


def test_engine_rows_with_different_fields_equal_generate_alone(model, single_thread):
    prompt_a, prompt_b = encode_prompt(TOK, PROMPT), encode_prompt(TOK, "def f(x):")
    plan = [  # (join step, prompt, mode, fields)
        (0, prompt_a, MODES[1][1], FIELDS),
        (0, prompt_b, MODES[0][1], {}),
        (0, prompt_a, MODES[2][1], {"repetition_penalty": 0.7, "min_tokens": 4, "logit_bias": {TOK.eos_id: 30}}),
        (3, prompt_b, MODES[1][1], {"presence_penalty": -1.0, "frequency_penalty": 2.0}),
        (5, prompt_a, MODES[3][1], FIELDS),
    ]
    engine = Engine(model, max_batch=8)
    runs = []
    for step in range(200):
        for join, prompt, mode_kwargs, fields in plan:
            if join == step:
                events: list = []
                seq = engine_sequence(prompt, mode_kwargs, 12, events.append, (TOK.eos_id,), **fields)
                engine.submit([seq])
                runs.append((seq, events, prompt, mode_kwargs, fields))
        if step > plan[-1][0] and all(seq.finished for seq, *_ in runs):
            break
        engine.step()
    stopped = 0
    for _seq, events, prompt, mode_kwargs, fields in runs:
        expected = generate(model, [prompt], 12, eos_token_id=TOK.eos_id, **mode_kwargs, **fields)[0].tolist()
        assert [e.token for e in events] == expected, fields
        stopped += events[-1].is_stop_token
    assert stopped >= 1  # the eos bias ended a row, after min_tokens


# ---- the server -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model):
    srv = ThreadServer(model, TOK, NAME, max_batch=6)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def text_until(tokens: list[int], ends: set[int]) -> tuple[str, str]:
    for i, token in enumerate(tokens):
        if token in ends:
            return TOK.decode(tokens[:i]), "stop"
    return TOK.decode(tokens), "length"


@pytest.mark.parametrize("label,mode_kwargs", MODES, ids=[m for m, _ in MODES])
def test_server_applies_the_fields_in_every_mode(client, model, label, mode_kwargs, single_thread):
    fields = {**FIELDS, "min_tokens": 3}
    decode = {"decode_mode": mode_kwargs["mode"], "fused_passes": mode_kwargs.get("fused_passes", 1)}
    out = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=14, temperature=0, logit_bias=JSON_BIAS,
        presence_penalty=fields["presence_penalty"], frequency_penalty=fields["frequency_penalty"], user="tester",
        extra_body={**decode, "repetition_penalty": fields["repetition_penalty"], "min_tokens": 3,
                    "stop_token_ids": [ord("z")]})
    tokens = generate(model, [encode_prompt(TOK, PROMPT)], 14, eos_token_id=TOK.eos_id, stop_token_ids=[ord("z")],
                      **mode_kwargs, **fields)[0].tolist()
    assert (out.choices[0].text, out.choices[0].finish_reason) == text_until(tokens, {TOK.eos_id, ord("z")}), label


def test_server_chat_applies_the_fields_and_stop_token_ids(client, model, single_thread):
    messages = [{"role": "user", "content": "hello there"}]
    prompt = apply_chat_template(TOK, messages, add_generation_prompt=True)
    ends = [*end_of_turn_ids(TOK), TOK.eos_id]
    free = generate(model, [prompt], 12, mode="soft", stop_token_ids=ends, **FIELDS)[0].tolist()
    stop = free[4]
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, temperature=0, logit_bias=JSON_BIAS,
        presence_penalty=FIELDS["presence_penalty"], frequency_penalty=FIELDS["frequency_penalty"],
        extra_body={"decode_mode": "soft", "repetition_penalty": FIELDS["repetition_penalty"],
                    "stop_token_ids": [stop]})
    expected = generate(model, [prompt], 12, mode="soft", stop_token_ids=[*ends, stop], **FIELDS)[0].tolist()
    assert expected == free[: free.index(stop) + 1]
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == text_until(expected, {*ends, stop})


def test_server_sampled_min_tokens_and_top_k(server, single_thread):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 7, "min_tokens": 6,
            "logit_bias": {str(TOK.eos_id): 100}, "top_k": 3}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 7, out
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 2.0, "seed": 1, "top_k": 1}
    greedy = {**body, "temperature": 0, "top_k": -1}
    texts = [httpx.post(server.url + "/v1/completions", json=b, timeout=60).json()["choices"][0]["text"]
             for b in (body, greedy)]
    assert texts[0] == texts[1]  # top_k 1 samples the argmax whatever the temperature


@pytest.mark.parametrize("extra,status,param,message", [
    ({"user": "someone", "metadata": {"k": "v"}, "echo": False, "suffix": "", "best_of": 1, "store": False,
      "response_format": {"type": "text"}, "tools": None, "foo": None}, 400, "foo", "unknown field 'foo'"),
    ({"user": "someone", "metadata": {"k": "v"}, "echo": False, "suffix": "", "best_of": 1, "store": False,
      "response_format": {"type": "text"}, "tools": None, "stream_options": None}, 200, None, None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "tools is not supported"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format", 'response_format={"type": "json_object"}'),
    ({"echo": True}, 400, "echo", "echo=true is not supported"),
    ({"suffix": "end"}, 400, "suffix", "suffix="),
    ({"best_of": 3}, 400, "best_of", "best_of=3"),
    ({"store": True}, 400, "store", "store=true"),
    ({"min_p": 0.1}, 400, "min_p", "unknown field 'min_p'"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 400,
     "stream_options.continuous_usage_stats", "unknown field 'stream_options.continuous_usage_stats'"),
])
def test_fields_the_server_does_not_implement_are_refused_by_name(server, extra, status, param, message):
    body = {"model": NAME, "prompt": "x", "max_tokens": 2, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    if status == 400:
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"], error


def test_chat_message_fields_are_refused_by_name_and_nulls_left_out(server):
    base = {"model": NAME, "max_tokens": 2}
    named = {**base, "messages": [{"role": "user", "content": "hi", "name": "bob"}]}
    response = httpx.post(server.url + "/v1/chat/completions", json=named, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0.name", response.text
    nulls = {**base, "messages": [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "ok", "tool_calls": None, "refusal": None},
                                  {"role": "user", "content": "and?"}]}
    assert httpx.post(server.url + "/v1/chat/completions", json=nulls, timeout=30).status_code == 200


def test_chat_page_sends_the_sampling_fields(browser, server, single_thread):  # noqa: F811 (the fixture)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(server.url + "/")
    page.wait_for_selector("body[data-state=ready]", timeout=30_000)
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", "14")
    fields = {"presence-penalty": "1.5", "frequency-penalty": "0.7", "repetition-penalty": "1.6", "min-tokens": "3",
              "logit-bias": json.dumps(JSON_BIAS), "stop-token-ids": str(ord("z"))}
    for name, value in fields.items():
        page.fill(f"#{name}", value)
    page.click("#send")
    page.wait_for_selector("body[data-state=done]", timeout=60_000)
    sent = {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.6, "min_tokens": 3,
            "logit_bias": JSON_BIAS, "stop_token_ids": [ord("z")]}
    for mode in ("standard", "soft", "fused"):
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 14, "temperature": 0, "decode_mode": mode,
                "fused_passes": 1}
        texts = [httpx.post(server.url + "/v1/completions", json=b, timeout=60).json()["choices"][0]["text"]
                 for b in ({**body, **sent}, body)]
        assert texts[0] != texts[1]  # so a page that dropped the fields would be caught
        assert page.locator(f".answer[data-mode={mode}]").text_content() == texts[0], mode
    # A value the server refuses: each column shows the 400's message.
    page.fill("#repetition-penalty", "0")
    page.click("#send")
    page.wait_for_selector("body[data-state=done]", timeout=60_000)
    for mode in ("standard", "soft", "fused"):
        assert "repetition_penalty must be a finite number > 0" in page.locator(f"#col-{mode} .stats").inner_text()


# ---- hostile requests ---------------------------------------------------------------------------------------

COMPLETION = {"model": NAME, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
JSON_HEADERS = {"content-type": "application/json"}

# (method, path, request keyword arguments of httpx, the substring the error message must hold)
RAW_CASES = [
    ("POST", "/v1/completions", {"content": b'{"model": "tiny", "prompt": ', "headers": JSON_HEADERS},
     "not valid JSON"),
    ("POST", "/v1/completions", {"content": b"", "headers": JSON_HEADERS}, "body"),
    ("POST", "/v1/completions", {"content": b"[1, 2, 3]", "headers": JSON_HEADERS}, "body"),
    ("POST", "/v1/completions", {"content": b'"tiny"', "headers": JSON_HEADERS}, "body"),
    ("POST", "/v1/completions", {"content": b"null", "headers": JSON_HEADERS}, "body"),
    ("POST", "/v1/completions", {"content": b"\xff\xfe\x00garbage", "headers": JSON_HEADERS}, "JSON"),
    ("POST", "/v1/completions", {"content": b"[" * 100_000 + b"]" * 100_000, "headers": JSON_HEADERS},
     "error parsing the body"),
    ("POST", "/v1/completions", {"content": b'{"model": "tiny", "prompt": "x"}'}, "body"),
    ("POST", "/v1/completions", {"content": json.dumps(COMPLETION).encode(), "headers": {"content-type": "text/plain"}},
     "body"),
    ("POST", "/v1/completions", {"json": {"prompt": "x"}}, "model"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "model": "gpt-4"}}, "does not exist"),
    ("POST", "/v1/completions", {"json": {"model": NAME}}, "prompt"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "prompt": 5}}, "prompt"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "prompt": []}}, "prompt is empty"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "prompt": [10**6]}}, "outside the model's vocabulary"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "prompt": [-1]}}, "outside the model's vocabulary"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "prompt": [1, "a"]}}, "prompt"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "prompt": "x" * 5000}}, "context length"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "max_tokens": -5}}, "max_tokens"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "max_tokens": 10**30}}, "max_tokens"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "max_tokens": "many"}}, "max_tokens"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "max_tokens": 1.5}}, "max_tokens"),
    ("POST", "/v1/completions", {"content": b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
                                 "headers": JSON_HEADERS}, "temperature"),
    ("POST", "/v1/completions", {"content": b'{"model": "tiny", "prompt": "x", "temperature": Infinity}',
                                 "headers": JSON_HEADERS}, "temperature"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "top_p": 1.5}}, "top_p"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "n": 0}}, "n must be"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "n": 1000}}, "n must be"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "stop": [""]}}, "stop"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "stop": 5}}, "stop"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "seed": 10**30}}, "seed"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "seed": "abc"}}, "seed"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "logit_bias": [1, 2]}}, "logit_bias"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "logit_bias": {"abc": 1}}}, "logit_bias keys"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "logit_bias": {"-1": 1}}}, "logit_bias: token id -1"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "logit_bias": {"999999": 1}}}, "outside the model"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "logit_bias": {"5": 101}}}, "[-100, 100]"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "logit_bias": {"5": "x"}}}, "logit_bias"),
    ("POST", "/v1/completions", {"content": b'{"model": "tiny", "prompt": "x", "logit_bias": {"5": 1e999}}',
                                 "headers": JSON_HEADERS}, "logit_bias"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "presence_penalty": 2.5}}, "presence_penalty"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "presence_penalty": True}}, "presence_penalty"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "frequency_penalty": "0.5"}}, "frequency_penalty"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "frequency_penalty": 10**400}}, "frequency_penalty"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "repetition_penalty": 0}}, "repetition_penalty"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "repetition_penalty": -1}}, "repetition_penalty"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "min_tokens": -1}}, "min_tokens"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "min_tokens": 1.5}}, "min_tokens"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "min_tokens": 5}}, "min_tokens (5) must be at most"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "stop_token_ids": [999999]}}, "stop_token_ids"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "stop_token_ids": "5"}}, "stop_token_ids"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "stop_token_ids": [1.5]}}, "stop_token_ids"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "top_k": -5}}, "top_k"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "decode_mode": "turbo"}}, "decode_mode"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "fused_passes": 0}}, "fused_passes"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "logprobs": 9}}, "logprobs"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "foo": {"nested": [1, {"deep": None}]}}},
     "unknown field 'foo'"),
    ("POST", "/v1/completions", {"json": {**COMPLETION, "foo": None}}, "unknown field 'foo'"),
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "messages": []}}, "messages"),
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "messages": "hi"}}, "messages"),
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "messages": [{"role": "tool", "content": "x"}]}}, "role"),
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "messages": [{"role": "user", "content": 5}]}}, "content"),
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}}, "messages"),
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "top_logprobs": 50}}, "top_logprobs"),
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "max_completion_tokens": 0}}, "max_tokens"),
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "min_tokens": 200}}, "min_tokens"),
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "tool_choice": "auto"}}, "tool_choice is not supported"),
    ("GET", "/v1/completions", {}, "GET /v1/completions"),
    ("POST", "/v1/nothing", {"json": COMPLETION}, "/v1/nothing"),
]


def openai_cases(client) -> list:
    """(call, the substring the error message must hold): the official client's requests."""

    def complete(**kwargs):
        return client.completions.create(model=NAME, prompt="x", max_tokens=2, **kwargs)

    return [
        (lambda: complete(presence_penalty=5), "presence_penalty"),
        (lambda: complete(frequency_penalty=-3), "frequency_penalty"),
        (lambda: complete(logit_bias={"abc": 1}), "logit_bias"),
        (lambda: complete(logit_bias={"5": 500}), "logit_bias"),
        (lambda: complete(logit_bias={"5": 1}, extra_body={"min_tokens": -1}), "min_tokens"),
        (lambda: complete(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (lambda: complete(extra_body={"stop_token_ids": [10**6]}), "stop_token_ids"),
        (lambda: complete(extra_body={"foo": 1}), "unknown field 'foo'"),
        (lambda: complete(echo=True), "echo"),
        (lambda: complete(stream=True, extra_body={"min_tokens": 3}), "min_tokens"),
        (lambda: client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        (lambda: client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                response_format={"type": "json_object"}), "response_format"),
        (lambda: client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                reasoning_effort="high"), "reasoning_effort"),
        (lambda: client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                max_completion_tokens=0), "max_tokens"),
        (lambda: client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}]),
         "does not exist"),
    ]


def test_hostile_requests_get_clear_4xx_and_the_server_serves_on(server, client, single_thread):
    statuses = []
    for method, path, kwargs, message in RAW_CASES:
        response = httpx.request(method, server.url + path, timeout=30, **kwargs)
        assert 400 <= response.status_code < 500, (path, kwargs, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] and message in error["message"], (kwargs, error)
        statuses.append(response.status_code)
    for call, message in openai_cases(client):
        with pytest.raises(openai.APIStatusError) as info:
            call()
        assert 400 <= info.value.status_code < 500 and message in str(info.value), str(info.value)
        statuses.append(info.value.status_code)
    assert len(statuses) >= 40
    health = server.health()
    assert health["failed"] == 0 and health["running"] == 0 and health["waiting"] == 0, health
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].finish_reason in ("stop", "length")


# ---- the command line -------------------------------------------------------------------------------------------


def test_fullband_generate_and_chat_apply_the_fields(model, tmp_path, capsys, single_thread):
    directory = save_model(model, tmp_path / "m", TOK)
    flags = ["--logit-bias", f"{ord('e')}=4", "--logit-bias", f"{ord(' ')}=-3", "--presence-penalty", "1.5",
             "--frequency-penalty", "0.7", "--repetition-penalty", "1.6", "--decode-mode", "soft",
             "--max-new-tokens", "12", "--device", "cpu"]
    stop = ord("z")
    assert main(["generate", str(directory), "--prompt", PROMPT, *flags, "--stop-token-id", str(stop)]) == 0
    tokens = generate(model, [encode_prompt(TOK, PROMPT)], 12, mode="soft", eos_token_id=TOK.eos_id,
                      stop_token_ids=[stop], **FIELDS)[0].tolist()
    assert capsys.readouterr().out == PROMPT + text_until(tokens, {TOK.eos_id, stop})[0] + "\n"
    assert main(["chat", str(directory), "--message", "hello", *flags, "--min-tokens", "2"]) == 0
    prompt = apply_chat_template(TOK, [{"role": "user", "content": "hello"}])
    ends = end_of_turn_ids(TOK)
    tokens = generate(model, [prompt], 12, mode="soft", stop_token_ids=ends, **{**FIELDS, "min_tokens": 2})[0].tolist()
    assert capsys.readouterr().out.endswith(f"assistant> {text_until(tokens, set(ends))[0]}\n")
    assert main(["generate", str(directory), "--prompt", "x", "--presence-penalty", "3", "--max-new-tokens", "4",
                 "--device", "cpu"]) == 2
    assert "presence_penalty must be a number in [-2, 2]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", str(directory), "--prompt", "x", "--logit-bias", "5:3"])
    assert "expected TOKEN_ID=BIAS" in capsys.readouterr().err

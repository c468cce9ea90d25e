"""The OpenAI-compatible HTTP API (FastAPI) in front of the continuous-batching ``Engine``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /health`` and
the chat page at ``GET /``. Besides the OpenAI parameters, requests may carry the decode settings
``decode_mode`` ("standard" | "soft" | "fused"), ``fused_passes`` (an integer, "auto" or "exact"), ``fused_tol`` and
``fused_max_passes`` (the ``openai`` client sends them via ``extra_body``); what a request leaves out is the
server's settings (those stored with the model unless ``fullband serve`` overrides them), whose
``fused_max_passes`` also bounds the fused passes one request may ask for. Completions take ``ignore_eos``
(as in vLLM).
The sampling fields ``logit_bias``, ``presence_penalty``, ``frequency_penalty`` (OpenAI) and ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``top_k`` (vLLM) are applied per request (``fullband.sampling``). A field the
server does not implement is refused with a 400 naming it, never ignored; ``user`` and ``metadata`` are accepted and
have no effect, and a few OpenAI fields are accepted at the value that asks for nothing (``NEUTRAL``).
Errors are OpenAI-style JSON bodies ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from fullband.data import Tokenizer
from fullband.data.chat import apply_chat_template, end_of_turn_ids
from fullband.decoding import FIELDS, DecodeSettings, DecodeSettingsError
from fullband.loading import encode_prompt
from fullband.sampling import LogitsAdjustments, check_token_ids
from fullband.serve.engine import MAX_TOP_LOGPROBS, Engine, Event, QueueFull, SamplingParams, Sequence

PAGE = Path(__file__).parent / "static" / "chat.html"
MAX_STOP_STRINGS = 4
SEED_LIMIT = 2**63  # torch.Generator seeds are 64-bit; choice j of n is seeded with seed + j
# How often a request waiting for tokens checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ---- request bodies: pydantic checks the types, the handlers the values ---------------------------------

# OpenAI request fields that this server does not implement, with what they would need; a request that gives one
# (other than null) is refused with a 400 naming it. Any other unknown field is refused too.
NOT_IMPLEMENTED = {
    "tools": "function calling", "tool_choice": "function calling", "functions": "function calling",
    "function_call": "function calling", "parallel_tool_calls": "function calling", "audio": "audio output",
    "modalities": "output modalities other than text", "prediction": "predicted outputs",
    "reasoning_effort": "a reasoning model", "verbosity": "a reasoning model", "web_search_options": "web search",
    "service_tier": "service tiers",
}
# OpenAI fields accepted at the value that asks for nothing, and refused with a 400 at any other: name -> (test of
# the value and the request, the accepted values in words).
NEUTRAL = {
    "echo": (lambda v, req: v is False, "false (the prompt is not repeated in the answer)"),
    "suffix": (lambda v, req: v == "", "empty (no text after the completion)"),
    "best_of": (lambda v, req: v == req.n, "n (every generated choice is returned)"),
    "store": (lambda v, req: v is False, "false (nothing is stored)"),
    "response_format": (lambda v, req: v == {"type": "text"}, '{"type": "text"} (no JSON mode or schema)'),
}
# Message fields of the OpenAI chat API that a null leaves out (clients send assistant messages back with them).
NULLABLE_MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id", "refusal", "audio", "function_call")


def _drop_nulls(data: Any, names: Any) -> Any:
    # OpenAI clients may send an explicit null for a parameter they leave at its default.
    return {k: v for k, v in data.items() if v is not None or k not in names} if isinstance(data, dict) else data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")  # refused by name in the validation error handler

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # The sampling fields are checked by LogitsAdjustments, as at every other door.
    logit_bias: dict[str, Any] | None = None
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    repetition_penalty: Any = 1.0
    min_tokens: Any = 0
    stop_token_ids: list[int] | None = None
    top_k: int | None = None  # as in vLLM: -1 or 0 = every token
    # The decode settings are checked by DecodeSettings, so a bad value reads the same as at every other door.
    decode_mode: Any = None
    fused_passes: Any = None
    fused_tol: Any = None
    fused_max_passes: Any = None
    # Accepted without effect: they describe the caller, not the answer.
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Accepted only at their neutral value (NEUTRAL).
    best_of: Any = None
    store: Any = None
    response_format: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        return _drop_nulls(data, {*cls.model_fields, *NOT_IMPLEMENTED})


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    ignore_eos: bool = False  # as in vLLM: generate max_tokens tokens whatever the model says (benchmarks)
    echo: Any = None
    suffix: Any = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        return _drop_nulls(data, NULLABLE_MESSAGE_FIELDS)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ---- turning tokens into text, with stop strings ---------------------------------------------------------


@dataclass
class Choice:
    """The text of one choice so far, decoded incrementally: each token decodes a short window of ids, not
    the whole answer, so a long answer costs linear time. A window's text is taken only once it does not end
    in U+FFFD (an incomplete character) and is compared with the same window minus the new ids, so tokenizers
    that decode a piece differently at the start of a text (leading spaces) give the same result as decoding
    everything at once. Text that could be the start of a stop string is held back until it is clear that it
    is not; a stop string ends the choice and is not part of the text."""

    tokenizer: Tokenizer
    stop: list[str]
    ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far (complete characters)
    sent: str = ""  # the part of text released to the client
    tokens: int = 0  # tokens generated (the usage), including a final stop token
    stopped: bool = False
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    _prefix: int = 0  # ids[_prefix:_read] is the window decoded last time
    _read: int = 0
    _scanned: int = 0  # text[:_scanned] holds no stop string

    def add(self, event: Event) -> str:
        self.tokens += 1
        if event.logprob is not None:
            self.logprobs.append((event.token, event.logprob, event.top_logprobs or []))
        if not event.is_stop_token:
            self.ids.append(event.token)
            before = self.tokenizer.decode(self.ids[self._prefix : self._read])
            after = self.tokenizer.decode(self.ids[self._prefix :])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before) :]
                self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The rest of the text, at the end of the choice (a trailing incomplete character included)."""
        if self.stopped:
            return ""
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        self.text += self.tokenizer.decode(self.ids[self._prefix :])[len(before) :]
        self._prefix = self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self._scanned - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            upto = self.text[: min(hits)]
        else:
            self._scanned = len(self.text)
            upto = self.text if final else self.text[: max(len(self.sent), len(self.text) - max(longest - 1, 0))]
        delta, self.sent = upto[len(self.sent) :], upto
        return delta


@dataclass
class Update:
    index: int
    text: str
    event: Event
    finish_reason: str | None


# ---- the application -------------------------------------------------------------------------------------


def create_app(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    decode: DecodeSettings | None = None,
) -> FastAPI:
    """The API around ``engine``, which the app starts and stops with its lifespan. ``decode``: the settings of
    requests that do not give their own (default: those stored with the model); each fused pass is a full
    prefill that the running batch waits for, so its ``fused_max_passes`` bounds what one request may ask."""
    decode = decode if decode is not None else DecodeSettings.of(engine.model)
    # The model's own default mode tells whether its fusion was trained: a fresh or converted model and one trained
    # with train.schedule standard store standard, every schedule that trains the fusion soft or fused
    # (fullband.decoding). The chat page marks it and says when soft and fused mean nothing yet.
    model_mode = DecodeSettings.of(engine.model).mode
    config = engine.model.config
    created = int(time.time())
    chat_error = _chat_template_error(tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="fullband", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return APIError(400, "the request body is not valid JSON", code="invalid_json").response()
        extra = [e for e in errors if e.get("type") == "extra_forbidden"]
        if extra:
            return _unknown_field(extra[0]).response()
        if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
            return APIError(400, "the request body must be a JSON object of the request's fields, sent with "
                            "Content-Type: application/json", code="invalid_body").response()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                           for e in errors[:5])
        return APIError(400, f"invalid request: {detail}", param=where).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {exc}", "server_error").response()

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text())

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "max_model_len": config.max_seq_len, **decode.to_dict(),
                "chat": chat_error is None, "chat_error": chat_error, "model_decode_mode": model_mode,
                "fusion_trained": model_mode != "standard", **engine.stats()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "fullband", "max_model_len": config.max_seq_len}]}

    def check_common(req: _Request, max_tokens: int | None) -> tuple[SamplingParams, list[str]]:
        if req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        if req.n < 1 or req.n > engine.max_batch:
            raise APIError(400, f"n must be between 1 and the server's max batch {engine.max_batch}, got {req.n}",
                           param="n")
        if not 0 <= req.temperature <= 2:
            raise APIError(400, f"temperature must be in [0, 2] (0 = greedy), got {req.temperature}",
                           param="temperature")
        if not 0 < req.top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        for name, (neutral, accepted) in NEUTRAL.items():
            value = getattr(req, name, None)
            if value is not None and not neutral(value, req):
                raise APIError(400, f"{name}={json.dumps(value)} is not supported by this server: leave it out or "
                               f"set it to {accepted}", param=name)
        if req.seed is not None and not -SEED_LIMIT <= req.seed < SEED_LIMIT - req.n:
            raise APIError(400, f"seed must be an integer in [-2**63, 2**63 - n), got {req.seed}", param="seed")
        if req.top_k is not None and req.top_k < -1:
            raise APIError(400, f"top_k must be >= 1, or -1 or 0 for every token, got {req.top_k}", param="top_k")
        try:
            adjustments = LogitsAdjustments.of(config.vocab_size, max_tokens, req.logit_bias, req.presence_penalty,
                                               req.frequency_penalty, req.repetition_penalty, req.min_tokens)
            stop_token_ids = check_token_ids("stop_token_ids", req.stop_token_ids or (), config.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc), param=_field_named(str(exc))) from None
        asked = {"decode_mode": req.decode_mode, "fused_passes": req.fused_passes, "fused_tol": req.fused_tol,
                 "fused_max_passes": req.fused_max_passes}
        try:
            settings = decode.with_overrides(**asked)
            settings.check_within(decode.fused_max_passes)
        except DecodeSettingsError as exc:
            raise APIError(400, str(exc), param=_decode_param(str(exc))) from None
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise APIError(400, f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
        params = SamplingParams(max_tokens=max_tokens or 1, decode=settings, temperature=req.temperature,
                                top_k=req.top_k if req.top_k is not None and req.top_k > 0 else None,
                                top_p=req.top_p if req.top_p < 1 else None, seed=req.seed,
                                adjustments=adjustments, stop_token_ids=stop_token_ids)
        return params, stop

    def start(prompts: list[list[int]], params: SamplingParams, n: int, stop: list[str]):
        """Queue n sequences per prompt; choice i*n + j is prompt i's j-th. Seed s gives choice j the seed s + j."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        sequences, choices = [], []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                index = i * n + j
                seed = None if params.seed is None else params.seed + j
                p = replace(params, seed=seed)
                sink = lambda event, index=index: loop.call_soon_threadsafe(queue.put_nowait, (index, event))
                sequences.append(Sequence(prompt, p, sink))
                choices.append(Choice(tokenizer, stop))
        try:
            engine.submit(sequences)
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from exc
        except ValueError as exc:
            param = _field_named(str(exc)) or ("max_tokens" if "max_tokens" in str(exc) else None)
            raise APIError(400, str(exc), param=param) from exc
        return sequences, choices, queue

    async def updates(request: Request, sequences, choices, queue) -> AsyncIterator[Update]:
        """The choices' text as it is generated; cancels what is left when the consumer stops or the client
        goes away."""
        pending = set(range(len(sequences)))
        checked = time.monotonic()
        try:
            while pending:
                try:
                    index, event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    index = event = None
                # Also while tokens flow: a non-streamed answer has no other way to notice a client that left.
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if event is None:
                    continue
                if index not in pending:
                    continue  # tokens generated after a stop string, before the cancellation took effect
                if event.error is not None:
                    raise APIError(500, event.error, "server_error")
                choice = choices[index]
                text = choice.add(event)
                finish = "stop" if choice.stopped else event.finish_reason
                if finish is not None:
                    text += choice.flush()
                    pending.discard(index)
                    engine.cancel(sequences[index])
                yield Update(index, text, event, finish)
        finally:
            for seq in sequences:
                engine.cancel(seq)

    def usage(prompts: list[list[int]], choices: list[Choice]) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(c.tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    def completion_logprobs(entries: list[tuple[int, float, list[tuple[int, float]]]], start: int = 0):
        tokens, offsets, offset = [], [], start
        for token, _, _ in entries:
            tokens.append(token_text(token))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{token_text(t): v for t, v in top} for _, _, top in entries],
                "text_offset": offsets}

    def chat_logprobs(entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict[str, Any]:
        def item(token: int, lp: float) -> dict[str, Any]:
            text = token_text(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]}
                            for t, lp, top in entries]}

    def sse(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data)}\n\n"

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # the OpenAI default
        params, stop = check_common(req, max_tokens)
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise APIError(400, f"logprobs must be between 0 and 5, got {req.logprobs}", param="logprobs")
        prompts = _prompts(req.prompt, tokenizer)
        ends = () if req.ignore_eos else (tokenizer.eos_id,)
        params = replace(params, logprobs=req.logprobs, stop_token_ids=tuple(dict.fromkeys(
            [*ends, *params.stop_token_ids])))
        sequences, choices, queue = start(prompts, params, req.n, stop)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": now, "model": model_name}

        if req.stream:
            async def events() -> AsyncIterator[str]:
                try:
                    async for u in updates(request, sequences, choices, queue):
                        lp = None
                        if req.logprobs is not None:
                            choice = choices[u.index]
                            lp = completion_logprobs(choice.logprobs[-1:], len(choice.sent) - len(u.text))
                        yield sse({**base, "choices": [{"index": u.index, "text": u.text, "logprobs": lp,
                                                        "finish_reason": u.finish_reason}]})
                    if req.stream_options is not None and req.stream_options.include_usage:
                        yield sse({**base, "choices": [], "usage": usage(prompts, choices)})
                except APIError as exc:
                    yield sse(exc.body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        finish: dict[int, str] = {}
        async for u in updates(request, sequences, choices, queue):
            if u.finish_reason is not None:
                finish[u.index] = u.finish_reason
        return {**base, "choices": [
            {"index": i, "text": c.sent, "finish_reason": finish.get(i),
             "logprobs": completion_logprobs(c.logprobs) if req.logprobs is not None else None}
            for i, c in enumerate(choices)], "usage": usage(prompts, choices)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params, stop = check_common(req, max_tokens)
        if chat_error is not None:
            raise APIError(400, chat_error, param="messages", code="no_chat_template")
        if not req.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = apply_chat_template(tokenizer, messages, add_generation_prompt=True)
        except ValueError as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        if max_tokens is None:  # as in OpenAI: up to the end of the context
            max_tokens = max(1, config.max_seq_len - len(prompt))
        stop_ids = tuple(dict.fromkeys([*end_of_turn_ids(tokenizer), tokenizer.eos_id, *params.stop_token_ids]))
        params = replace(params, max_tokens=max_tokens, stop_token_ids=stop_ids,
                         logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        sequences, choices, queue = start([prompt], params, req.n, stop)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": now, "model": model_name}

        if req.stream:
            async def events() -> AsyncIterator[str]:
                chunk = {**base, "object": "chat.completion.chunk"}
                try:
                    for i in range(len(sequences)):
                        yield sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}]})
                    async for u in updates(request, sequences, choices, queue):
                        lp = chat_logprobs(choices[u.index].logprobs[-1:]) if req.logprobs else None
                        delta = {"content": u.text} if u.text or u.finish_reason is None else {}
                        yield sse({**chunk, "choices": [{"index": u.index, "delta": delta, "logprobs": lp,
                                                         "finish_reason": u.finish_reason}]})
                    if req.stream_options is not None and req.stream_options.include_usage:
                        yield sse({**chunk, "choices": [], "usage": usage([prompt], choices)})
                except APIError as exc:
                    yield sse(exc.body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        finish: dict[int, str] = {}
        async for u in updates(request, sequences, choices, queue):
            if u.finish_reason is not None:
                finish[u.index] = u.finish_reason
        return {**base, "object": "chat.completion", "choices": [
            {"index": i, "message": {"role": "assistant", "content": c.sent}, "finish_reason": finish.get(i),
             "logprobs": chat_logprobs(c.logprobs) if req.logprobs else None}
            for i, c in enumerate(choices)], "usage": usage([prompt], choices)}

    return app


def _prompts(prompt: str | list[int] | list[str] | list[list[int]], tokenizer: Tokenizer) -> list[list[int]]:
    """The four prompt forms of the completions API -> token-id lists (text gets the tokenizer's BOS token)."""
    if isinstance(prompt, str):
        return [encode_prompt(tokenizer, prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [encode_prompt(tokenizer, p) if isinstance(p, str) else list(p) for p in prompt]


def _chat_template_error(tokenizer: Tokenizer) -> str | None:
    """None when chat requests can be served, else why not (returned to chat clients as a 400)."""
    try:
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    except Exception as exc:
        return (f"this model's tokenizer cannot format chats ({exc}); use /v1/completions, or instruction-tune "
                "the model first (see docs/instruction-tuning.md)")
    return None


_UNION_BRANCH = re.compile(r"str|int|float|bool|\w+\[.*\]")


def _unknown_field(error: dict[str, Any]) -> APIError:
    """The 400 for a field the request models do not declare: named, with why, never ignored."""
    # Leave out the union branches pydantic names in a location (prompt.list[int].0 -> prompt.0).
    loc = [str(p) for p in error.get("loc", ())[1:] if not _UNION_BRANCH.fullmatch(str(p))]
    where = ".".join(loc) or "body"
    name = loc[-1] if loc else where
    if len(loc) == 1 and name in NOT_IMPLEMENTED:
        message = (f"{name} is not supported by this server (it would need {NOT_IMPLEMENTED[name]}, which fullband "
                   "serve does not implement); leave it out")
    else:
        message = (f"unknown field {where!r}: this server does not implement it and does not ignore it; leave it "
                   "out (the fields it takes are listed in docs/serving.md)")
    return APIError(400, message, param=where, code="unsupported_field")


def _field_named(message: str) -> str | None:
    """The request field a sampling error is about: its message names it first."""
    first = re.match(r"[a-z_]+", message)
    return first.group(0) if first and first.group(0) in ChatRequest.model_fields | CompletionRequest.model_fields \
        else None


def _decode_param(message: str) -> str:
    """The request field a decode settings error is about (its message names it first)."""
    return next((name for name in ("decode_mode", *FIELDS[1:]) if name in message.split()[:3]), "decode_mode")

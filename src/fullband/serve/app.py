"""The OpenAI-compatible HTTP API (FastAPI) in front of the continuous-batching ``Engine``: its endpoints, fields and
errors are in docs/serving.md. Each route is a function of ``router``; they share the served model (``Served``) and
one path from the engine's tokens to the answer, streamed or whole (``answer``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from fullband.data import Tokenizer
from fullband.data.chat import apply_chat_template, end_of_turn_ids
from fullband.decoding import AUTO, DecodeSettings, DecodeSettingsError
from fullband.detokenize import StreamingDetokenizer
from fullband.engine import Engine, Event, QueueFull, Sequence
from fullband.loading import encode_prompt
from fullband.sampling import RequestError, RequestLimits, SamplingParams
from fullband.stop_strings import first_stop

PAGE = Path(__file__).parent / "static" / "chat.html"
MAX_STOP_STRINGS = 4
SEED_LIMIT = 2**63  # torch.Generator seeds are 64-bit; choice j of n is seeded with seed + j
# How often a request waiting for tokens checks whether its client is still there.
DISCONNECT_POLL_S = 0.25
# The API's ranges (OpenAI's, and vLLM's -1 or 0 for a top_k of every token), checked with the model's own limits
# by fullband.sampling.check_request when the engine takes a request.
COMPLETION_LIMITS = RequestLimits(max_temperature=2.0, max_logprobs=5, top_k_every=(-1, 0))
CHAT_LIMITS = RequestLimits(max_temperature=2.0, logprobs_name="top_logprobs", top_k_every=(-1, 0))


class APIError(Exception):
    """An error answer of the API other than a refused request parameter (those are ``RequestError``, a 400)."""

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
    # The sampling fields are checked by fullband.sampling, as at every other door.
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
    max_tokens: int = 16  # the OpenAI default
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

LogprobEntries = list[tuple[int, float, list[tuple[int, float]]]]  # (token, its logprob, [(top token, logprob)])


@dataclass
class Choice:
    """The text of one choice so far, decoded incrementally (``fullband.detokenize``: a long answer costs linear
    time). Text that could be the start of a stop string is held back until it is clear that it is not; a stop
    string ends the choice and is not part of the text."""

    tokenizer: Tokenizer
    stop: list[str]
    sent: str = ""  # the part of the text released to the client
    tokens: int = 0  # tokens generated (the usage), including a final stop token
    stopped: bool = False
    finish_reason: str | None = None  # set by its last token: "stop" (a stop string or token) or "length"
    logprobs: LogprobEntries = field(default_factory=list)
    _scanned: int = 0  # the text's first _scanned characters hold no stop string
    _text: StreamingDetokenizer = field(init=False)

    def __post_init__(self) -> None:
        self._text = StreamingDetokenizer(self.tokenizer)

    def add(self, event: Event) -> str:
        """The text the token releases; all the rest when it ends the choice."""
        self.tokens += 1
        if event.logprob is not None:
            self.logprobs.append((event.token, event.logprob, event.top_logprobs or []))
        if not event.is_stop_token:
            self._text.add(event.token)
        text = self._release(final=False)
        if self.stopped or event.finish_reason is not None:
            self.finish_reason = "stop" if self.stopped else event.finish_reason
            text += self.flush()
        return text

    def flush(self) -> str:
        """The rest of the text, at the end of the choice (a trailing incomplete character included)."""
        if self.stopped:
            return ""
        self._text.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._text.text
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self._scanned - longest + 1)
        cut = first_stop(text, self.stop, start)
        if cut is not None:
            self.stopped = True
            upto = text[:cut]
        else:
            self._scanned = len(text)
            upto = text if final else text[: max(len(self.sent), len(text) - max(longest - 1, 0))]
        delta, self.sent = upto[len(self.sent) :], upto
        return delta


# ---- the served model: a request's parameters, its sequences and their text ------------------------------


@dataclass
class Served:
    """What the routes share: the engine, its tokenizer and the settings of requests that do not give their own."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    decode: DecodeSettings  # its fused_max_passes bounds what one request may ask
    model_mode: str  # the mode stored with the model: standard means its fusion was never trained
    chat_error: str | None  # why chat requests cannot be served (None: they can)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_seq_len(self) -> int:
        return self.engine.model.config.max_seq_len

    def check_model(self, req: _Request) -> None:
        if req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def sampling(self, req: _Request, max_tokens: int, logprobs: int | None,
                 end_ids: Iterable[int]) -> tuple[SamplingParams, DecodeSettings, list[str]]:
        """The request's ``SamplingParams`` and ``DecodeSettings`` (folded once, here) and its stop strings. What
        the engine checks itself (``fullband.sampling.check_request``, within the endpoint's limits) is refused when
        the request is submitted; the rest here."""
        if req.n < 1 or req.n > self.engine.max_batch:
            raise RequestError(f"n must be between 1 and the server's max batch {self.engine.max_batch}, got {req.n}",
                               "n")
        for name, (neutral, accepted) in NEUTRAL.items():
            value = getattr(req, name, None)
            if value is not None and not neutral(value, req):
                raise RequestError(f"{name}={json.dumps(value)} is not supported by this server: leave it out or "
                                   f"set it to {accepted}", name)
        if req.seed is not None and not -SEED_LIMIT <= req.seed < SEED_LIMIT - req.n:
            raise RequestError(f"seed must be an integer in [-2**63, 2**63 - n), got {req.seed}", "seed")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise RequestError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", "stop")
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                                seed=req.seed, logit_bias=req.logit_bias, presence_penalty=req.presence_penalty,
                                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                                min_tokens=req.min_tokens, logprobs=logprobs,
                                stop_token_ids=tuple(dict.fromkeys([*end_ids, *(req.stop_token_ids or ())])))
        return params, self._decode_settings(req), stop

    def _decode_settings(self, req: _Request) -> DecodeSettings:
        asked = {"decode_mode": req.decode_mode, "fused_passes": req.fused_passes, "fused_tol": req.fused_tol,
                 "fused_max_passes": req.fused_max_passes}
        for name, value in asked.items():  # each alone first, so that a bad value is refused under its own name
            try:
                self.decode.with_overrides(**{name: value})
            except DecodeSettingsError as exc:
                raise RequestError(str(exc), name) from None
        settings = self.decode.with_overrides(**asked)
        try:
            settings.check_within(self.decode.fused_max_passes)
        except DecodeSettingsError as exc:  # the bound applies to fused:auto's cap, else to the fused passes
            raise RequestError(str(exc), "fused_max_passes" if settings.fused_passes == AUTO else "fused_passes") \
                from None
        return settings

    def start(self, prompts: list[list[int]], params: SamplingParams, decode: DecodeSettings, limits: RequestLimits,
              n: int, stop: list[str]) -> tuple[list[Sequence], list[Choice], asyncio.Queue]:
        """Queue n sequences per prompt; choice i*n + j is prompt i's j-th. Seed s gives choice j the seed s + j."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        sequences, choices = [], []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                seed = None if params.seed is None else params.seed + j
                sink = lambda event, index=i * n + j: loop.call_soon_threadsafe(queue.put_nowait, (index, event))
                sequences.append(Sequence(prompt, replace(params, seed=seed), sink, decode))
                choices.append(Choice(self.tokenizer, stop))
        try:
            self.engine.submit(sequences, limits)
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from exc
        return sequences, choices, queue

    async def updates(self, request: Request, sequences: list[Sequence], choices: list[Choice],
                      queue: asyncio.Queue) -> AsyncIterator[tuple[int, str]]:
        """(choice index, new text) as the choices are generated; cancels what is left when the consumer stops or
        the client goes away."""
        checked = time.monotonic()
        try:
            while any(choice.finish_reason is None for choice in choices):
                try:
                    index, event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                    index = event = None
                # Also while tokens flow: a non-streamed answer has no other way to notice a client that left.
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if event is None or choices[index].finish_reason is not None:
                    continue  # (or a token generated after a stop string, before the cancellation took effect)
                if event.error is not None:
                    raise APIError(500, event.error, "server_error")
                text = choices[index].add(event)
                if choices[index].finish_reason is not None:
                    self.engine.cancel(sequences[index])
                yield index, text
        finally:
            for seq in sequences:
                self.engine.cancel(seq)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])


# ---- the two endpoints' answers: one path, streamed or whole ------------------------------------------------


class Answer:
    """How an endpoint writes a choice: streamed (``chunk``: its new text) or whole. Completions write text and the
    legacy log-probabilities (tokens, offsets), chat an assistant message and per-token entries."""

    def __init__(self, served: Served, chat: bool, logprobs: bool):
        self.served, self.chat, self.logprobs = served, chat, logprobs
        self.prefix, self.object = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def chunk(self, index: int, choice: Choice, text: str) -> dict[str, Any]:
        if self.chat:
            body = {"delta": {"content": text} if text or choice.finish_reason is None else {}}
            logprobs = self._logprobs(choice.logprobs[-1:])
        else:
            body, logprobs = {"text": text}, self._logprobs(choice.logprobs[-1:], len(choice.sent) - len(text))
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    def whole(self, index: int, choice: Choice) -> dict[str, Any]:
        body = {"message": {"role": "assistant", "content": choice.sent}} if self.chat else {"text": choice.sent}
        return {"index": index, **body, "logprobs": self._logprobs(choice.logprobs),
                "finish_reason": choice.finish_reason}

    def _logprobs(self, entries: LogprobEntries, start: int = 0) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        text = self.served.token_text
        if self.chat:
            def item(token: int, lp: float) -> dict[str, Any]:
                piece = text(token)
                return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}

            return {"content": [{**item(t, lp), "top_logprobs": [item(*top) for top in tops]}
                                for t, lp, tops in entries]}
        tokens = [text(token) for token, _, _ in entries]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{text(t): v for t, v in tops} for _, _, tops in entries],
                "text_offset": list(itertools.accumulate(map(len, tokens), initial=start))[:-1]}


async def answer(served: Served, request: Request, req: _Request, prompts: list[list[int]],
                 asked: tuple[SamplingParams, DecodeSettings, list[str]], limits: RequestLimits, shape: Answer):
    """Generate the request's choices and answer with them: as server-sent events when it streams, else whole.
    ``asked``: ``Served.sampling``'s answer; ``limits``: the endpoint's ranges."""
    params, decode, stop = asked
    sequences, choices, queue = served.start(prompts, params, decode, limits, req.n, stop)
    head = {"id": f"{shape.prefix}-{uuid.uuid4().hex}", "object": shape.object, "created": int(time.time()),
            "model": served.model_name}

    def usage() -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(c.tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    if req.stream:
        async def events() -> AsyncIterator[str]:
            chunk = {**head, "object": shape.chunk_object}
            try:
                for index in range(len(choices) if shape.chat else 0):  # a chat choice opens with its role
                    opening = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}
                    yield _sse({**chunk, "choices": [opening]})
                async for index, text in served.updates(request, sequences, choices, queue):
                    yield _sse({**chunk, "choices": [shape.chunk(index, choices[index], text)]})
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield _sse({**chunk, "choices": [], "usage": usage()})
            except APIError as exc:
                yield _sse(exc.body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async for _ in served.updates(request, sequences, choices, queue):
        pass
    return {**head, "choices": [shape.whole(i, c) for i, c in enumerate(choices)], "usage": usage()}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


# ---- the routes ----------------------------------------------------------------------------------------------

router = APIRouter()


def _served(request: Request) -> Served:
    return request.app.state.served


ServedBy = Annotated[Served, Depends(_served)]


@router.get("/", response_class=HTMLResponse)
async def page() -> HTMLResponse:
    return HTMLResponse(PAGE.read_text())


@router.get("/health")
async def health(served: ServedBy) -> dict[str, Any]:
    return {"status": "ok", "model": served.model_name, "max_model_len": served.max_seq_len,
            **served.decode.to_dict(), "chat": served.chat_error is None, "chat_error": served.chat_error,
            "model_decode_mode": served.model_mode, "fusion_trained": served.model_mode != "standard",
            **served.engine.stats()}


@router.get("/v1/models")
async def models(served: ServedBy) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": served.created,
                                        "owned_by": "fullband", "max_model_len": served.max_seq_len}]}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, served: ServedBy):
    served.check_model(req)
    ends = () if req.ignore_eos else (served.tokenizer.eos_id,)
    asked = served.sampling(req, req.max_tokens, req.logprobs, ends)
    prompts = _prompts(req.prompt, served.tokenizer)
    return await answer(served, request, req, prompts, asked, COMPLETION_LIMITS,
                        Answer(served, chat=False, logprobs=req.logprobs is not None))


@router.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request, served: ServedBy):
    served.check_model(req)
    if served.chat_error is not None:
        raise APIError(400, served.chat_error, param="messages", code="no_chat_template")
    if not req.messages:
        raise RequestError("messages must hold at least one message", "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs asks for the top log-probabilities of each token: set logprobs to true "
                           "too, or leave top_logprobs out", "top_logprobs")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        prompt = apply_chat_template(served.tokenizer, messages, add_generation_prompt=True)
    except ValueError as exc:
        raise RequestError(f"cannot apply the chat template: {exc}", "messages") from exc
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # as in OpenAI: up to the end of the context
        max_tokens = max(1, served.max_seq_len - len(prompt))
    ends = [*end_of_turn_ids(served.tokenizer), served.tokenizer.eos_id]
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    asked = served.sampling(req, max_tokens, logprobs, ends)
    return await answer(served, request, req, [prompt], asked, CHAT_LIMITS,
                        Answer(served, chat=True, logprobs=req.logprobs))


# ---- errors: OpenAI-style bodies -------------------------------------------------------------------------------


async def _error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, RequestError):
        exc = APIError(400, str(exc), param=exc.param)
    elif isinstance(exc, RequestValidationError):
        exc = _invalid_body(exc.errors())
    elif isinstance(exc, StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        exc = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)
    elif not isinstance(exc, APIError):
        exc = APIError(500, f"internal error: {exc}", "server_error")
    return exc.response()


def _invalid_body(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for a body that pydantic refuses."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    if extra:
        return _unknown_field(extra[0])
    if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return APIError(400, "the request body must be a JSON object of the request's fields, sent with "
                        "Content-Type: application/json", code="invalid_body")
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                       for e in errors[:5])
    return APIError(400, f"invalid request: {detail}", param=where)


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, decode: DecodeSettings | None = None) -> FastAPI:
    """The API around ``engine``, which the app starts and stops with its lifespan. ``decode``: the settings of
    requests that do not give their own (default: those stored with the model); each fused pass is a full
    prefill that the running batch waits for, so its ``fused_max_passes`` bounds what one request may ask."""
    # The model's own default mode tells whether its fusion was trained: a fresh or converted model and one trained
    # with train.schedule standard store standard, every schedule that trains the fusion soft or fused
    # (fullband.decoding). The chat page marks it and says when soft and fused mean nothing yet.
    stored = DecodeSettings.of(engine.model)
    served = Served(engine, tokenizer, model_name, decode if decode is not None else stored, stored.mode,
                    _chat_template_error(tokenizer))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="fullband", lifespan=lifespan)
    app.state.served = served
    app.include_router(router)
    for kind in (APIError, RequestError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, _error)  # every error as an OpenAI-style body
    return app


def _prompts(prompt: str | list[int] | list[str] | list[list[int]], tokenizer: Tokenizer) -> list[list[int]]:
    """The four prompt forms of the completions API -> token-id lists (text gets the tokenizer's BOS token)."""
    if isinstance(prompt, str):
        return [encode_prompt(tokenizer, prompt)]
    if not prompt:
        raise RequestError("prompt is empty", "prompt")
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

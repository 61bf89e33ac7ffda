"""The OpenAI API in front of the engine (§7: the API is the narrow waist of the new stack: any client that
speaks it reaches the KV store behind it without knowing it is there).

    POST /v1/chat/completions   messages -> an answer; "stream": true sends server-sent events
    POST /v1/completions        a prompt -> its continuation, the same way
    GET  /v1/models             the one model served
    GET  /health                alive, and what waits (requests queued and running, store jobs and writes)
    GET  /metrics               Prometheus text: requests, prompt tokens by where their KV came from, store hits
                                per tier, time to first token and time in the queue (histograms)

What the store did for a request is in OpenAI's own field, usage.prompt_tokens_details.cached_tokens (prompt
tokens whose KV came from the store), and in the header x-kv-cache (path=prefix|blend|prefill; prefix=exact
tokens; blended=tokens of reused chunks; recomputed=tokens computed here; context=the tokens before the last
message, which a store could have served) with x-kv-hits (records per place: hot, ram, disk, redis) and
x-queue-seconds (arrival to first step). A request may ask for "kv_check": true (outside OpenAI's fields): the
engine then also prefills the prompt in full and returns the first answer token's KL against what it served, in
"kv_cache".
Bad requests get OpenAI's error body ({"error": {"message", "type", "param", "code"}}) with HTTP 400 (401 for a
wrong API key); nothing answers with a traceback.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Annotated, Literal

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from lecture27.engine.chat import ROLES, Prompt, chat_prompt, completion_prompt
from lecture27.engine.generate import Engine, Request

DEFAULT_MAX_TOKENS = 128     # a chat answer's length when the request names none (a completion's: OpenAI's 16)
TTFT_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)


# ------------------------------------------------------------------------------------------------ request shapes
class Part(BaseModel):
    type: str = "text"
    text: str = ""


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal[ROLES]
    content: str | list[Part] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints take beside the prompt."""
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None   # up to 4 stop strings, as OpenAI takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    kv_check: bool = False


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int]


class BadRequest(Exception):
    """A request the API refuses: HTTP status, OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.kind)


def error_response(status: int, message: str, param=None, code=None, kind="invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


# ------------------------------------------------------------------------------------------------ metrics
class Metrics:
    """The engine's Prometheus metrics, in a registry of their own (two apps in one process keep theirs apart)."""

    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("l27_requests", "Requests served, by endpoint", ["endpoint"], registry=r)
        self.errors = Counter("l27_request_errors", "Requests refused or failed, by HTTP status", ["status"],
                              registry=r)
        self.prompt_tokens = Counter("l27_prompt_tokens", "Prompt tokens by where their KV came from: prefix (the "
                                     "store, exact), blended (reused chunks), recomputed (computed here)", ["source"],
                                     registry=r)
        self.generated = Counter("l27_generation_tokens", "Answer tokens generated", registry=r)
        self.hits = Counter("l27_store_hits", "KV records read from the store, by tier", ["tier"], registry=r)
        self.cancelled = Counter("l27_cancelled", "Answers stopped because the client went away", registry=r)
        self.ttft = Histogram("l27_ttft_seconds", "Time from a request's arrival to its first answer token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.queue = Histogram("l27_queue_seconds", "Time from a request's arrival to its first step (its KV looked up "
                               "and loaded, a place among the running requests)",
                               buckets=TTFT_BUCKETS, registry=r)
        Gauge("l27_running", "Requests being served at once (prefilling or decoding)", registry=r).set_function(
            lambda: engine.load()["running"])
        Gauge("l27_queued", "Requests waiting for their first step", registry=r).set_function(
            lambda: engine.load()["queued"])
        Gauge("l27_store_jobs", "Chunks waiting to be prefilled alone and records waiting to be written",
              registry=r).set_function(
            lambda: engine.load()["store_jobs"])


# ------------------------------------------------------------------------------------------------ the app
def make_app(engine: Engine, model_name: str, context_length: int, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="lecture 27 engine", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(engine)
    app.state.metrics = metrics

    @app.middleware("http")
    async def check_key(request: HTTPRequest, call_next):
        if api_key and request.url.path.startswith("/v1") and \
                request.headers.get("authorization", "") != f"Bearer {api_key}":
            metrics.errors.labels("401").inc()
            return error_response(401, "Incorrect API key provided", code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            message, param = "We could not parse the JSON body of your request.", None
        else:
            param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        metrics.errors.labels("400").inc()
        return error_response(400, message, param, "invalid_value" if param else "invalid_json")

    @app.exception_handler(BadRequest)
    async def refused(request, exc: BadRequest):
        metrics.errors.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        metrics.errors.labels(str(exc.status_code)).inc()
        return error_response(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def failed(request, exc: Exception):
        metrics.errors.labels("500").inc()
        return error_response(500, f"the engine failed: {type(exc).__name__}", kind="server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, **engine.load()}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "lecture27",
                                            "context_length": context_length}]}

    def checked(body: Sampling, prompt: Prompt, default_max: int) -> int:
        """The request's max_tokens, after OpenAI's checks."""
        if body.model != model_name:
            raise BadRequest(f"The model `{body.model}` does not exist; this engine serves `{model_name}`.", "model",
                             "model_not_found")
        if not len(prompt):
            raise BadRequest("The prompt is empty.", "prompt", "invalid_value")
        asked = getattr(body, "max_completion_tokens", None)
        asked = body.max_tokens if asked is None else asked
        if asked is not None and asked < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {asked}.", "max_tokens", "invalid_value")
        wanted = asked if asked is not None else min(default_max, max(1, context_length - len(prompt)))
        if len(prompt) + wanted > context_length:
            raise BadRequest(f"This model's maximum context length is {context_length} tokens. However, you requested "
                             f"{len(prompt) + wanted} tokens ({len(prompt)} in the messages, {wanted} in the "
                             "completion). Please reduce the length of the messages or completion.",
                             "messages", "context_length_exceeded")
        return wanted

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: HTTPRequest):
        prompt = chat_prompt(engine.tok, [(m.role, m.text()) for m in body.messages])
        return await serve(body, prompt, checked(body, prompt, DEFAULT_MAX_TOKENS), "chat.completion", request)

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: HTTPRequest):
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise BadRequest("This engine completes one prompt a request.", "prompt", "invalid_value")
            p = p[0]
        if isinstance(p, list) and any(not 0 <= t < engine.model.cfg.vocab_size for t in p):
            raise BadRequest("A token id is outside the vocabulary.", "prompt", "invalid_value")
        prompt = (completion_prompt(engine.tok, text=p) if isinstance(p, str)
                  else completion_prompt(engine.tok, tokens=p))
        return await serve(body, prompt, checked(body, prompt, 16), "text_completion", request)

    async def serve(body: Sampling, prompt: Prompt, max_tokens: int, kind: str, request: HTTPRequest):
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())

        def emit(what: str, **data) -> None:   # called by the model thread: counted here, even for a client gone
            if what == "end":
                metrics.generated.inc(data["tokens"])
                if data["finish_reason"] == "cancelled":
                    metrics.cancelled.inc()
            loop.call_soon_threadsafe(events.put_nowait, (what, data))

        req = Request(prompt=prompt, max_tokens=max_tokens, temperature=body.temperature, seed=body.seed, stop=stop,
                      kv_check=body.kv_check, emit=emit)
        metrics.requests.labels(kind).inc()
        engine.submit(req)
        try:
            what, data = await events.get()
        except asyncio.CancelledError:
            req.cancelled.set()
            raise
        if what == "error":
            raise RuntimeError(data["message"])
        reuse = data["reuse"]
        for source in ("prefix", "blended", "recomputed"):
            metrics.prompt_tokens.labels(source).inc(getattr(reuse, source))
        for tier, n in reuse.hits.items():
            metrics.hits.labels(tier).inc(n)
        metrics.queue.observe(data["queue_s"])
        headers = {"x-kv-cache": reuse.header(), "x-queue-seconds": f"{data['queue_s']:.4f}",
                   "x-prefill-seconds": f"{data['prefill_s']:.4f}",
                   "x-kv-hits": "; ".join(f"{t}={n}" for t, n in reuse.hits.items()) or "none"}
        answer = Answer(kind, model_name, len(prompt), reuse, req, metrics)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(answer.stream(events, include_usage), media_type="text/event-stream",
                                     headers=headers)
        try:
            await answer.collect(events)
        except asyncio.CancelledError:
            req.cancelled.set()
            raise
        return JSONResponse(answer.body(), headers=headers)

    return app


class Answer:
    """One response being assembled from the engine's events: the whole body, or its stream of chunks."""

    def __init__(self, kind: str, model: str, prompt_tokens: int, reuse, req: Request, metrics: Metrics):
        self.kind, self.model, self.prompt_tokens, self.reuse, self.req, self.metrics = \
            kind, model, prompt_tokens, reuse, req, metrics
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created, self.text, self.finish, self.tokens, self.kl = int(time.time()), [], None, 0, None
        self.first, self.first_chunk = True, True   # the first text not yet seen (TTFT), the first chunk not yet sent

    def got(self, what: str, data: dict) -> None:
        if what == "text":
            if self.first and data["token"] is not None:
                self.metrics.ttft.observe(time.perf_counter() - self.req.queued_at)
                self.first = False
            self.text.append(data["delta"])
        elif what == "end":
            self.finish, self.tokens, self.kl = data["finish_reason"], data["tokens"], data["kl"]
        elif what == "error":
            raise RuntimeError(data["message"])

    async def collect(self, events: asyncio.Queue) -> None:
        while self.finish is None:
            self.got(*await events.get())

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens,
                "prompt_tokens_details": {"cached_tokens": self.reuse.cached}}

    def kv_cache(self) -> dict:
        r = self.reuse
        return {"path": r.path, "prefix": r.prefix, "blended": r.blended, "recomputed": r.recomputed,
                "context": r.context, "hits": r.hits,
                **({"first_token_kl": self.kl} if self.kl is not None else {})}

    def finish_reason(self) -> str:
        return "stop" if self.finish == "cancelled" else self.finish

    def choice(self, text: str, final: bool, delta: bool) -> dict:
        reason = self.finish_reason() if final else None
        if self.kind == "text_completion":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if delta:
            return {"index": 0, "delta": {"role": "assistant", "content": text} if self.first_chunk else
                    ({"content": text} if text else {}), "logprobs": None, "finish_reason": reason}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}

    def body(self) -> dict:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [self.choice("".join(self.text), True, False)], "usage": self.usage(),
                "kv_cache": self.kv_cache()}

    def chunk(self, text: str, final: bool = False, usage: bool = False) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": [] if usage else [self.choice(text, final, True)]}
        if usage:
            out["usage"] = self.usage()
        if final or usage:
            out["kv_cache"] = self.kv_cache()
        self.first_chunk = False
        return f"data: {json.dumps(out)}\n\n"

    async def stream(self, events: asyncio.Queue, include_usage: bool):
        """Server-sent events: a chunk per piece of text, the finish reason, the usage if asked, [DONE]. A client
        that goes away cancels this generator: the engine stops its answer at the next token."""
        try:
            while self.finish is None:
                what, data = await events.get()
                before = len(self.text)
                self.got(what, data)
                if what == "text" and len(self.text) > before and self.text[-1]:
                    yield self.chunk(self.text[-1])
            yield self.chunk("", final=True)
            if include_usage:
                yield self.chunk("", usage=True)
            yield "data: [DONE]\n\n"
        finally:
            self.req.cancelled.set()   # a no-op once the answer is done; else the client went away

"""The OpenAI API in front of the engine (§7: the API is the narrow waist of the new stack: any client that
speaks it reaches the KV store behind it without knowing it is there).

    POST /v1/chat/completions   messages -> an answer; "stream": true sends server-sent events
    POST /v1/completions        a prompt -> its continuation, the same way
    GET  /v1/models             the one model served (its root and max_model_len, as vLLM lists them)
    GET  /health                alive, and what waits (requests queued and running, store jobs and writes)
    GET  /metrics               Prometheus text: requests, prompt tokens by where their KV came from, store hits
                                per tier, time to first token and time in the queue (histograms)

Its parts: schemas.py says what a request may ask (OpenAI's fields, each honoured, accepted as a label or refused
by name) and how it is refused; responses.py builds what it gets back (the body or the stream, the usage, the
logprobs, what the store did in usage and the x-kv-cache header); metrics.py counts for /metrics; this module routes
each endpoint between them and the engine (`Api`). A message (or a completion's text) holding the chunk separator
(chat.py) is cut into chunks there, each reusable alone from the store in any order.

Bad requests get OpenAI's error body ({"error": {"message", "type", "param", "code"}}) with HTTP 400 (404 and
code model_not_found for a model this engine does not serve, 401 for a wrong API key); a request the engine could
not finish gets 500 (server_error); nothing answers with a traceback.
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from lecture27.engine.chat import SEPARATOR, Prompt, chat_prompt, completion_prompt
from lecture27.engine.engine import Engine
from lecture27.engine.metrics import Metrics
from lecture27.engine.responses import Answer, Vocab, kv_headers
from lecture27.engine.schemas import (DEFAULT_MAX_TOKENS, BadRequest, ChatRequest, CompletionRequest, EngineError,
                                      Limits, Sampling, error_response, shape_error)
from lecture27.engine.sequence import Request


class Api:
    """The app in front of `engine` (`.app`, for uvicorn). separator: the text that cuts a message into chunks
    (chat.py; None or "": never cut). root: the weights served (GET /v1/models' `root`, as vLLM names the model's
    source). engine: engine.Engine, or anything with its tok, model.cfg, load() and submit()."""

    def __init__(self, engine: Engine, model_name: str, context_length: int, api_key: str | None = None,
                 separator: str | None = SEPARATOR, root: str | None = None):
        self.engine, self.model_name, self.context_length, self.api_key, self.separator, self.root = \
            engine, model_name, context_length, api_key, separator, root
        cfg = engine.model.cfg
        self.limits = Limits(model_name, cfg.vocab_size, context_length, engine.load()["kv_budget"],
                             cfg.kv_bytes_per_token(4))   # the engine's caches are float32
        self.metrics, self.vocab = Metrics(engine), Vocab(engine.tok)
        self.app = app = FastAPI(title="lecture 27 engine", docs_url=None, redoc_url=None, openapi_url=None)
        app.state.metrics = self.metrics
        app.middleware("http")(self.check_key)
        for exc, handler in ((RequestValidationError, self.invalid), (BadRequest, self.refused),
                             (HTTPException, self.http_error), (Exception, self.failed)):
            app.add_exception_handler(exc, handler)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/v1/completions")(self.complete)

    # ---- refusals: OpenAI's error body, counted by status
    async def check_key(self, request: HTTPRequest, call_next):
        if self.api_key and request.url.path.startswith("/v1") and \
                request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            self.metrics.errors.labels("401").inc()
            return error_response(401, "Incorrect API key provided", code="invalid_api_key")
        return await call_next(request)

    async def invalid(self, request, exc: RequestValidationError):
        self.metrics.errors.labels("400").inc()
        return shape_error(exc.errors()).response()

    async def refused(self, request, exc: BadRequest):
        self.metrics.errors.labels(str(exc.status)).inc()
        return exc.response()

    async def http_error(self, request, exc: HTTPException):
        self.metrics.errors.labels(str(exc.status_code)).inc()
        return error_response(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

    async def failed(self, request, exc: Exception):
        self.metrics.errors.labels("500").inc()
        return error_response(500, f"the engine failed: {type(exc).__name__}", kind="server_error")

    # ---- the routes
    async def health(self):
        return {"status": "ok", "model": self.model_name, **self.engine.load()}

    async def prometheus(self):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        name, n = self.model_name, self.context_length
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "lecture27",
                                            "root": self.root or name, "parent": None,
                                            "max_model_len": n, "context_length": n}]}

    async def chat(self, body: ChatRequest):
        self.limits.fields(body)
        prompt = chat_prompt(self.engine.tok, [(m.role, m.text()) for m in body.messages], self.separator)
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await self.serve(body, prompt, self.limits.checked(body, prompt, DEFAULT_MAX_TOKENS), "chat.completion",
                                logprobs=top)

    async def complete(self, body: CompletionRequest):
        self.limits.fields(body)
        p, tok = self.limits.one_prompt(body), self.engine.tok
        prompt = completion_prompt(tok, text=p, separator=self.separator) if isinstance(p, str) else \
            completion_prompt(tok, tokens=p)
        echo = (p if isinstance(p, str) else tok.decode(p)) if body.echo else None
        return await self.serve(body, prompt, self.limits.checked(body, prompt, 16), "text_completion",
                                logprobs=body.logprobs, echo=echo)

    async def serve(self, body: Sampling, prompt: Prompt, max_tokens: int, kind: str, logprobs: int | None,
                    echo: str | None = None):
        """The request handed to the engine; its answer whole (JSON) or streamed (server-sent events), the store's
        headers on either. A client that goes away before the answer is whole stops it at the next token."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        req = body.engine_request(prompt, max_tokens, self._emitter(loop, events), logprobs, echo)
        self.metrics.requests.labels(kind).inc()
        self.engine.submit(req)
        what, data = await _until(req, events.get())
        if what == "error":
            raise EngineError(data["message"])
        self.metrics.started(data)
        answer = Answer(kind, self.model_name, prompt, data["reuse"], req, self.metrics, self.vocab, echo)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(answer.stream(events, include_usage), media_type="text/event-stream",
                                     headers=kv_headers(data))
        await _until(req, answer.collect(events))
        return JSONResponse(answer.body(), headers=kv_headers(data))

    def _emitter(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
        """The request's emit: called by the model thread, it puts each event on this request's queue."""
        def emit(what: str, **data) -> None:   # counted here, even for a client gone
            if what == "end":
                self.metrics.ended(data)
            try:
                loop.call_soon_threadsafe(events.put_nowait, (what, data))
            except RuntimeError:   # the event loop has closed: the server stopped, nobody is left to tell
                pass
        return emit


async def _until(req: Request, waiting):
    """Await `waiting`; a client that goes away meanwhile (this task cancelled) cancels the request."""
    try:
        return await waiting
    except asyncio.CancelledError:
        req.cancelled.set()
        raise

"""The OpenAI API in front of the engine (§7: the API is the narrow waist of the new stack: any client that
speaks it reaches the KV store behind it without knowing it is there).

    POST /v1/chat/completions   messages -> an answer; "stream": true sends server-sent events
    POST /v1/completions        a prompt -> its continuation, the same way
    GET  /v1/models             the one model served (its root and max_model_len, as vLLM lists them)
    GET  /health                alive, and what waits (requests queued and running, store jobs and writes)
    GET  /metrics               Prometheus text: requests, prompt tokens by where their KV came from, store hits
                                per tier, time to first token and time in the queue (histograms)

What a request may ask (OpenAI's fields, each honoured, accepted as a label or refused by name) and how it is
refused are schemas.py's. A message (or a completion's text) holding the chunk separator (chat.py) is cut into
chunks there, each reusable alone from the store in any order.

What it gets back (the body or the stream, the usage, the logprobs, what the store did in usage and the x-kv-cache
header) is responses.py's; the Prometheus metrics are metrics.py's.

Bad requests get OpenAI's error body ({"error": {"message", "type", "param", "code"}}) with HTTP 400 (404 and
code model_not_found for a model this engine does not serve, 401 for a wrong API key); nothing answers with a
traceback.
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from lecture27.engine.chat import SEPARATOR, Prompt, chat_prompt, completion_prompt
from lecture27.engine.generate import Engine
from lecture27.engine.metrics import Metrics
from lecture27.engine.responses import Answer, Vocab, kv_headers
from lecture27.engine.schemas import (DEFAULT_MAX_TOKENS, BadRequest, ChatRequest, CompletionRequest, EngineError,
                                      Limits, Sampling, error_response, shape_error)


# ------------------------------------------------------------------------------------------------ the app
def make_app(engine: Engine, model_name: str, context_length: int, api_key: str | None = None,
             separator: str | None = SEPARATOR, root: str | None = None) -> FastAPI:
    """The app in front of `engine`. separator: the text that cuts a message into chunks (chat.py; None or "": never
    cut). root: the weights served (GET /v1/models' `root`, as vLLM names the model's source)."""
    app = FastAPI(title="lecture 27 engine", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(engine)
    app.state.metrics = metrics
    vocab, cfg = Vocab(engine.tok), engine.model.cfg
    limits = Limits(model_name, cfg.vocab_size, context_length, engine.load()["kv_budget"],
                    cfg.kv_bytes_per_token(4))   # the engine's caches are float32

    @app.middleware("http")
    async def check_key(request: HTTPRequest, call_next):
        if api_key and request.url.path.startswith("/v1") and \
                request.headers.get("authorization", "") != f"Bearer {api_key}":
            metrics.errors.labels("401").inc()
            return error_response(401, "Incorrect API key provided", code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        metrics.errors.labels("400").inc()
        return shape_error(exc.errors()).response()

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
                                            "root": root or model_name, "parent": None,
                                            "max_model_len": context_length, "context_length": context_length}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: HTTPRequest):
        limits.fields(body)
        prompt = chat_prompt(engine.tok, [(m.role, m.text()) for m in body.messages], separator)
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await serve(body, prompt, limits.checked(body, prompt, DEFAULT_MAX_TOKENS), "chat.completion", request,
                           logprobs=top)

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: HTTPRequest):
        limits.fields(body)
        p = limits.one_prompt(body)
        prompt = completion_prompt(engine.tok, text=p, separator=separator) if isinstance(p, str) else \
            completion_prompt(engine.tok, tokens=p)
        echo = (p if isinstance(p, str) else engine.tok.decode(p)) if body.echo else None
        return await serve(body, prompt, limits.checked(body, prompt, 16), "text_completion", request,
                           logprobs=body.logprobs, echo=echo)

    async def serve(body: Sampling, prompt: Prompt, max_tokens: int, kind: str, request: HTTPRequest,
                    logprobs: int | None, echo: str | None = None):
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(what: str, **data) -> None:   # called by the model thread: counted here, even for a client gone
            if what == "end":
                metrics.ended(data)
            try:
                loop.call_soon_threadsafe(events.put_nowait, (what, data))
            except RuntimeError:   # the event loop has closed: the server stopped, nobody is left to tell
                pass

        req = body.engine_request(prompt, max_tokens, emit, logprobs, echo)
        metrics.requests.labels(kind).inc()
        engine.submit(req)
        try:
            what, data = await events.get()
        except asyncio.CancelledError:
            req.cancelled.set()
            raise
        if what == "error":
            raise EngineError(data["message"])
        metrics.started(data)
        headers = kv_headers(data)
        answer = Answer(kind, model_name, prompt, data["reuse"], req, metrics, vocab, echo)
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

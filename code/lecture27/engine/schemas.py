"""What a request to the OpenAI API may ask (api.py serves it), and how a request is refused.

Decoding honours OpenAI's fields: temperature, top_p, seed, stop, max_tokens (max_completion_tokens),
presence_penalty, frequency_penalty, logit_bias; logprobs and top_logprobs (chat, 0-20), logprobs (an int) and echo
(completions), computed from the logits the engine served (engine.py says which). A field this engine cannot honour
(n > 1, tools, structured output, an image part, ...) or one OpenAI does not define gets a 400 that names it; fields
that only label a request (user, metadata, ...) are accepted. A request may ask for "kv_check": true (outside
OpenAI's fields): the engine then also prefills the prompt in full and reports what reuse cost (responses.py).
Bad requests get OpenAI's error body ({"error": {"message", "type", "param", "code"}}) with HTTP 400 (404 and
code model_not_found for a model this engine does not serve); nothing answers with a traceback.

The checks that need what is served (the model's name, its vocabulary and context, the engine's KV budget) are
`Limits`'s; the ones a body's shape settles are pydantic's, turned into OpenAI's words by `shape_error`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Callable, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from lecture27.engine.chat import ROLES, Prompt
from lecture27.engine.sequence import Request, kv_need

DEFAULT_MAX_TOKENS = 128     # a chat answer's length when the request names none (a completion's: OpenAI's 16)


# ------------------------------------------------------------------------------------------------ request shapes
# Every field OpenAI's two endpoints define is declared here and either honoured, accepted as a label that changes
# no answer (LABELS), or refused with a 400 that names it when it asks for what this engine does not do
# (UNSUPPORTED); a field OpenAI does not define is refused the same way (extra="forbid"). None is ever dropped.
LABELS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
          "parallel_tool_calls")   # who asks, where OpenAI would keep it, how tools may run (none do here)
UNSUPPORTED = {   # field: (asked for, what is not supported)
    "n": (lambda v: v not in (None, 1), "more than one choice per request (n > 1)"),
    "best_of": (lambda v: v not in (None, 1), "best_of > 1"),
    "tools": (bool, "tools (function calling)"),
    "tool_choice": (lambda v: v not in (None, "none"), "tool_choice other than \"none\" (function calling)"),
    "functions": (bool, "functions (function calling)"),
    "function_call": (lambda v: v not in (None, "none"), "function_call (function calling)"),
    "response_format": (lambda v: v is not None and v.get("type") != "text",
                        "response_format other than {\"type\": \"text\"} (structured output)"),
    "suffix": (bool, "suffix (insertion)"),
    "modalities": (lambda v: v not in (None, ["text"]), "modalities other than [\"text\"]"),
    "audio": (lambda v: v is not None, "audio output"),
    "prediction": (lambda v: v is not None, "predicted outputs"),
    "reasoning_effort": (lambda v: v is not None, "reasoning_effort (this model does not reason)"),
    "verbosity": (lambda v: v is not None, "verbosity"),
    "web_search_options": (lambda v: v is not None, "web search"),
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Part(BaseModel):
    """A content part: text is read; any other type (an image, audio, a file) is refused by name."""
    model_config = ConfigDict(extra="allow")
    type: str = "text"
    text: str | None = None


class Message(Strict):
    role: Literal[ROLES]
    content: str | list[Part] | None = None
    name: str | None = None          # accepted, not rendered: SmolLM2's ChatML template has no place for a name
    tool_call_id: str | None = None  # a tool message's reference to a call: accepted, not rendered
    refusal: str | None = None       # an assistant's earlier refusal: its text when the message has no content
    annotations: list | None = None  # an earlier answer's citations, sent back with it: accepted, not rendered
    tool_calls: list | None = None   # refused unless empty (no tools here)
    function_call: dict | None = None
    audio: dict | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return self.content or self.refusal or ""


class StreamOptions(Strict):
    include_usage: bool | None = False


class Sampling(Strict):
    """What both endpoints take beside the prompt."""
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, ge=0, le=1)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None   # up to 4 stop strings, as OpenAI takes
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1)
    kv_check: bool = False
    ignore_eos: bool = False   # vLLM's field (its benchmark sends it): decode max_tokens tokens, past an end of turn
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def engine_request(self, prompt: Prompt, max_tokens: int, emit: Callable, logprobs: int | None,
                       echo: str | None = None) -> Request:
        """The engine's Request for this body (sequence.Request): a completion's echo with logprobs scores the
        prompt's tokens too."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return Request(prompt=prompt, max_tokens=max_tokens, temperature=_or(self.temperature, 1.0),
                       top_p=_or(self.top_p, 1.0), presence_penalty=_or(self.presence_penalty, 0.0),
                       frequency_penalty=_or(self.frequency_penalty, 0.0),
                       logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()}, seed=self.seed, stop=stop,
                       logprobs=logprobs, echo_logprobs=logprobs if echo is not None else None,
                       kv_check=self.kv_check, ignore_eos=self.ignore_eos, emit=emit)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


def _or(value, default):
    """A field sent as null takes its default, as OpenAI reads it."""
    return default if value is None else value


# ------------------------------------------------------------------------------------------------ refusals
class BadRequest(Exception):
    """A request the API refuses: HTTP status, OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.kind)


class EngineError(BadRequest):
    """A request the engine could not finish (a step failed, the KV could not be loaded, the server is stopping):
    HTTP 500 and OpenAI's server_error body; in a stream that has begun, its last event before [DONE]."""

    def __init__(self, message: str):
        super().__init__(message, status=500, kind="server_error")

    def event(self) -> str:
        error = {"message": self.message, "type": self.kind, "param": None, "code": self.status}
        return f"data: {json.dumps({'error': error})}\n\n"


def error_response(status: int, message: str, param=None, code=None, kind="invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def shape_error(errors: list[dict]) -> BadRequest:
    """A body pydantic refused (FastAPI's validation errors, each located from "body"), in OpenAI's words: the first
    error names the field, and says whether the JSON did not parse, the field is unknown, or its value is wrong."""
    first = errors[0]
    param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    if first.get("type") == "json_invalid":
        message, param, code = "We could not parse the JSON body of your request.", None, "invalid_json"
    elif first.get("type") == "extra_forbidden":
        message, code = f"Unrecognized request argument supplied: {param} (not supported by this engine).", \
            "unknown_parameter"
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        code = "invalid_value" if param else "invalid_json"
    return BadRequest(message, param, code)


# ------------------------------------------------------------------------------------------------ what is served
@dataclass(frozen=True)
class Limits:
    """What a well-shaped request must still fit: the model served (`model`), its vocabulary (`vocab_size` token
    ids) and context (`context_length` tokens), and the engine's KV budget (`kv_budget` bytes, at `per_token` bytes
    a token: sequence.kv_need counts a request's)."""
    model: str
    vocab_size: int
    context_length: int
    kv_budget: int
    per_token: int

    def fields(self, body: Sampling) -> None:
        """The model exists, and every field asks for what the engine does (the request shapes' comment)."""
        if body.model != self.model:
            raise BadRequest(f"The model `{body.model}` does not exist; this engine serves `{self.model}`.", "model",
                             "model_not_found", status=404)
        for name, (asked, what) in UNSUPPORTED.items():
            if name in type(body).model_fields and asked(getattr(body, name)):
                raise BadRequest(f"{name}: {what} is not supported by this engine.", name, "unsupported_value")
        for i, m in enumerate(getattr(body, "messages", ())):
            for name in ("tool_calls", "function_call", "audio"):
                if getattr(m, name):
                    raise BadRequest(f"messages.{i}.{name}: a message's {name} is not supported by this engine.",
                                     f"messages.{i}.{name}", "unsupported_value")
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if part.type != "text":
                    raise BadRequest(f"messages.{i}.content.{j}.type: content of type '{part.type}' is not "
                                     "supported by this engine (SmolLM2 reads text).", f"messages.{i}.content.{j}.type",
                                     "unsupported_value")
        if getattr(body, "top_logprobs", None) and not body.logprobs:
            raise BadRequest("top_logprobs: asks for logprobs; set logprobs to true.", "top_logprobs", "invalid_value")
        for key in body.logit_bias or {}:
            if not (key.isdigit() and int(key) < self.vocab_size):
                raise BadRequest(f"logit_bias: {key!r} is not a token id of this model's vocabulary "
                                 f"(0..{self.vocab_size - 1}).", "logit_bias", "invalid_value")
        if isinstance(body.stop, list) and "" in body.stop or body.stop == "":
            raise BadRequest("stop: a stop string is empty.", "stop", "invalid_value")

    def one_prompt(self, body: CompletionRequest) -> str | list[int]:
        """A completion's one prompt: its text, or its token ids, each in the vocabulary."""
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise BadRequest("This engine completes one prompt a request.", "prompt", "invalid_value")
            p = p[0]
        if isinstance(p, list) and any(not 0 <= t < self.vocab_size for t in p):
            raise BadRequest("A token id is outside the vocabulary.", "prompt", "invalid_value")
        return p

    def checked(self, body: Sampling, prompt: Prompt, default_max: int) -> int:
        """The request's max_tokens, after OpenAI's checks."""
        if not len(prompt):
            raise BadRequest("The prompt is empty.", "prompt", "invalid_value")
        asked = getattr(body, "max_completion_tokens", None)
        asked = body.max_tokens if asked is None else asked
        if asked is not None and asked < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {asked}.", "max_tokens", "invalid_value")
        context = self.context_length
        wanted = asked if asked is not None else min(default_max, max(1, context - len(prompt)))
        if len(prompt) + wanted > context:
            raise BadRequest(f"This model's maximum context length is {context} tokens. However, you requested "
                             f"{len(prompt) + wanted} tokens ({len(prompt)} in the messages, {wanted} in the "
                             "completion). Please reduce the length of the messages or completion.",
                             "messages", "context_length_exceeded")
        check = bool(body.kv_check or (getattr(body, "echo", False) and body.logprobs is not None))
        need = kv_need(self.per_token, len(prompt), wanted, check=check)
        if need > self.kv_budget:
            raise BadRequest(f"This request may hold {need / 1e9:.2f} GB of KV cache ({len(prompt)} prompt tokens, "
                             f"{wanted} completion tokens{', kv_check' if check else ''}), more than the engine's "
                             f"budget of {self.kv_budget / 1e9:.2f} GB (serve.py --kv-gb). Please reduce "
                             "the length of the messages or completion.", "messages", "kv_budget_exceeded")
        return wanted

"""The API's three parts without a server or a model: schemas.py (a body refused with OpenAI's param and code, the
checks that need what is served, the engine Request a body asks for), responses.py (a token's text and bytes, an
Answer fed the engine's events: OpenAI's body, chunks, usage and logprobs) and api.py (its routes on a FastAPI
TestClient, around a fake engine whose submit() emits canned events)."""
import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from lecture27.engine.api import Api
from lecture27.engine.chat import Prompt
from lecture27.engine.connector import Reuse
from lecture27.engine.metrics import Metrics
from lecture27.engine.responses import Answer, Vocab, _byte_alphabet, _finite, kv_headers
from lecture27.engine.schemas import (BadRequest, ChatRequest, CompletionRequest, EngineError, Limits, shape_error)
from lecture27.engine.sequence import Request, Scored

MODEL = "tiny"
USER = [{"role": "user", "content": "hi"}]
BYTE_OF = _byte_alphabet()
CHAR_OF = {b: c for c, b in BYTE_OF.items()}


class Tok:
    """A byte-level tokenizer: token i is byte i, spelled in byte-level BPE's alphabet (256 tokens)."""

    def encode(self, text: str):
        return SimpleNamespace(ids=list(text.encode()))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str | None:
        return CHAR_OF.get(i)


class FakeEngine:
    """What Api reads of engine.Engine: tok, model.cfg, load(), submit(). submit() answers at once with `answer`'s
    bytes, a token each, and their scores when logprobs are asked; fail="start" fails before the answer, "mid" after
    its first two tokens."""

    def __init__(self, answer: str = "Hé!", fail: str | None = None, kv_budget: int = 10**9):
        self.tok = Tok()
        self.model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=256, kv_bytes_per_token=lambda n: 1000 * n))
        self.answer, self.fail, self.kv_budget, self.got = answer, fail, kv_budget, []

    def load(self) -> dict:
        return {"queued": 0, "running": 0, "store_jobs": 0, "steps": 0, "kv_bytes": 0, "kv_budget": self.kv_budget}

    def submit(self, req: Request) -> None:
        self.got.append(req)
        if self.fail == "start":
            return req.emit("error", message="loading the KV failed: boom")
        req.emit("start", reuse=Reuse(path="prefix", prefix=2, recomputed=len(req.prompt) - 2, hits={"ram": 1}),
                 queue_s=0.25, prefill_s=0.5)
        raw = self.answer.encode()[:req.max_tokens]
        for i, b in enumerate(raw):
            if self.fail == "mid" and i == 2:
                return req.emit("error", message="the engine stopped")
            text, before = raw[:i + 1].decode(errors="ignore"), raw[:i].decode(errors="ignore")
            req.emit("text", delta=text[len(before):], token=b,
                     scored=None if req.logprobs is None else Scored(b, -0.5, ((b, -0.5), (65, -2.0))[:req.logprobs]))
        req.emit("end", finish_reason="length" if len(raw) == req.max_tokens else "stop", tokens=len(raw), kl=None)


# ------------------------------------------------------------------------------------------------ schemas.py
LIMITS = Limits(model=MODEL, vocab_size=256, context_length=100, kv_budget=10**9, per_token=1000)


def refusal(model, body: dict) -> BadRequest:
    """The refusal the API sends for a body pydantic rejects (FastAPI locates its errors from "body")."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return shape_error([{**x, "loc": ("body", *x["loc"])} for x in e.value.errors()])


def refused(check, *args) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        check(*args)
    return e.value


def test_an_unknown_field_or_a_bad_value_is_refused_naming_it():
    r = refusal(ChatRequest, {"model": MODEL, "messages": USER, "top_k": 2})
    assert (r.status, r.param, r.code) == (400, "top_k", "unknown_parameter") and "top_k" in r.message
    r = refusal(ChatRequest, {"model": MODEL, "messages": USER, "temperature": 3})
    assert (r.param, r.code) == ("temperature", "invalid_value") and r.message.startswith("temperature: ")
    r = refusal(ChatRequest, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]})
    assert (r.param, r.code) == ("messages.0.role", "invalid_value")
    r = refusal(CompletionRequest, {"model": MODEL, "prompt": "a", "logprobs": 21})
    assert (r.param, r.code) == ("logprobs", "invalid_value")


def test_fields_refuse_another_model_an_unsupported_field_and_a_bias_outside_the_vocabulary():
    r = refused(LIMITS.fields, ChatRequest(model="gpt-4", messages=USER))
    assert (r.status, r.param, r.code) == (404, "model", "model_not_found")
    r = refused(LIMITS.fields, ChatRequest(model=MODEL, messages=USER, n=2))
    assert (r.status, r.param, r.code) == (400, "n", "unsupported_value")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    assert refused(LIMITS.fields, ChatRequest(model=MODEL, messages=image)).param == "messages.0.content.0.type"
    r = refused(LIMITS.fields, ChatRequest(model=MODEL, messages=USER, logit_bias={"256": 1}))
    assert (r.param, r.code) == ("logit_bias", "invalid_value") and "(0..255)" in r.message
    LIMITS.fields(ChatRequest(model=MODEL, messages=USER, logit_bias={"255": 1}, tool_choice="none"))
    assert refused(LIMITS.fields, ChatRequest(model=MODEL, messages=USER, stop=["a", ""])).param == "stop"


def test_max_completion_tokens_is_preferred_and_the_context_and_the_kv_budget_bound_it():
    prompt = Prompt(system=(), chunks=(), question=tuple(range(10)))
    both = ChatRequest(model=MODEL, messages=USER, max_tokens=3, max_completion_tokens=5)
    assert LIMITS.checked(both, prompt, 128) == 5
    assert LIMITS.checked(ChatRequest(model=MODEL, messages=USER, max_tokens=3), prompt, 128) == 3
    assert LIMITS.checked(ChatRequest(model=MODEL, messages=USER), prompt, 128) == 90   # what the context leaves
    r = refused(LIMITS.checked, ChatRequest(model=MODEL, messages=USER, max_tokens=91), prompt, 128)
    assert r.code == "context_length_exceeded" and "101 tokens (10 in the messages, 91" in r.message
    assert refused(LIMITS.checked, ChatRequest(model=MODEL, messages=USER, max_tokens=0), prompt, 128).param == \
        "max_tokens"
    small = Limits(MODEL, 256, 100, kv_budget=30_000, per_token=1000)   # 10 + 9 + 1 + 10 held = 30 tokens fit
    assert small.checked(ChatRequest(model=MODEL, messages=USER, max_tokens=9), prompt, 128) == 9
    r = refused(small.checked, ChatRequest(model=MODEL, messages=USER, max_tokens=10), prompt, 128)
    assert r.code == "kv_budget_exceeded" and "--kv-gb" in r.message


def test_a_completion_has_one_prompt_of_token_ids_in_the_vocabulary():
    assert LIMITS.one_prompt(CompletionRequest(model=MODEL, prompt=["ab"])) == "ab"
    assert LIMITS.one_prompt(CompletionRequest(model=MODEL, prompt=[0, 255])) == [0, 255]
    assert refused(LIMITS.one_prompt, CompletionRequest(model=MODEL, prompt=["a", "b"])).param == "prompt"
    assert "outside the vocabulary" in refused(LIMITS.one_prompt, CompletionRequest(model=MODEL, prompt=[256])).message


def test_the_engine_request_takes_a_null_fields_default_and_the_echo_scores_the_prompt():
    prompt = Prompt(system=(), chunks=(), question=(1, 2))
    body = CompletionRequest(model=MODEL, prompt="a", temperature=None, top_p=None, stop="x", logit_bias={"7": 2})
    req = body.engine_request(prompt, 4, print, logprobs=2, echo="a")
    assert (req.temperature, req.top_p, req.stop, req.logit_bias) == (1.0, 1.0, ("x",), {7: 2.0})
    assert (req.max_tokens, req.logprobs, req.echo_logprobs) == (4, 2, 2)
    assert body.engine_request(prompt, 4, print, logprobs=2).echo_logprobs is None


# ------------------------------------------------------------------------------------------------ responses.py
def test_a_byte_token_is_its_byte_and_a_piece_of_a_character_is_u_fffd():
    vocab = Vocab(Tok())
    assert vocab(ord("H")) == ("H", [72]) and vocab(ord(" ")) == (" ", [32])   # a space is spelled Ġ
    assert vocab("é".encode()[0]) == ("\ufffd", [0xC3])
    assert _finite(float("-inf")) == -9999.0 and _finite(-1.5) == -1.5


def answer(kind: str, logprobs: int | None = None, echo: str | None = None) -> Answer:
    prompt = Prompt(system=(), chunks=(), question=tuple(b"Hi"))
    req = Request(prompt=prompt, emit=print, logprobs=logprobs, echo_logprobs=logprobs if echo else None)
    return Answer(kind, MODEL, prompt, Reuse(path="prefix", prefix=1, recomputed=1), req, Metrics(FakeEngine()),
                  Vocab(Tok()), echo)


def feed(a: Answer, text: str = "Hé", finish: str = "stop") -> None:
    """A token per byte of `text`, as the engine sends them: a character's text once its last byte is in."""
    raw = text.encode()
    for i, b in enumerate(raw):
        a.got("text", {"delta": raw[:i + 1].decode(errors="ignore")[len(raw[:i].decode(errors="ignore")):], "token": b,
                       "scored": Scored(b, -0.5, ((b, -0.5),)) if a.req.logprobs is not None else None})
    a.got("end", {"finish_reason": finish, "tokens": len(text.encode()), "kl": None})


def test_an_answer_fed_the_engines_events_is_openais_chat_body():
    a = answer("chat.completion", logprobs=1)
    feed(a)
    body = a.body()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hé"} and choice["finish_reason"] == "stop"
    assert [e["bytes"] for e in choice["logprobs"]["content"]] == [[72], [0xC3], [0xA9]]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    assert body["kv_cache"]["path"] == "prefix"


def test_a_completions_echo_comes_first_and_its_offsets_count_the_characters_begun_before():
    a = answer("text_completion", logprobs=0, echo="Hi")
    a.got("prompt", {"scores": [None, Scored(ord("i"), -1.0)]})
    feed(a, finish="length")
    choice = a.body()["choices"][0]
    assert choice["text"] == "HiHé" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3, 4] and choice["logprobs"]["token_logprobs"][0] is None


def test_an_answer_streams_chunks_then_its_usage_then_done():
    a = answer("chat.completion")
    events = asyncio.Queue()
    for what, data in [("text", {"delta": "He", "token": 72, "scored": None}),
                       ("end", {"finish_reason": "stop", "tokens": 2, "kl": None})]:
        events.put_nowait((what, data))

    async def chunks():
        return [c async for c in a.stream(events, include_usage=True)]
    out = asyncio.run(chunks())
    assert out[-1] == "data: [DONE]\n\n" and all(c.startswith("data: ") for c in out)
    first, final, usage = (json.loads(c[6:]) for c in out[:3])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert final["choices"][0]["finish_reason"] == "stop" and "usage" not in final
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2 and a.req.cancelled.is_set()


def test_an_engine_error_is_a_500_body_or_a_streams_last_event():
    e = EngineError("the engine stopped")
    assert e.response().status_code == 500
    assert json.loads(e.event()[6:]) == {"error": {"message": "the engine stopped", "type": "server_error",
                                                   "param": None, "code": 500}}
    start = {"reuse": Reuse(path="blend", blended=3, hits={"disk": 2}), "queue_s": 0.5, "prefill_s": 0.25}
    assert kv_headers(start) == {"x-kv-cache": "path=blend; prefix=0; blended=3; recomputed=0; context=0",
                                 "x-queue-seconds": "0.5000", "x-prefill-seconds": "0.2500", "x-kv-hits": "disk=2"}


# ------------------------------------------------------------------------------------------------ api.py
def client(engine=None, **kw) -> TestClient:
    return TestClient(Api(engine or FakeEngine(), MODEL, 300, **kw).app, raise_server_exceptions=False)


def test_a_chat_completion_and_the_same_streamed_end_to_end_on_a_fake_engine():
    engine = FakeEngine()
    c = client(engine)
    r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hé"
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.headers["x-kv-hits"] == "ram=1"
    assert engine.got[-1].max_tokens == 3 and engine.got[-1].temperature == 1.0
    r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and "".join(
        json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "Hé!"
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": [72, 105], "echo": True, "max_tokens": 1})
    assert r.json()["choices"][0]["text"] == "HiH"


def test_bad_input_gets_400_with_openais_error_body_and_is_counted():
    c = client()
    r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "top_k": 2})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "Unrecognized request argument supplied: top_k (not supported by this engine).",
        "type": "invalid_request_error", "param": "top_k", "code": "unknown_parameter"}
    r = c.post("/v1/chat/completions", content="{\"model\": ", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = c.post("/v1/chat/completions", json={"model": "gpt-4", "messages": USER})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert c.get("/nope").json()["error"]["code"] == "not_found"
    assert 'l27_request_errors_total{status="400"} 2.0' in c.get("/metrics").text


def test_health_models_and_the_api_key():
    c = client(api_key="k", root="w.gguf")
    assert c.get("/health").json() == {"status": "ok", "model": MODEL, **FakeEngine().load()}   # no key needed
    r = c.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    m = c.get("/v1/models", headers={"authorization": "Bearer k"}).json()["data"][0]
    assert (m["id"], m["root"], m["max_model_len"]) == (MODEL, "w.gguf", 300)


def test_an_engine_that_fails_gets_500_or_ends_the_stream_with_an_error_event():
    r = client(FakeEngine(fail="start")).post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert r.status_code == 500 and r.json()["error"] == {"message": "loading the KV failed: boom",
                                                          "type": "server_error", "param": None, "code": None}
    r = client(FakeEngine(fail="mid")).post("/v1/chat/completions",
                                            json={"model": MODEL, "messages": USER, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["message"] == "the engine stopped"


def test_the_kv_budget_is_read_from_the_engines_load():
    c = client(FakeEngine(kv_budget=1000))
    r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_budget_exceeded"

"""What a request gets back from the OpenAI API (api.py serves it): OpenAI's body, or its stream of chunks, built
from the engine's events (sequence.Request says which), with the usage and the logprobs in OpenAI's shapes.

What the store did for a request is in OpenAI's own field, usage.prompt_tokens_details.cached_tokens (prompt
tokens whose KV came from the store), and in the header x-kv-cache (path=prefix|blend|prefill; prefix=exact
tokens; blended=tokens of reused chunks; recomputed=tokens computed here; context=the tokens before the question,
which a store could have served) with x-kv-hits (records per place: hot, ram, disk, redis) and x-queue-seconds
(arrival to first step). A request that asked for "kv_check": true (outside OpenAI's fields) also gets the first
answer token's KL against a full prefill of its prompt, in "kv_cache" (first_token_kl).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from lecture27.engine.chat import Prompt
from lecture27.engine.metrics import Metrics
from lecture27.engine.schemas import EngineError
from lecture27.engine.sequence import Request


# ------------------------------------------------------------------------------------------------ tokens as text
def _byte_alphabet() -> dict:
    """Byte-level BPE's alphabet read backwards: the printable character that stands for each byte -> the byte
    (printable bytes stand for themselves; the others, in order, for the characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


class Vocab:
    """A token's text and its bytes, as OpenAI's logprobs give them: a token may hold part of a character, whose
    text is then U+FFFD while its bytes are exact (the bytes of an answer's tokens, joined, are its UTF-8)."""

    def __init__(self, tok):
        self.tok, self.alphabet, self.known = tok, _byte_alphabet(), {}

    def __call__(self, token: int) -> tuple[str, list]:
        if token not in self.known:
            piece = self.tok.id_to_token(token) or ""
            raw = bytes(self.alphabet[c] for c in piece) if all(c in self.alphabet for c in piece) else piece.encode()
            self.known[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self.known[token]


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: a token the logits rule out gets -9999 (as vLLM reports it)."""
    return max(logprob, -9999.0)


# ------------------------------------------------------------------------------------------------ the answer
def kv_headers(start: dict) -> dict:
    """The response's headers from a request's "start" event (reuse, queue_s, prefill_s): what the store did."""
    reuse = start["reuse"]
    return {"x-kv-cache": reuse.header(), "x-queue-seconds": f"{start['queue_s']:.4f}",
            "x-prefill-seconds": f"{start['prefill_s']:.4f}",
            "x-kv-hits": "; ".join(f"{t}={n}" for t, n in reuse.hits.items()) or "none"}


class Answer:
    """One response being assembled from the engine's events: the whole body, or its stream of chunks. A completion's
    echo puts the prompt's text first (and, with logprobs, its tokens' scores, which come before any answer text).
    The usage is the same on every path: the prompt's tokens, the answer's tokens (each one the engine chose, up to a
    stop string's or an end token; the logprobs list one entry per such token), the prompt's tokens from the store."""

    def __init__(self, kind: str, model: str, prompt: Prompt, reuse, req: Request, metrics: Metrics, vocab: Vocab,
                 echo: str | None = None):
        self.kind, self.model, self.prompt, self.reuse, self.req, self.metrics, self.vocab = \
            kind, model, prompt, reuse, req, metrics, vocab
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created, self.text, self.finish, self.tokens, self.kl = int(time.time()), [], None, 0, None
        self.first, self.first_chunk = True, True   # the first text not yet seen (TTFT), the first chunk not yet sent
        self.echo = echo
        self.scores: list = []        # (Scored, text offset) of each answer token, when logprobs are asked
        self.prompt_scores = None     # echo with logprobs: (Scored or None, token, text offset) of each prompt token
        self.offset = len(echo) if echo is not None else 0   # characters before the next answer token (completions)

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _chars(self, token: int) -> int:
        """Characters a token's bytes begin (its bytes that do not continue a character)."""
        return sum((b & 0xC0) != 0x80 for b in self.vocab(token)[1])

    def got(self, what: str, data: dict) -> None:
        if what == "text":
            if self.first and data["token"] is not None:
                self.metrics.ttft.observe(time.perf_counter() - self.req.queued_at)
                self.first = False
            self.text.append(data["delta"])
            if data.get("scored") is not None:
                self.scores.append((data["scored"], self.offset))
                self.offset += self._chars(data["token"])
        elif what == "prompt":
            at, self.prompt_scores = 0, []
            for score, token in zip(data["scores"], self.prompt.tokens):
                self.prompt_scores.append((score, token, at))
                at += self._chars(token)
        elif what == "end":
            self.finish, self.tokens, self.kl = data["finish_reason"], data["tokens"], data["kl"]
        elif what == "error":
            raise EngineError(data["message"])

    async def collect(self, events: asyncio.Queue) -> None:
        while self.finish is None:
            self.got(*await events.get())

    def usage(self) -> dict:
        n = len(self.prompt)
        return {"prompt_tokens": n, "completion_tokens": self.tokens, "total_tokens": n + self.tokens,
                "prompt_tokens_details": {"cached_tokens": self.reuse.cached}}

    def kv_cache(self) -> dict:
        r = self.reuse
        return {"path": r.path, "prefix": r.prefix, "blended": r.blended, "recomputed": r.recomputed,
                "context": r.context, "hits": r.hits,
                **({"first_token_kl": self.kl} if self.kl is not None else {})}

    def finish_reason(self) -> str:
        return "stop" if self.finish == "cancelled" else self.finish

    # ---- logprobs in OpenAI's two shapes
    def _entry(self, token: int, logprob: float) -> dict:
        text, raw = self.vocab(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": raw}

    def logprobs(self, scores: list, prompt: list = ()) -> dict | None:
        """The logprobs of these answer tokens (and, for an echo, these prompt tokens first), or None when not asked:
        chat's {"content": [...]}; a completion's {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, whose
        top_logprobs hold the chosen token beside the most likely ones."""
        if self.req.logprobs is None:
            return None
        if self.chat:
            return {"content": [{**self._entry(s.token, s.logprob),
                                 "top_logprobs": [self._entry(t, lp) for t, lp in s.top]} for s, _ in scores],
                    "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for score, token, at in [*prompt, *((s, s.token, at) for s, at in scores)]:
            out["tokens"].append(self.vocab(token)[0])
            out["text_offset"].append(at)
            if score is None:   # the prompt's first token: nothing before it scores it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(score.logprob))
            top = {self.vocab(t)[0]: _finite(lp) for t, lp in score.top}
            out["top_logprobs"].append({**top, self.vocab(score.token)[0]: _finite(score.logprob)})
        return out

    def choice(self, text: str, final: bool, delta: bool, scores: list = (), prompt: list = ()) -> dict:
        reason = self.finish_reason() if final else None
        logprobs = self.logprobs(list(scores), list(prompt)) if scores or prompt else \
            (None if delta or self.req.logprobs is None else self.logprobs([]))
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if delta:
            return {"index": 0, "delta": {"role": "assistant", "content": text} if self.first_chunk else
                    ({"content": text} if text else {}), "logprobs": logprobs, "finish_reason": reason}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": reason}

    def body(self) -> dict:
        text = (self.echo or "") + "".join(self.text)
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [self.choice(text, True, False, self.scores, self.prompt_scores or ())],
                "usage": self.usage(), "kv_cache": self.kv_cache()}

    def chunk(self, text: str, final: bool = False, usage: bool = False, scores: list = (), prompt: list = ()) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": [] if usage else [self.choice(text, final, True, scores, prompt)]}
        if usage:
            out["usage"] = self.usage()
        if final or usage:
            out["kv_cache"] = self.kv_cache()
        self.first_chunk = False
        return f"data: {json.dumps(out)}\n\n"

    async def stream(self, events: asyncio.Queue, include_usage: bool):
        """Server-sent events: the echo first (a completion's prompt, with its scores once they are in), a chunk per
        piece of text with the logprobs of the tokens since the last chunk, the finish reason, the usage if asked,
        [DONE]. A client that goes away cancels this generator: the engine stops its answer at the next token."""
        try:
            if self.echo is not None:
                while self.req.echo_logprobs is not None and self.prompt_scores is None and self.finish is None:
                    self.got(*await events.get())   # the answer's text waits in self.text
                yield self.chunk(self.echo, prompt=self.prompt_scores or ())
            sent, scored = 0, 0
            while True:
                if len(self.text) > sent and "".join(self.text[sent:]):
                    yield self.chunk("".join(self.text[sent:]), scores=self.scores[scored:])
                    sent, scored = len(self.text), len(self.scores)
                if self.finish is not None:
                    break
                self.got(*await events.get())
            yield self.chunk("", final=True, scores=self.scores[scored:])
            if include_usage:
                yield self.chunk("", usage=True)
            yield "data: [DONE]\n\n"
        except EngineError as e:   # the stream's last event says why it ends, then [DONE], as vLLM's server ends it
            self.metrics.errors.labels(str(e.status)).inc()
            yield e.event()
            yield "data: [DONE]\n\n"
        finally:
            self.req.cancelled.set()   # a no-op once the answer is done; else the client went away

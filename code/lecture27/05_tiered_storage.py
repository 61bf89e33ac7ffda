"""LMCache's two ideas in numbers: zero-copy sharing, tiered KV storage for multi-turn chat, and the
narrow waist (handout §6.2, §6.3, §7; pitfall 7; exercises 9-10); and why RAG needs non-prefix reuse
(§5.1, pitfall 6) on the same tiers.

    python code/lecture27/05_tiered_storage.py [--json out.json] [--cpu-gb 150] [--rate 10] ...

Part 1  hand 16K tokens of LLaMA-3.1-70B KV from GPU A to GPU B three ways, each a sum of its hops.
Part 2  a discrete-event simulation of 200 users x 12 turns of chat on LLaMA-3-8B, one H100, with the
        KV kept in GPU only / + a CPU tier read slowly or fast / + an SSD tier (the tiers: tiers.py).
Part 3  the narrow waist: documents that come back again and again mixed with one-shot long prompts;
        a cache that sees only tokens (LRU) vs the same cache told "this will be reused"; exercise 10 (an
        API that carries the hint) and the slides' table of the inference stack beside classic systems.
Exercise 9  a KV service process vs a KV library in every engine, in numbers: copies and handoff time,
        memory for N engines sharing one document set, what an engine restart loses, IPC per request.
Part 4  RAG (§5.1): requests of k documents from a shared corpus, popular ones often, in a new order each
        time; a prefix cache (vLLM's keys: each block hashed with its parent's) against a chunk cache
        (LMCache's keys: a document's own content, blended at CacheBlend's recompute ratio), on Part 2's
        tiers, for k = 1, 2, 4, 8 (the caches: rag_caches.py).
Runs in a few seconds; figures/05_handoff.png (Part 1), figures/05_ttft_cdf.png (Part 2), figures/05_rag.png
(Part 4).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # code/ holds `common`

import numpy as np

from common.cli import Parser, fraction, nonneg_float, positive_float, positive_int, settings_from, shipped_defaults
from common.present import (Chart, Field, Handout, Page, Ref, Row, Series, Table, Val, cdf, change, chart_figure, cols,
                            segment_bars, table_of, text_table)
from common.timemodel import get_model, kv_bytes_per_token, prefill_time
from rag_caches import CACHES, rag_trace, serve_rag
from tiers import Tier, TieredStore

GB = 1e9

# ------------------------------------------------------------------ Part 1: GPU A -> GPU B handoff
HANDOFF_MODEL = "llama-3.1-70b"
HANDOFF_TOKENS = 16_000      # "16K tokens, about 5.2 GB" (handout §6.2; 16,000 x 320 KiB, as in exercise 2)
PCIE_GBPS = 50.0             # PCIe Gen5 x16 is 64 GB/s each way; pinned cudaMemcpy reaches ~50 GB/s on H100
MEMCPY_GBPS = 10.0           # one CPU core copying DRAM to DRAM: ~10 GB/s (STREAM "copy", single thread)
NET_GBPS = 12.5              # a 100 Gb/s Ethernet link to a remote KV pool (100 / 8 GB/s)

# ------------------------------------------------------------------ Part 2: multi-turn chat (§6.3)
MODEL, GPU = "llama-3-8b", "H100"
USERS = 200                  # handout §6.3
TURNS = 12                   # handout §6.3
RATE = 10.0                  # requests/s, Poisson (handout §6.3)
USER_TOKENS = 256            # new tokens a user sends per turn (our choice: a short chat message)
ANSWER_TOKENS = 512          # tokens the model answers per turn; they join the history (our choice)
#   -> after 12 turns a history is 12 x 768 = 9,216 tokens x 128 KiB = 1.21 GB; 200 users = 241.6 GB
CHUNK = 256                  # tokens per cached chunk (LMCache's default chunk size)
GPU_GB = 58.0                # H100 80 GB - 16 GB of BF16 weights - activations/workspace (handout: ~58 GB)
CPU_GB = 150.0               # CPU DRAM tier. A DGX H100 has 2 TB of DRAM for 8 GPUs (256 GB each).
#   Write-through tiers are inclusive: a CPU tier no bigger than the GPU's 58 GB adds nothing (row cpu50).
CPU_SMALL_GB = 50.0          # the handout's CPU tier size (§6.3), kept as row cpu50
CPU_SLOW_GBPS = MEMCPY_GBPS  # CPU -> GPU through an extra CPU copy: memcpy-bound (pitfall 7)
CPU_FAST_GBPS = PCIE_GBPS    # zero-copy, large DMA transfers: PCIe-bound
SSD_GB = 2000.0              # a 2 TB NVMe drive
SSD_GBPS = 7.0               # PCIe Gen4 x4 NVMe sequential read, ~7 GB/s (e.g. Samsung 990 Pro: 7.45 GB/s)
SEED = 0

# ------------------------------------------------------------------ Part 3: the narrow waist (§7)
DOC_REQUESTS = 2000          # requests in the trace
DOCS = 10                    # documents many requests reference (a RAG corpus's hot set)
DOC_TOKENS = 4096            # tokens per document
ONESHOT_TOKENS = 8192        # a one-shot long prompt (a pasted log, a transcript) never seen again
ONESHOT_SHARE = 0.5          # share of requests that are one-shot
DOC_CACHE_GB = 9.0           # KV room for this application (documents alone: 10 x 4096 x 128 KiB = 5.4 GB)

# ------------------------------------------------------------------ exercise 9 (§10): service vs library
EX9_ENGINES = 4              # inference engines (processes) on one node sharing Part 3's documents
EX9_IPC_US = 30.0            # one request/response over a Unix socket between processes, ~10-50 us (our assumption)
EX9_CALLS = 2                # calls a request makes to the KV service: look up + retrieve (store is asynchronous)

# ------------------------------------------------------------------ Part 4: RAG, prefix vs chunk keys (§5.1)
RAG_DOCS = 10_000            # documents in the shared corpus (their KV, 10,000 x 512 x 128 KiB = 687 GB, outgrows
#                              Part 2's GPU + CPU tiers: popularity decides what stays)
RAG_DOC_TOKENS = 512         # tokens per retrieved document (a RAG chunk of 512 tokens, as in 04's Part 4)
RAG_QUESTION_TOKENS = 32     # the question after the documents: new every time, never reused
RAG_KS = (1, 2, 4, 8)        # documents a request retrieves
RAG_ZIPF = 1.0               # popularity: document d is drawn in proportion to 1 / (d + 1) ** RAG_ZIPF
RAG_REQUESTS = 2000          # requests in the trace, Poisson at RAG_RATE
RAG_RATE = 10.0              # requests/s (Part 2's rate)
RAG_RECOMPUTE = 0.15         # CacheBlend's recompute ratio: the share of a reused document's tokens prefilled
RAG_TIERS = "cpu_fast"       # which of Part 2's storage configurations both caches run on

# handout §7: the inference stack's four layers (engine, data store, orchestrator, API, as the handout names
# them) beside the classic computer system. The handout's own table was lost: the right-hand column is this
# companion's reading of the mapping, anchored only where the handout says it (the API is a narrow waist "like IPv4")
STACK_VS_CLASSIC = [("inference engine (vLLM, SGLang)", "processor / compute", "04 Part 4, 05 Part 2 (prefill)"),
                    ("KV cache store (LMCache)", "memory hierarchy / storage system", "05 Parts 1-2"),
                    ("orchestrator (production stack, llm-d, Dynamo)", "operating system / cluster scheduler",
                     "-"),
                    ("OpenAI API", "narrow waist (IP, POSIX)", "05 Part 3, exercise 10")]

# the slides' LMCache benchmarks (handout §6.3), printed for reference only
SLIDES = [("DP-EP serving, Qwen3-235B FP8, 4 x MI300", "mean TTFT", "0.33 s", "0.80 s", "2.4x"),
          ("CPU+disk offload, LLaMA-3.1-70B, MI300X", "TTFT", "0.15 s", "1.63 s", "10.8x"),
          ("CPU+disk offload, LLaMA-3.1-70B, MI300X", "decode", "25.59 tok/s", "11.64 tok/s", "2.19x")]


@dataclass(frozen=True)
class Settings:
    """One run's inputs: the constants above, as the command line left them (field = constant's name)."""
    handoff_model: str
    handoff_tokens: int
    pcie_gbps: float
    memcpy_gbps: float
    net_gbps: float
    model: str
    gpu: str
    users: int
    turns: int
    rate: float
    user_tokens: int
    answer_tokens: int
    chunk: int
    gpu_gb: float
    cpu_gb: float
    cpu_small_gb: float
    cpu_slow_gbps: float
    cpu_fast_gbps: float
    ssd_gb: float
    ssd_gbps: float
    seed: int
    doc_requests: int
    docs: int
    doc_tokens: int
    oneshot_tokens: int
    oneshot_share: float
    doc_cache_gb: float
    ex9_engines: int
    ex9_ipc_us: float
    ex9_calls: int
    rag_docs: int
    rag_doc_tokens: int
    rag_question_tokens: int
    rag_ks: tuple
    rag_zipf: float
    rag_requests: int
    rag_rate: float
    rag_recompute: float
    rag_tiers: str


# The handout's figures printed beside ours, each with the inputs it holds for: a figure shows only when
# the run's settings are these. Nothing is computed from them.
CHAT = {"model": "llama-3-8b", "users": 200, "turns": 12, "user_tokens": 256, "answer_tokens": 512}
HANDOUT = Handout({
    "handoff_gb": Ref("about 5.2 GB", {"handoff_model": "llama-3.1-70b", "handoff_tokens": 16_000}),
    "all_kv_gb": Ref("241 GB", CHAT),
    "gpu_room_gb": Ref("~58 GB", {"model": "llama-3-8b", "gpu": "H100", "gpu_gb": 58.0}),
    "slow_vs_fast": Ref("5x", {**CHAT, "gpu": "H100", "rate": 10.0, "gpu_gb": 58.0, "cpu_gb": 150.0,
                               "cpu_slow_gbps": 10.0, "cpu_fast_gbps": 50.0},
                        "the handout's CPU tier holds 50 GB; written through, a CPU tier no bigger than the GPU's "
                        "58 GB never hits (row cpu50), so ours holds 150 GB"),
    # §5.1 and §9 pitfall 6 state it for any RAG input whose chunks come in a new combination and order
    "rag_prefix": Ref("1st doc only"),
    "rag_trend": Ref('"the more chunks, the less it saves"'),
    **{k: Ref(fig, {"model": "llama-3-8b", "doc_requests": 2000, "docs": 10, "doc_tokens": 4096, "oneshot_tokens": 8192,
                    "oneshot_share": 0.5, "doc_cache_gb": 9.0}) for k, fig in (("lru", "45%"), ("hinted", "99%"))},
})


# ================================================================================ Part 1
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


def hand_off(s: Settings) -> Handoff:
    return handoff_paths(s.handoff_model, s.handoff_tokens, s.pcie_gbps, s.memcpy_gbps, s.net_gbps)


# ================================================================================ Part 2
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
    return TieredStore([Tier(name, gb * GB, (bw or float("inf")) * GB if i else float("inf"))
                        for i, (name, gb, bw) in enumerate(tiers)])


@dataclass(frozen=True)
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


def chat_tiers(s: Settings) -> Chat:
    """Every storage configuration serving the same chat trace."""
    trace = chat_trace(s.users, s.turns, s.rate, s.seed)
    configs = chat_configs(s.gpu_gb, s.cpu_gb, s.cpu_small_gb, s.cpu_slow_gbps, s.cpu_fast_gbps, s.ssd_gb,
                           s.ssd_gbps)
    served = {name: serve(trace, make_store(tiers), s.model, s.gpu, s.user_tokens, s.answer_tokens, s.chunk)
              for name, tiers in configs.items()}
    return Chat(configs, served, s.users * s.turns * (s.user_tokens + s.answer_tokens) * kv_bytes_per_token(s.model)
                / GB, served["cpu_slow"].mean_ttft_s / served["cpu_fast"].mean_ttft_s)


# ================================================================================ Part 3
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
    store = TieredStore([Tier("cache", cache_gb * GB, hinted=hinted)])
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


def narrow_waist(s: Settings) -> Waist:
    docs = doc_trace(s.doc_requests, s.docs, s.oneshot_share, s.seed)
    return Waist(*(doc_hit_rate(docs, hinted, s.doc_cache_gb, s.doc_tokens, s.oneshot_tokens, s.chunk, s.model)
                   for hinted in (False, True)))


# what the application would have to tell the backend, and cannot through the OpenAI API (exercise 10)
HINT_API_EXAMPLE = """\
POST /v1/chat/completions            (today: only "messages" -> tokens; the backend guesses with LRU)
  "messages": [...],
  "kv_hints": [                       (hypothetical extension)
    {"span": "system+doc:manual-7", "doc_id": "manual-7", "reuse": true,  "ttl_s": 86400},
    {"span": "user paste (log)",                          "reuse": false},
    {"span": "answer",                                    "reuse": true,  "ttl_s": 600}]
POST /v1/kv/prefetch {"doc_id": "manual-7"}   warm the cache before the requests come
POST /v1/kv/release  {"doc_id": "manual-7"}   the application is done with it"""


# ================================================================================ exercise 9
@dataclass(frozen=True)
class ServiceVsLibrary:
    """Each quantity for a KV library inside every engine and for one KV service: "library" / "service"."""
    engines: int
    doc_gb: float
    copies: dict
    handoff_s: dict
    memory_gb: dict
    restart_s: dict
    ipc_ms: float
    ipc_share_of_ttft: float


def service_vs_library(s: Settings, h: Handoff, chat: Chat) -> ServiceVsLibrary:
    """A KV service process vs a KV library inside every engine, each cost computed:
    copies and time of Part 1's handoff; memory for `engines` engines that all serve the same `docs`
    documents (a library keeps a copy per engine, the service one); what an engine restart costs (the
    library's CPU-memory KV dies with the process and is recomputed, the service's is read back over PCIe);
    the IPC a request pays to reach the service, against Part 2's mean TTFT with the fast CPU tier."""
    doc_bytes = s.docs * s.doc_tokens * kv_bytes_per_token(s.model)
    lib, svc = h.routes["library_copy"], h.routes["shared_pool"]
    ipc_s = s.ex9_calls * s.ex9_ipc_us * 1e-6
    return ServiceVsLibrary(
        s.ex9_engines, doc_bytes / GB, {"library": len(lib.hops), "service": len(svc.hops)},
        {"library": lib.seconds, "service": svc.seconds},
        {"library": s.ex9_engines * doc_bytes / GB, "service": doc_bytes / GB},
        {"library": s.docs * prefill_time(s.model, s.gpu, s.doc_tokens, 0), "service": doc_bytes / (s.pcie_gbps * GB)},
        ipc_s * 1e3, ipc_s / chat.served["cpu_fast"].mean_ttft_s)


# ================================================================================ Part 4
@dataclass(frozen=True)
class Rag:
    """Both caches serving the RAG trace of each k, on the same tiers."""
    ks: tuple
    tiers: list                  # Part 2's configuration s.rag_tiers: [(name, GB, GB/s)], fastest first
    served: dict                 # "prefix" / "chunk" -> [rag_caches.RagServed per k]

    def of(self, cache: str, field: str) -> list:
        return [getattr(r, field) for r in self.served[cache]]


def rag_reuse(s: Settings) -> Rag:
    """For each k, one trace of RAG requests served by the prefix cache and by the chunk cache, each on its
    own store with Part 2's tiers (same capacity, same bandwidths)."""
    tiers = chat_configs(s.gpu_gb, s.cpu_gb, s.cpu_small_gb, s.cpu_slow_gbps, s.cpu_fast_gbps, s.ssd_gb,
                         s.ssd_gbps)[s.rag_tiers]
    served: dict = {c: [] for c in CACHES}
    for k in s.rag_ks:
        trace = rag_trace(s.rag_requests, k, s.rag_docs, s.rag_zipf, s.rag_rate, s.seed)
        for c in CACHES:
            served[c].append(serve_rag(trace, make_store(tiers), c, s.model, s.gpu, s.rag_doc_tokens,
                                       s.rag_question_tokens, s.rag_recompute))
    return Rag(tuple(s.rag_ks), tiers, served)


# ================================================================================ presenting
def show_handoff(page: Page, h: Handoff, s: Settings) -> None:
    page.part("Part 1", "§6.2", "Zero-copy: handing KV from one engine to another")
    zero_copy = h.routes["shared_pool"].seconds
    fields = [Field("path"), Field("links (GB/s)", get=lambda r: " > ".join(f"{x[1]} {x[2]:g}" for x in r.hops)),
              Field("copies", get=lambda r: len(r.hops)), Field("seconds", "{:.3f}", "handoff_s.{row}", get="seconds"),
              Field("vs zero-copy", "{:.1f}x", get=lambda r: r.seconds / zero_copy)]
    page.table(table_of(f"hand {s.handoff_tokens:,} tokens of {get_model(s.handoff_model).name} KV ({h.nbytes / GB:.2f}"
                        f" GB; handout: {HANDOUT.figure('handoff_gb', s)}) from GPU A to GPU B", "§6.2", fields,
                        h.routes, "05_tiered_storage.handoff_paths",
                        [f"{name}: " + " -> ".join(r.stops) for name, r in h.routes.items()]
                        + ["Store and forward: each copy moves all the bytes once over its link. A library inside each "
                           "engine cannot map the other process's CPU memory, so it relays through a remote pool or "
                           "copies once more; one service process owns a CPU pool both engines map (handout §6.2)."]))
    segment_bars(page, "05_handoff.png", {name: [(h.nbytes / (bw * GB), what, f"{link} copy")
                                                 for what, link, bw in r.hops] for name, r in h.routes.items()},
                 {"PCIe copy": "tab:blue", "network copy": "tab:red", "memcpy copy": "tab:orange"},
                 "seconds to hand the KV from GPU A to GPU B",
                 f"{h.nbytes / GB:.2f} GB of KV: one shared CPU pool needs no CPU copy (handout §6.2)", (7.5, 3),
                 dict(fontsize=7, loc="upper right"))


def chat_notes(c: Chat, s: Settings) -> list:
    """What the chat table shows, each sentence chosen by its numbers."""
    slow, fast, res = c.served["cpu_slow"], c.served["cpu_fast"], c.served
    rs, rf = (f"{x.recompute_s.sum():.0f}" for x in (slow, fast))
    amounts = f"cpu_slow recomputes {rs} GPU seconds, cpu_fast {rf}"
    busy = change(slow.busy_s, fast.busy_s, "{:.0f} s")   # 'falls (119 s -> 71 s)'
    busy = ("faster loading shrinks the busy time" + busy[5:]) if busy.startswith("falls") else "the busy time " + busy
    share = change(slow.recompute_share, fast.recompute_share, "{:.0%}")
    return ["hits = share of history tokens found cached; recompute/busy = the GPU's seconds recomputing history "
            "over its busy seconds (load + prefill); GPU busy = busy seconds / run time. Decode is not simulated.",
            f"recompute/busy is a share, not an amount: {amounts}, but {busy}, so the share {share}."
            if rs == rf and not share.startswith("stays") else f"{amounts}; {busy}, and the share {share}.",
            *cpu_tier_notes(c, s.gpu_gb),
            f"cpu_slow / cpu_fast mean TTFT: {c.slow_vs_fast:.1f}x (handout: {HANDOUT.figure('slow_vs_fast', s)}, "
            f"pitfall 7)   gpu_only / cpu_ssd: {res['gpu_only'].mean_ttft_s / res['cpu_ssd'].mean_ttft_s:.0f}x"]


def cpu_tier_notes(c: Chat, room: float) -> list:
    """Why a CPU tier hits or not. One no bigger than the GPU's room, written through, holds a subset of the
    GPU's chunks (inclusion) and never hits: every configuration where that happens is named. cpu50, the
    handout's case, is explained in any run."""
    cpu = {n: next(gb for name, gb, _ in tiers if name == "CPU") for n, tiers in c.configs.items() if len(tiers) > 1}
    kept = {n: c.served[n].hit_rate_per_tier[1] for n in cpu}
    never = [n for n in cpu if kept[n] == 0 and cpu[n] <= room]
    out = [f"{', '.join(never)}: " + (f"a {cpu[never[0]]:g} GB CPU tier is" if len(never) == 1 else
                                      f"CPU tiers of {' / '.join(f'{cpu[n]:g}' for n in never)} GB are")
           + f" no bigger than the GPU's room ({room:g} GB); written through, an LRU tier holds a subset of the GPU's "
           "chunks (inclusion), so it never hits."] if never else []
    small, hit = cpu["cpu50"], kept["cpu50"]
    if "cpu50" not in never:
        out.append(f"cpu50: a {small:g} GB CPU tier is " + (
            f"no bigger than the GPU's room ({room:g} GB), yet it keeps {hit:.0%} of the history tokens."
            if small <= room else f"bigger than the GPU's room ({room:g} GB) here, " + (
                f"so it keeps some chunks the GPU evicted: {hit:.0%} of the history tokens." if hit else
                "but the GPU keeps every chunk that is asked for again: it never hits.")))
    return out


def tiers_text(tiers: list) -> str:
    """A storage configuration as 'GPU 58, CPU 150@50': each tier's GB, @ its GB/s below the GPU."""
    return ", ".join(f"{t} {gb:g}" + (f"@{bw:g}" if bw else "") for t, gb, bw in tiers)


def show_chat(page: Page, c: Chat, s: Settings) -> None:
    page.part("Part 2", "§6.3", "Tiered KV storage for multi-turn chat")
    per = lambda header, fmt, name: Field(header, fmt, "configs.{row}." + name, get=name)   # a Served field
    fields = [Field("config"), Field("tiers GB@GB/s", get={n: tiers_text(t) for n, t in c.configs.items()}),
              per("hits by tier", lambda x: " ".join(f"{v:.0%}" for v in x), "hit_rate_per_tier"),
              per("hits", "{:.0%}", "hit_rate"), per("mean TTFT s", "{:.3f}", "mean_ttft_s"),
              per("p50 s", "{:.3f}", "p50_ttft_s"), per("p99 s", "{:.3f}", "p99_ttft_s"),
              per("recompute/busy", "{:.0%}", "recompute_share"), Field("GPU busy", "{:.0%}", get="busy_share")]
    page.table(table_of(f"{s.users} users x {s.turns} turns ({s.user_tokens} + {s.answer_tokens} tokens a turn), "
                        f"{s.rate:g} req/s, {get_model(s.model).name} on one {s.gpu};\n  all histories {c.total_gb:.1f}"
                        f" GB of KV (handout: {HANDOUT.figure('all_kv_gb', s)}), GPU room {s.gpu_gb:g} GB (handout: "
                        f"{HANDOUT.figure('gpu_room_gb', s)})", "§6.3", fields, c.served, "05_tiered_storage.serve",
                        chat_notes(c, s), {"cpu_fast_vs_slow_ttft_ratio": c.slow_vs_fast}))
    page.table(text_table("  for reference (handout §6.3, not simulated here):", "§6.3",
                          ["slides' LMCache benchmark", "metric", "LMCache", "engine's own offload", "ratio"], SLIDES))
    chart_figure(page, "05_ttft_cdf.png", Chart(   # cpu50 dashed: it lies on gpu_only when it never hits
        [Series(*cdf(r.ttft), name, "step", {"ls": "--" if name == "cpu50" else "-"}) for name, r in c.served.items()],
        "time to first token (s)", "share of requests",
        f"Multi-turn chat, {get_model(s.model).name} on one {s.gpu}: TTFT by KV storage tiers", "log"), figsize=(7, 4))


def show_waist(page: Page, w: Waist, s: Settings) -> None:
    page.part("Part 3", "§7", "The narrow waist: what the OpenAI API cannot tell the cache")
    page.table(Table(f"{s.doc_requests} requests, {1 - s.oneshot_share:.0%} on {s.docs} documents of {s.doc_tokens} "
                     f"tokens, {s.oneshot_share:.0%} one-shot prompts of {s.oneshot_tokens} tokens; cache "
                     f"{s.doc_cache_gb:g} GB", "§7", cols("policy", ("document hit rate", "{:.0%}")),
                     [Row(["LRU (sees only tokens)", Val(w.lru, "lru_doc_hit_rate")], HANDOUT.figure("lru", s)),
                      Row(['hinted ("will be reused")', Val(w.hinted, "hinted_doc_hit_rate")],
                          HANDOUT.figure("hinted", s))], "05_tiered_storage.doc_hit_rate"))
    page.table(text_table("\n§7: the inference stack's layers (handout) beside the classic computer system (our "
                          "reading; the table was lost)", "§7",
                          ["LLM inference stack", "classic computer system", "in this lecture's code"],
                          STACK_VS_CLASSIC))
    page.exercise(10, "§7", "what the hint needs an API to carry")
    page.say("\n".join("    " + line for line in HINT_API_EXAMPLE.splitlines()), code=True)


def show_service_vs_library(page: Page, e: ServiceVsLibrary, s: Settings) -> None:
    page.exercise(9, "§6.1", "what a separate KV service process buys and costs")
    lib, svc = f"{e.memory_gb['library']:.1f}", f"{e.memory_gb['service']:.1f}"
    rows = [("copies to hand KV from GPU A to GPU B (Part 1)", "copies", "{}", "{}"),
            ("handoff time, s (Part 1)", "handoff_s", "{:.3f}", "{:.3f}"),
            (f"CPU memory for {e.engines} engines sharing {s.docs} documents, GB", "memory_gb", "{:.1f}", "{:.1f}"),
            ("an engine restarts: its KV back after, s", "restart_s", "{:.2f} (recompute)", "{:.3f} (PCIe read)")]
    page.table(Table(f"  ({e.engines} engines on a node; the documents of Part 3, {e.doc_gb:.1f} GB of KV)", "§6.1",
                     cols("exercise 9: KV library in each engine vs one KV service", ("library", "{}",
                          "exercise9.{row}.library"), ("service", "{}", "exercise9.{row}.service")),
                     [Row([label, Val(getattr(e, k)["library"], fmt=fl), Val(getattr(e, k)["service"], fmt=fs)], key=k)
                      for label, k, fl, fs in rows] + [Row(["IPC a request adds, ms", "0",
                                                            Val(e.ipc_ms, "exercise9.ipc_ms", "{:.3f}")])],
                     "05_tiered_storage.service_vs_library",
                     [f"The service keeps the documents' KV once ({svc} GB" + (f", not {lib})" if lib != svc else ")")
                      + ", survives an engine's restart or upgrade, and lets researchers add plugins without touching "
                      f"the engine. It costs an IPC round trip per call ({s.ex9_ipc_us:g} us assumed, {s.ex9_calls} "
                      f"calls: {e.ipc_share_of_ttft:.2%} of Part 2's mean TTFT with the fast CPU tier), a "
                      "shared-memory interface agreed with every engine, and one more service to run and keep alive."],
                     {"exercise9.engines": e.engines, "exercise9.doc_gb": e.doc_gb,
                      "exercise9.ipc_share_of_ttft": e.ipc_share_of_ttft}))


def pct(x) -> str:
    return f"{x:.0%}"


def rag_notes(r: Rag, s: Settings) -> list:
    """What the RAG table shows, each sentence chosen by its numbers."""
    hp, hc = r.of("prefix", "hit_rate"), r.of("chunk", "hit_rate")
    k0, k1 = r.ks[0], r.ks[-1]
    out = [f"hits = share of the documents' tokens not prefilled (the chunk cache prefills {s.rag_recompute:.0%} of "
           "each document it reuses); 1/k = the first document's share; mean and p99 TTFT in seconds (queue + "
           "load + prefill); busy = the GPU's load + prefill seconds over the run.",
           "Prefix caching reuses only the identical leading part of a prompt (handout: "
           f"{HANDOUT.figure('rag_trend', s)}, §5.1 and §9 pitfall 6)."]
    if len(r.ks) > 1:
        fp, fc = (change(a[0], a[-1], "{:.0%}") for a in (hp, hc))
        less = "the prefix cache saves less the more documents a request has"
        if not fp.startswith("falls"):
            verdict = "the prefix cache does not lose with k here."
        elif fc.startswith("falls"):
            verdict = "both fall, " + ("the prefix cache's more." if hp[0] - hp[-1] > hc[0] - hc[-1] else
                                       "the chunk cache's as much or more.")
        elif pct(max(hc)) == pct(0):
            verdict = (f"{less}; the chunk cache, recomputing {s.rag_recompute:.0%} of what it finds, saves nothing "
                       "at any k.")
        else:
            verdict = f"{less}, the chunk cache does not: it finds a cached document wherever it stands."
        out.append(f"From k = {k0} to {k1} the prefix cache's hit rate {fp} and the chunk cache's {fc}: {verdict}")
    heads = r.of("prefix", "head_share")
    over = [k for k, h in zip(r.ks, hp) if h > 1 / k and pct(h) != pct(1 / k)]
    out.append(f"Of the documents the prefix cache reused at k = {k1}, {heads[-1]:.0%} stood first in their "
               "request; its hit rate is " + ("below 1/k, the first document's share, at every k." if not over else
                                              f"above 1/k at k = {', '.join(map(str, over))}: popular documents "
                                              "recur there in the same order."))
    found = [r.of(c, "reused_share")[0] for c in CACHES]
    if k0 == 1 and pct(found[0]) == pct(found[1]):
        out.append(f"At k = 1 the one document is the whole prefix: both caches find {found[0]:.0%} of the documents, "
                   "and the chunk cache, which does not know where a KV was computed, still recomputes "
                   f"{s.rag_recompute:.0%} of each it finds ({hc[0]:.0%} hits).")
    mp, mc = (r.of(c, "mean_ttft_s")[-1] for c in CACHES)
    bp, bc = (r.of(c, "busy_share")[-1] for c in CACHES)
    ratio = f"{mp / mc:.1f}x shorter" if mp >= mc else f"{mc / mp:.1f}x longer"
    out.append(f"At k = {k1}: mean TTFT {mp:.3f} s with the prefix cache, {mc:.3f} s with the chunk cache (the chunk "
               f"cache's {ratio}); the GPU is busy {bp:.0%} and {bc:.0%} of the time.")
    return out


def show_rag(page: Page, r: Rag, s: Settings) -> None:
    page.part("Part 4", "§5.1, §9", "RAG on the same tiers: prefix caching against non-prefix reuse")
    measures = [("hits", "{:.0%}", "hit_rate"), ("mean", "{:.3f}", "mean_ttft_s"), ("p99", "{:.3f}", "p99_ttft_s"),
                ("busy", "{:.0%}", "busy_share")]                # each a column per cache, busy without a key
    fields = [Field("k", "{}", "rag_k", get=lambda i: r.ks[i]), Field("1/k", "{:.0%}", get=lambda i: 1 / r.ks[i])]
    fields += [Field(f"{c} {m}", fmt, None if m == "busy" else f"rag_{c}_{f}",
                     get=lambda i, c=c, f=f: getattr(r.served[c][i], f)) for m, fmt, f in measures for c in CACHES]
    page.table(table_of(f"{s.rag_requests} requests of k documents ({s.rag_doc_tokens} tokens) from {s.rag_docs:,} "
                        f"(Zipf {s.rag_zipf:g}), a new order each time, + a {s.rag_question_tokens}-token question; "
                        f"{s.rag_rate:g} req/s, {get_model(s.model).name} on one {s.gpu};\n  both caches on Part 2's "
                        f"{s.rag_tiers} ({tiers_text(r.tiers)}); the chunk cache blends at {s.rag_recompute:.0%}",
                        "§5.1", fields, range(len(r.ks)), "rag_caches.serve_rag", rag_notes(r, s),
                        handout=HANDOUT.figure("rag_prefix", s)))
    lines = lambda f, ls, label: [Series(r.ks, r.of(c, f), label.format(c), style=dict(marker="o", ls=ls, color=color))
                                  for c, color in zip(CACHES, ("tab:red", "tab:blue"))]
    hits, mean, p99 = (lines("hit_rate", "-", "{} cache"), lines("mean_ttft_s", "-", "{} cache, mean"),
                       lines("p99_ttft_s", ":", "{} cache, p99"))
    k_axis = "documents per request (k)"
    chart_figure(page, "05_rag.png", [
        Chart(hits + [Series(r.ks, [1 / k for k in r.ks], "1/k: the first document's share",
                             style={"color": "k", "ls": "--", "lw": 1})], k_axis,
              "share of document tokens not prefilled", "hit rate", axes={"xticks": r.ks, "ylim": (0, 1.05)}),
        Chart([mean[0], p99[0], mean[1], p99[1]], k_axis, "time to first token (s)", "TTFT", yscale="log",
              axes={"xticks": r.ks})],
        f"RAG, {s.rag_docs:,} documents (Zipf {s.rag_zipf:g}) on Part 2's {s.rag_tiers}: a prefix cache against a "
        "chunk cache (handout §5.1)", figsize=(9, 3.8))


# ================================================================================ the run
def parse(argv) -> tuple:
    """(this run's Settings, the defaults' Settings, the parsed command line)."""
    p = Parser(__doc__)
    p.add_argument("--users", type=positive_int, default=USERS, help="chat users")
    p.add_argument("--turns", type=positive_int, default=TURNS, help="turns per user")
    p.add_argument("--rate", type=positive_float, default=RATE, help="requests/s")
    p.add_argument("--user-tokens", type=positive_int, default=USER_TOKENS, help="new tokens a user sends a turn")
    p.add_argument("--answer-tokens", type=positive_int, default=ANSWER_TOKENS, help="tokens answered a turn")
    p.add_argument("--gpu-gb", type=nonneg_float, default=GPU_GB, help="GPU memory left for KV, GB")
    p.add_argument("--cpu-gb", type=nonneg_float, default=CPU_GB, help="CPU DRAM tier, GB")
    p.add_argument("--cpu-slow-gbps", type=positive_float, default=CPU_SLOW_GBPS,
                   help="CPU tier read through an extra CPU copy, GB/s")
    p.add_argument("--cpu-fast-gbps", type=positive_float, default=CPU_FAST_GBPS, help="zero-copy CPU tier read, GB/s")
    p.add_argument("--ssd-gb", type=nonneg_float, default=SSD_GB, help="SSD tier, GB")
    p.add_argument("--ssd-gbps", type=positive_float, default=SSD_GBPS, help="SSD tier read, GB/s")
    p.add_argument("--doc-cache-gb", type=nonneg_float, default=DOC_CACHE_GB, help="Part 3: the KV cache, GB")
    p.add_argument("--rag-docs", type=positive_int, default=RAG_DOCS, help="Part 4: documents in the corpus")
    p.add_argument("--rag-doc-tokens", type=positive_int, default=RAG_DOC_TOKENS, help="Part 4: tokens per document")
    p.add_argument("--rag-question-tokens", type=positive_int, default=RAG_QUESTION_TOKENS,
                   help="Part 4: tokens of the question after the documents")
    p.add_argument("--rag-ks", type=positive_int, nargs="+", default=list(RAG_KS),
                   help="Part 4: documents a request retrieves, one row each")
    p.add_argument("--rag-zipf", type=nonneg_float, default=RAG_ZIPF, help="Part 4: popularity's Zipf exponent")
    p.add_argument("--rag-requests", type=positive_int, default=RAG_REQUESTS, help="Part 4: requests")
    p.add_argument("--rag-rate", type=positive_float, default=RAG_RATE, help="Part 4: requests/s")
    p.add_argument("--rag-recompute", type=fraction, default=RAG_RECOMPUTE,
                   help="Part 4: CacheBlend's recompute ratio for a document the chunk cache reuses")
    p.add_argument("--rag-tiers", default=RAG_TIERS, choices=["gpu_only", "cpu50", "cpu_slow", "cpu_fast", "cpu_ssd"],
                   help="Part 4: which of Part 2's storage configurations the two caches run on")
    p.add_argument("--seed", type=int, default=SEED, help="seed of the chat, document and RAG traces")
    a = p.parse_args(argv)
    if max(a.rag_ks) > a.rag_docs:
        p.error(f"--rag-ks: a request cannot retrieve {max(a.rag_ks)} different documents from {a.rag_docs}")
    if a.user_tokens + a.answer_tokens > 128 * 1024 // a.turns:
        p.error(f"{a.turns} turns of {a.user_tokens + a.answer_tokens} tokens exceed a 128K context")
    return (settings_from(Settings, a, globals(), rag_ks=tuple(sorted(set(a.rag_ks)))),
            shipped_defaults(Settings, globals()), a)


def main(argv=None) -> Page:
    s, defaults, a = parse(argv)
    page = Page("05", "LMCache: zero-copy sharing, tiered storage, the narrow waist", "§6-7", s, defaults,
                plot=not a.no_plot)
    handoff = hand_off(s)
    chat = chat_tiers(s)
    waist = narrow_waist(s)
    service = service_vs_library(s, handoff, chat)
    rag = rag_reuse(s)
    show_handoff(page, handoff, s)
    show_chat(page, chat, s)
    show_waist(page, waist, s)
    show_service_vs_library(page, service, s)
    show_rag(page, rag, s)
    page.finish(a.json)
    return page


if __name__ == "__main__":
    main()

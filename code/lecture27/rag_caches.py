"""RAG requests on tiered KV storage (handout §5.1, §9 pitfall 6): prefix caching against non-prefix reuse.

A RAG request is k documents retrieved from a shared corpus, then a question. Popular documents come back
again and again, but in a new combination and a new order each time. Two caches see the same requests,
on the same tiers (tiers.TieredStore) with the same capacity; they differ only in their keys:

  - the prefix cache (vLLM's automatic prefix caching, SGLang's RadixAttention). Document i's key hashes
    its parent's key with its own content, as vLLM hashes each block with its parent's hash, so a key names
    the whole prefix up to it. A lookup walks the keys in order and stops at the first miss: the reuse ends
    where the leading documents stop matching. What it reuses is exact (the same tokens behind it).
  - the chunk cache (LMCache's chunks, reused anywhere by CacheBlend). A document's key is its own content,
    so its KV is found wherever the document appears. That KV was computed behind other documents (or none),
    so it is blended: CacheBlend recomputes a share `recompute` of the document's tokens in prefill.

The question is new every time: it is prefilled and never stored. A document is the unit of storage (one
block of its tokens' KV). The engine is 05's Part 2: it waits for the loads, then prefills, first come first
served on one GPU, and writes the request's documents through every tier.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from common.timemodel import kv_bytes_per_token, prefill_time
from lecture27.tiers import TieredStore

CACHES = ("prefix", "chunk")


# ----------------------------------------------------------------------------- the two caches' keys
def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def content_key(doc: int) -> str:
    """A document's content hash (its tokens are named by its id here): the same wherever it appears."""
    return _digest(f"document {doc}")


def prefix_keys(docs) -> list[str]:
    """Prefix caching's keys: each document's key hashes its parent's key with its own content, so it
    changes when any earlier document changes or moves."""
    keys, parent = [], ""
    for d in docs:
        parent = _digest(parent + "|" + content_key(int(d)))
        keys.append(parent)
    return keys


def chunk_keys(docs) -> list[str]:
    """The chunk cache's keys: each document's own content, whatever comes before it."""
    return [content_key(int(d)) for d in docs]


KEYS = {"prefix": prefix_keys, "chunk": chunk_keys}


# ----------------------------------------------------------------------------- the requests
@dataclass(frozen=True)
class RagTrace:
    arrival: np.ndarray          # seconds, Poisson, in arrival order
    docs: np.ndarray             # (requests, k) document ids, in prompt order


def popularity(corpus: int, zipf: float) -> np.ndarray:
    """Zipf popularity: document d (0 the most popular) is drawn in proportion to 1 / (d + 1) ** zipf."""
    w = 1.0 / np.arange(1, corpus + 1) ** zipf
    return w / w.sum()


def rag_trace(requests: int, k: int, corpus: int, zipf: float, rate: float, seed: int) -> RagTrace:
    """`requests` Poisson arrivals at `rate`, each drawing k different documents by popularity and putting
    them in a random order (a retriever ranks them per question, not by how often they were retrieved)."""
    if not 1 <= k <= corpus:
        raise ValueError(f"k = {k} documents from a corpus of {corpus}")
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate, requests))
    cdf = np.cumsum(popularity(corpus, zipf))
    cdf[-1] = 1.0
    docs = np.zeros((requests, k), dtype=int)
    for i in range(requests):
        picked: list = []
        while len(picked) < k:   # draw by popularity, a document already drawn is drawn again
            d = int(np.searchsorted(cdf, rng.random(), side="right"))
            if d not in picked:
                picked.append(d)
        docs[i] = rng.permutation(picked)
    return RagTrace(arrival, docs)


# ----------------------------------------------------------------------------- one request's prefill
def reuse_of(found: list, k: int) -> list[bool]:
    """Which of the k documents are reused, from the store's lookup: the prefix cache's leading run of hits
    (its lookup stops at the first miss), the chunk cache's every hit (None: a miss)."""
    return [i < len(found) and found[i] is not None for i in range(k)]


def prefill_tokens(cache: str, reused: list[bool], doc_tokens: int, recompute: float) -> list[float]:
    """Tokens each document prefills: all of them when it is not reused; none when the prefix cache reuses
    it (exact); `recompute` of them when the chunk cache blends it."""
    blended = recompute * doc_tokens if cache == "chunk" else 0.0
    return [blended if r else float(doc_tokens) for r in reused]


def prefill_s(model, gpu, new: list[float], doc_tokens: int, question_tokens: int) -> float:
    """The prefill of one request: each document's new tokens after every token before them (for a blended
    document, as if its recomputed tokens were its last: an upper bound on their attention), then the
    question after all the documents."""
    t = sum(_prefill(model, gpu, n, j * doc_tokens + doc_tokens - n) for j, n in enumerate(new) if n > 0)
    return t + _prefill(model, gpu, question_tokens, len(new) * doc_tokens)


_prefill = functools.lru_cache(maxsize=None)(prefill_time)   # a request's pieces take few distinct sizes


# ----------------------------------------------------------------------------- serving the trace
@dataclass(frozen=True, kw_only=True)
class RagServed:
    """One cache serving a RAG trace. hit_rate = share of the documents' tokens not prefilled; reused_share =
    share of the documents' tokens whose KV was found (the chunk cache prefills `recompute` of those)."""
    ttft: np.ndarray
    load_s: np.ndarray
    compute_s: np.ndarray
    hit_rate: float
    reused_share: float
    head_share: float            # of the reused documents, the share that stood first in their request
    mean_ttft_s: float
    p99_ttft_s: float
    busy_share: float            # GPU busy (load + prefill) over the run


def serve_rag(trace: RagTrace, store: TieredStore, cache: str, model, gpu, doc_tokens: int,
              question_tokens: int, recompute: float) -> RagServed:
    """Serve every request with `cache` ("prefix" or "chunk") on `store`: look the documents up, wait for
    the loads, prefill what is not reused, then write the documents' KV through every tier."""
    size = doc_tokens * kv_bytes_per_token(model)
    n, k = trace.docs.shape
    load, compute, finish = np.zeros(n), np.zeros(n), np.zeros(n)
    prefilled = reused_docs = reused_heads = 0.0
    gpu_free = 0.0
    for i, docs in enumerate(trace.docs):
        keys = KEYS[cache](docs)
        found = store.fetch(keys, [size] * k, prefix=cache == "prefix")
        reused = reuse_of(found.tier_of_chunk, k)
        new = prefill_tokens(cache, reused, doc_tokens, recompute)
        prefilled += sum(new)
        reused_docs += sum(reused)
        reused_heads += reused[0]
        load[i], compute[i] = found.load_s, prefill_s(model, gpu, new, doc_tokens, question_tokens)
        gpu_free = max(trace.arrival[i], gpu_free) + load[i] + compute[i]
        finish[i] = gpu_free
        store.store(keys, [size] * k)
    ttft = finish - trace.arrival
    busy = load.sum() + compute.sum()
    return RagServed(ttft=ttft, load_s=load, compute_s=compute, hit_rate=1.0 - prefilled / (n * k * doc_tokens),
                     reused_share=reused_docs / (n * k), head_share=reused_heads / max(reused_docs, 1),
                     mean_ttft_s=float(ttft.mean()), p99_ttft_s=float(np.percentile(ttft, 99)),
                     busy_share=float(busy / (finish[-1] - trace.arrival[0])))

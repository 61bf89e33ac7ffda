"""rag_caches.py and 05's Part 4: the two caches' keys (a prefix key names everything before it, a chunk key
only its document), the prefix cache reusing only the leading matching run, the chunk cache reusing a
document anywhere at CacheBlend's recompute ratio, and the RAG table: the prefix cache's hit rate falls
with k while the chunk cache's does not."""
import importlib
import re

import numpy as np
import pytest

from common.present import change
from common.timemodel import prefill_time
from lecture27.rag_caches import (RagTrace, chunk_keys, content_key, prefill_s, prefix_keys, rag_trace, reuse_of,
                        serve_rag)
from lecture27.tiers import SimTier, TieredStore

mod = importlib.import_module("lecture27.05_tiered_storage")
MODEL, GPU, T, Q = "llama-3-8b", "H100", 512, 32


# ------------------------------------------------------------------------------------- the keys
def test_a_prefix_key_names_every_document_before_it():
    base = prefix_keys([3, 1, 4, 1 + 5])
    assert len(set(base)) == 4
    assert prefix_keys([3, 1, 4]) == base[:3]                     # the same leading documents, the same keys
    changed = prefix_keys([3, 9, 4, 6])                           # document 1 changes
    assert changed[0] == base[0] and all(a != b for a, b in zip(changed[1:], base[1:]))
    moved = prefix_keys([1, 3, 4, 6])                             # the first two swap places
    assert all(a != b for a, b in zip(moved, base))               # documents 4 and 6 too: their prefix moved
    assert prefix_keys([4])[0] != base[2]                         # the same document at another place


def test_a_chunk_key_is_the_documents_content_alone():
    base = chunk_keys([3, 1, 4, 6])
    assert base == [content_key(d) for d in (3, 1, 4, 6)]
    assert chunk_keys([6, 9, 9 + 1, 3]) == [base[3], content_key(9), content_key(10), base[0]]
    assert chunk_keys([4])[0] == base[2]                          # wherever it stands, whatever comes before
    assert len(set(base)) == 4


# ------------------------------------------------------------------------------------- the lookups
def store():
    """GPU 2 documents, CPU 100 (a document is 1 byte here, the CPU reads 1 document/s)."""
    return TieredStore([SimTier("GPU", 2), SimTier("CPU", 100, bandwidth=1.0)])


def test_the_prefix_cache_hits_only_the_leading_matching_run():
    s = store()
    s.store(prefix_keys([1, 2, 3]), [1] * 3)
    assert reuse_of(s.fetch(prefix_keys([1, 2, 4, 3]), [1] * 4).tier_of_chunk, 4) == [True, True, False, False]
    assert reuse_of(s.fetch(prefix_keys([2, 1, 3]), [1] * 3).tier_of_chunk, 3) == [False] * 3   # a new order
    assert reuse_of(s.fetch(prefix_keys([1, 2, 3]), [1] * 3).tier_of_chunk, 3) == [True] * 3


def test_the_chunk_cache_hits_a_cached_document_anywhere():
    s = store()
    s.store(chunk_keys([1, 2, 3]), [1] * 3)
    found = s.fetch(chunk_keys([3, 9, 1, 2]), [1] * 4, prefix=False)
    assert reuse_of(found.tier_of_chunk, 4) == [True, False, True, True]
    assert found.n_chunks == 3 and sum(found.bytes_per_tier) == 3
    # 2 of them are on the GPU (the last stored), the third is read from the CPU at 1 byte/s
    assert found.load_s == pytest.approx(1.0)


def serve(cache, requests, recompute=0.15):
    """`requests` (lists of k documents) one second apart, on a store that holds them all."""
    trace = RagTrace(np.arange(len(requests), dtype=float), np.array(requests))
    big = TieredStore([SimTier("GPU", 1e15), SimTier("CPU", 1e15, bandwidth=50e9)])
    return serve_rag(trace, big, cache, MODEL, GPU, T, Q, recompute)


def test_the_chunk_cache_charges_the_recompute_ratio():
    r = serve("chunk", [[1, 2, 3], [3, 9, 1]], recompute=0.15)
    # the second request finds documents 3 and 1 (not at their old places) and prefills 15% of each
    assert r.hit_rate == pytest.approx(2 * 0.85 * T / (6 * T))
    assert r.reused_share == pytest.approx(2 / 6)
    want = (prefill_time(MODEL, GPU, 0.15 * T, 0.85 * T) + prefill_time(MODEL, GPU, T, T)
            + prefill_time(MODEL, GPU, 0.15 * T, 3 * T - 0.15 * T) + prefill_time(MODEL, GPU, Q, 3 * T))
    assert r.compute_s[1] == pytest.approx(want)
    assert serve("chunk", [[1, 2, 3], [3, 9, 1]], recompute=1.0).hit_rate == 0.0   # blending all: nothing saved
    assert serve("prefix", [[1, 2, 3], [3, 9, 1]]).hit_rate == 0.0                 # no leading match


def test_what_the_prefix_cache_reuses_is_exact():
    r = serve("prefix", [[1, 2, 3], [1, 2, 7]])
    assert r.hit_rate == pytest.approx(2 / 6)                    # documents 1 and 2, nothing recomputed
    assert r.compute_s[1] == pytest.approx(prefill_time(MODEL, GPU, T + Q, 2 * T))
    assert r.compute_s[0] == pytest.approx(prefill_time(MODEL, GPU, 3 * T + Q, 0))
    assert r.head_share == 0.5                                   # of the two reused, one stood first


def test_a_request_waits_for_the_gpu_to_finish_the_one_before():
    trace = RagTrace(np.zeros(2), np.array([[1, 2, 3], [4, 5, 6]]))   # both at once, no document shared
    big = TieredStore([SimTier("GPU", 1e15), SimTier("CPU", 1e15, bandwidth=50e9)])
    r = serve_rag(trace, big, "prefix", MODEL, GPU, T, Q, 0.15)
    assert r.ttft[0] == pytest.approx(r.load_s[0] + r.compute_s[0])
    assert r.ttft[1] == pytest.approx(r.ttft[0] + r.load_s[1] + r.compute_s[1])   # queued behind the first


def test_prefill_pieces_add_up_to_a_full_prefill():
    assert prefill_s(MODEL, GPU, [T] * 4, T, Q) == pytest.approx(prefill_time(MODEL, GPU, 4 * T + Q, 0))


def test_the_trace_is_seeded_draws_distinct_documents_and_favours_popular_ones():
    a, b = rag_trace(500, 4, 100, 1.0, 10.0, 0), rag_trace(500, 4, 100, 1.0, 10.0, 0)
    assert np.array_equal(a.docs, b.docs) and np.array_equal(a.arrival, b.arrival)
    assert all(len(set(row)) == 4 for row in a.docs.tolist())
    counts = np.bincount(a.docs.ravel(), minlength=100)
    assert counts[0] > counts[10] > counts[90]
    first = np.bincount(a.docs[:, 0], minlength=100)            # a new order each time: the most popular
    assert 0.15 < first[0] / counts[0] < 0.35                   # document leads about 1 in 4 of its requests
    with pytest.raises(ValueError):
        rag_trace(10, 5, 4, 1.0, 1.0, 0)


# ------------------------------------------------------------------------------------- 05's Part 4
SMALL = ["--no-plot", "--users", "20", "--turns", "4"]


@pytest.fixture(scope="module")
def pages():
    runs = {"seed 0": [], "seed 1": ["--seed", "1"], "seed 2": ["--seed", "2"],
            "recompute 100%": ["--rag-recompute", "1"],
            "uniform": ["--rag-zipf", "0"], "steep, small corpus": ["--rag-zipf", "2", "--rag-docs", "50"],
            "k 8 2 3": ["--rag-ks", "8", "2", "3"]}
    return {name: mod.main(SMALL + args) for name, args in runs.items()}


def rag_table(page):
    return next(t for t in page.tables if t.source == "rag_caches.serve_rag")


@pytest.mark.slow
@pytest.mark.parametrize("run", ["seed 0", "seed 1", "seed 2"])
def test_the_prefix_cache_falls_with_k_and_the_chunk_cache_does_not(pages, run):
    j = pages[run].json()
    assert j["rag_k"] == [1, 2, 4, 8]
    prefix, chunk = j["rag_prefix_hit_rate"], j["rag_chunk_hit_rate"]
    assert all(b < a for a, b in zip(prefix, prefix[1:])), prefix
    assert all(b >= a - 0.005 for a, b in zip(chunk, chunk[1:])), chunk
    assert chunk[-1] > 5 * prefix[-1]
    assert prefix[0] > chunk[0]                                  # k = 1: the same hits, the chunk cache blends them
    assert j["rag_chunk_mean_ttft_s"][-1] < j["rag_prefix_mean_ttft_s"][-1]
    assert all(len(j[f"rag_{c}_{m}"]) == 4 for c in ("prefix", "chunk") for m in ("hit_rate", "mean_ttft_s",
                                                                                  "p99_ttft_s"))


@pytest.mark.slow
@pytest.mark.parametrize("run", ["seed 0", "recompute 100%", "uniform", "steep, small corpus", "k 8 2 3"])
def test_the_verdict_follows_the_numbers(pages, run):
    page = pages[run]
    j, t = page.json(), rag_table(page)
    prefix, chunk = j["rag_prefix_hit_rate"], j["rag_chunk_hit_rate"]
    note = next(n for n in t.notes if n.startswith("From k ="))
    assert f"From k = {j['rag_k'][0]} to {j['rag_k'][-1]}" in note
    assert f"hit rate {change(prefix[0], prefix[-1], '{:.0%}')} and the chunk cache's " \
           f"{change(chunk[0], chunk[-1], '{:.0%}')}" in note
    says_less = "saves less the more documents" in note
    assert says_less == (f"{prefix[-1]:.0%}" != f"{prefix[0]:.0%}" and prefix[-1] < prefix[0])
    chunk_holds = f"{chunk[-1]:.0%}" == f"{chunk[0]:.0%}" or chunk[-1] > chunk[0]
    assert ("it finds a cached document" in note) == (says_less and chunk_holds and f"{max(chunk):.0%}" != "0%")
    over = [k for k, h in zip(j["rag_k"], prefix) if h > 1 / k and f"{h:.0%}" != f"{1 / k:.0%}"]
    head = next(n for n in t.notes if n.startswith("Of the documents"))
    assert ("below 1/k" in head) == (not over)
    for r in t.rows:
        assert r.handout == importlib.import_module("lecture27.store.tiers_page").HANDOUT.refs["rag_prefix"].figure
    for text in page.texts():
        assert not re.search(r"\(([^()]+?) -> \1\)", text), text


@pytest.mark.slow
def test_the_k_list_is_sorted_and_the_bad_ones_refused(pages, cli_exit):
    assert pages["k 8 2 3"].json()["rag_k"] == [2, 3, 8]
    code, err = cli_exit("05_tiered_storage", "--rag-ks", "20", "--rag-docs", "10")
    assert code == 2 and "--rag-ks" in err and len(err.strip().splitlines()) == 1
    code, err = cli_exit("05_tiered_storage", "--rag-recompute", "1.5")
    assert code == 2


def test_part4_draws_its_figure(tmp_path, monkeypatch):
    monkeypatch.setenv("L27_FIGURES", str(tmp_path))
    page = mod.main(["--users", "20", "--turns", "4", "--rag-requests", "300"])
    assert any(b["kind"] == "figure" and b["path"].endswith("/05_rag.png") for b in page.blocks)

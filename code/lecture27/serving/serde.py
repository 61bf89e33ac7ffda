"""What a compressed shared tier changes (§3-§4's bitstream in §6's tiers; LMCache's remote_serde), measured: the RAG
workload (serving/bench.py's rag: each item's documents once, then requests with them in new orders, `users` at
once) through two engines whose only tier is their own Redis server on the same budget, too small for the
workload's KV in FP16: one keeps FP16 records there (--serde fp16), the other CacheGen's bitstream at the codec's
level 0 (--serde cachegen). The hot cache is made too small to hold a chunk, and RAM and disk are off, so every
reused document comes from Redis, as it must for a second engine. Then --no-store answers the same requests, the
answers to set the others beside.

For each: the records and bytes Redis holds at the end, the documents still there (a last request per item with
its documents in yet another order: the records its lookup reads from Redis, the system message aside), the share
of the timed requests' prompt tokens from the store, TTFT p50 and p99, the seconds a timed request spent reading
and decoding records (the engine's /metrics: l27_tier_read_seconds, l27_tier_decode_seconds), the first token's KL
to a full prefill (kv_check), and the answers equal to --no-store's. And the link speed below which fetching and
decoding CacheGen's bytes beats fetching FP16's, from this run's bytes and decode seconds a token: (FP16 bytes -
CacheGen bytes) / (CacheGen decode - FP16 decode).

    python -m lecture27.serving.serde           # from code/ (or bench_serve.py --workload serde)
"""
from __future__ import annotations

import statistics
import urllib.request

from common.cli import Parser, positive_float, positive_int
from lecture27.serving import bench, launch

REDIS_GB = 0.03       # each engine's Redis budget: the documents and each request's prefix blocks, in FP16 (23 kB a
                      # token of SmolLM2) about 1,300 tokens, in CacheGen's level 0 (6.2 kB) about 3.7 times as many
HOT_GB = 1e-4         # the hot cache: 100 kB, less than one 32-token block (1.5 MB in float32), so reuse is Redis's
USERS = 4
REQUESTS = 8
ITEMS = 2
MAX_TOKENS = 16
KV_CHECKS = 2
THREADS = 1
SERDES = ("fp16", "cachegen")


def metrics(url: str) -> dict:
    """The engine's tier figures from GET /metrics: {(name, tier): value} of the l27_tier_* series (a counter by its
    name without _total)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(m.name.removesuffix("_total"), m.labels["tier"]): m.value
            for family in text_string_to_metric_families(text) for m in family.samples
            if m.name.startswith("l27_tier_") and not m.name.endswith("_created")}


def documents_held(url: str, model: str, items: int, docs: int, words: int) -> list:
    """For each item, how many of its documents Redis still holds: a request with them in an order the run never
    sent, the records its lookup read from Redis less the system message's."""
    client = bench.client_for(url)
    held = []
    for item in range(items):
        texts = bench.rag_documents(item, docs, words)
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=bench.rag_request(item, list(range(docs))[::-1], texts), max_tokens=1,
            temperature=0)
        hits = dict(part.strip().split("=") for part in raw.headers["x-kv-hits"].split(";") if "=" in part)
        held.append(min(docs, max(0, int(hits.get("redis", 0)) - 1)))   # a prefix path's blocks would count more
    return held


def measure(serde: str, a) -> dict:
    """One engine's figures (module docstring); serde None: --no-store, its run alone."""
    flags = ("--no-store",) if serde is None else \
        ("--serde", serde, "--no-ram", "--no-disk", "--redis-gb", f"{a.redis_gb:g}", "--hot-gb", f"{HOT_GB:g}")
    name = serde or "no_store"
    with launch.engine(*flags, threads=a.threads).start() as s:
        model = bench.model_name(s.url)
        before = metrics(s.url) if serde else {}
        run = bench.run_rag(name, s.url, model, users=a.users, requests=a.requests, items=a.items,
                            max_tokens=a.max_tokens, kv_checks=KV_CHECKS if serde else 0)
        if serde is None:
            return {"run": run}
        after = metrics(s.url)
        held = documents_held(s.url, model, a.items, bench.RAG_DOCS, bench.DOC_WORDS)
    got = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    reads = {what: got.get((f"l27_tier_{what}", "redis"), 0.0)
             for what in ("read_records", "read_tokens", "read_bytes", "read_seconds", "decode_seconds")}
    requests = a.items + len(run.samples) + len(run.kls)   # the warm-up's, the timed ones, kv_check's
    return {"run": run, "records": after.get(("l27_tier_records", "redis"), 0.0),
            "bytes": after.get(("l27_tier_bytes", "redis"), 0.0), "held": held, "reads": reads,
            "read_s": (reads["read_seconds"] + reads["decode_seconds"]) / requests,
            "decode_s": reads["decode_seconds"] / requests}


def breakeven_gbps(fp16: dict, cachegen: dict) -> float | None:
    """The link speed (Gb/s) below which CacheGen's fetch and decode of a token take less than FP16's fetch and
    decode: (FP16 bytes - CacheGen bytes) / (CacheGen decode s - FP16 decode s), a token's, from this run's reads."""
    def per_token(r, what):
        return r["reads"][what] / r["reads"]["read_tokens"] if r["reads"]["read_tokens"] else None
    b16, bcg = per_token(fp16, "read_bytes"), per_token(cachegen, "read_bytes")
    d16, dcg = per_token(fp16, "decode_seconds"), per_token(cachegen, "decode_seconds")
    if None in (b16, bcg, d16, dcg) or dcg <= d16:
        return None
    return 8 * (b16 - bcg) / (dcg - d16) / 1e9


def rows(results: dict, docs: int) -> list:
    """One row a serde: [serde, records, MB held, documents held, from store, TTFT p50, p99, read+decode s a request,
    decode s a request, mean first-token KL, same as no_store]."""
    plain = results[None]["run"].samples
    out = []
    for serde in SERDES:
        r = results[serde]
        run = r["run"]
        out.append([serde, int(r["records"]), r["bytes"] / 1e6, f"{sum(r['held'])}/{docs * len(r['held'])}",
                    run.cached_share, run.p(0.5), run.p(0.99), r["read_s"], r["decode_s"],
                    statistics.fmean(run.kls) if run.kls else None, bench.same_share(run.samples, plain)])
    return out


def show(results: dict, a) -> None:
    from common.render import render_text
    from common.table import Row, Table, cols
    t = Table(title=f"A shared tier of {a.redis_gb:g} GB (Redis alone, the hot cache too small for a chunk): FP16 "
                    f"records or CacheGen's (level 0); RAG, {a.users} users at once, {a.requests} timed requests "
                    f"after each item's documents once", section="§3-§4, §6",
              cols=cols("serde", "records", ("MB held", "{:.1f}"), "documents held", ("from store", "{:.0%}"),
                        ("TTFT p50 s", "{:.2f}"), ("TTFT p99 s", "{:.2f}"), ("read+decode s/req", "{:.2f}"),
                        ("decode s/req", "{:.2f}"), ("KL", "{:.3f}"), ("same as no_store", "{:.0%}")),
              rows=[Row(row) for row in rows(results, bench.RAG_DOCS)], source="serving.serde.measure")
    print(render_text(t))
    per_token = [r["reads"]["read_bytes"] / r["reads"]["read_tokens"] if r["reads"]["read_tokens"] else None
                 for r in (results["fp16"], results["cachegen"])]
    if None not in per_token:
        print(f"  a token's KV read from Redis: {per_token[0]:,.0f} bytes in FP16, {per_token[1]:,.0f} in CacheGen's "
              f"records ({per_token[0] / per_token[1]:.2f}x fewer)")
    gbps = breakeven_gbps(results["fp16"], results["cachegen"])
    print(f"  CacheGen's fetch and decode beat FP16's fetch below {gbps:.2f} Gb/s ({gbps / 8:.3f} GB/s), from this "
          f"run's bytes and decode seconds a token" if gbps else "  CacheGen's decode was no slower than FP16's here")


def parser() -> Parser:
    p = Parser(__doc__, json=False)
    p.add_argument("--redis-gb", type=positive_float, default=REDIS_GB, help="each engine's Redis budget, GB")
    p.add_argument("--users", type=positive_int, default=USERS, help="RAG users at once")
    p.add_argument("--requests", type=positive_int, default=REQUESTS, help="timed RAG requests")
    p.add_argument("--items", type=positive_int, default=ITEMS, help="RAG items the documents come from")
    p.add_argument("--max-tokens", type=positive_int, default=MAX_TOKENS, help="answer tokens each")
    p.add_argument("--threads", type=positive_int, default=THREADS, help="each server's torch threads")
    return p


def run_for(a) -> dict | None:
    """bench_serve.py's arguments: when they name the workload serde (never part of "all": it starts servers of its
    own), this benchmark with their --users, --rag-requests, --rag-items, --max-tokens and --threads."""
    if "serde" not in a.workload:
        return None
    return main([f"--users={a.users}", f"--requests={a.rag_requests}", f"--items={a.rag_items}",
                 f"--max-tokens={a.max_tokens}", f"--threads={a.threads}"])


def main(argv=None) -> dict:
    a = parser().parse_args(argv)
    results = {serde: measure(serde, a) for serde in (*SERDES, None)}
    show(results, a)
    return results


if __name__ == "__main__":
    main()

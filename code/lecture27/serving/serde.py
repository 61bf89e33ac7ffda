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

import json
import statistics
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common.cli import Parser, positive_float, positive_int
from common.render import render_text
from common.table import Row, Table, cols, pct0
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
READS = ("read_records", "read_tokens", "read_bytes", "read_seconds", "decode_seconds")   # /metrics' l27_tier_*


@dataclass(frozen=True, kw_only=True)
class SerdeRun:
    """One engine's run on its shared tier (the module docstring's figures)."""
    serde: str
    run: bench.Run          # the RAG workload through it
    records: float          # the records Redis holds at the end ...
    bytes: float            # ... and their bytes
    held: list              # for each item, how many of its documents Redis still holds ...
    docs: int               # ... of the documents an item has
    reads: dict             # what the workload read from Redis: READS -> its total
    requests: int           # the requests those reads served: the warm-up's, the timed ones, kv_check's

    @property
    def read_s(self) -> float:
        """Seconds a request spent reading and decoding records."""
        return (self.reads["read_seconds"] + self.reads["decode_seconds"]) / self.requests

    @property
    def decode_s(self) -> float:
        return self.reads["decode_seconds"] / self.requests

    def per_token(self, what: str) -> float | None:
        """A READS figure over the tokens read (None: nothing read)."""
        return self.reads[what] / self.reads["read_tokens"] if self.reads["read_tokens"] else None

    def json(self, plain: list) -> dict:
        """Its figures, the answers set beside `plain` (--no-store's samples of the same requests)."""
        run = self.run
        return {"records": int(self.records), "mb_held": self.bytes / 1e6, "documents_held": sum(self.held),
                "documents": len(self.held) * self.docs, "cached_share": run.cached_share,
                "ttft_p50_s": run.p(0.5), "ttft_p99_s": run.p(0.99), "read_decode_s": self.read_s,
                "decode_s": self.decode_s, "bytes_per_token": self.per_token("read_bytes"),
                "kl": statistics.fmean(run.kls) if run.kls else None,
                "same_as_no_store": bench.same_share(run.samples, plain)}


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


def measure(serde: str, *, redis_gb: float, threads: int, work: dict, kv_checks: int = KV_CHECKS,
            flags: tuple = ()) -> SerdeRun:
    """One engine whose only tier is a Redis server of its own with `redis_gb` (serve.py --serde `serde`), the RAG
    workload `work` (bench.run_rag's users, requests, items, max_tokens, docs, words) through it. flags: serve.py's
    others (--gguf, --chunk-separator)."""
    with launch.engine("--serde", serde, "--no-ram", "--no-disk", "--redis-gb", f"{redis_gb:g}", "--hot-gb",
                       f"{HOT_GB:g}", *flags, threads=threads).start() as s:
        before = metrics(s.url)
        run = bench.run_rag(serde, s.url, s.model, kv_checks=kv_checks, **work)
        after = metrics(s.url)
        held = documents_held(s.url, s.model, work["items"], work["docs"], work["words"])
    got = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return SerdeRun(serde=serde, run=run, records=after.get(("l27_tier_records", "redis"), 0.0),
                    bytes=after.get(("l27_tier_bytes", "redis"), 0.0), held=held, docs=work["docs"],
                    reads={what: got.get((f"l27_tier_{what}", "redis"), 0.0) for what in READS},
                    requests=work["items"] + len(run.samples) + len(run.kls))


def no_store(*, threads: int, work: dict, flags: tuple = ()) -> bench.Run:
    """The same workload through serve.py --no-store: the answers the others are set beside."""
    with launch.engine("--no-store", *flags, threads=threads).start() as s:
        return bench.run_rag("no_store", s.url, s.model, **work)


def breakeven_gbps(fp16: SerdeRun, cachegen: SerdeRun) -> float | None:
    """The link speed (Gb/s) below which CacheGen's fetch and decode of a token take less than FP16's fetch and
    decode: (FP16 bytes - CacheGen bytes) / (CacheGen decode s - FP16 decode s), a token's, from this run's reads."""
    b16, bcg = fp16.per_token("read_bytes"), cachegen.per_token("read_bytes")
    d16, dcg = fp16.per_token("decode_seconds"), cachegen.per_token("decode_seconds")
    if None in (b16, bcg, d16, dcg) or dcg <= d16:
        return None
    return 8 * (b16 - bcg) / (dcg - d16) / 1e9


def json_keys(results: dict, plain: list, redis_gb: float) -> dict:
    """The --json keys: serve_serde ({serde: SerdeRun.json}), serve_serde_breakeven_gbps, serve_serde_redis_gb."""
    return {"serve_serde": {k: r.json(plain) for k, r in results.items()}, "serve_serde_redis_gb": redis_gb,
            "serve_serde_breakeven_gbps": breakeven_gbps(results["fp16"], results["cachegen"])}


FULL = ("serde", "records", "MB held", "documents held", "from store", "TTFT p50 s", "TTFT p99 s",
        "read+decode s/req", "decode s/req", "KL", "same as no_store")
SHORT = ("serde", "MB held", "documents held", "from store", "TTFT p50 s", "read+decode s/req", "KL",
         "same as no_store")
FORMATS = {"MB held": "{:.1f}", "TTFT p50 s": "{:.2f}", "TTFT p99 s": "{:.2f}", "read+decode s/req": "{:.2f}",
           "decode s/req": "{:.2f}", "KL": "{:.3f}"}   # the other columns: text, or a whole number


def table(results: dict, plain: list, title: str, columns: tuple = FULL) -> Table:
    """FP16's row and CacheGen's: `columns` of FULL (SHORT: 05's Part 6), with the notes of the bytes a token and
    the break-even link speed."""
    def cells(r: SerdeRun) -> dict:
        j = r.json(plain)
        return {"serde": r.serde, "records": j["records"], "MB held": j["mb_held"],
                "documents held": f"{j['documents_held']}/{j['documents']}", "from store": pct0(j["cached_share"]),
                "TTFT p50 s": j["ttft_p50_s"], "TTFT p99 s": j["ttft_p99_s"], "read+decode s/req": j["read_decode_s"],
                "decode s/req": j["decode_s"], "KL": j["kl"], "same as no_store": pct0(j["same_as_no_store"])}
    return Table(title=title, section="§3-§4, §6",
                 cols=cols(*[(c, FORMATS[c]) if c in FORMATS else c for c in columns]),
                 rows=[Row([cells(results[k])[c] for c in columns]) for k in SERDES],
                 source="serving.serde.measure", notes=notes(results))


def notes(results: dict) -> list:
    """The table's notes: a token's bytes in each format, and the link speed below which CacheGen's pays."""
    fp16, cachegen = results["fp16"], results["cachegen"]
    b16, bcg = fp16.per_token("read_bytes"), cachegen.per_token("read_bytes")
    out = []
    if b16 and bcg:
        out.append(f"A token's KV read from Redis: {b16:,.0f} bytes in FP16, {bcg:,.0f} in CacheGen's records "
                   f"({b16 / bcg:.2f}x fewer).")
    gbps = breakeven_gbps(fp16, cachegen)
    out.append(f"CacheGen's fetch and decode beat FP16's fetch below {gbps:.2f} Gb/s ({gbps / 8:.3f} GB/s), from this "
               "run's bytes and decode seconds a token: a compressed shared tier pays for capacity, and for time only "
               "over a link slower than that." if gbps else "CacheGen's decode was no slower than FP16's here.")
    return out


def parser() -> Parser:
    p = Parser(__doc__)
    p.add_argument("--redis-gb", type=positive_float, default=REDIS_GB, help="each engine's Redis budget, GB")
    p.add_argument("--users", type=positive_int, default=USERS, help="RAG users at once")
    p.add_argument("--requests", type=positive_int, default=REQUESTS, help="timed RAG requests")
    p.add_argument("--items", type=positive_int, default=ITEMS, help="RAG items the documents come from")
    p.add_argument("--max-tokens", type=positive_int, default=MAX_TOKENS, help="answer tokens each")
    p.add_argument("--threads", type=positive_int, default=THREADS, help="each server's torch threads")
    return p


def run_for(a) -> dict | None:
    """bench_serve.py's arguments: when they name the workload serde (never part of "all": it starts servers of its
    own), this benchmark with their --users, --rag-requests, --rag-items, --max-tokens and --threads: its --json keys
    (json_keys). None: not named."""
    if "serde" not in a.workload:
        return None
    return main([f"--users={a.users}", f"--requests={a.rag_requests}", f"--items={a.rag_items}",
                 f"--max-tokens={a.max_tokens}", f"--threads={a.threads}"])


def main(argv=None) -> dict:
    a = parser().parse_args(argv)
    work = dict(users=a.users, requests=a.requests, items=a.items, max_tokens=a.max_tokens, docs=bench.RAG_DOCS,
                words=bench.DOC_WORDS)
    results = {serde: measure(serde, redis_gb=a.redis_gb, threads=a.threads, work=work) for serde in SERDES}
    plain = no_store(threads=a.threads, work=work).samples
    print(render_text(table(results, plain, f"A shared tier of {a.redis_gb:g} GB (Redis alone, the hot cache too "
                                            f"small for a chunk): FP16 records or CacheGen's (level 0); RAG, {a.users} "
                                            f"users at once, {a.requests} timed requests after each item's documents "
                                            "once")))
    keys = json_keys(results, plain, a.redis_gb)
    if a.json:
        Path(a.json).write_text(json.dumps(keys, indent=2) + "\n")
        print(f"wrote {a.json}")
    return keys


if __name__ == "__main__":
    main()

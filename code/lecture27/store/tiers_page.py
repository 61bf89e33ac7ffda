"""How 05_tiered_storage.py shows each Part (handout §5.1, §6-7; exercises 9-10): its tables, notes,
figures and --json keys, one show_<part>(page, result, settings) per Part, each --json key taken from the
result in one place (the Part's *_json function). The results are tiers_study's; the handout's figures are
HANDOUT below.
"""
from __future__ import annotations

from common.present import (DASH, Chart, Field, Handout, Page, Ref, Row, Series, Table, Val, cdf, change,
                            chart_figure, cols, handout, pct0, segment_bars, table_of, text_table)
from common.timemodel import get_model
from lecture27.rag_caches import CACHES
from lecture27.store.tiers_study import GB, Chat, Handoff, Rag, ServiceVsLibrary, Waist

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

def figure(name: str, s) -> str:
    """The handout's figure `name` as a sentence quotes it; "-" when the run's inputs are not its."""
    ref = handout(HANDOUT, name, s)
    return ref.figure if isinstance(ref, Ref) else DASH


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


# ================================================================================ Part 1
def show_handoff(page: Page, h: Handoff, s) -> None:
    """Part 1: each path's hops and seconds, and the figure of its copies."""
    page.part("Part 1", "§6.2", "Zero-copy: handing KV from one engine to another")
    zero_copy = h.routes["shared_pool"].seconds
    fields = [Field("path"), Field("links (GB/s)", get=lambda r: " > ".join(f"{x[1]} {x[2]:g}" for x in r.hops)),
              Field("copies", get=lambda r: len(r.hops)), Field("seconds", "{:.3f}", get="seconds"),
              Field("vs zero-copy", "{:.1f}x", get=lambda r: r.seconds / zero_copy)]
    page.table(table_of(f"hand {s.handoff_tokens:,} tokens of {get_model(s.handoff_model).name} KV ({h.nbytes / GB:.2f}"
                        f" GB; handout: {figure('handoff_gb', s)}) from GPU A to GPU B", "§6.2", fields,
                        h.routes, "store.tiers_study.handoff_paths",
                        [f"{name}: " + " -> ".join(r.stops) for name, r in h.routes.items()]
                        + ["Store and forward: each copy moves all the bytes once over its link. A library inside each "
                           "engine cannot map the other process's CPU memory, so it relays through a remote pool or "
                           "copies once more; one service process owns a CPU pool both engines map (handout §6.2)."],
                        {"handoff_s": {name: r.seconds for name, r in h.routes.items()}}))
    segment_bars(page, "05_handoff.png", {name: [(h.nbytes / (bw * GB), what, f"{link} copy")
                                                 for what, link, bw in r.hops] for name, r in h.routes.items()},
                 {"PCIe copy": "tab:blue", "network copy": "tab:red", "memcpy copy": "tab:orange"},
                 "seconds to hand the KV from GPU A to GPU B",
                 f"{h.nbytes / GB:.2f} GB of KV: one shared CPU pool needs no CPU copy (handout §6.2)", (7.5, 3),
                 dict(fontsize=7, loc="upper right"))


def chat_notes(c: Chat, s) -> list:
    """What the chat table shows, each sentence chosen by its numbers."""
    res = c.served
    return ["hits = share of history tokens found cached; recompute/busy = the GPU's seconds recomputing history "
            "over its busy seconds (load + prefill); GPU busy = busy seconds / run time. Decode is not simulated.",
            share_note(c), *cpu_tier_notes(c, s.gpu_gb),
            f"cpu_slow / cpu_fast mean TTFT: {c.slow_vs_fast:.1f}x (handout: {figure('slow_vs_fast', s)}, "
            f"pitfall 7)   gpu_only / cpu_ssd: {res['gpu_only'].mean_ttft_s / res['cpu_ssd'].mean_ttft_s:.0f}x"]


def share_note(c: Chat) -> str:
    """cpu_slow against cpu_fast: the GPU seconds recomputed, the busy time and the recompute share; when the
    amounts print the same and the share moves, it is said to be a share, not an amount."""
    slow, fast = c.served["cpu_slow"], c.served["cpu_fast"]
    rs, rf = (f"{x.recompute_s.sum():.0f}" for x in (slow, fast))
    amounts = f"cpu_slow recomputes {rs} GPU seconds, cpu_fast {rf}"
    busy = change(slow.busy_s, fast.busy_s, "{:.0f} s")   # 'falls (119 s -> 71 s)'
    busy = ("faster loading shrinks the busy time" + busy[5:]) if busy.startswith("falls") else "the busy time " + busy
    share = change(slow.recompute_share, fast.recompute_share, "{:.0%}")
    if rs == rf and not share.startswith("stays"):
        return f"recompute/busy is a share, not an amount: {amounts}, but {busy}, so the share {share}."
    return f"{amounts}; {busy}, and the share {share}."


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


def chat_json(c: Chat) -> dict:
    return {"cpu_fast_vs_slow_ttft_ratio": c.slow_vs_fast, "configs": {name: {
        "hit_rate_per_tier": r.hit_rate_per_tier, "hit_rate": r.hit_rate, "mean_ttft_s": r.mean_ttft_s,
        "p50_ttft_s": r.p50_ttft_s, "p99_ttft_s": r.p99_ttft_s, "recompute_share": r.recompute_share}
        for name, r in c.served.items()}}


def show_chat(page: Page, c: Chat, s) -> None:
    page.part("Part 2", "§6.3", "Tiered KV storage for multi-turn chat")
    per = lambda header, fmt, name: Field(header, fmt, get=name)   # a Served field
    fields = [Field("config"), Field("tiers GB@GB/s", get={n: tiers_text(t) for n, t in c.configs.items()}),
              per("hits by tier", lambda x: " ".join(f"{v:.0%}" for v in x), "hit_rate_per_tier"),
              per("hits", "{:.0%}", "hit_rate"), per("mean TTFT s", "{:.3f}", "mean_ttft_s"),
              per("p50 s", "{:.3f}", "p50_ttft_s"), per("p99 s", "{:.3f}", "p99_ttft_s"),
              per("recompute/busy", "{:.0%}", "recompute_share"), Field("GPU busy", "{:.0%}", get="busy_share")]
    page.table(table_of(f"{s.users} users x {s.turns} turns ({s.user_tokens} + {s.answer_tokens} tokens a turn), "
                        f"{s.rate:g} req/s, {get_model(s.model).name} on one {s.gpu};\n  all histories {c.total_gb:.1f}"
                        f" GB of KV (handout: {figure('all_kv_gb', s)}), GPU room {s.gpu_gb:g} GB (handout: "
                        f"{figure('gpu_room_gb', s)})", "§6.3", fields, c.served, "store.tiers_study.serve",
                        chat_notes(c, s), chat_json(c)))
    page.table(text_table("  for reference (handout §6.3, not simulated here):", "§6.3",
                          ["slides' LMCache benchmark", "metric", "LMCache", "engine's own offload", "ratio"], SLIDES))
    chart_figure(page, "05_ttft_cdf.png", Chart(   # cpu50 dashed: it lies on gpu_only when it never hits
        series=[Series(*cdf(r.ttft), name, "step", {"ls": "--" if name == "cpu50" else "-"}) for name,
                r in c.served.items()],
        xlabel="time to first token (s)", ylabel="share of requests",
        title=f"Multi-turn chat, {get_model(s.model).name} on one {s.gpu}: TTFT by KV storage tiers",
        xscale="log"), figsize=(7, 4))


def show_waist(page: Page, w: Waist, s) -> None:
    page.part("Part 3", "§7", "The narrow waist: what the OpenAI API cannot tell the cache")
    page.table(Table(title=f"{s.doc_requests} requests, {1 - s.oneshot_share:.0%} on {s.docs} documents of "
                           f"{s.doc_tokens} tokens, {s.oneshot_share:.0%} one-shot prompts of {s.oneshot_tokens} "
                           f"tokens; cache {s.doc_cache_gb:g} GB", section="§7",
                     cols=cols("policy", ("document hit rate", "{:.0%}")),
                     rows=[Row(["LRU (sees only tokens)", w.lru], figure("lru", s)),
                      Row(['hinted ("will be reused")', w.hinted], figure("hinted",
                                                                          s))], source="store.tiers_study.doc_hit_rate",
                     json={"lru_doc_hit_rate": w.lru, "hinted_doc_hit_rate": w.hinted}))
    page.table(text_table("\n§7: the inference stack's layers (handout) beside the classic computer system (our "
                          "reading; the table was lost)", "§7",
                          ["LLM inference stack", "classic computer system", "in this lecture's code"],
                          STACK_VS_CLASSIC))
    page.exercise(10, "§7", "what the hint needs an API to carry")
    page.say("\n".join("    " + line for line in HINT_API_EXAMPLE.splitlines()), code=True)


def service_json(e: ServiceVsLibrary) -> dict:
    return {"exercise9": {"copies": e.copies, "handoff_s": e.handoff_s, "memory_gb": e.memory_gb,
                          "restart_s": e.restart_s, "ipc_ms": e.ipc_ms, "engines": e.engines, "doc_gb": e.doc_gb,
                          "ipc_share_of_ttft": e.ipc_share_of_ttft}}


def show_service_vs_library(page: Page, e: ServiceVsLibrary, s) -> None:
    page.exercise(9, "§6.1", "what a separate KV service process buys and costs")
    lib, svc = f"{e.memory_gb.library:.1f}", f"{e.memory_gb.service:.1f}"
    rows = [("copies to hand KV from GPU A to GPU B (Part 1)", e.copies, "{}", "{}"),
            ("handoff time, s (Part 1)", e.handoff_s, "{:.3f}", "{:.3f}"),
            (f"CPU memory for {e.engines} engines sharing {s.docs} documents, GB", e.memory_gb, "{:.1f}", "{:.1f}"),
            ("an engine restarts: its KV back after, s", e.restart_s, "{:.2f} (recompute)", "{:.3f} (PCIe read)")]
    page.table(Table(title=f"  ({e.engines} engines on a node; the documents of Part 3, {e.doc_gb:.1f} GB of KV)",
                     section="§6.1",
                     cols=cols("exercise 9: KV library in each engine vs one KV service", "library", "service"),
                     rows=[Row([label, Val(x.library, fmt=fl), Val(x.service, fmt=fs)]) for label, x, fl, fs in rows]
                     + [Row(["IPC a request adds, ms", "0", Val(e.ipc_ms, fmt="{:.3f}")])],
                     source="store.tiers_study.service_vs_library",
                     notes=[f"The service keeps the documents' KV once ({svc} GB"
                            + (f", not {lib})" if lib != svc else ")")
                      + ", survives an engine's restart or upgrade, and lets researchers add plugins without touching "
                      f"the engine. It costs an IPC round trip per call ({s.ex9_ipc_us:g} us assumed, {s.ex9_calls} "
                      f"calls: {e.ipc_share_of_ttft:.2%} of Part 2's mean TTFT with the fast CPU tier), a "
                      "shared-memory interface agreed with every engine, and one more service to run and keep alive."],
                     json=service_json(e)))


def rag_notes(r: Rag, s) -> list:
    """What the RAG table shows, each sentence chosen by its numbers."""
    return [f"hits = share of the documents' tokens not prefilled (the chunk cache prefills {s.rag_recompute:.0%} of "
            "each document it reuses); 1/k = the first document's share; mean and p99 TTFT in seconds (queue + "
            "load + prefill); busy = the GPU's load + prefill seconds over the run.",
            "Prefix caching reuses only the identical leading part of a prompt (handout: "
            f"{figure('rag_trend', s)}, §5.1 and §9 pitfall 6).", *trend_note(r, s), first_doc_note(r),
            *one_doc_note(r, s), ttft_note(r)]


def trend_note(r: Rag, s) -> list:
    """From the smallest k to the largest: which way each cache's hit rate moved, and what that says."""
    if len(r.ks) < 2:
        return []
    hp, hc = r.of("prefix", "hit_rate"), r.of("chunk", "hit_rate")
    fp, fc = (change(a[0], a[-1], "{:.0%}") for a in (hp, hc))
    less = "the prefix cache saves less the more documents a request has"
    if not fp.startswith("falls"):
        verdict = "the prefix cache does not lose with k here."
    elif fc.startswith("falls"):
        verdict = "both fall, " + ("the prefix cache's more." if hp[0] - hp[-1] > hc[0] - hc[-1] else
                                   "the chunk cache's as much or more.")
    elif pct0(max(hc)) == pct0(0):
        verdict = (f"{less}; the chunk cache, recomputing {s.rag_recompute:.0%} of what it finds, saves nothing "
                   "at any k.")
    else:
        verdict = f"{less}, the chunk cache does not: it finds a cached document wherever it stands."
    return [f"From k = {r.ks[0]} to {r.ks[-1]} the prefix cache's hit rate {fp} and the chunk cache's {fc}: {verdict}"]


def first_doc_note(r: Rag) -> str:
    """Where the prefix cache's reuse stands against 1/k, the first document's share, as printed."""
    hp, heads = r.of("prefix", "hit_rate"), r.of("prefix", "head_share")
    over = [k for k, h in zip(r.ks, hp) if h > 1 / k and pct0(h) != pct0(1 / k)]
    at = [k for k, h in zip(r.ks, hp) if pct0(h) == pct0(1 / k)]
    where = (f"above 1/k at k = {', '.join(map(str, over))}: popular documents recur there in the same order." if over
             else f"{'at most' if at else 'below'} 1/k, the first document's share, at every k.")
    return (f"Of the documents the prefix cache reused at k = {r.ks[-1]}, {heads[-1]:.0%} stood first in their "
            f"request; its hit rate is {where}")


def one_doc_note(r: Rag, s) -> list:
    """At k = 1 both caches find the same documents; the chunk cache still recomputes its share of each."""
    found, hc = [r.of(c, "reused_share")[0] for c in CACHES], r.of("chunk", "hit_rate")
    if r.ks[0] != 1 or pct0(found[0]) != pct0(found[1]):
        return []
    recomputes = (f"still recomputes {s.rag_recompute:.0%} of each it finds" if s.rag_recompute else
                  "is told to recompute none of what it finds")
    return [f"At k = 1 the one document is the whole prefix: both caches find {found[0]:.0%} of the documents, and "
            f"the chunk cache, which does not know where a KV was computed, {recomputes} ({hc[0]:.0%} hits)."]


def ttft_note(r: Rag) -> str:
    """At the largest k: both caches' mean TTFT, how many times shorter the chunk cache's, the GPU's busy share."""
    mp, mc = (r.of(c, "mean_ttft_s")[-1] for c in CACHES)
    bp, bc = (r.of(c, "busy_share")[-1] for c in CACHES)
    ratio = ("the same" if f"{mp:.3f}" == f"{mc:.3f}" else f"{mp / mc:.1f}x shorter" if mp >= mc else
             f"{mc / mp:.1f}x longer")
    return (f"At k = {r.ks[-1]}: mean TTFT {mp:.3f} s with the prefix cache, {mc:.3f} s with the chunk cache (the "
            f"chunk cache's {ratio}); the GPU is busy {bp:.0%} and {bc:.0%} of the time.")


def rag_json(r: Rag) -> dict:
    return {"rag_k": list(r.ks),
            "rag_prefix_hit_rate": r.of("prefix", "hit_rate"), "rag_chunk_hit_rate": r.of("chunk", "hit_rate"),
            "rag_prefix_mean_ttft_s": r.of("prefix", "mean_ttft_s"),
            "rag_chunk_mean_ttft_s": r.of("chunk", "mean_ttft_s"),
            "rag_prefix_p99_ttft_s": r.of("prefix", "p99_ttft_s"), "rag_chunk_p99_ttft_s": r.of("chunk", "p99_ttft_s")}


def show_rag(page: Page, r: Rag, s) -> None:
    page.part("Part 4", "§5.1, §9", "RAG on the same tiers: prefix caching against non-prefix reuse")
    measures = [("hits", "{:.0%}", "hit_rate"), ("mean", "{:.3f}", "mean_ttft_s"), ("p99", "{:.3f}", "p99_ttft_s"),
                ("busy", "{:.0%}", "busy_share")]                # each a column per cache
    fields = [Field("k", "{}", get=lambda i: r.ks[i]), Field("1/k", "{:.0%}", get=lambda i: 1 / r.ks[i])]
    fields += [Field(f"{c} {m}", fmt, get=lambda i, c=c, f=f: getattr(r.served[c][i], f))
               for m, fmt, f in measures for c in CACHES]
    page.table(table_of(f"{s.rag_requests} requests of k documents ({s.rag_doc_tokens} tokens) from {s.rag_docs:,} "
                        f"(Zipf {s.rag_zipf:g}), a new order each time, + a {s.rag_question_tokens}-token question; "
                        f"{s.rag_rate:g} req/s, {get_model(s.model).name} on one {s.gpu};\n  both caches on Part 2's "
                        f"{s.rag_tiers} ({tiers_text(r.tiers)}); the chunk cache blends at {s.rag_recompute:.0%}",
                        "§5.1", fields, range(len(r.ks)), "rag_caches.serve_rag", rag_notes(r, s), rag_json(r),
                        handout=figure("rag_prefix", s)))
    lines = lambda f, ls, label: [Series(r.ks, r.of(c, f), label.format(c), style=dict(marker="o", ls=ls, color=color))
                                  for c, color in zip(CACHES, ("tab:red", "tab:blue"))]
    hits, mean, p99 = (lines("hit_rate", "-", "{} cache"), lines("mean_ttft_s", "-", "{} cache, mean"),
                       lines("p99_ttft_s", ":", "{} cache, p99"))
    k_axis = "documents per request (k)"
    chart_figure(page, "05_rag.png", [
        Chart(series=hits + [Series(r.ks, [1 / k for k in r.ks], "1/k: the first document's share",
                             style={"color": "k", "ls": "--", "lw": 1})], xlabel=k_axis,
              ylabel="share of document tokens not prefilled", title="hit rate", axes={"xticks": r.ks, "ylim": (0,
                                                                                                                1.05)}),
        Chart(series=[mean[0], p99[0], mean[1], p99[1]], xlabel=k_axis, ylabel="time to first token (s)", title="TTFT",
              yscale="log",
              axes={"xticks": r.ks})],
        f"RAG, {s.rag_docs:,} documents (Zipf {s.rag_zipf:g}) on Part 2's {s.rag_tiers}: a prefix cache against a "
        "chunk cache (handout §5.1)", figsize=(9, 3.8))



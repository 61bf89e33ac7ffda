"""LMCache's two ideas in numbers: zero-copy sharing, tiered KV storage for multi-turn chat, and the
narrow waist (handout §6.2, §6.3, §7; pitfall 7; exercises 9-10).

    python code/lecture27/05_tiered_storage.py [--json out.json] [--cpu-gb 150] [--rate 10] ...

Part 1  hand 16K tokens of LLaMA-3.1-70B KV from GPU A to GPU B three ways, each a sum of its hops.
Part 2  a discrete-event simulation of 200 users x 12 turns of chat on LLaMA-3-8B, one H100, with the
        KV kept in GPU only / + a CPU tier read slowly or fast / + an SSD tier (the tiers: tiers.py).
Part 3  the narrow waist: documents that come back again and again mixed with one-shot long prompts;
        a cache that sees only tokens (LRU) vs the same cache told "this will be reused"; exercise 10 (an
        API that carries the hint) and the slides' table of the inference stack beside classic systems.
Exercise 9  a KV service process vs a KV library in every engine, in numbers: copies and handoff time,
        memory for N engines sharing one document set, what an engine restart loses, IPC per request.
Runs in a few seconds; figures/05_handoff.png (Part 1) and figures/05_ttft_cdf.png (Part 2).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # code/ holds `common`

import numpy as np

from common.cli import (Parser, fail, figure_path, nonneg_float, positive_float, positive_int, say, table,
                        write_json)
from common.timemodel import get_model, kv_bytes_per_token, prefill_time
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
# The handout's figures (reference only; nothing is computed from them), and the inputs they hold for:
# a figure is printed only when the run's inputs are these, "-" otherwise
HANDOUT = {"handoff_gb": "about 5.2 GB", "all_kv_gb": "241 GB", "gpu_room_gb": "~58 GB",
           "slow_vs_fast": "5x", "lru": "45%", "hinted": "99%"}
HANDOUT_INPUTS = {
    "handoff": {"model": "llama-3.1-70b", "tokens": 16_000},
    "chat": {"model": "llama-3-8b", "gpu": "H100", "users": 200, "turns": 12, "turn_tokens": 768},
    "tiers": {"rate": 10.0, "cpu_slow_gbps": 10.0, "cpu_fast_gbps": 50.0},
    "waist": {"requests": 2000, "docs": 10, "doc_tokens": 4096, "oneshot_tokens": 8192, "oneshot_share": 0.5,
              "cache_gb": 9.0},
}


# ================================================================================ Part 1
def handoff_paths(model=HANDOFF_MODEL, tokens=HANDOFF_TOKENS, pcie=PCIE_GBPS, memcpy=MEMCPY_GBPS,
                  net=NET_GBPS) -> dict:
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
    return {"bytes": nbytes,
            "paths": {name: {"hops": hops, "seconds": sum(nbytes / (bw * GB) for _, _, bw in hops)}
                      for name, hops in paths.items()}}


# ================================================================================ Part 2
def chat_trace(users=USERS, turns=TURNS, rate=RATE, seed=SEED):
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


def make_store(config: dict) -> TieredStore:
    """config: {"tiers": [(name, GB, GB/s), ...]}, fastest first (the GPU's bandwidth is ignored)."""
    return TieredStore([Tier(name, gb * GB, (bw or float("inf")) * GB if i else float("inf"))
                        for i, (name, gb, bw) in enumerate(config["tiers"])])


def serve(trace, store: TieredStore, model=MODEL, gpu=GPU, user_tokens=USER_TOKENS,
          answer_tokens=ANSWER_TOKENS, chunk=CHUNK) -> dict:
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
    out.update(
        ttft=ttft,
        hit_rate_per_tier=(hit_tokens / max(history_tokens, 1)).tolist(),  # share of history tokens
        hit_rate=float(hit_tokens.sum() / max(history_tokens, 1)),
        mean_ttft_s=float(ttft.mean()), p50_ttft_s=float(np.median(ttft)),
        p99_ttft_s=float(np.percentile(ttft, 99)),
        recompute_share=float(out["recompute_s"].sum() / busy.sum()),    # of the GPU's busy time
        busy_s=float(busy.sum()),
        busy_share=float(busy.sum() / (out["finish"][-1] - arrival[0])),  # GPU busy over the run
    )
    return out


def chat_configs(gpu_gb=GPU_GB, cpu_gb=CPU_GB, slow=CPU_SLOW_GBPS, fast=CPU_FAST_GBPS,
                 ssd_gb=SSD_GB, ssd_gbps=SSD_GBPS) -> dict:
    return {
        "gpu_only": {"tiers": [("GPU", gpu_gb, None)]},
        "cpu50": {"tiers": [("GPU", gpu_gb, None), ("CPU", CPU_SMALL_GB, fast)]},
        "cpu_slow": {"tiers": [("GPU", gpu_gb, None), ("CPU", cpu_gb, slow)]},
        "cpu_fast": {"tiers": [("GPU", gpu_gb, None), ("CPU", cpu_gb, fast)]},
        "cpu_ssd": {"tiers": [("GPU", gpu_gb, None), ("CPU", cpu_gb, fast), ("SSD", ssd_gb, ssd_gbps)]},
    }


# ================================================================================ Part 3
def doc_trace(n=DOC_REQUESTS, docs=DOCS, oneshot_share=ONESHOT_SHARE, seed=SEED):
    """Per request: a document id (0..docs-1), or -1 for a one-shot prompt."""
    rng = np.random.default_rng(seed + 1)
    doc = rng.integers(0, docs, n)
    doc[rng.random(n) < oneshot_share] = -1
    return doc


def doc_hit_rate(trace, hinted: bool, cache_gb=DOC_CACHE_GB, doc_tokens=DOC_TOKENS,
                 oneshot_tokens=ONESHOT_TOKENS, chunk=CHUNK, model=MODEL) -> float:
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
def exercise9(h: dict, chat: dict, engines=EX9_ENGINES, docs=DOCS, doc_tokens=DOC_TOKENS, model=MODEL, gpu=GPU,
              ipc_us=EX9_IPC_US, calls=EX9_CALLS, pcie=PCIE_GBPS) -> dict:
    """A KV service process vs a KV library inside every engine, each cost computed:
    copies and time of Part 1's handoff; memory for `engines` engines that all serve the same `docs`
    documents (a library keeps a copy per engine, the service one); what an engine restart costs (the
    library's CPU-memory KV dies with the process and is recomputed, the service's is read back over PCIe);
    the IPC a request pays to reach the service, against Part 2's mean TTFT with the fast CPU tier."""
    doc_bytes = docs * doc_tokens * kv_bytes_per_token(model)
    lib, svc = h["paths"]["library_copy"], h["paths"]["shared_pool"]
    recompute_docs = docs * prefill_time(model, gpu, doc_tokens, 0)
    ipc_s = calls * ipc_us * 1e-6
    return {
        "engines": engines, "doc_gb": doc_bytes / GB,
        "copies": {"library": len(lib["hops"]), "service": len(svc["hops"])},
        "handoff_s": {"library": lib["seconds"], "service": svc["seconds"]},
        "memory_gb": {"library": engines * doc_bytes / GB, "service": doc_bytes / GB},
        "restart_s": {"library": recompute_docs, "service": doc_bytes / (pcie * GB)},
        "ipc_ms": ipc_s * 1e3, "ipc_share_of_ttft": ipc_s / chat["results"]["cpu_fast"]["mean_ttft_s"],
    }


def print_exercise9(e9):
    n, gb = e9["engines"], e9["doc_gb"]
    rows = [["copies to hand KV from GPU A to GPU B (Part 1)", e9["copies"]["library"], e9["copies"]["service"]],
            ["handoff time, s (Part 1)", f"{e9['handoff_s']['library']:.3f}", f"{e9['handoff_s']['service']:.3f}"],
            [f"CPU memory for {n} engines sharing {DOCS} documents, GB",
             f"{e9['memory_gb']['library']:.1f}", f"{e9['memory_gb']['service']:.1f}"],
            ["an engine restarts: its KV back after, s", f"{e9['restart_s']['library']:.2f} (recompute)",
             f"{e9['restart_s']['service']:.3f} (PCIe read)"],
            ["IPC a request adds, ms", "0", f"{e9['ipc_ms']:.3f}"]]
    print()
    print(table(["exercise 9: KV library in each engine vs one KV service", "library", "service"], rows,
                f"Exercise 9 (§6.1, §10): what a separate KV service process buys and costs\n"
                f"  ({n} engines on a node; the documents of Part 3, {gb:.1f} GB of KV)"))
    say(f"  The service keeps the documents' KV once ({e9['memory_gb']['service']:.1f} GB, not "
        f"{e9['memory_gb']['library']:.1f}), survives an engine's restart or upgrade, and lets researchers add "
        f"plugins without touching the engine. It costs an IPC round trip per call ({EX9_IPC_US:g} us assumed, "
        f"{EX9_CALLS} calls: {e9['ipc_share_of_ttft']:.2%} of Part 2's mean TTFT with the fast CPU tier), a shared-"
        "memory interface agreed with every engine, and one more service to run and keep alive.")


# ================================================================================ output
def plot_handoff(h: dict, path) -> None:
    """One bar per path, one segment per copy (seconds): the handout's point is the shared pool's two copies."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3))
    colors = {"PCIe": "tab:blue", "network": "tab:red", "memcpy": "tab:orange"}
    names = list(h["paths"])
    for y, name in enumerate(names):
        left = 0.0
        for what, link, bw in h["paths"][name]["hops"]:
            dt = h["bytes"] / (bw * GB)
            ax.barh(y, dt, left=left, color=colors[link], edgecolor="white")
            ax.text(left + dt / 2, y, what, ha="center", va="center", fontsize=6, color="white")
            left += dt
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds to hand the KV from GPU A to GPU B")
    ax.set_title(f"{h['bytes'] / GB:.2f} GB of KV: one shared CPU pool needs no CPU copy (handout §6.2)", fontsize=9)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
              labels=[f"{k} copy" for k in colors], fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def plot_ttft(results: dict, path, model: str, gpu: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        x = np.sort(r["ttft"])
        ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=name,
                linestyle="--" if name == "cpu50" else "-")  # cpu50 lies on gpu_only
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"Multi-turn chat, {get_model(model).name} on one {gpu}: TTFT by KV storage tiers")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ================================================================================ the three parts
def part1():
    return handoff_paths(HANDOFF_MODEL, HANDOFF_TOKENS, PCIE_GBPS, MEMCPY_GBPS, NET_GBPS)


def part2(a) -> dict:
    """Every storage configuration serving the same chat trace."""
    trace = chat_trace(a.users, a.turns, a.rate, a.seed)
    configs = chat_configs(a.gpu_gb, a.cpu_gb, a.cpu_slow_gbps, a.cpu_fast_gbps, a.ssd_gb, a.ssd_gbps)
    results = {name: serve(trace, make_store(cfg), MODEL, GPU, a.user_tokens, a.answer_tokens, CHUNK)
               for name, cfg in configs.items()}
    return {"configs": configs, "results": results,
            "total_gb": a.users * a.turns * (a.user_tokens + a.answer_tokens) * kv_bytes_per_token(MODEL) / GB,
            "slow_vs_fast": results["cpu_slow"]["mean_ttft_s"] / results["cpu_fast"]["mean_ttft_s"]}


def part3(a) -> dict:
    """Document hit rates of one cache, blind (LRU) and told which KV will be reused."""
    docs = doc_trace(DOC_REQUESTS, DOCS, ONESHOT_SHARE, a.seed)
    return {hint: doc_hit_rate(docs, hint == "hinted", a.doc_cache_gb, DOC_TOKENS, ONESHOT_TOKENS, CHUNK, MODEL)
            for hint in ("lru", "hinted")}


def is_handout_setup(part: str, **inputs) -> bool:
    """Are the inputs of this part the ones the handout's figures hold for?"""
    return all(inputs[k] == v for k, v in HANDOUT_INPUTS[part].items())


def ref(key: str, applies: bool) -> str:
    return HANDOUT[key] if applies else "-"


def print_part1(h):
    zero = h["paths"]["shared_pool"]["seconds"]
    rows = [[name, " > ".join(f"{link} {bw:g}" for _, link, bw in v["hops"]), len(v["hops"]),
             f"{v['seconds']:.3f}", f"{v['seconds'] / zero:.1f}x"] for name, v in h["paths"].items()]
    same = is_handout_setup("handoff", model=HANDOFF_MODEL, tokens=HANDOFF_TOKENS)
    print(table(["path", "links (GB/s)", "copies", "seconds", "vs zero-copy"], rows,
                f"Part 1 (§6.2): hand {HANDOFF_TOKENS:,} tokens of {get_model(HANDOFF_MODEL).name} KV "
                f"({h['bytes'] / GB:.2f} GB; handout: {ref('handoff_gb', same)}) from GPU A to GPU B"))
    for name, v in h["paths"].items():
        print(f"  {name}: " + " -> ".join([v["hops"][0][0].split("->")[0]] + [w.split("->")[1] for w, _, _ in v["hops"]]))
    say("  Store and forward: each copy moves all the bytes once over its link. A library inside each engine "
        "cannot map the other process's CPU memory, so it relays through a remote pool or copies once more; "
        "one service process owns a CPU pool both engines map (handout §6.2).")


def print_part2(p2, a):
    rows = []
    for name, r in p2["results"].items():
        tiers = p2["configs"][name]["tiers"]
        per = [f"{x:.0%}" for t, x in zip(tiers, r["hit_rate_per_tier"])]
        rows.append([name, ", ".join(f"{t[0]} {t[1]:g}" + (f"@{t[2]:g}" if t[2] else "") for t in tiers),
                     " ".join(per), f"{r['hit_rate']:.0%}", f"{r['mean_ttft_s']:.3f}",
                     f"{r['p50_ttft_s']:.3f}", f"{r['p99_ttft_s']:.3f}",
                     f"{r['recompute_share']:.0%}", f"{r['busy_share']:.0%}"])
    chat = is_handout_setup("chat", model=MODEL, gpu=GPU, users=a.users, turns=a.turns,
                            turn_tokens=a.user_tokens + a.answer_tokens)
    tiers = chat and is_handout_setup("tiers", rate=a.rate, cpu_slow_gbps=a.cpu_slow_gbps, cpu_fast_gbps=a.cpu_fast_gbps)
    print()
    print(f"Part 2 (§6.3): {a.users} users x {a.turns} turns ({a.user_tokens} + {a.answer_tokens} tokens "
          f"a turn), {a.rate:g} req/s, {get_model(MODEL).name} on one {GPU};")
    print(table(["config", "tiers GB@GB/s", "hits by tier", "hits", "mean TTFT s", "p50 s", "p99 s",
                 "recompute/busy", "GPU busy"], rows,
                f"  all histories {p2['total_gb']:.1f} GB of KV (handout: {ref('all_kv_gb', chat)}), "
                f"GPU room {a.gpu_gb:g} GB (handout: {ref('gpu_room_gb', chat)})"))
    say("  hits = share of history tokens found cached; recompute/busy = the GPU's seconds recomputing history "
        "over its busy seconds (load + prefill); GPU busy = busy seconds / run time. Decode is not simulated.")
    res = p2["results"]
    slow, fast = res["cpu_slow"], res["cpu_fast"]
    say(f"  recompute/busy is a share, not an amount: cpu_slow recomputes {slow['recompute_s'].sum():.0f} GPU "
        f"seconds, cpu_fast {fast['recompute_s'].sum():.0f}, but faster loading "
        f"shrinks the busy time ({slow['busy_s']:.0f} -> {fast['busy_s']:.0f} s), so the share rises "
        f"({slow['recompute_share']:.0%} -> {fast['recompute_share']:.0%}).")
    if CPU_SMALL_GB <= a.gpu_gb:
        say(f"  cpu50: a {CPU_SMALL_GB:g} GB CPU tier is no bigger than the GPU's room ({a.gpu_gb:g} GB); written "
            "through, an LRU tier holds a subset of the GPU's chunks (inclusion), so it never hits.")
    else:
        say(f"  cpu50: a {CPU_SMALL_GB:g} GB CPU tier is bigger than the GPU's room ({a.gpu_gb:g} GB) here, so it "
            "keeps some chunks the GPU evicted and can hit.")
    say(f"  cpu_slow / cpu_fast mean TTFT: {p2['slow_vs_fast']:.1f}x (handout: {ref('slow_vs_fast', tiers)}, "
        f"pitfall 7)   gpu_only / cpu_ssd: {res['gpu_only']['mean_ttft_s'] / res['cpu_ssd']['mean_ttft_s']:.0f}x")
    print(table(["slides' LMCache benchmark", "metric", "LMCache", "engine's own offload", "ratio"],
                [list(s) for s in SLIDES], "  for reference (handout §6.3, not simulated here):"))


def print_part3(hits, a):
    same = is_handout_setup("waist", requests=DOC_REQUESTS, docs=DOCS, doc_tokens=DOC_TOKENS,
                            oneshot_tokens=ONESHOT_TOKENS, oneshot_share=ONESHOT_SHARE, cache_gb=a.doc_cache_gb)
    print()
    print(table(["policy", "document hit rate", "handout"],
                [["LRU (sees only tokens)", f"{hits['lru']:.0%}", ref("lru", same)],
                 ['hinted ("will be reused")', f"{hits['hinted']:.0%}", ref("hinted", same)]],
                f"Part 3 (§7): {DOC_REQUESTS} requests, {1 - ONESHOT_SHARE:.0%} on {DOCS} documents of "
                f"{DOC_TOKENS} tokens, {ONESHOT_SHARE:.0%} one-shot prompts of {ONESHOT_TOKENS} tokens; "
                f"cache {a.doc_cache_gb:g} GB"))
    print()
    print(table(["LLM inference stack", "classic computer system", "in this lecture's code"],
                [list(r) for r in STACK_VS_CLASSIC],
                "§7: the inference stack's layers (handout) beside the classic computer system (our reading; the table was lost)"))
    print("  what the hint needs an API to carry (exercise 10):")
    print("\n".join("    " + line for line in HINT_API_EXAMPLE.splitlines()))


def to_json(h, p2, hits, e9) -> dict:
    return {
        "exercise9": e9,
        "handoff_s": {k: v["seconds"] for k, v in h["paths"].items()},
        "configs": {name: {"hit_rate": r["hit_rate"], "hit_rate_per_tier": r["hit_rate_per_tier"],
                           "mean_ttft_s": r["mean_ttft_s"], "p50_ttft_s": r["p50_ttft_s"],
                           "p99_ttft_s": r["p99_ttft_s"], "recompute_share": r["recompute_share"]}
                    for name, r in p2["results"].items()},
        "cpu_fast_vs_slow_ttft_ratio": p2["slow_vs_fast"],
        "lru_doc_hit_rate": hits["lru"],
        "hinted_doc_hit_rate": hits["hinted"],
    }


def parse(argv):
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
    p.add_argument("--seed", type=int, default=SEED)
    a = p.parse_args(argv)
    if a.user_tokens + a.answer_tokens > 128 * 1024 // a.turns:
        fail(f"{a.turns} turns of {a.user_tokens + a.answer_tokens} tokens exceed a 128K context")
    return a


def main(argv=None):
    a = parse(argv)
    h, p2, hits = part1(), part2(a), part3(a)
    e9 = exercise9(h, p2)
    print_part1(h)
    if not a.no_plot:
        path = figure_path("05_handoff.png")
        plot_handoff(h, path)
        print(f"  figure: {path}")
    print_part2(p2, a)
    if not a.no_plot:
        path = figure_path("05_ttft_cdf.png")
        plot_ttft(p2["results"], path, MODEL, GPU)
        print(f"  figure: {path}")
    print_part3(hits, a)
    print_exercise9(e9)
    write_json(a.json, to_json(h, p2, hits, e9))


if __name__ == "__main__":
    main()

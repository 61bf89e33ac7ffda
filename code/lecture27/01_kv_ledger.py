"""01 -- the KV ledger (handout §1): how big KV is, whether fetching it beats recomputing it, whether
storing it pays.

    python code/lecture27/01_kv_ledger.py                  # every table of §1, two figures
    python code/lecture27/01_kv_ledger.py --json out.json  # + headline figures as JSON
    python code/lecture27/01_kv_ledger.py --model llama-2-7b --context 4096        # exercise 1, another model
    python code/lecture27/01_kv_ledger.py --compression 5 --recompute-context 32768  # exercise 2, other numbers

Part 1: KV bytes per token and per context for the lecture's models; one GPU's KV per day.
Part 2: LLaMA-3.1-70B on 8 x H100: recompute time (common/timemodel.py), the break-even bandwidth
        KV bytes / recompute time, fetch time from each storage tier; exercise 2 (compression).
Part 3: is storing worth it: (a) the slides' account, both readings of its total; (b) our own per
        context account.
Every figure is computed here; the "handout" column is the reference the handout prints.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ledger  # noqa: E402
from common import timemodel as tm  # noqa: E402
from common.cli import (Parser, figure_path, nonneg_float, positive_float, positive_int, fraction, say, table,  # noqa: E402
                        write_json)

K = 1024
# ---- Part 1 and exercise 1
MODEL = "llama-3.1-70b"          # the model of Parts 2-3 and of exercises 1-2
CONTEXT = 32 * K                 # exercise 1: how big is a context this long?
BYTES_PER_VALUE = 2              # BF16 / FP16
SIZE_CONTEXTS = [1 * K, 32 * K, 128 * K]
DAY_MODEL, DAY_GPU = "deepseek-r1", "MI300X"
DAY_TOKENS_PER_S = 2625          # slides p.8: one MI300X serving DeepSeek-R1, tokens/s
# ---- Part 2 and exercise 2
GPU, N_GPUS = "H100", 8
CONTEXTS = [1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K]
RECOMPUTE_CONTEXT = 16 * K       # exercise 2: "recomputing 16K tokens takes about 0.97 s"
COMPRESSION = 3.0                # exercise 2: KV compressed 3x
# ---- Part 3: the slides' economics (slides p.9) and our own account
GPU_HOUR_USD = 2.0               # slides p.9: $2 per GPU-hour
GPUS_PER_NODE = 8                # slides p.9: an 8-GPU node
STORAGE_TB_PER_NODE = 1.0        # slides p.9: 1 TB of secondary storage per node
STORAGE_USD_PER_TB_HOUR = 0.15   # slides p.9: $0.15 per TB-hour
HIT_SAVES = 0.88                 # share of a request's GPU time a hit saves (fetch and decode remain);
                                 # not on the slides: the value that turns their $0.15/$16 = 0.94% into 1.06%
HIT_RATE = 0.10                  # slides p.9: 10% of requests hit
NODES, YEARS = 1000, 3           # slides p.9
STORE_CONTEXT = 10_000           # Part 3b: "a 10K-token context"
ECON_CONTEXTS = [1 * K, 4 * K, 10_000, 32 * K, 128 * K]

# The handout's figures, printed beside ours (reference only; nothing below is computed from them)
HANDOUT = {
    "kib": {"llama-3.1-8b": "128 KiB", "llama-3.1-70b": "320 KiB", "llama-2-7b": "512 KiB",
            "deepseek-r1": "68.6 KiB", "city": "512 B (FP16)", "record": "512 B (FP16)"},
    "70b_32k": "10.7 GB", "day_tb": "15.9 TB (slides: ~15 TB)", "recompute_16k": "0.97 s",
    "breakeven": "4-6 GB/s", "ex2_gbit": "14.4 Gb/s", "breakeven_pct": "1.06%", "savings": "$33M",
    "storage": "~$4M", "navigation": "$29M", "ctx10k": ("3.3 GB", "$0.0005", "$0.0026", "0.19"),
    "ex1_per_token": "327,680 B = 320 KiB",
}
# The inputs the handout's figures hold for (a figure is printed only when the run's inputs are these)
HANDOUT_SLIDES = {"gpu_hour_usd": 2.0, "gpus_per_node": 8, "storage_tb_per_node": 1.0,
                  "storage_usd_per_tb_hour": 0.15, "hit_saves": 0.88, "hit_rate": 0.10, "nodes": 1000, "years": 3}
HANDOUT_DAY = {"model": "deepseek-r1", "tokens_per_s": 2625}
HANDOUT_STORE_CONTEXT = 10_000


# ------------------------------------------------------------------------------------- calculators
def part1(bpv, contexts):
    rows = {}
    for key, m in tm.MODELS.items():
        rows[key] = {**ledger.kv_layout(m), "tag": m.tag, "name": m.name,
                     "bytes_per_token": tm.kv_bytes_per_token(m, bpv),
                     "sizes": {n: ledger.kv_bytes(m, n, bpv) for n in contexts}}
    day = ledger.gpu_day_bytes(DAY_MODEL, DAY_TOKENS_PER_S, bpv)
    return rows, day


def part2(model, gpu, n_gpus, contexts, recompute_ctx, compression, bpv):
    rows = ledger.fetch_or_recompute(model, gpu, n_gpus, contexts, ledger.TIERS, 1.0, bpv)
    ex2 = {"context": recompute_ctx, "recompute_s": tm.prefill_time(model, gpu, recompute_ctx, 0, n_gpus),
           "raw_bytes": ledger.kv_bytes(model, recompute_ctx, bpv),
           "threshold_bytes_per_s": ledger.breakeven_bandwidth(model, gpu, recompute_ctx, n_gpus, compression, bpv)}
    return rows, ex2


def part3(a, bpv):
    slides = ledger.slides_economics(a.gpu_hour_usd, GPUS_PER_NODE, STORAGE_TB_PER_NODE, a.storage_usd_per_tb_hour,
                                 a.hit_saves, a.hit_rate, a.nodes, a.years)
    ours = [ledger.context_economics(a.model, a.gpu, a.n_gpus, n, a.gpu_hour_usd, a.storage_usd_per_tb_hour, bpv)
            for n in sorted(set(ECON_CONTEXTS + [STORE_CONTEXT]))]
    return slides, ours


# ---------------------------------------------------------------------------------------- printing
def fmt_bytes(n):
    for unit, s in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= s:
            return f"{n / s:.1f} {unit}"
    return f"{n:.0f} B"


def ctx_name(n):
    return f"{n // K}K" if n % K == 0 else f"{n / 1000:g}k"


def print_part1(rows, day, a):
    bf16 = a.bytes_per_value == 2
    print(f"\n== Part 1 (§1.2). KV size ({'BF16; FP16 for the small models' if bf16 else f'{a.bytes_per_value:g} bytes per value'}) "
          + "=" * 40)
    body = []
    for key, r in rows.items():
        heads = f"latent {r['mla_latent']}" if r["mla_latent"] else str(r["kv_heads"])
        body.append([r["name"], r["tag"], r["layers"], heads, r["head_dim"] or "-", f"{r['bytes_per_token']:,}",
                     f"{r['bytes_per_token'] / 1024:.1f}"] + [fmt_bytes(b) for b in r["sizes"].values()]
                    + [HANDOUT["kib"].get(key, "-") if bf16 else "-"])
    print(table(["model", "attention", "layers", "KV heads", "hd", "B/token", "KiB/tok"]
                + [ctx_name(n) for n in SIZE_CONTEXTS] + ["handout"], body))
    say("  (KV heads x head dim (hd) x 2 (K and V) x layers x 2 bytes; MLA caches one latent + one RoPE key per layer)")

    per_tok = tm.kv_bytes_per_token(DAY_MODEL, a.bytes_per_value)
    print(f"\nOne GPU's day (§1.2): {tm.GPUS[DAY_GPU].name} serving {tm.MODELS[DAY_MODEL].name} at {DAY_TOKENS_PER_S:,} tokens/s")
    print(table(["quantity", "ours", "handout"], [
        ["KV per token", f"{per_tok / 1024:.1f} KiB ({per_tok:,} B)",
         HANDOUT["kib"]["deepseek-r1"] if bf16 and DAY_MODEL == HANDOUT_DAY["model"] else "-"],
        ["KV per day (decimal TB)", f"{day / 1e12:.1f} TB",
         HANDOUT["day_tb"] if bf16 and (DAY_MODEL, DAY_TOKENS_PER_S) == tuple(HANDOUT_DAY.values()) else "-"],
        ["KV per day (binary TiB)", f"{day / 2**40:.1f} TiB", "-"],
    ]))

    b = tm.kv_bytes_per_token(a.model, a.bytes_per_value)
    is_ref = a.model == "llama-3.1-70b" and a.context == 32 * K and a.bytes_per_value == 2
    print(f"\nExercise 1 (§1.2, §10): {tm.MODELS[a.model].name}, {a.context:,} tokens, {a.bytes_per_value} bytes/value")
    print(table(["quantity", "ours", "handout"], [
        ["KV bytes per token", f"{b:,} B = {b / 1024:g} KiB", HANDOUT["ex1_per_token"] if is_ref else "-"],
        [f"KV of {a.context:,} tokens", fmt_bytes(b * a.context), HANDOUT["70b_32k"] if is_ref else "-"],
    ]))


def print_part2(rows, ex2, a):
    g, m = tm.GPUS[a.gpu], tm.MODELS[a.model]
    print(f"\n== Part 2 (§1.3, §1.4). Fetch or recompute: {m.name} on {a.n_gpus} x {g.name} " + "=" * 30)
    say(f"time model: MFU {tm.MFU:.3f} (fitted to {tm.ANCHOR_1GPU[0]} {tm.ANCHOR_1GPU[2]:,} tokens on 1 {tm.ANCHOR_1GPU[1]} "
        f"= {tm.ANCHOR_1GPU[4]} s), TP all-reduce efficiency {tm.TP_COMM_EFFICIENCY:.3f} (fitted to "
        f"{tm.ANCHOR_TP[0]} {tm.ANCHOR_TP[2]:,} tokens on {tm.ANCHOR_TP[3]} {tm.ANCHOR_TP[1]} = {tm.ANCHOR_TP[4]} s)")
    print("tiers: " + ", ".join(f"{k} {bw / 1e9:g} GB/s" for k, bw in ledger.TIERS.items()))
    is_ref = a.model == "llama-3.1-70b" and a.gpu == "H100" and a.n_gpus == 8
    body = []
    for r in rows:
        ref = []
        if is_ref and r["context"] == 16 * K:
            ref.append(HANDOUT["recompute_16k"])
        if is_ref and a.bytes_per_value == 2 and 4 * K <= r["context"] <= 64 * K:
            ref.append(HANDOUT["breakeven"])
        body.append([ctx_name(r["context"]), fmt_bytes(r["kv_bytes"]), f"{r['recompute_s']:.3f}",
                     f"{r['breakeven_bytes_per_s'] / 1e9:.2f}"]
                    + [f"{t:.3f}" + ("*" if t > r["recompute_s"] else " ") for t in r["fetch_s"].values()]
                    + [", ".join(ref) or "-"])
    print(table(["context", "KV", "recompute s", "break-even"] + list(ledger.TIERS) + ["handout"], body,
                "break-even: GB/s at which fetching the KV takes as long as recomputing it; then the seconds to fetch "
                "it from each tier"))
    print("  * slower than recomputing: storing it there was wasted")

    thr = ex2["threshold_bytes_per_s"]
    is_ref2 = is_ref and a.compression == 3 and a.recompute_context == 16 * K and a.bytes_per_value == 2
    print(f"\nExercise 2 (§1.4, §10): {ex2['context']:,} tokens, KV {fmt_bytes(ex2['raw_bytes'])} compressed {a.compression:g}x "
          f"-> {fmt_bytes(ex2['raw_bytes'] / a.compression)}, recompute {ex2['recompute_s']:.3f} s")
    print(table(["quantity", "ours", "handout"], [
        ["break-even bandwidth (raw KV)", f"{ex2['raw_bytes'] / ex2['recompute_s'] / 1e9:.2f} GB/s", "-"],
        ["break-even bandwidth (compressed)", f"{thr / 1e9:.2f} GB/s = {thr * 8 / 1e9:.1f} Gb/s",
         HANDOUT["ex2_gbit"] if is_ref2 else "-"],
    ]))
    if is_ref2:
        say("  (the handout's 14.4 takes the bytes of 16,000 tokens but the time of 16K = 16,384; "
            "either length alone gives the figure above)")


def print_part3(slides, ours, a):
    print("\n== Part 3 (§1.3). Is storing KV worth it? " + "=" * 47)
    print("(a) the slides' account. Assumptions:")
    print(table(["assumption", "value", "source"], [
        ["GPU price", f"${a.gpu_hour_usd:g}/GPU-hour x {GPUS_PER_NODE} GPUs = ${slides['node_usd_per_h']:g}/node-hour", "slides p.9"],
        ["storage", f"{STORAGE_TB_PER_NODE:g} TB/node at ${a.storage_usd_per_tb_hour:g}/TB-hour", "slides p.9"],
        ["a hit saves", f"{a.hit_saves:.0%} of the request's GPU time", "ours: what makes 1.06%"],
        ["hit rate, fleet, period", f"{a.hit_rate:.0%}, {a.nodes:,} nodes, {a.years:g} years = {slides['hours']:,.0f} h", "slides p.9"],
    ]))
    M = 1e6
    slides_inputs = {"gpu_hour_usd": a.gpu_hour_usd, "gpus_per_node": GPUS_PER_NODE,
                     "storage_tb_per_node": STORAGE_TB_PER_NODE, "storage_usd_per_tb_hour": a.storage_usd_per_tb_hour,
                     "hit_saves": a.hit_saves, "hit_rate": a.hit_rate, "nodes": a.nodes, "years": a.years}
    h = HANDOUT if slides_inputs == HANDOUT_SLIDES else {k: "-" for k in HANDOUT}
    print(table(["quantity", "ours", "handout"], [
        ["break-even hit rate if a hit saves 100%", f"{slides['breakeven_if_hit_saves_all']:.2%}", "-"],
        [f"break-even hit rate (a hit saves {a.hit_saves:.0%})", f"{slides['breakeven_hit_rate']:.2%}", h["breakeven_pct"]],
        ["GPU time saved (gross)", f"${slides['gpu_time_saved_usd'] / M:.1f}M", "-"],
        ["storage paid", f"${slides['storage_usd'] / M:.1f}M", h["storage"]],
        ["reading 1 (§1.3): saved net of storage", f"${slides['net_usd'] / M:.1f}M", h["savings"]],
        ["reading 2 (navigation): net read as gross, minus storage again",
         f"${slides['net_if_33m_read_as_gross_usd'] / M:.1f}M", h["navigation"]],
    ]))
    print("  The two readings disagree: the $33M of §1.3 is already net of storage; the navigation paragraph's\n"
          "  $29M subtracts the storage from it a second time.")

    m = tm.MODELS[a.model]
    print()
    say(f"(b) our account: {m.name} on {a.n_gpus} x {tm.GPUS[a.gpu].name} at ${a.gpu_hour_usd:g}/GPU-hour, "
        f"storage ${a.storage_usd_per_tb_hour:g}/TB-hour; a hit saves the recompute")
    is_ref = a.model == "llama-3.1-70b" and a.gpu == "H100" and a.n_gpus == 8 and a.bytes_per_value == 2 \
        and a.gpu_hour_usd == HANDOUT_SLIDES["gpu_hour_usd"] \
        and a.storage_usd_per_tb_hour == HANDOUT_SLIDES["storage_usd_per_tb_hour"]
    body = []
    for r in ours:
        ref = ", ".join(HANDOUT["ctx10k"]) if (is_ref and r["context"] == HANDOUT_STORE_CONTEXT) else "-"
        body.append([f"{r['context']:,}", fmt_bytes(r["kv_bytes"]), f"{r['storage_usd_per_h']:.5f}",
                     f"{r['recompute_s']:.3f}", f"{r['hit_saves_usd']:.5f}", f"{r['breakeven_hits_per_h']:.3f}",
                     f"{r['breakeven_hits_per_h'] * 168:.1f}", ref])
    print(table(["context", "KV", "storage $/h", "recompute s", "hit saves $", "break-even hits/h",
                 "hits/week", "handout"], body))
    print("  longer contexts pay off sooner: recompute grows faster than linearly (attention), storage linearly.")
    say("  (the slides' 'a cached prompt reused 2-3 times a week' depends on a request mix they do not give;"
        " this account needs the weekly hits above)")


# ----------------------------------------------------------------------------------------- figures
def plot(a, bpv):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = [2 ** i for i in range(7, 18)]  # 128 .. 128K tokens
    fig, ax = plt.subplots(figsize=(7, 4.5))
    seen = {}  # models with the same KV layout draw the same line: dash the second one
    for m in tm.MODELS.values():
        b = tm.kv_bytes_per_token(m, bpv)
        label = f"{m.name} ({m.tag.split(',')[0]})" + (f" = {seen[b]}" if b in seen else "")
        ax.plot(ctx, [ledger.kv_bytes(m, n, bpv) for n in ctx], "--" if b in seen else "-", marker=".", label=label)
        seen.setdefault(b, m.name)
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="KV bytes",
           title="KV size vs context length (handout §1.2)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7)
    p1 = figure_path("01_kv_size.png")
    fig.tight_layout(); fig.savefig(p1, dpi=120); plt.close(fig)

    ctx = [2 ** i for i in range(9, 18)]  # 512 .. 128K
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ctx, [ledger.breakeven_bandwidth(a.model, a.gpu, n, a.n_gpus, 1.0, bpv) / 1e9 for n in ctx],
            "k-o", label="break-even (raw KV)")
    ax.plot(ctx, [ledger.breakeven_bandwidth(a.model, a.gpu, n, a.n_gpus, a.compression, bpv) / 1e9 for n in ctx],
            "k--", label=f"break-even ({a.compression:g}x compressed)")
    for (name, bw), c in zip(ledger.TIERS.items(), ["C0", "C1", "C2", "C3"]):
        ax.axhline(bw / 1e9, color=c, lw=1.5, label=f"{name} ({bw / 1e9:g} GB/s)")
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="GB/s",
           title=f"A tier above the black line fetches faster than recomputing\n{tm.MODELS[a.model].name}, {a.n_gpus} x {a.gpu} (handout §1.4)")
    ax.grid(True, which="major", alpha=0.3)
    ax.set_ylim(0.5, 2000)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    p2 = figure_path("01_breakeven_bandwidth.png")
    fig.tight_layout(); fig.savefig(p2, dpi=120); plt.close(fig)
    return p1, p2


def to_json(a, bpv, sizes, day, rows, ex2, slides, ours) -> dict:
    ctx10k = next(r for r in ours if r["context"] == STORE_CONTEXT)
    return {
        # Part 1 (fixed models, whatever --model says)
        "llama31_70b_bytes_per_token": sizes["llama-3.1-70b"]["bytes_per_token"],
        "llama31_70b_32k_gb": ledger.kv_bytes("llama-3.1-70b", 32 * K, bpv) / 1e9,
        "deepseek_r1_kib_per_token": sizes["deepseek-r1"]["bytes_per_token"] / 1024,
        "gpu_day_tb": day / 1e12,
        "bytes_per_token": {k: r["bytes_per_token"] for k, r in sizes.items()},
        "ex1_bytes_per_token": tm.kv_bytes_per_token(a.model, bpv),
        "ex1_context_gb": ledger.kv_bytes(a.model, a.context, bpv) / 1e9,
        # Part 2 (--model on --n-gpus x --gpu)
        "part2_setup": {"model": a.model, "gpu": a.gpu, "n_gpus": a.n_gpus},
        "contexts": CONTEXTS,
        "recompute_16k_s": tm.prefill_time(a.model, a.gpu, 16 * K, 0, a.n_gpus),
        "breakeven_gbytes_per_s": [r["breakeven_bytes_per_s"] / 1e9 for r in rows],
        "ex2_threshold_gbit_per_s": ex2["threshold_bytes_per_s"] * 8 / 1e9,
        "mfu": tm.MFU, "tp_comm_efficiency": tm.TP_COMM_EFFICIENCY,
        # Part 3
        "slides_breakeven_hit_rate_pct": slides["breakeven_hit_rate"] * 100,
        "slides_breakeven_if_hit_saves_all_pct": slides["breakeven_if_hit_saves_all"] * 100,
        "slides_gross_savings_musd": slides["gpu_time_saved_usd"] / 1e6,
        "slides_savings_musd": slides["net_usd"] / 1e6,
        "slides_storage_musd": slides["storage_usd"] / 1e6,
        "slides_navigation_reading_musd": slides["net_if_33m_read_as_gross_usd"] / 1e6,
        "ctx10k_storage_usd_per_h": ctx10k["storage_usd_per_h"],
        "ctx10k_hit_saves_usd": ctx10k["hit_saves_usd"],
        "ctx10k_breakeven_hits_per_h": ctx10k["breakeven_hits_per_h"],
    }


def main(argv=None):
    p = Parser(__doc__)
    p.add_argument("--model", default=MODEL, choices=sorted(tm.MODELS), help="model of Parts 2-3 and exercises")
    p.add_argument("--context", type=positive_int, default=CONTEXT, help="exercise 1: context length, tokens")
    p.add_argument("--bytes-per-value", type=positive_float, default=BYTES_PER_VALUE, help="2 = BF16/FP16, 1 = 8-bit")
    p.add_argument("--gpu", default=GPU, choices=sorted(tm.GPUS))
    p.add_argument("--n-gpus", type=positive_int, default=N_GPUS, help="tensor-parallel GPUs")
    p.add_argument("--recompute-context", type=positive_int, default=RECOMPUTE_CONTEXT, help="exercise 2: tokens")
    p.add_argument("--compression", type=positive_float, default=COMPRESSION, help="exercise 2: KV compression ratio")
    p.add_argument("--gpu-hour-usd", type=positive_float, default=GPU_HOUR_USD)
    p.add_argument("--storage-usd-per-tb-hour", type=nonneg_float, default=STORAGE_USD_PER_TB_HOUR)
    p.add_argument("--hit-saves", type=fraction, default=HIT_SAVES, help="share of a request's GPU time a hit saves")
    p.add_argument("--hit-rate", type=fraction, default=HIT_RATE)
    p.add_argument("--nodes", type=positive_int, default=NODES)
    p.add_argument("--years", type=positive_float, default=YEARS)
    a = p.parse_args(argv)
    if a.hit_saves == 0:
        p.error("argument --hit-saves: must be above 0")
    bpv = a.bytes_per_value

    sizes, day = part1(bpv, SIZE_CONTEXTS)
    rows, ex2 = part2(a.model, a.gpu, a.n_gpus, CONTEXTS, a.recompute_context, a.compression, bpv)
    slides, ours = part3(a, bpv)

    print_part1(sizes, day, a)
    print_part2(rows, ex2, a)
    print_part3(slides, ours, a)
    if not a.no_plot:
        for path in plot(a, bpv):
            print(f"figure: {path}")

    write_json(a.json, to_json(a, bpv, sizes, day, rows, ex2, slides, ours))


if __name__ == "__main__":
    main()

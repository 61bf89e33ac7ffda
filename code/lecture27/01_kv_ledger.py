"""01 -- the KV ledger (handout §1): how big KV is, whether fetching it beats recomputing it, whether
storing it pays.

    python code/lecture27/01_kv_ledger.py                  # every table of §1, two figures
    python code/lecture27/01_kv_ledger.py --json out.json  # + headline figures as JSON
    python code/lecture27/01_kv_ledger.py --model llama-2-7b --context 4096        # exercise 1, another model
    python code/lecture27/01_kv_ledger.py --compression 5 --recompute-context 32768  # exercise 2, other numbers

Part 1: KV bytes per token and per context for the lecture's models; one GPU's KV per day.
Part 2: LLaMA-3.1-70B on 8 x H100: recompute time (common/timemodel.py), the break-even bandwidth
        KV bytes / recompute time, fetch time from each storage tier; the time model on one GPU (LLaMA-3.1-8B
        on an H200: full prefill, its KV from CPU memory) beside that GPU's measurement
        (common/gpu_reference.json, a reference column); exercise 2 (compression).
Part 3: is storing worth it: (a) the slides' account, both readings of its total; (b) our own per
        context account.
Every figure is computed here; the "handout" column is the reference the handout prints, the "H200
measured" column the one a real GPU gave (gpu_check.py measures yours).
"""
from __future__ import annotations

from dataclasses import dataclass

from lecture27 import ledger
from common import gpu_reference as gr
from common import timemodel as tm
from common.cli import (Parser, fraction, nonneg_float, positive_float, positive_int, settings,
                        settings_from, shipped_defaults)
from common.present import (DASH, Chart, Col, Handout, Page, Ref, Row, Series, Table, Val, chart_figure,
                            cols, fact, handout, handout_text, pct2, plural, text_table)

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
CHECK_GPU = "H200"               # the time model on one GPU, beside that GPU's measurement (common/gpu_reference.json)
CHECK_MODEL = "llama-3.1-8b"     # ... of this model (the time model's anchor)
CHECK_CONTEXTS = [1 * K, 4 * K, 12 * K, 32 * K]   # ... its full prefill at these lengths
CHECK_KV_CONTEXT = 12 * K        # ... and this context's KV copied from CPU memory to the GPU
# ---- Part 3: the slides' economics (slides p.9) and our own account
GPU_HOUR_USD = 2.0               # slides p.9: $2 per GPU-hour
GPUS_PER_NODE = 8                # slides p.9: an 8-GPU node
STORAGE_TB_PER_NODE = 1.0        # slides p.9: 1 TB of secondary storage per node
STORAGE_USD_PER_TB_HOUR = 0.15   # slides p.9: $0.15 per TB-hour
HIT_SAVES = 0.884                # share of a request's GPU time a hit saves (fetch and decode remain);
                                 # not on the slides: 0.9375% / 0.884 = 1.06%, the handout's break-even
HIT_RATE = 0.10                  # slides p.9: 10% of requests hit
NODES, YEARS = 1000, 3           # slides p.9
STORE_CONTEXT = 10_000           # Part 3b: "a 10K-token context"
ECON_CONTEXTS = [1 * K, 4 * K, 10_000, 32 * K, 128 * K]


@settings(globals())
class Settings:
    """One run's inputs: the constants above, as the command line left them (field = constant's name)."""


# The handout's figures printed beside ours, each with the inputs it holds for: a figure shows only when
# the run's settings are these. Nothing is computed from them.
BF16, L70B = {"bytes_per_value": 2}, {"model": "llama-3.1-70b", "gpu": "H100", "n_gpus": 8}  # L70B: Parts 2-3
P9 = {"gpu_hour_usd": 2.0, "gpus_per_node": 8, "storage_tb_per_node": 1.0, "storage_usd_per_tb_hour": 0.15,
      "hit_saves": 0.884, "hit_rate": 0.10, "nodes": 1000, "years": 3}   # the slides' account (p.9; 0.884 is ours)
HANDOUT = Handout({
    **{f"kib.{m}": Ref(f, BF16) for m, f in [("llama-3.1-8b", "128 KiB"), ("llama-3.1-70b", "320 KiB"), ("llama-2-7b",
       "512 KiB"), ("deepseek-r1", "68.6 KiB"), ("city", "512 B (FP16)"), ("record", "512 B (FP16)")]},
    "day_kib": Ref("68.6 KiB", {**BF16, "day_model": "deepseek-r1"}),
    "day_tb": Ref("15.9 TB (slides: ~15 TB)", {**BF16, "day_model": "deepseek-r1", "day_tokens_per_s": 2625}),
    "ex1_per_token": Ref("327,680 B = 320 KiB", {**BF16, "model": "llama-3.1-70b"}),
    "ex1_context": Ref("10.7 GB", {**BF16, "model": "llama-3.1-70b", "context": 32 * K}),
    "recompute_16k": Ref("0.97 s", L70B), "breakeven": Ref("4-6 GB/s", {**L70B, **BF16}),  # over 4K-64K tokens
    "ex2": Ref("14.4 Gb/s", {**L70B, **BF16, "compression": 3.0, "recompute_context": 16 * K},
               "it takes the bytes of 16,000 tokens but the time of 16K = 16,384; either length alone gives ours"),
    "breakeven_pct": Ref("1.06%", {k: P9[k] for k in P9 if k not in ("hit_rate", "nodes", "years")}),
    "storage": Ref("~$4M", {k: P9[k] for k in ("storage_tb_per_node", "storage_usd_per_tb_hour", "nodes", "years")}),
    "savings": Ref("$33M", P9), "navigation": Ref("$29M", P9), "ctx10k": Ref("3.3 GB, $0.0005, $0.0026, 0.19", {
        **L70B, **BF16, "gpu_hour_usd": 2.0, "storage_usd_per_tb_hour": 0.15, "store_context": 10_000}),
})
# A real GPU's measurements (common/gpu_reference.json), printed in a column of their own beside the time model for
# that GPU; a figure shows only while the run's GPU row is the one measured and the KV is BF16. Nothing is computed
# from them.
MEASURED = Handout(gr.refs(gr.H200, {"gpu": "check_gpu", "bytes_per_value": "bytes_per_value"}))


# ------------------------------------------------------------------------------------- Part 1
@dataclass(frozen=True)
class ModelKV:
    key: str
    name: str
    tag: str
    layout: ledger.Layout
    bytes_per_token: int
    sizes: dict                  # context length -> KV bytes


@dataclass(frozen=True, kw_only=True)
class Sizes:
    models: list                 # one ModelKV per model of common/timemodel.py
    day_bytes_per_token: int     # DAY_MODEL's KV per token
    day_bytes: float             # KV one DAY_GPU makes in a day
    ex1_bytes_per_token: int     # exercise 1: MODEL
    ex1_bytes: int               # exercise 1: MODEL x CONTEXT
    llama70b_32k_bytes: int      # the spec's headline, whatever MODEL is
    curve_contexts: list         # the figure's x axis
    curves: dict                 # model key -> KV bytes at each curve context


def kv_sizes(s: Settings) -> Sizes:
    bpv = s.bytes_per_value
    models = [ModelKV(k, m.name, m.tag, ledger.kv_layout(m), tm.kv_bytes_per_token(m, bpv),
                      {n: ledger.kv_bytes(m, n, bpv) for n in s.size_contexts}) for k, m in tm.MODELS.items()]
    curve = [2 ** i for i in range(7, 18)]  # 128 .. 128K tokens
    return Sizes(models=models, day_bytes_per_token=tm.kv_bytes_per_token(s.day_model, bpv),
                 day_bytes=ledger.gpu_day_bytes(s.day_model, s.day_tokens_per_s, bpv),
                 ex1_bytes_per_token=tm.kv_bytes_per_token(s.model, bpv),
                 ex1_bytes=ledger.kv_bytes(s.model, s.context, bpv),
                 llama70b_32k_bytes=ledger.kv_bytes("llama-3.1-70b", 32 * K, bpv), curve_contexts=curve,
                 curves={k: [ledger.kv_bytes(m, n, bpv) for n in curve] for k, m in tm.MODELS.items()})


# ------------------------------------------------------------------------------------- Part 2
@dataclass(frozen=True, kw_only=True)
class FetchOrRecompute:
    rows: list                   # one ledger.FetchRow per context of CONTEXTS
    recompute_16k_s: float       # the handout's 16K tokens, whatever CONTEXTS holds
    ex2_recompute_s: float       # exercise 2: RECOMPUTE_CONTEXT tokens
    ex2_raw_bytes: int
    ex2_threshold_bytes_per_s: float  # break-even bandwidth of the KV compressed COMPRESSION x
    curve_contexts: list         # the figure: break-even raw and compressed
    curve_raw: list
    curve_compressed: list


def fetch_or_recompute(s: Settings) -> FetchOrRecompute:
    m, g, n, bpv = s.model, s.gpu, s.n_gpus, s.bytes_per_value
    curve = [2 ** i for i in range(9, 18)]  # 512 .. 128K tokens
    return FetchOrRecompute(
        rows=ledger.fetch_or_recompute(m, g, n, s.contexts, bpv, 1.0),
        recompute_16k_s=tm.prefill_time(m, g, 16 * K, 0, n),
        ex2_recompute_s=tm.prefill_time(m, g, s.recompute_context, 0, n),
        ex2_raw_bytes=ledger.kv_bytes(m, s.recompute_context, bpv),
        ex2_threshold_bytes_per_s=ledger.breakeven_bandwidth(m, g, s.recompute_context, n, bpv, s.compression),
        curve_contexts=curve, curve_raw=[ledger.breakeven_bandwidth(m, g, c, n, bpv, 1.0) for c in curve],
        curve_compressed=[ledger.breakeven_bandwidth(m, g, c, n, bpv, s.compression) for c in curve])


@dataclass(frozen=True, kw_only=True)
class OneGpu:
    prefill_s: dict              # CHECK_CONTEXTS -> a full prefill of CHECK_MODEL on one CHECK_GPU
    kv_bytes: int                # CHECK_KV_CONTEXT's KV
    kv_fetch_s: float            # ... copied from pinned CPU memory over the GPU's host link
    kv_recompute_s: float        # ... recomputed instead (a full prefill of CHECK_KV_CONTEXT tokens)


def one_gpu(s: Settings) -> OneGpu:
    """The time model on one GPU: full prefill at each check context, and the check context's KV fetched from
    CPU memory (its bytes over the GPU's host link) against recomputing it."""
    m, g = s.check_model, s.check_gpu
    kv = ledger.kv_bytes(m, s.check_kv_context, s.bytes_per_value)
    return OneGpu(prefill_s={n: tm.prefill_time(m, g, n) for n in s.check_contexts}, kv_bytes=kv,
                  kv_fetch_s=ledger.fetch_time(kv, tm.GPUS[g].pcie_bw),
                  kv_recompute_s=tm.prefill_time(m, g, s.check_kv_context))


# ------------------------------------------------------------------------------------- Part 3
@dataclass(frozen=True)
class Worth:
    slides: ledger.SlidesAccount
    ours: list                   # one ledger.ContextAccount per context, ECON_CONTEXTS and STORE_CONTEXT


def is_storing_worth_it(s: Settings) -> Worth:
    slides = ledger.slides_economics(s.gpu_hour_usd, s.gpus_per_node, s.storage_tb_per_node,
                                     s.storage_usd_per_tb_hour, s.hit_saves, s.hit_rate, s.nodes, s.years)
    ours = [ledger.context_economics(s.model, s.gpu, s.n_gpus, n, s.gpu_hour_usd, s.storage_usd_per_tb_hour,
                                     s.bytes_per_value) for n in sorted({*s.econ_contexts, s.store_context})]
    return Worth(slides, ours)


# ------------------------------------------------------------------------------------- presenting
def fmt_bytes(n):
    unit, scale = next((u, x) for u, x in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 0)) if n >= x)
    return f"{n / scale:.1f} {unit}" if scale else f"{n:.0f} B"


def ctx_name(n):
    return f"{n // K}K" if n % K == 0 else f"{n / 1000:g}k"


def quantities(title: str, section: str, source: str, *rows, notes=()) -> Table:
    """A table of (quantity, our value, the handout's figure or "-") rows."""
    return Table(title=title, section=section, cols=cols("quantity", "ours"), rows=[fact(q, v, handout=h) for q, v,
                                                                                    h in rows], source=source,
                 notes=list(notes))


def show_sizes(page: Page, r: Sizes, s: Settings) -> None:
    bpv, by, b = s.bytes_per_value, {m.key: m for m in r.models}, r.ex1_bytes_per_token
    size = plural(bpv, "byte", "{:g}")         # of one value: "2 bytes", "1 byte"
    page.part("Part 1", "§1.2", "KV size (" + ("BF16; FP16 for the small models" if bpv == 2 else
                                              f"{size} per value") + ")")
    page.table(Table(title="", section="§1.2", cols=cols("model", "attention", "layers", "KV heads", "hd", ("B/token",
                                                                                                            "{:,}",
                                      "bytes_per_token.{row}"), ("KiB/tok", "{:.1f}"),
                                      *[(ctx_name(n), fmt_bytes) for n in s.size_contexts]),
                     rows=[Row([m.name, m.tag, m.layout.layers, m.layout.kv_heads or f"latent {m.layout.mla_latent}",
                           m.layout.head_dim, m.bytes_per_token, m.bytes_per_token / 1024, *m.sizes.values()],
                          handout(HANDOUT, f"kib.{m.key}",
                                  s), m.key) for m in r.models], source="01_kv_ledger.kv_sizes",
                     notes=[f"(KV heads x head dim (hd) x 2 (K and V) x layers x {size}; MLA caches one latent + one "
                      "RoPE key per layer)"], json={"llama31_70b_bytes_per_token": by["llama-3.1-70b"].bytes_per_token,
                                                "llama31_70b_32k_gb": r.llama70b_32k_bytes / 1e9,
                                                "deepseek_r1_kib_per_token": by["deepseek-r1"].bytes_per_token / 1024}))
    tok, day = r.day_bytes_per_token, r.day_bytes
    page.table(quantities(f"\nOne GPU's day (§1.2): {tm.GPUS[s.day_gpu].name} serving {tm.MODELS[s.day_model].name} "
                          f"at {s.day_tokens_per_s:,} tokens/s", "§1.2", "ledger.gpu_day_bytes",
                          ("KV per token", f"{tok / 1024:.1f} KiB ({tok:,} B)", handout(HANDOUT, "day_kib", s)),
                          ("KV per day (decimal TB)", Val(f"{day / 1e12:.1f} TB", "gpu_day_tb", json=day / 1e12),
                           handout(HANDOUT, "day_tb", s)),
                          ("KV per day (binary TiB)", f"{day / 2**40:.1f} TiB", DASH)))
    page.exercise(1, "§1.2", f"{tm.MODELS[s.model].name}, {s.context:,} tokens, {size}/value")
    page.table(quantities("", "§1.2", "01_kv_ledger.kv_sizes", ("KV bytes per token", Val(
        f"{b:,} B = {b / 1024:g} KiB", "ex1_bytes_per_token", json=b), handout(HANDOUT, "ex1_per_token", s)),
        (f"KV of {s.context:,} tokens", Val(fmt_bytes(r.ex1_bytes), "ex1_context_gb", json=r.ex1_bytes / 1e9),
         handout(HANDOUT, "ex1_context", s))))
    first = {}   # models with the same KV layout draw the same line: the second one dashed, "= the first"
    lines = [Series(r.curve_contexts, r.curves[m.key], f"{m.name} ({m.tag.split(',')[0]})"
                    + ("" if f == m.name else f" = {f}"), style={"ls": "-" if f == m.name else "--", "marker": "."})
             for m in r.models for f in [first.setdefault(m.bytes_per_token, m.name)]]
    chart_figure(page, "01_kv_size.png", Chart(series=lines, xlabel="context length (tokens)", ylabel="KV bytes",
                                               title="KV size vs context "
                 "length (handout §1.2)", xscale="log", yscale="log", legend={"fontsize": 7}))


def row_handout(n: int, s: Settings) -> str:
    """The handout's figures beside the row of n tokens: 0.97 s at 16K, 4-6 GB/s over 4K-64K."""
    refs = [handout(HANDOUT, "recompute_16k", s) if n == 16 * K else DASH,
            handout(HANDOUT, "breakeven", s) if 4 * K <= n <= 64 * K else DASH]
    return ", ".join(h.figure for h in refs if h != DASH) or DASH


def show_one_gpu(page: Page, r: OneGpu, s: Settings) -> None:
    """The time model on one GPU beside that GPU's measurement: a reference column, blank where the run's GPU row,
    model, length or bytes per value are not the ones measured."""
    g, m, n = tm.GPUS[s.check_gpu], tm.MODELS[s.check_model].name, s.check_kv_context
    keys = {x: gr.row_key("prefill", s.check_model, x) for x in r.prefill_s}
    kv = {memory: gr.row_key("kv", s.check_model, n, memory=memory) for memory in ("pinned", "pageable")}
    row = lambda label, ms, key: Row([label, ms, handout_text(handout(MEASURED, key, s))], key=key)  # noqa: E731
    rows = [row(f"full prefill, {x:,} tokens", 1e3 * t, keys[x]) for x, t in r.prefill_s.items()]
    rows += [row(f"its KV of {n:,} tokens ({fmt_bytes(r.kv_bytes)}), pinned CPU memory -> GPU", 1e3 * r.kv_fetch_s,
                 kv["pinned"]),
             row("the same from pageable CPU memory", None, kv["pageable"])]
    page.table(Table(title=f"The time model on one GPU: {m} on one {s.check_gpu} ({g.bf16_flops / 1e12:,.0f} TFLOP/s "
                           f"BF16 at MFU {tm.MFU:.3f}, host link {g.pcie_bw / 1e9:g} GB/s), beside a measurement",
                     section="§1.4", cols=[Col("one GPU", left=True), Col(f"time model, {s.check_gpu} (ms)", ms_text,
                                                                          "one_gpu_timemodel_s.{row}", 1e-3),
                                           Col(gr.H200.label, left=True, reference=True)],
                     rows=rows, source="01_kv_ledger.one_gpu",
                     notes=[f"On the time model, fetching the {n:,} tokens' KV from pinned CPU memory takes "
                            f"{r.kv_fetch_s / r.kv_recompute_s:.1%} of recomputing it. The model has one host-link "
                            "rate; pageable memory has another, slower one (gpu_check.py measures yours)."]))


def ms_text(ms) -> str:
    """Milliseconds: 1,260, 360, 24.8 (None: -)."""
    return DASH if ms is None else f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def show_fetch_or_recompute(page: Page, r: FetchOrRecompute, one: OneGpu, s: Settings) -> None:
    a1, tp, m = tm.ANCHOR_1GPU, tm.ANCHOR_TP, tm.MODELS[s.model].name
    page.part("Part 2", "§1.3, §1.4", f"Fetch or recompute: {m} on {s.n_gpus} x {tm.GPUS[s.gpu].name}")
    page.say(f"time model: MFU {tm.MFU:.3f} (fitted to {a1[0]} {a1[2]:,} tokens on 1 {a1[1]} = {a1[4]} s), TP "
             f"all-reduce efficiency {tm.TP_COMM_EFFICIENCY:.3f} (fitted to {tp[0]} {tp[2]:,} tokens on {tp[3]} "
             f"{tp[1]} = {tp[4]} s)")
    page.say("tiers: " + ", ".join(f"{k} {bw / 1e9:g} GB/s" for k, bw in ledger.TIERS.items()))
    page.data(mfu=tm.MFU, tp_comm_efficiency=tm.TP_COMM_EFFICIENCY,
              part2_setup={"model": s.model, "gpu": s.gpu, "n_gpus": s.n_gpus})
    page.table(Table(title="break-even: GB/s at which fetching the KV takes as long as recomputing it; then the "
                           "seconds to fetch it from each tier", section="§1.4",
                     cols=cols(("context", ctx_name, "contexts"), ("KV", fmt_bytes),
                     ("recompute s", "{:.3f}"), ("break-even", "{:.2f}", "breakeven_gbytes_per_s"), *ledger.TIERS),
                     rows=[Row([x.context, x.kv_bytes, x.recompute_s, x.breakeven_bytes_per_s / 1e9]
                          + [f"{t:.3f}" + ("*" if t > x.recompute_s else " ") for t in x.fetch_s.values()],
                          row_handout(x.context, s)) for x in r.rows], source="ledger.fetch_or_recompute",
                     notes=["* slower than recomputing: storing it there was wasted"],
                     json={"recompute_16k_s": r.recompute_16k_s}))
    show_one_gpu(page, one, s)
    raw, thr, c = r.ex2_raw_bytes, r.ex2_threshold_bytes_per_s, s.compression
    page.exercise(2, "§1.4", f"{s.recompute_context:,} tokens, KV {fmt_bytes(raw)} compressed {c:g}x -> "
                             f"{fmt_bytes(raw / c)}, recompute {r.ex2_recompute_s:.3f} s")
    page.table(quantities("", "§1.4", "ledger.breakeven_bandwidth", ("break-even bandwidth (raw KV)",
                          f"{raw / r.ex2_recompute_s / 1e9:.2f} GB/s", DASH), ("break-even bandwidth (compressed)", Val(
                              f"{thr / 1e9:.2f} GB/s = {thr * 8 / 1e9:.1f} Gb/s", "ex2_threshold_gbit_per_s",
                              json=thr * 8 / 1e9), handout(HANDOUT, "ex2", s))))
    gbps = lambda xs: [x / 1e9 for x in xs]
    chart_figure(page, "01_breakeven_bandwidth.png", Chart(
        series=[Series(r.curve_contexts, gbps(r.curve_raw), "break-even (raw KV)", style={"color": "k", "marker": "o"}),
         Series(r.curve_contexts, gbps(r.curve_compressed), f"break-even ({c:g}x compressed)",
                style={"color": "k", "ls": "--"})],
        xlabel="context length (tokens)", ylabel="GB/s",
        title=f"A tier above the black line fetches faster than recomputing\n{m}, {s.n_gpus} x {s.gpu} (handout §1.4)",
        xscale="log", yscale="log", axes={"ylim": (0.5, 2000)},
        hlines=[(bw / 1e9, {"color": f"C{i}", "lw": 1.5, "label": f"{name} ({bw / 1e9:g} GB/s)"})
                for i, (name, bw) in enumerate(ledger.TIERS.items())],
        legend=dict(fontsize=7, loc="upper center", ncol=2)))


def show_slides_account(page: Page, acct: ledger.SlidesAccount, s: Settings) -> None:
    page.part("Part 3", "§1.3", "Is storing KV worth it?")
    src = lambda names, said="slides p.9": said if all(getattr(s, k) == P9[k] for k in names.split()) else "edited"
    page.table(text_table("(a) the slides' account. Assumptions:", "§1.3", ["assumption", "value", "source"], [
        ("GPU price", f"${s.gpu_hour_usd:g}/GPU-hour x {s.gpus_per_node} GPUs = ${acct.node_usd_per_h:g}/node-hour",
         src("gpu_hour_usd gpus_per_node")),
        ("storage", f"{s.storage_tb_per_node:g} TB/node at ${s.storage_usd_per_tb_hour:g}/TB-hour",
         src("storage_tb_per_node storage_usd_per_tb_hour")),
        ("a hit saves", f"{s.hit_saves:.0%} of the request's GPU time",
         src("hit_saves", f"ours: what makes {pct2(acct.breakeven_hit_rate)}")),   # the break-even below
        ("hit rate, fleet, period", f"{s.hit_rate:.0%}, {s.nodes:,} nodes, {s.years:g} years = {acct.hours:,.0f} h",
         src("hit_rate nodes years"))], "ledger.slides_economics"))
    pct = lambda key, x: Val(f"{x:.2%}", key, json=x * 100)
    usd = lambda key, x: Val(f"${x / 1e6:.1f}M", key, json=x / 1e6)
    h = {k: handout(HANDOUT, k, s) for k in ("breakeven_pct", "storage", "savings", "navigation")}
    net, nav = ((h["savings"].figure, h["navigation"].figure) if h["savings"] != DASH else
                (usd(None, acct.net_usd).value, usd(None, acct.net_if_33m_read_as_gross_usd).value))
    page.table(quantities("", "§1.3", "ledger.slides_economics", (
        "break-even hit rate if a hit saves 100%", pct("slides_breakeven_if_hit_saves_all_pct",
                                                       acct.breakeven_if_hit_saves_all), DASH),
        (f"break-even hit rate (a hit saves {s.hit_saves:.0%})", pct("slides_breakeven_hit_rate_pct",
                                                                    acct.breakeven_hit_rate), h["breakeven_pct"]),
        ("GPU time saved (gross)", usd("slides_gross_savings_musd", acct.gpu_time_saved_usd), DASH),
        ("storage paid", usd("slides_storage_musd", acct.storage_usd), h["storage"]),
        ("reading 1 (§1.3): saved net of storage", usd("slides_savings_musd", acct.net_usd), h["savings"]),
        ("reading 2 (navigation): net read as gross, minus storage again",
         usd("slides_navigation_reading_musd", acct.net_if_33m_read_as_gross_usd), h["navigation"]),
        notes=[f"The two readings disagree: reading 1's {net} (§1.3's way) is already net of storage; reading 2's "
               f"{nav} (the navigation paragraph's way) subtracts the storage from it a second time."
               if acct.storage_usd else
               "The two readings agree: storage costs nothing here."]))


def show_own_account(page: Page, ours: list, s: Settings) -> None:
    hits = [x.breakeven_hits_per_h for x in ours]
    notes = ["storage costs nothing here: any hit pays for it, at every context length." if not any(hits) else
             "longer contexts pay off sooner: recompute grows faster than linearly (attention), storage linearly."
             if all(h1 > h2 for h1, h2 in zip(hits, hits[1:])) else
             "longer contexts do not pay off sooner here: the break-even hits/h do not fall with the length."]
    if handout(HANDOUT, "breakeven_pct", s) != DASH:   # the slides' claim, beside the weekly hits of this account
        notes.append("(the slides' 'a cached prompt reused 2-3 times a week' depends on a request mix they do not "
                     "give; this account needs the weekly hits above)")
    ctx10k = lambda x, k: Val(getattr(x, k), f"ctx10k_{k}" if x.context == s.store_context else None)
    page.table(Table(title=f"\n(b) our account: {tm.MODELS[s.model].name} on {s.n_gpus} x {tm.GPUS[s.gpu].name} at "
                     f"${s.gpu_hour_usd:g}/GPU-hour, storage ${s.storage_usd_per_tb_hour:g}/TB-hour; a hit saves the "
                     "recompute", section="§1.3", cols=cols(("context", "{:,}"), ("KV", fmt_bytes), ("storage $/h",
                                                                                                     "{:.5f}"),
                     ("recompute s", "{:.3f}"), ("hit saves $", "{:.5f}"), ("break-even hits/h", "{:.3f}"),
                     ("hits/week", "{:.1f}")),
                     rows=[Row([x.context, x.kv_bytes, ctx10k(x, "storage_usd_per_h"), x.recompute_s,
                           ctx10k(x, "hit_saves_usd"), ctx10k(x, "breakeven_hits_per_h"), x.breakeven_hits_per_h * 168],
                          handout(HANDOUT, "ctx10k", s) if x.context == s.store_context else DASH) for x in ours],
                     source="ledger.context_economics", notes=notes))


# ------------------------------------------------------------------------------------- the run
def parse(argv) -> tuple:
    """(this run's Settings, the defaults' Settings, the parsed command line)."""
    p = Parser(__doc__)
    p.add_argument("--model", default=MODEL, choices=sorted(tm.MODELS), help="model of Parts 2-3 and exercises")
    p.add_argument("--context", type=positive_int, default=CONTEXT, help="exercise 1: context length, tokens")
    p.add_argument("--bytes-per-value", type=positive_float, default=BYTES_PER_VALUE, help="2 = BF16/FP16, 1 = 8-bit")
    p.add_argument("--gpu", default=GPU, choices=sorted(tm.GPUS), help="GPU of Parts 2-3 and exercises")
    p.add_argument("--n-gpus", type=positive_int, default=N_GPUS, help="tensor-parallel GPUs")
    p.add_argument("--recompute-context", type=positive_int, default=RECOMPUTE_CONTEXT, help="exercise 2: tokens")
    p.add_argument("--compression", type=positive_float, default=COMPRESSION, help="exercise 2: KV compression ratio")
    p.add_argument("--check-gpu", default=CHECK_GPU, choices=sorted(tm.GPUS),
                   help="Part 2: the GPU of the time model set beside a real GPU's measurement")
    p.add_argument("--gpu-hour-usd", type=positive_float, default=GPU_HOUR_USD, help="Part 3: $ per GPU-hour")
    p.add_argument("--storage-usd-per-tb-hour", type=nonneg_float, default=STORAGE_USD_PER_TB_HOUR,
                   help="Part 3: $ per TB-hour of storage")
    p.add_argument("--hit-saves", type=fraction, default=HIT_SAVES, help="share of a request's GPU time a hit saves")
    p.add_argument("--hit-rate", type=fraction, default=HIT_RATE, help="Part 3: share of requests that hit")
    p.add_argument("--nodes", type=positive_int, default=NODES, help="Part 3: nodes in the fleet")
    p.add_argument("--years", type=positive_float, default=YEARS, help="Part 3: years the fleet runs")
    a = p.parse_args(argv)
    if a.hit_saves == 0:
        p.error("argument --hit-saves: must be above 0")
    return settings_from(Settings, a, globals()), shipped_defaults(Settings, globals()), a


def main(argv=None) -> Page:
    s, defaults, a = parse(argv)
    page = Page("01", "The KV ledger", "§1", s, defaults, plot=not a.no_plot)
    sizes, fetch, worth = kv_sizes(s), fetch_or_recompute(s), is_storing_worth_it(s)
    show_sizes(page, sizes, s)
    show_fetch_or_recompute(page, fetch, one_gpu(s), s)
    show_slides_account(page, worth.slides, s)
    show_own_account(page, worth.ours, s)
    page.finish(a.json)
    return page


if __name__ == "__main__":
    main()

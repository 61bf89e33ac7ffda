"""04 -- CacheBlend (handout §5): reusing chunks' KV that are not a prefix, and recomputing the few
tokens that matter.

    python code/lecture27/04_cacheblend.py                    # the record world and the time model, figures
    python code/lecture27/04_cacheblend.py --chunk-len 6      # exercise 6 in the main table: no record is split
    python code/lecture27/04_cacheblend.py --ratio 0.1        # another recompute ratio
    python code/lecture27/04_cacheblend.py --locality 0       # a record model trained without the locality
                                                              # penalty: insight 1 disappears (~80 s to train)
    python code/lecture27/04_cacheblend.py --layers 32 --read-ms 10 --prefill-ms 20   # exercise 8
    python code/lecture27/04_cacheblend.py --json out.json
    python code/lecture27/04_cacheblend.py --model smollm2    # Part 5 only: a real LLaMA (SmolLM2-135M)
    python code/lecture27/04_cacheblend.py --model smollm2 --curve   # every selection rule at 5-50%, the oracle
    python code/lecture27/04_cacheblend.py --model smollm2 --passages code/lecture27/passages_example.json
    python code/lecture27/04_cacheblend.py --model smollm2 --curve --passages code/lecture27/passages_six.json

In the handout's order:
§5.1    Part 0: prefix caching is not enough (prefix_caching.py, time model): RAG with k = 1..10 chunks of
        512 tokens + a 32-token question on LLaMA-7B (1 x A40) and LLaMA-70B (2 x A40), the KV in CPU memory
        or on NVMe: TTFT of full prefill, prefix caching (only the first chunk is a prefix), full reuse and
        CacheBlend (MIN_RATIO, pipelined as in Part 4), and the share of full prefill's GPU time each saves.
        Exercise 5: a chunk's K computed at 0 and rotated to 1000 vs computed at 1000, V unchanged, and
        full reuse with the K left unrotated (the city model).
§5.2    Part 1: the city language, 3 chunks x 8 tokens + an 8-token question: full prefill vs full KV
        reuse (each chunk precomputed alone, K moved by shift_kv). Sentences are independent: no loss.
§5.2-3  Part 2: the record world (blend_world.py), chunks of 5: accuracy on split and unsplit records
        under full prefill, full reuse, CacheBlend and a random selection of the same size.
        Exercise 6: how many records chunk length 6 splits, and full reuse's accuracy there.
§5.3    Part 3: the two insights (deviation is concentrated; adjacent layers agree), layer 0's picks,
        shorter chunks, and the compute-quality curve. The deviation is concentrated because document
        tokens attend almost only to themselves (and a value to its key): the record model learned that
        locality from a small penalty (record_trainer.LOCALITY), as a pretrained LLM learns it from language.
        The pitfall of the released blenders (mask_pitfall.py): the recomputed tokens' causal mask aligned
        to the bottom right, against blend's position mask. Exercise 7: the check's cost at layer 0 vs
        layer 1 (time model).
§5.4    Part 4: hiding recompute behind loading, from common/timemodel.py: per layer load vs recompute
        per storage device, the controller's ratio, pipelined TTFT; LLaMA-7B vs 70B; requests/s of a
        busy server, full prefill vs CacheBlend (the paper's 2.8-5x throughput); the controller
        (loading_controller.py) also says when not to reuse: a read slower than the layer's prefill means a
        full prefill, or the fastest device that still pays. Exercise 8.
Part 5 (--model smollm2 and the flags of its own group; blend_real.py): the same blend() on
        SmolLM2-135M-Instruct, RAG items of 6 chunks x 256 tokens + the question (or --passages FILE: your
        own, one chunk per passage): KL to full prefill of CacheBlend (REAL_RULE), random and an oracle at
        15% (cached), each selection rule's measured CPU TTFT at 15% (live), greedy answers, the two
        insights on a real model; §5.1 measured (k = 2, 4, 6 chunks: TTFT on one thread and KL of prefix
        caching, full reuse, CacheBlend) and the mask pitfall's KL (prefix_caching.measured, cached); where
        the rule's distance from full prefill comes from: its ranking (rule -> ranking oracle) or recomputing
        from a partly stale cache (ranking oracle -> patch oracle).
        --curve: KL vs recompute ratio for every selection rule of blend() (blend_rules.RULES), random and
        the two oracles, and a figure; every rule's ranking oracle; the built-in items with shorter chunks;
        a rule whose count adapts to the input beside flat.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# Every name 04 takes from the record world's library and from the real-model study, imported here only
import blend_real as br  # noqa: E402
import loading_controller as lc  # noqa: E402
import mask_pitfall as mp  # noqa: E402
import prefix_caching as pc  # noqa: E402
import record_trainer as rt  # noqa: E402  (rt.SEED, rt.LOCALITY: the trainer's defaults, read when parsing)
from blend_rules import RULES, Random  # noqa: E402
from blend_world import (DOC_LEN, N_RECORDS, PROGRESSIVE, accuracy, answer_correct, answer_slots, blend,  # noqa: E402
                         full_prefill, full_reuse, heldout, kv_deviation, precompute_chunks, spearman, split_mask,
                         split_records, top_share)
from record_trainer import doc_attention_elsewhere, plot_training, record_model  # noqa: E402
from common import checkpoints, timemodel as tm  # noqa: E402
from common.checkpoints import TrainingFailed  # noqa: E402
from common.city import city_model  # noqa: E402
from common.cli import (Parser, fail, fraction, nonneg_float, positive_float, positive_int,  # noqa: E402
                        settings_from, shipped_defaults)
from common.llama import KVCache, idle_threads, kl_divergence, shift_kv, single_thread  # noqa: E402
from common.present import (  # noqa: E402
    DASH, REFERENCE, Chart, Col, Field, Handout, Page, Ref, Row, Series, Table, Val, change, chart_figure, cols, fact,
    handout_text, points, refs, table_of)

# ---- §5.1 (Part 0): prefix caching against full reuse and CacheBlend, k retrieved chunks (of Part 4's RAG size)
PREFIX_KS = list(range(1, 11))            # k chunks of RAG_CHUNK_TOKENS + the question; CacheBlend at MIN_RATIO
PREFIX_DEVICES = ["CPU RAM", "NVMe SSD"]  # where the chunks' KV is kept (of DEVICES); JSON *_ttft_s: the last one
# ---- §5.1-5.2: the city language (exercise 5 and Part 1)
CITY_CHUNKS, CITY_CHUNK_LEN = 3, 8        # 3 chunks x 8 tokens, then an 8-token question
CITY_DOCS = 1000
EX5_SHIFT = 1000                          # exercise 5: move a chunk's KV from position 0 to this position
# ---- §5.2-5.3: the record world (Parts 2-3, exercise 6)
CHUNK_LEN = 5                             # odd: the records whose values sit at positions 5 and 15 are split
RATIO = 0.20                              # CacheBlend's recompute ratio r
N_DOCS = 1000                             # held-out documents (x 12 questions; 2,000 on split records)
EX6_CHUNK_LEN = 6                         # exercise 6: an even chunk length
TOP_SHARE = 0.15                          # "the top 15% of tokens hold ... of the deviation"
CURVE_RATIOS = [0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0]   # the curve also gets r (--ratio)
CURVE_CHUNK_LENS = [3, 5]                 # the curve's chunk lengths (the one of Part 2 is precomputed once)
RECOVER = 0.99                            # "the lowest ratio recovering 99% of split records"
# ---- §5.4 (Part 4, exercises 7-8): RAG with 6 chunks x 512 tokens + a 32-token question on A40
RAG_CHUNKS, RAG_CHUNK_TOKENS, RAG_QUESTION = 6, 512, 32
GPU = "A40"
MIN_RATIO = 0.15                          # CacheBlend: never recompute less than 15% (quality floor, §5.4)
SYSTEMS = [("llama-2-7b", 1), ("llama-3.1-70b", 2)]  # (model, A40s): the slides' 70B runs on 2 x A40
DEVICES = {  # storage device -> read bandwidth, bytes/s
    # pinned CPU memory over each GPU's PCIe 4.0 x16 link (timemodel's A40 pcie_bw, 32 GB/s each way)
    "CPU RAM": ("per_gpu", tm.GPUS[GPU].pcie_bw),
    # CacheBlend §7: NVMe read of one LLaMA-7B layer's 4K-token KV (64 MiB) in about 16 ms -> ~4 GB/s
    "NVMe SSD": ("shared", 4.2e9),
    # a SATA SSD: the SATA III link is 6 Gb/s, about 0.55 GB/s of data after 8b/10b coding
    "SATA SSD": ("shared", 0.55e9),
}
PAPER_CONTEXT, PAPER_RATIO, PAPER_DEVICE = 4096, 0.15, "NVMe SSD"   # CacheBlend's per-layer example
EX8_LAYERS, EX8_READ_MS, EX8_PREFILL_MS = 32, 10.0, 20.0            # exercise 8: the controller's inputs
# ---- Part 5: the real model (blend_real.py)
REAL_ITEMS = 4                            # RAG items (of 8); their KL is cached, the TTFT measured live
REAL_CHUNK_TOKENS = 256                   # tokens per retrieved chunk (6 chunks + the question per item)
REAL_RATIO = 0.15                         # CacheBlend's default recompute ratio
REAL_RULE = "flat"                        # blend()'s selection rule: the lowest KL at 15%, all input sets (--curve)
REAL_CURVE_RATIOS = [0.05, 0.15, 0.30, 0.50]  # --curve: every rule, random and the two oracles at these ratios
REAL_SHORT_CHUNKS = [64, 128]             # --curve, built-in items: also cut to these chunk lengths (as --passages')
ADAPTIVE_TARGETS = [0.5, 0.7, 0.85]       # --curve: the adaptive rule keeps the smallest set holding these shares
ADAPTIVE_LAYER = 1                        # ... of the deviation measured at this layer (computed in full up to it)
ADAPTIVE_FLOOR = 0.05                     # ... and never fewer than this ratio of the tokens
REAL_TTFT_ITEMS = 1                       # inputs whose TTFT is measured live (a full prefill: ~5.5 s, one thread)
REAL_PREFIX_KS = [2, 4, 6]                # §5.1 on SmolLM2: k chunks of REAL_CHUNK_TOKENS (cached with its TTFT)
REAL_PREFIX_ITEMS = 2                     # built-in items measured at each k (about a minute on one idle core)


@dataclass(frozen=True)
class Settings:
    """One run's settings: the constants above, as the command line set them."""
    city_chunks: int
    city_chunk_len: int
    city_docs: int
    ex5_shift: int
    chunk_len: int
    ratio: float
    docs: int
    ex6_chunk_len: int
    top_share: float
    curve_ratios: tuple
    curve_chunk_lens: tuple
    recover: float
    seed: int
    locality: float
    retrain: bool
    prefix_ks: tuple
    prefix_devices: tuple
    rag_chunks: int
    rag_chunk_tokens: int
    rag_question: int
    gpu: str
    min_ratio: float
    systems: tuple                  # ((model, n_gpus), ...)
    devices: dict
    paper_context: int
    paper_ratio: float
    paper_device: str
    layers: int
    read_ms: float
    prefill_ms: float
    model: str                      # "record": Parts 1-4; "smollm2": Part 5
    gguf: str | None
    items: int
    rule: str
    passages: str | None
    chunk_tokens: int
    real_ratio: float
    real_curve_ratios: tuple
    real_short_chunks: tuple
    adaptive_targets: tuple
    adaptive_layer: int
    adaptive_floor: float
    real_ttft_items: int
    real_prefix_ks: tuple
    real_prefix_items: int
    curve: bool
    recompute: bool


def handout_figures() -> Handout:
    """The handout's figures, printed beside ours (reference only; nothing is computed from them), each
    with the inputs it holds for: a figure is shown only when the run's settings have these values."""
    c5, c5r20 = {"chunk_len": 5}, {"chunk_len": 5, "ratio": 0.20}
    rag = {"gpu": "A40", "rag_chunks": 6, "rag_chunk_tokens": 512, "rag_question": 32}
    paper = {"gpu": "A40", "paper_context": 4096, "paper_ratio": 0.15, "paper_device": "NVMe SSD"}
    b7, b70 = {"system": ("llama-2-7b", 1)}, {"system": ("llama-3.1-70b", 2)}   # a row's (model, A40s)
    return Handout({
        **refs({"city_chunks": 3, "city_chunk_len": 8},
               {"city_ce_full": "0.6940", "city_ce_reuse": "0.6941", "city_kl": "0.00003"}),
        "train": Ref("12,000 steps, ~6 min, drop near step 5,000"),
        **refs(c5, {"split_full": "100.0%", "split_reuse": "8.8%", "unsplit_reuse": "unaffected",
                    "rank_corr": "0.88-0.93"}),
        **refs(c5r20, {"split_random": "21.0%", "blend_c5": "99.4%", "layer0_coverage": "99.0%"}),
        "blend_c3": Ref("81.0%", {"chunk_len": 3, "ratio": 0.20}),
        **refs({"ex6_chunk_len": 6}, {"ex6_split": "0", "ex6_reuse": "100%"}),
        "top_share": Ref("98.0%", {**c5, "top_share": 0.15}),
        "nvme_vs_recompute llama-2-7b": Ref("~1x (NVMe almost as slow)", {**rag, **b7}),
        "nvme_vs_recompute llama-3.1-70b": Ref("4.6x", {**rag, **b70}),
        **refs({**paper, **b7}, {"paper_recompute llama-2-7b": "~3", "paper_load llama-2-7b": "~16"}),
        **refs({**paper, **b70}, {"paper_recompute llama-3.1-70b": "~7", "paper_load llama-3.1-70b": "~4"}),
        **refs({**rag, "min_ratio": 0.15}, {"ttft_speedup": "2.2-3.3x", "throughput": "2.8-5x"}),
        "prefix_fewer": Ref("the more chunks, the less"),
        "blend_recompute": Ref("recomputes ~15%", {"min_ratio": 0.15}),
        **refs({"layers": 32, "read_ms": 10.0, "prefill_ms": 20.0, "min_ratio": 0.15},
               {"ex8_choice": "blend", "ex8_ratio": "50%", "ex8_ttft_ms": "~320"}),
        "ex8_full_ms": Ref("640", {"layers": 32, "prefill_ms": 20.0}),
        "real_ttft": Ref("2.2-3.3x", {"real_ratio": 0.15})})


HANDOUT = handout_figures()


def h(name: str, s: Settings, **row) -> Ref | str | None:
    """The handout's figure `name` for this run: its Ref, "-" where the run's inputs are not the ones it holds
    for, None where the handout has no such figure. `row`: inputs a row changes (its chunk length, its system)."""
    if name not in HANDOUT.refs:
        return None
    return HANDOUT(name, {**dataclasses.asdict(s), **row} if row else s) or DASH


def number(ref: Ref) -> float:
    """A handout figure as a number: "21.0%" -> 0.21, "~7" -> 7.0."""
    x = ref.figure.strip("~x")
    return float(x.rstrip("%")) / 100 if x.endswith("%") else float(x)


def pct(x):
    return DASH if x is None else f"{100 * x:.1f}%"


def pcts(xs):
    return " ".join(pct(x) for x in xs)


def pk(r: float) -> str:
    """A ratio as the JSON keys name it: 0.2 -> "20" (split_acc_blend20), 0.125 -> "12.5"."""
    return f"{100 * r:.6g}"


def show(page: Page, t: Table) -> None:
    """A table on the page, a blank line before it unless it follows a heading."""
    if page.blocks and page.blocks[-1]["kind"] not in ("part", "exercise"):
        print()
    page.table(t)


def above(x: float, y: float) -> str:
    return "above" if x > y else "below" if x < y else "at"


# ============================================================================ §5.1 Part 0: prefix caching
HOWS = ("prefix", "reuse", "blend")       # the three ways to use stored KV against k chunks


def part0_prefix(s: Settings, page: Page) -> pc.PrefixStudy:
    """§5.1 on the time model: prefix caching, full reuse and CacheBlend against k chunks (prefix_caching.py)."""
    st = pc.time_model(s.systems, s.gpu, {d: s.devices[d] for d in s.prefix_devices}, s.prefix_ks,
                       s.rag_chunk_tokens, s.rag_question, s.min_ratio)
    page.part("Part 0", "§5.1", f"Prefix caching is not enough: k retrieved chunks, only the first a prefix "
                                f"({s.gpu}, time model)")
    for m, x in st.systems.items():
        by = {how: getattr(x, f"{how}_ttft_s") for how in HOWS}      # method -> device -> TTFT per k
        rows = [Row([k, 1e3 * x.full_ttft_s[i], *[1e3 * by[how][d][i] for how in HOWS for d in st.devices]])
                for i, k in enumerate(st.ks)]
        show(page, Table(f"{tm.get_model(m).name} ({tm.get_model(m).tag}) on {x.n_gpus} x {s.gpu}: TTFT (ms) of k "
                         f"chunks x {st.chunk_tokens} tokens + a {st.question}-token question; the KV read from "
                         f"{' or '.join(st.devices)}, pipelined (CacheBlend recomputes {s.min_ratio:.0%})", "§5.1",
                         cols(("k", "{}", "prefix_k"), ("full prefill", "{:.0f}"),
                              *[(f"{how} {d}", "{:.0f}") for how in HOWS for d in st.devices]),
                         rows, "prefix_caching.system_prefix", json={"full_ttft_s": {m: x.full_ttft_s}, **{
                             f"{how}_ttft{part}_s": {m: v} for how in HOWS
                             for part, v in (("", by[how][st.devices[-1]]), ("_by_device", by[how]))}}))
    present_saved_share(st, s, page)
    prefix_figure(st, s, page)
    return st


def saved_verdict(name: str, shares: list) -> str:
    """How a saved share moves over k, in the words its values allow."""
    falls = all(b < a for a, b in zip(shares, shares[1:]))
    return f"{name} " + (f"falls with every chunk ({shares[0]:.0%} -> {shares[-1]:.0%})" if falls else
                         f"stays within {min(shares):.0%}-{max(shares):.0%}" if max(shares) - min(shares) < 0.1
                         else change(shares[0], shares[-1], "{:.0%}"))


def present_saved_share(st: pc.PrefixStudy, s: Settings, page: Page) -> None:
    r, names = f"{s.min_ratio:.0%}", {m: tm.get_model(m).name for m in st.systems}
    methods = (("prefix caching", "prefix", h("prefix_fewer", s)), ("full reuse", "reuse", None),
               (f"CacheBlend {r}", "blend", h("blend_recompute", s)))
    rows = [Row([f"{names[m]} {label}", *getattr(x, f"{how}_saved_share")], ref)
            for m, x in st.systems.items() for label, how, ref in methods]
    verdicts = "; ".join(f"{saved_verdict(f'{names[m]}: prefix caching', x.prefix_saved_share)}, "
                         f"{saved_verdict(f'CacheBlend {r}', x.blend_saved_share)}" for m, x in st.systems.items())
    show(page, Table("Share of full prefill's GPU time each method does not spend, by k", "§5.1",
                     cols("method", *[(f"k={k}", "{:.0%}") for k in st.ks]), rows, "prefix_caching.system_prefix",
                     [f"{verdicts}. Only the first chunk can be a prefix, so prefix caching prefills the other k - 1; "
                      f"CacheBlend recomputes {r} of every chunk wherever it sits, full reuse none (and loses what the "
                      "chunks would have seen of each other, §5.2)."],
                     {"prefix_k": st.ks, **{f"{how}_saved_share": {m: getattr(x, f"{how}_saved_share")
                                                                   for m, x in st.systems.items()} for how in HOWS}}))


def prefix_figure(st: pc.PrefixStudy, s: Settings, page: Page) -> None:
    ref, methods = HANDOUT("prefix_fewer", s), (("prefix", "tab:red", "-", "prefix caching"),
                                                ("blend", "tab:blue", "--", f"CacheBlend {s.min_ratio:.0%}"))
    lines = [Series(st.ks, [100 * v for v in getattr(x, f"{how}_saved_share")], f"{tm.get_model(m).name}, {label}",
                    style=dict(marker=mark, color=color, ls=ls, **(dict(mfc="none", ms=8) if mark == "o" else {})))
             for (m, x), mark in zip(st.systems.items(), "oxs^") for how, color, ls, label in methods]
    chart_figure(page, "04_prefix_caching.png", Chart(lines, "k retrieved chunks", "% of full prefill's GPU time saved",
                 axes={"ylim": (0, 100)}), f"§5.1: share of full prefill's GPU time saved\n(k chunks of "
                 f"{st.chunk_tokens} tokens" + (f"; handout: {ref.figure})" if ref else ")"), figsize=(6.4, 4.2))


# ============================================================================ §5.1, exercise 5
@dataclass
class CityDocs:
    """Part 1's documents of the city language and full prefill's predictions of their questions."""
    model: object
    ctx: torch.Tensor               # (B, chunks x chunk_len) context tokens
    q: torch.Tensor                 # (B, chunk_len) question tokens
    lp_full: torch.Tensor           # full prefill's log-probs for question tokens 2..
    tgt: torch.Tensor               # (B, chunk_len - 1, 1) question tokens 2..


@dataclass
class City:
    ce_full: float                  # the question's cross-entropy, nats/token
    ce_reuse: float
    kl: float                       # KL(full prefill || full reuse)
    entropy: float                  # the language's true entropy of words 2-8


@dataclass
class Shift:
    shift: int
    k_rotated_max_diff: float
    k_unrotated_max_diff: float
    v_max_diff: float
    k_max_abs: float
    ce_unrotated: float
    kl_unrotated: float


def cross_entropy(lp: torch.Tensor, tgt: torch.Tensor) -> float:
    return float(-lp.gather(-1, tgt).mean())


@torch.no_grad()
def city_docs(model, lang, n_docs: int, seed: int, chunks: int, chunk_len: int) -> CityDocs:
    n_ctx = chunks * chunk_len
    x = lang.sample_text(n_docs, chunks + 1, torch.Generator().manual_seed(seed + 11))
    full, _ = model(x)
    return CityDocs(model, x[:, :n_ctx], x[:, n_ctx:], full[:, n_ctx:-1].log_softmax(-1), x[:, n_ctx + 1:, None])


@torch.no_grad()
def city_losses(d: CityDocs, lang, chunk_len: int) -> City:
    """Cross-entropy of the question's tokens (each predicted from everything before it) under full
    prefill and under full reuse of the precomputed sentence chunks, and KL(full || reuse)."""
    reuse, _ = d.model(d.q, cache=precompute_chunks(d.model, d.ctx, chunk_len))
    lp_reuse = reuse[:, :-1].log_softmax(-1)
    return City(cross_entropy(d.lp_full, d.tgt), cross_entropy(lp_reuse, d.tgt),
                float(kl_divergence(d.lp_full, lp_reuse).mean()), lang.entropy_after_first_word())


@torch.no_grad()
def shift_check(d: CityDocs, chunk_len: int, shift: int) -> Shift:
    """A chunk prefilled at positions 0.. and one prefilled at shift..; K of the first rotated by `shift`
    (shift_kv) against K of the second, V of both, every layer. Then full reuse with every chunk's K left
    where it was computed (position 0..): the question's cross-entropy and KL from full prefill."""
    model, c = d.model, chunk_len
    chunk = d.ctx[:, :c]
    _, at0 = model(chunk)
    _, at_s = model(chunk, pos=torch.arange(shift, shift + c))
    theta = model.cfg.rope_theta
    k_rot = max(float((shift_kv(k0, shift, theta) - k1).abs().max()) for k0, k1 in zip(at0.k, at_s.k))
    k_raw = max(float((k0 - k1).abs().max()) for k0, k1 in zip(at0.k, at_s.k))
    v_diff = max(float((v0 - v1).abs().max()) for v0, v1 in zip(at0.v, at_s.v))
    caches = []
    for start in range(0, d.ctx.shape[1], c):         # each chunk at 0..c-1, K not moved, at its real place
        _, kv = model(d.ctx[:, start:start + c])
        caches.append(KVCache(k=kv.k, v=kv.v, pos=kv.pos + start))
    unrot, _ = model(d.q, cache=KVCache.cat(caches))
    lp_unrot = unrot[:, :-1].log_softmax(-1)
    return Shift(shift, k_rot, k_raw, v_diff, max(float(k.abs().max()) for k in at_s.k),
                 cross_entropy(lp_unrot, d.tgt), float(kl_divergence(d.lp_full, lp_unrot).mean()))


def exercise5(d: CityDocs, lang, s: Settings, page: Page) -> None:
    e, rotated = shift_check(d, s.city_chunk_len, s.ex5_shift), city_losses(d, lang, s.city_chunk_len)
    page.exercise(5, "§5.1", f"a chunk's KV computed at position 0, moved to position {e.shift} (city model, "
                             "all layers)")
    at = f"computed at {e.shift}"
    show(page, Table("", "§5.1", cols("quantity", ("max |difference|", "{:.1e}")), [
        fact(f"K at 0 rotated by {e.shift} (shift_kv) vs K {at}", e.k_rotated_max_diff, "ex5.k_rotated_max_diff"),
        fact(f"K at 0, not rotated, vs K {at}", e.k_unrotated_max_diff, "ex5.k_unrotated_max_diff", "{:.2f}"),
        fact(f"V at 0 vs V {at}", e.v_max_diff, "ex5.v_max_diff"),
        fact("(largest |K| value, for scale)", e.k_max_abs, "ex5.k_max_abs", "{:.2f}")],
        "04_cacheblend.shift_check", [shift_note(e, rotated)],
        {"ex5.shift": e.shift, "ex5.ce_unrotated": e.ce_unrotated, "ex5.kl_unrotated": e.kl_unrotated}))


def shift_note(e: Shift, rotated: City) -> str:
    """What exercise 5's differences say (a difference under a thousandth of the largest |K| is rounding)."""
    tiny = 1e-3 * e.k_max_abs
    return (f"K must rotate once more by {e.shift} x theta (RoPE rotations add)" if e.k_rotated_max_diff < tiny
            < e.k_unrotated_max_diff else f"rotating K by {e.shift} x theta does not give K computed there") + (
        "; V never passes through RoPE, so it is reused as it is" if e.v_max_diff < tiny else "; V differs too") + (
        f". Full reuse with unrotated K: question cross-entropy {e.ce_unrotated:.4f} (rotated: "
        f"{rotated.ce_reuse:.4f}), KL from full prefill {e.kl_unrotated:.4f} (rotated: {rotated.kl:.5f}).")


# ============================================================================ §5.2 Part 1: the city language
def part1_city(d: CityDocs, lang, s: Settings, page: Page) -> None:
    c = city_losses(d, lang, s.city_chunk_len)
    page.part("Part 1", "§5.2", f"City language: {s.city_chunks} chunks x {s.city_chunk_len} tokens + a question of "
                                f"{s.city_chunk_len} tokens, {s.city_docs} documents")
    show(page, Table("Independent sentences: reuse loses " + ("nothing." if c.kl < 1e-3 else f"{c.kl:.4f} nats (KL)."),
                     "§5.2", cols("city language", ("ours", "{:.4f}")), [
        fact("cross-entropy, full prefill (nats/token)", c.ce_full, "city_ce_full", handout=h("city_ce_full", s)),
        fact("cross-entropy, full reuse (nats/token)", c.ce_reuse, "city_ce_reuse", handout=h("city_ce_reuse", s)),
        fact("KL(full prefill || full reuse)", c.kl, "city_kl", "{:.5f}", h("city_kl", s)),
        fact("true entropy of words 2-8 (nats/token)", c.entropy)], "04_cacheblend.city_losses", [city_note(c, s)]))


def city_note(c: City, s: Settings) -> str:
    """Where our cross-entropies sit against the language's own entropy and the handout's, and whether
    reuse equals prefill (KL under a thousandth)."""
    gap, ref = c.ce_full - c.entropy, HANDOUT("city_ce_full", s)
    sits = (f"sits {'on' if abs(gap) < 0.01 else f'{gap:+.4f} nats/token off'} its own language's entropy (ours "
            f"{c.ce_full:.4f} vs a true {c.entropy:.4f} nats/token")
    return (f"Our city language is not the handout's, so the cross-entropies differ: each model {sits}; the "
            f"handout's {ref.figure} is near ln 2 = {math.log(2):.4f}, one coin flip a word)" if ref else
            f"Our model {sits})") + (f". What carries over is reuse = prefill: KL {c.kl:.5f}." if c.kl < 1e-3 else
                                     f". Reuse is not prefill: KL {c.kl:.5f}.")


# ============================================================================ the record world's model (§0.4)
def cache_loaded(name: str) -> bool:
    """Did this process load `name` from code/checkpoints/ (rather than compute it)?"""
    return next((e["loaded"] for e in reversed(checkpoints.EVENTS) if e["name"] == name), False)


def record_world_model(s: Settings, page: Page):
    """The record-world LLaMA: trained once, then loaded; what the cache holds about its training."""
    model, meta = trained_record_model(s)
    m, loc = meta["metrics"], meta["ident"]["train"]["locality"]
    how = f"trained {m['steps']} steps in {m['train_seconds']:.0f} s"
    page.say("\nrecord world model: " + (f"loaded from code/checkpoints/ ({how} when it was cached)"
                                           if cache_loaded("records") else how)
             + f", accuracy crossed 50% at step {m['drop_step']} (handout: {HANDOUT.figure('train', s)}); held-out "
             f"{m['heldout_acc']:.2%} on {m['heldout_questions']:,} questions; locality penalty {loc}"
             + (f" from step {m['locality_from_step']}" if loc else ""))
    page.data(train_seconds=m["train_seconds"], drop_step=m["drop_step"], heldout_acc=m["heldout_acc"])
    if page.plot:
        plot_training(meta, path := page.figure_path("04_record_world_training.png"))
        page.add_figure(path)
    return model


def trained_record_model(s: Settings):
    """record_model(...) of the run's seed and locality; a training that fails stops the run with its message."""
    try:
        return record_model(s.retrain, s.seed, locality=s.locality)
    except TrainingFailed as e:
        print(f"\n!!! {e}\n", file=sys.stderr)
        sys.exit(1)


# ============================================================================ §5.2-5.3 Part 2: records
METHODS = ("full", "reuse", "blend", "random")


@dataclass
class Accuracy:
    split: float | None             # None where no record is split
    unsplit: float | None
    all: float


@dataclass
class RecordRun:
    rec: object                     # the held-out Records
    pre: KVCache                    # their chunks, precomputed once for Parts 2-3 and exercise 6
    split_ids: list[int]
    n_split: int                    # questions on split records
    acc: dict[str, Accuracy]        # method (METHODS) -> accuracy


def acc_or_none(correct, mask):
    return accuracy(correct, mask) if mask.any() else None


def methods(model, rec, chunk_len: int, ratio: float, seed: int, pre) -> dict[str, torch.Tensor]:
    """(B, Q) correctness of each way to prefill, by method."""
    g = torch.Generator().manual_seed(seed + 7)
    return {"full": answer_correct(full_prefill(model, rec), rec),
            "reuse": answer_correct(full_reuse(model, rec, chunk_len, pre), rec),
            "blend": answer_correct(blend(model, rec, chunk_len, ratio, pre=pre), rec),
            "random": answer_correct(blend(model, rec, chunk_len, ratio, rule=Random(g), pre=pre), rec)}


def record_experiment(model, s: Settings) -> RecordRun:
    rec = heldout(s.docs)
    pre = precompute_chunks(model, rec.doc, s.chunk_len)
    split = split_mask(rec, s.chunk_len)
    acc = {m: Accuracy(acc_or_none(ok, split), acc_or_none(ok, ~split), accuracy(ok))
           for m, ok in methods(model, rec, s.chunk_len, s.ratio, s.seed, pre).items()}
    return RecordRun(rec, pre, split_records(s.chunk_len), int(split.sum()), acc)


def part2_records(model, s: Settings, page: Page) -> RecordRun:
    run = record_experiment(model, s)
    r, ids, n_unsplit = f"{s.ratio:.0%}", run.split_ids, run.rec.answers.numel() - run.n_split
    page.part("Part 2", "§5.2, §5.3", "Record world: full reuse, CacheBlend and random picks of the same size")
    label = {"full": "full prefill", "reuse": "full reuse", "blend": f"CacheBlend {r}", "random": f"random {r}"}
    ref = {"full": "split_full", "reuse": "split_reuse", "blend": f"blend_c{s.chunk_len}", "random": "split_random"}
    rows = [Row([label[m], run.acc[m].split, Val(run.acc[m].unsplit, f"unsplit_acc_{m}" if m in ("full", "reuse")
                                                  else None), handout_text(h(ref[m], s)),
                 handout_text(h("unsplit_reuse", s) if m == "reuse" else None)],
                key=m if m in ("full", "reuse") else m + pk(s.ratio)) for m in METHODS]
    show(page, Table(f"Record world, chunks of {s.chunk_len}: split records {ids} (values at positions "
                     f"{[2 * i + 1 for i in ids]});\n{run.n_split:,} questions on split records, {n_unsplit:,} on "
                     f"unsplit; chance 1/{N_RECORDS} = {1 / N_RECORDS:.1%}.", "§5.2, §5.3",
                     cols("method", ("split records", pct, "split_acc_{row}"), ("unsplit records", pct),
                          "handout split", "handout unsplit"), rows, "04_cacheblend.record_experiment",
                     random_note(run, s), {"chunk_len": s.chunk_len, "ratio": s.ratio}))
    return run


def random_note(run: RecordRun, s: Settings) -> list[str]:
    """What random picks of r N tokens should repair if a pick helps only the record it touches."""
    rand, reuse, dev = (run.acc[m].split for m in ("random", "reuse", "blend"))
    if rand is None or reuse is None:
        return []
    r, guess, ref = f"{s.ratio:.0%}", s.ratio + (1 - s.ratio) * reuse, HANDOUT("split_random", s)
    touch = "about" if abs(rand - guess) < 0.1 else "more than" if rand > guess else "less than"
    return [f"random {r}: a split record is repaired when its value token is among the picks; if nothing else "
            f"helped, {r} + {1 - s.ratio:.0%} x {pct(reuse)} (full reuse) = {pct(guess)}. Ours: {pct(rand)}, "
            f"{above(rand, guess)} that estimate" + (f"; the handout's {ref.figure} lies {above(number(ref), guess)}"
                                                    " it" if ref else "")
            + f". Random picks recover {touch} what they touch; deviation picks recover {pct(dev)}."]


# ---------------------------------------------------------------------------- §5.2, exercise 6
@dataclass
class SplitAt:
    chunk_len: int
    split_records: list[int]
    reuse_acc: float                # full reuse, every question
    full_acc: float                 # full prefill, every question
    reuse_equals_full: bool         # full reuse gives full prefill's answer to every question


def split_at(model, run: RecordRun, chunk_len: int, s: Settings) -> SplitAt:
    """The held-out records of Part 2 in chunks of `chunk_len`: which records are split, and full reuse
    against full prefill on every question."""
    rec = run.rec
    pre = run.pre if chunk_len == s.chunk_len else precompute_chunks(model, rec.doc, chunk_len)
    reuse, full = full_reuse(model, rec, chunk_len, pre), full_prefill(model, rec)
    slots = answer_slots(N_RECORDS)
    same = bool((reuse[:, slots].argmax(-1) == full[:, slots].argmax(-1)).all())
    return SplitAt(chunk_len, split_records(chunk_len), accuracy(answer_correct(reuse, rec)),
                   accuracy(answer_correct(full, rec)), same)


def exercise6(model, run: RecordRun, s: Settings, page: Page) -> None:
    e = split_at(model, run, s.ex6_chunk_len, s)
    page.exercise(6, "§5.2", f"chunk length {e.chunk_len}: how many records are split, and full reuse's accuracy")
    show(page, Table("", "§5.2", cols("exercise 6", ("ours", pct)), [
        fact(f"records split by chunks of {e.chunk_len}", e.split_records, "ex6.split_records",
             lambda x: f"{len(x)} {x}", h("ex6_split", s)),
        fact("full reuse: accuracy on every question", e.reuse_acc, "ex6.reuse_acc", handout=h("ex6_reuse", s)),
        fact("full prefill: accuracy on every question", e.full_acc, "ex6.full_acc")],
        "04_cacheblend.split_at", [split_note(e)],
        {"ex6.chunk_len": e.chunk_len, "ex6.reuse_equals_full": e.reuse_equals_full}))


def split_note(e: SplitAt) -> str:
    """Why records are (or are not) split at this chunk length, and whether full reuse answers as full prefill."""
    bounds = range(e.chunk_len, DOC_LEN, e.chunk_len)
    where = ("every boundary falls on a key (an even position)" if all(b % 2 == 0 for b in bounds) else
             f"boundaries {list(bounds)} fall on values too")
    return (f"{where}, so no record is split" if not e.split_records else
            f"{where}: records {e.split_records} are split") + (
        f"; full reuse answers {'exactly as' if e.reuse_equals_full else 'NOT as'} full prefill does "
        f"({pct(e.reuse_acc)} vs {pct(e.full_acc)}).")


# ============================================================================ §5.3 Part 3: insights
@dataclass
class Insights:
    top_share: float                # share of the deviation held by the top TOP_SHARE tokens, layers 1..
    top_per_layer: list[float]
    rank_corr: list[float]          # Spearman of the deviation, layers (1, 2), (2, 3), ...
    layer0_vs_layer1: float         # layer 0's attention deviation vs layer 1's KV deviation
    layer0_coverage: float | None   # layer 0's picks covering the chunk-initial values
    first_value_share: list         # chunk-initial values' share of the deviation, per layer 1..
    deviation: torch.Tensor         # (L, B, N)


@dataclass
class Curve:
    ratios: list[float]
    blend: dict[int, list]          # chunk length -> CacheBlend's split-record accuracy per ratio
    random: dict[int, list]

    def json(self) -> dict:
        return {f"c{c}_{how}": acc for c in self.blend for how, acc in (("deviation", self.blend[c]),
                                                                          ("random", self.random[c]))}


@dataclass
class Part3:
    insights: Insights
    curve: Curve
    elsewhere: list[float]          # document tokens' attention on other tokens, per layer
    blend_at_ratio: dict[int, float | None]   # curve chunk length -> CacheBlend at r on split records
    lowest: dict[int, float | None]           # curve chunk length -> lowest ratio recovering RECOVER


@torch.no_grad()
def insights(model, rec, chunk_len: int, ratio: float, top: float, pre=None) -> Insights:
    pre = pre if pre is not None else precompute_chunks(model, rec.doc, chunk_len)
    dev = kv_deviation(model, rec, chunk_len, pre)          # (L, B, N)
    L = dev.shape[0]
    per_layer = [top_share(dev[i], top) for i in range(1, L)]
    corr = [spearman(dev[i], dev[i + 1]) for i in range(1, L - 1)]
    _, trace = blend(model, rec, chunk_len, ratio, pre=pre, trace=True)
    corr0 = spearman(trace.attn_dev0, dev[1])                 # layer 0's attention deviation vs layer 1's KV deviation
    # layer 0's picks vs the chunk-initial values (the split records' values)
    firsts = [2 * i + 1 for i in split_records(chunk_len)]
    picks = trace.recomputed[0]
    coverage = float(torch.stack([(picks == p).any(1) for p in firsts], 1).float().mean()) if firsts else None
    first_share = [float(dev[i][:, firsts].sum() / dev[i].sum()) if firsts else None for i in range(1, L)]
    return Insights(sum(per_layer) / len(per_layer), per_layer, corr, corr0, coverage, first_share, dev)


def curve(model, rec, seed: int, ratios, chunk_lens, pre: dict | None = None) -> Curve:
    """Split-record accuracy against the recompute ratio, CacheBlend and random, per chunk length
    (None where a chunk length splits no record; pre: chunk length -> its precomputed chunks, where
    already at hand)."""
    out = Curve(list(ratios), {}, {})
    for c in chunk_lens:
        pre_c = (pre or {}).get(c)
        pre_c = pre_c if pre_c is not None else precompute_chunks(model, rec.doc, c)
        split = split_mask(rec, c)
        for how, into in (("deviation", out.blend), ("random", out.random)):
            g = torch.Generator().manual_seed(seed + 7)
            rule = Random(g) if how == "random" else PROGRESSIVE
            into[c] = [acc_or_none(answer_correct(blend(model, rec, c, r, rule=rule, pre=pre_c), rec), split)
                       for r in ratios]
    return out


def lowest_ratio(ratios, accs, target: float):
    """The smallest ratio whose accuracy reaches target (None if none does)."""
    return next((r for r, acc in zip(ratios, accs) if acc is not None and acc >= target), None)


def cached_curve(model, run: RecordRun, s: Settings, ratios) -> Curve:
    """`curve` on the run's held-out records, computed once for this model, seed, ratios and chunk lengths,
    then loaded (19 s of the run)."""
    ident = {"model": getattr(model, "cache_key", None), "docs": s.docs, "seed": s.seed, "ratios": ratios,
             "chunk_lens": list(s.curve_chunk_lens)}
    return Curve(**checkpoints.cached("curve-records", ident, lambda: dataclasses.asdict(
        curve(model, run.rec, s.seed, ratios, s.curve_chunk_lens, pre={s.chunk_len: run.pre}))))


def insights_and_curve(model, run: RecordRun, s: Settings) -> Part3:
    """The insights at the run's chunk length, and the compute-quality curve (CURVE_RATIOS and r)."""
    ratios = sorted(set(s.curve_ratios) | {s.ratio})
    c = cached_curve(model, run, s, ratios)
    return Part3(insights(model, run.rec, s.chunk_len, s.ratio, s.top_share, run.pre), c,
                 doc_attention_elsewhere(model, run.rec),
                 {n: c.blend[n][ratios.index(s.ratio)] for n in s.curve_chunk_lens},
                 {n: lowest_ratio(ratios, c.blend[n], s.recover) for n in s.curve_chunk_lens})


def part3_insights(model, run: RecordRun, s: Settings, page: Page) -> Part3:
    p = insights_and_curve(model, run, s)
    f, L, r, top = p.insights, p.insights.deviation.shape[0], f"{s.ratio:.0%}", pk(s.top_share)
    page.part("Part 3", "§5.3", "The two insights, and the compute-quality curve")
    rows = [fact(f"document tokens' attention on other tokens, layers 0-{L - 1}", p.elsewhere,
                 "doc_attention_elsewhere", pcts),
            fact(f"top {s.top_share:.0%} of tokens: share of KV deviation (layers 1-{L - 1})", f.top_share,
                 f"top{top}_deviation_share", handout=h("top_share", s)),
            fact(f"  per layer {', '.join(map(str, range(1, L)))}", f.top_per_layer, f"top{top}_per_layer", pcts),
            fact(f"rank correlation of deviation, layers {', '.join(f'{i}-{i + 1}' for i in range(1, L - 1))}",
                 f.rank_corr, "adjacent_layer_rank_corr", lambda xs: " ".join(f"{x:.2f}" for x in xs),
                 h("rank_corr", s)),
            fact("  layer-0 attention dev. vs layer-1 KV dev.", f.layer0_vs_layer1, fmt="{:.2f}"),
            fact(f"layer-0 picks ({r}) covering chunk-initial values", f.layer0_coverage, "layer0_pick_coverage",
                 handout=h("layer0_coverage", s)),
            fact(f"chunk-initial values' share of the deviation, layers 1-{L - 1}", f.first_value_share, fmt=pcts),
            *[fact(f"chunk length {n}: CacheBlend {r} on split records", acc, handout=h(f"blend_c{n}", s, chunk_len=n))
              for n, acc in p.blend_at_ratio.items()],
            fact(f"lowest ratio recovering >= {s.recover:.0%} of split records, chunk length "
                 + " / ".join(map(str, s.curve_chunk_lens)), " / ".join(pct(x) for x in p.lowest.values()))]
    show(page, Table(f"chunks of {s.chunk_len}; deviation = precomputed chunks' KV minus full prefill's, per layer",
                     "§5.3", cols("insight", ("ours", pct)), rows, "04_cacheblend.insights",
                     json={f"chunk3_blend{pk(s.ratio)}": p.blend_at_ratio.get(3)}))
    c = p.curve
    show(page, Table("compute-quality curve: accuracy on split records", "§5.3",
                     cols(("ratio", "{:.0%}", "curve_ratios"), *[(f"c={n} {how}", pct) for n in c.blend
                                                                  for how in ("blend", "random")]),
                     [Row([x] + [acc[i] for n in c.blend for acc in (c.blend[n], c.random[n])])
                      for i, x in enumerate(c.ratios)], "04_cacheblend.curve", json={"curve": c.json()}))
    curve_figure(c, s, page)
    concentration_figure(f.deviation, s, page)
    return p


def curve_figure(c: Curve, s: Settings, page: Page) -> None:
    x, color = [100 * r for r in c.ratios], {3: "tab:purple", 5: "tab:blue"}
    lines = [Series(x, [None if a is None else 100 * a for a in accs], f"chunk length {n}, {how}",
                    style=dict(marker=mark, ls=ls, color=color.get(n, "gray")))
             for n in c.blend for how, accs, mark, ls in (("CacheBlend (deviation)", c.blend[n], "o", "-"),
                                                          ("random tokens", c.random[n], "x", "--"))]
    chart_figure(page, "04_compute_quality.png", Chart(
        lines, "recompute ratio r (% of context tokens)", "accuracy on split records (%)",
        legend=dict(loc="lower right"),
        hlines=[(100 / N_RECORDS, {**REFERENCE, "label": f"chance (1/{N_RECORDS})"})],  # and CacheBlend's quality floor
        vlines=[(100 * s.min_ratio, dict(color="gray", ls="-.", lw=0.8))]),
        "compute vs quality: recomputing the right tokens", figsize=(6.4, 4))


def concentration_figure(dev: torch.Tensor, s: Settings, page: Page) -> None:
    """Per layer: share of the KV deviation held by the top x% of tokens (a Lorenz-style curve)."""
    ref, x = HANDOUT("top_share", s), [100 * k / dev.shape[2] for k in range(dev.shape[2] + 1)]
    lines = [Series(x, (100 * lorenz(dev[i])).tolist(), f"layer {i}", style=dict(marker="."))
             for i in range(1, dev.shape[0])]
    chart_figure(page, "04_deviation_concentration.png", Chart(
        lines + [Series([0, 100], [0, 100], "evenly spread", style=REFERENCE)],
        "top x% of context tokens (by KV deviation)", "% of the layer's KV deviation",
        vlines=[(100 * s.top_share, dict(color="gray", ls="--", lw=0.8))]), "How concentrated is full reuse's KV "
        f"deviation?\n(chunks of {s.chunk_len}"
        + (f"; handout: top {s.top_share:.0%} hold {ref.figure})" if ref else ")"),
        figsize=(6.4, 4.4))


def lorenz(dev: torch.Tensor) -> torch.Tensor:
    """(B, N) deviation -> the mean share held by the top 0, 1, ..., N tokens of each row."""
    d = dev.sort(1, descending=True).values
    return (torch.cat([torch.zeros(d.shape[0], 1), d.cumsum(1)], 1) / d.sum(1, keepdim=True).clamp_min(1e-30)).mean(0)


# ---------------------------------------------------------------------------- §5.3, the mask pitfall
def why_the_mask_is_wrong(future: float, picks: int, n_context: int) -> str:
    """The pitfall in one line, with what the mask did to this run's picks."""
    return (f"Why it is wrong: the bottom-right mask lets the i-th of the m recomputed tokens see keys up to "
            f"N - m + i, as if the picks were the last m tokens; this run's {picks} picks at layer 1 each see "
            f"{future:.1f} later tokens of the {n_context} on average, a future no prefill shows (LMCache#1152, "
            "CacheBlend#21).")


def pitfall_mask(model, run: RecordRun, s: Settings, page: Page) -> None:
    """CacheBlend with the position mask against the released blenders' bottom-right mask (mask_pitfall.py)."""
    c = mp.record_cost(model, run.rec, s.chunk_len, s.ratio, run.pre)
    if c.split["position"] is None:
        page.say(f"  The mask pitfall (§5.3): chunks of {s.chunk_len} split no record, so there is nothing for "
                 "either mask to repair here.")
        return
    show(page, Table(f"Pitfall: the causal mask of the recomputed tokens. CacheBlend {s.ratio:.0%}, chunks of "
                     f"{s.chunk_len}", "§5.3", cols("mask at layers 1..L-1", ("split records", pct),
                                                    ("unsplit records", pct)), [
        Row(["position mask (blend's): each row sees the keys up to its own position",
             Val(c.split["position"], "mask_position_split_acc"), c.unsplit["position"]]),
        Row(["bottom-right mask (the pitfall): the rows taken as the last ones",
             Val(c.split["bottom-right"], "mask_pitfall_split_acc"), c.unsplit["bottom-right"]])],
        "mask_pitfall.record_cost", [why_the_mask_is_wrong(c.future_keys, c.picks, DOC_LEN), mask_cost_note(c)]))


def mask_cost_note(c: mp.MaskCost) -> str:
    """What the bottom-right mask costs the split records here, and why it can cost nothing in this model."""
    diff = c.split["position"] - c.split["bottom-right"]
    cost = (f"Here it costs {diff:.1%} of the split records" if diff > 0 else
            "Here it costs nothing" if diff == 0 else f"Here it gains {-diff:.1%} of the split records")
    return cost + (f": the answers read the context's KV of layers 0-{c.layers_read - 1} only (full reuse's above "
                   f"them answers as well), and the first K, V a mask can change are layer {mp.FIRST_LAYER_CHANGED}'s; "
                   "--model smollm2 measures the pitfall on a real LLaMA." if c.layers_read <= mp.FIRST_LAYER_CHANGED
                   else ".")


# ---------------------------------------------------------------------------- §5.3, exercise 7
@dataclass
class CheckCost:
    model: str
    n_gpus: int
    n_ctx: int
    layer0_gflop: float
    layer1_gflop: float
    layer0_ms: float
    layer1_ms: float
    full_layer_ms: float
    full_prefill_ms: float


def check_cost(model: str, n_gpus: int, n_ctx: int, gpu: str) -> CheckCost:
    """What CacheBlend's check costs at layer 0 and at layer 1, on the time model.
    Layer 0: K, V depend only on token and position, so the precomputed ones are exact; the check is one
    more attention pass (queries of every token against every earlier key) beside the own-chunk one.
    Layer 1: its true K, V need layer 0's output with full attention, for every token: a whole layer of
    prefill, then the same attention pass."""
    m = tm.get_model(model)
    attn = m.attn_pair_flops * tm.causal_pairs(n_ctx)
    q_proj = 2 * m.d_model * m.n_heads * m.head_dim * n_ctx
    layer0 = tm.prefill_layer_time(model, gpu, n_ctx, 0, n_gpus)            # a full layer, all tokens
    layer_flops = 2 * m.linear_params / m.n_layers * n_ctx + attn
    per_flop = layer0 / layer_flops                                        # the time model's s/FLOP here
    return CheckCost(model, n_gpus, n_ctx, (attn + q_proj) / 1e9, (layer_flops + attn + q_proj) / 1e9,
                     1e3 * (attn + q_proj) * per_flop, 1e3 * (layer0 + (attn + q_proj) * per_flop),
                     1e3 * layer0, 1e3 * m.n_layers * layer0)


def exercise7(found: Insights, s: Settings, page: Page) -> None:
    n_ctx = s.rag_chunks * s.rag_chunk_tokens
    ex = [check_cost(m, g, n_ctx, s.gpu) for m, g in s.systems]
    page.exercise(7, "§5.3", f"the cost of CacheBlend's check at layer 0 vs layer 1 ({n_ctx:,} context tokens, "
                             f"{s.gpu}, time model)")
    rows = [Row([f"{tm.get_model(e.model).name}, at layer {i}", gflop, ms, e.full_layer_ms])
            for e in ex for i, gflop, ms in ((0, e.layer0_gflop, e.layer0_ms), (1, e.layer1_gflop, e.layer1_ms))]
    show(page, Table("", "§5.3", cols("check of the deviation (all tokens)", ("GFLOP", "{:.0f}"), ("ms", "{:.1f}"),
                                      ("one full layer, ms", "{:.1f}")), rows, "04_cacheblend.check_cost",
                     [check_note(ex, found.layer0_vs_layer1)], {"ex7": ex}))


def check_note(ex: list[CheckCost], rho: float) -> str:
    """Why CacheBlend checks at layer 0 (its K, V exact, one attention pass) and not at layer 1, from the costs;
    how layer 0's deviation ranks against layer 1's (rank correlation rho)."""
    return ("Layer 0's K, V depend only on token and position, so the precomputed ones are exact: one more attention "
            "pass over them (all keys instead of the chunk's) gives the deviation, at most "
            f"{max(e.layer0_ms / e.full_layer_ms for e in ex):.0%} of a layer here. Layer 1's true K, V need layer "
            "0's output for every token, a whole layer of prefill"
            + (" (with the check, more than a layer here)" if all(e.layer1_ms > e.full_layer_ms for e in ex) else "")
            + ": at layer 1 and above CacheBlend can afford to recompute only the tokens it picked. Ours: layer-0 "
            "attention deviation ranks " + ("like" if rho >= 0.8 else "roughly like" if rho >= 0.5 else "unlike")
            + f" layer-1 KV deviation (rank correlation {rho:.2f}).")


# ============================================================================ §5.4 Part 4: timing
@dataclass
class DeviceTiming:
    load_ms: float                  # one layer's KV read from the device
    ratio: float                    # the controller's recompute ratio
    recompute_ms: float
    ttft_s: float                   # pipelined CacheBlend
    speedup: float                  # full prefill TTFT / CacheBlend TTFT
    load_vs_full: float             # full recompute of a layer / its load
    choice: str                     # the controller's, KV kept here: "blend", "blend from <device>", "full prefill"
    reason: str                     # why (loading_controller.choose)


@dataclass
class PaperPoint:
    recompute_ms: float             # PAPER_RATIO of a layer at PAPER_CONTEXT tokens
    load_ms: float                  # its read from PAPER_DEVICE


@dataclass
class Throughput:
    full_rps: float
    blend_rps: float
    gpu_s: float
    load_s: float
    bound: str                      # "GPU" or the device


@dataclass
class SystemTiming:
    n_gpus: int
    tag: str
    full_layer_ms: float
    floor_layer_ms: float
    prefill_s: float
    devices: dict[str, DeviceTiming]
    paper: PaperPoint
    throughput: dict[float, Throughput]   # recompute ratio -> requests/s


def throughput(model, n_gpus: int, ratio: float, device: str, s: Settings) -> Throughput:
    """Requests/s of one server on the RAG requests of Part 4 when it is busy all the time: full prefill
    spends the GPUs' prefill of the whole prompt per request; CacheBlend spends the recompute at `ratio`
    plus the question, its loads overlapping other requests' compute, so the device's bandwidth caps it
    (KV bytes per request / bandwidth)."""
    n_ctx, gpu = s.rag_chunks * s.rag_chunk_tokens, s.gpu
    full = tm.prefill_time(model, gpu, n_ctx + s.rag_question, 0, n_gpus)
    gpu_s = (tm.recompute_time(model, gpu, n_ctx, ratio, n_gpus)
             + tm.prefill_time(model, gpu, s.rag_question, n_ctx, n_gpus))
    load_s = lc.load_time(model, n_ctx, device, n_gpus, s.devices) * tm.get_model(model).n_layers
    return Throughput(1 / full, 1 / max(gpu_s, load_s), gpu_s, load_s, "GPU" if gpu_s >= load_s else device)


def system_timing(model: str, n_gpus: int, s: Settings) -> SystemTiming:
    """One layer's full and floor-ratio recompute, and per device the load, the controller's ratio, the
    pipelined TTFT; CacheBlend's per-layer paper point; a busy server's requests/s."""
    n_ctx, gpu, m = s.rag_chunks * s.rag_chunk_tokens, s.gpu, tm.get_model(model)
    full_layer = tm.recompute_time(model, gpu, n_ctx, 1.0, n_gpus) / m.n_layers
    floor_layer = tm.recompute_time(model, gpu, n_ctx, s.min_ratio, n_gpus) / m.n_layers
    question = tm.prefill_time(model, gpu, s.rag_question, n_ctx, n_gpus)
    prefill = tm.prefill_time(model, gpu, n_ctx + s.rag_question, 0, n_gpus)
    devices, loads = {}, {d: lc.load_time(model, n_ctx, d, n_gpus, s.devices) for d in s.devices}
    for device, load in loads.items():
        r = lc.controller_ratio(load, full_layer, s.min_ratio)
        recompute = tm.recompute_time(model, gpu, n_ctx, r, n_gpus) / m.n_layers
        ttft = lc.pipelined_ttft(m.n_layers, load, recompute, question)
        c = lc.choose(m.n_layers, full_layer, loads, device, s.min_ratio, question)
        devices[device] = DeviceTiming(1e3 * load, r, 1e3 * recompute, ttft, prefill / ttft, full_layer / load,
                                       choice_label(c), c.reason)
    paper = PaperPoint(1e3 * tm.recompute_time(model, gpu, s.paper_context, s.paper_ratio, n_gpus) / m.n_layers,
                       1e3 * lc.load_time(model, s.paper_context, s.paper_device, n_gpus, s.devices))
    tput = {r: throughput(model, n_gpus, r, s.paper_device, s)
            for r in sorted({devices[s.paper_device].ratio, s.min_ratio})}
    return SystemTiming(n_gpus, m.tag, 1e3 * full_layer, 1e3 * floor_layer, prefill, devices, paper, tput)


def choice_label(c: lc.Choice) -> str:
    """The controller's choice in a table cell: "blend" (from where the KV is), "blend from <device>", "full
    prefill"."""
    return c.choice if c.device in (None, c.stored) else f"{c.choice} from {c.device}"


def part4_pipelining(s: Settings, page: Page) -> dict[str, SystemTiming]:
    timings = {model: system_timing(model, n_gpus, s) for model, n_gpus in s.systems}
    page.part("Part 4", "§5.4", f"Hiding recompute behind loading ({s.gpu}, time model)")
    for model, t in timings.items():
        rows = [Row([label, ms, None, None, None, None]) for label, ms in (
            ("full recompute of the layer", t.full_layer_ms), (f"recompute {s.min_ratio:.0%}", t.floor_layer_ms))]
        rows += [Row([f"load from {d}", x.load_ms, x.ratio, 1e3 * x.ttft_s, x.speedup, x.choice])
                 for d, x in t.devices.items()]
        show(page, Table(f"{tm.get_model(model).name} ({t.tag}) on {t.n_gpus} x {s.gpu}: {s.rag_chunks} x "
                         f"{s.rag_chunk_tokens} tokens + {s.rag_question}-token question; full prefill TTFT "
                         f"{1e3 * t.prefill_s:.0f} ms", "§5.4",
                         cols("per layer", ("ms", "{:.1f}"), ("controller ratio", "{:.0%}"),
                              ("TTFT CacheBlend (ms)", "{:.0f}"), ("vs full prefill", "{:.2f}x"),
                              Col("controller's choice", left=True)), rows, "04_cacheblend.system_timing",
                         [f"{d}: {x.reason}." for d, x in t.devices.items() if x.choice != lc.BLEND],
                         json={"timing": {model: t}}))
    present_comparison(timings, s, page)
    present_throughput(timings, s, page)
    timing_figure(timings, s, page)
    return timings


def present_comparison(timings: dict[str, SystemTiming], s: Settings, page: Page) -> None:
    dev, rows = s.paper_device, []
    for model, t in timings.items():
        name, ref = tm.get_model(model).name, lambda x: h(f"{x} {model}", s, system=(model, t.n_gpus))
        rows += [fact(f"{name}: full recompute / {dev} load per layer", t.devices[dev].load_vs_full, fmt="{:.3g}x",
                      handout=ref("nvme_vs_recompute")),
                 fact(f"paper point, {name}, {s.paper_context} tokens: {s.paper_ratio:.0%} recompute per layer (ms)",
                      t.paper.recompute_ms, handout=ref("paper_recompute")),
                 fact(f"paper point, {name}: {dev} read per layer (ms)", t.paper.load_ms, handout=ref("paper_load"))]
    rows.append(fact(f"TTFT speed-up over full prefill ({dev}, {' / '.join(tm.get_model(m).name for m in timings)})",
                     " / ".join(f"{t.devices[dev].speedup:.1f}x" for t in timings.values()),
                     handout=h("ttft_speedup", s)))
    t70 = timings.get("llama-3.1-70b")
    show(page, Table(f"Load vs recompute ({s.gpu}; paper points on the same GPU)", "§5.4",
                     cols("comparison", ("ours", "{:.1f}")), rows, "04_cacheblend.system_timing",
                     speedup_notes(timings, s),
                     {"llama70b_nvme_vs_recompute": t70.devices[dev].load_vs_full if t70 else None}))


def speedup_notes(timings: dict[str, SystemTiming], s: Settings) -> list[str]:
    """Why the time model's speed-ups and load/recompute ratios differ from the paper's, from the rows."""
    nvme, ref = {m: t.devices[s.paper_device] for m, t in timings.items()}, HANDOUT("ttft_speedup", s)
    lo, hi = (float(x.strip("x")) for x in ref.figure.split("-")) if ref else (0.0, 0.0)
    outside = ref and not any(lo <= d.speedup <= hi for d in nvme.values())
    notes = [(f"Why our speed-ups are not the paper's {ref.figure}: " if outside else "Our speed-ups: ")
             + "the controller sets recompute = load, so " + " and ".join(
                 f"{tm.get_model(m).name} recomputes {d.ratio:.0%} of every layer (speed-up about 1/{d.ratio:.2f} = "
                 f"{1 / d.ratio:.1f}x)" for m, d in nvme.items()) + f"; the floor is {s.min_ratio:.0%}."
             + (" The paper's are measured end to end in vLLM (kernels, scheduling, real disks), ours are a roofline "
                "with no overheads." if ref else "")]
    t = timings.get("llama-3.1-70b")
    ref70 = t and h("nvme_vs_recompute llama-3.1-70b", s, system=("llama-3.1-70b", t.n_gpus))
    if isinstance(ref70, Ref):
        implied = t.paper.recompute_ms / s.paper_ratio / t.paper.load_ms
        notes.append(f"Full recompute / {s.paper_device} load for LLaMA-3.1-70B is "
                     f"{nvme['llama-3.1-70b'].load_vs_full:.1f}x here; the paper's own per-layer points (the rows "
                     f"above) imply {t.paper.recompute_ms:.1f} / {s.paper_ratio:.2f} / {t.paper.load_ms:.1f} = "
                     f"{implied:.1f}x at {s.paper_context} tokens, so the "
                     f"handout's {ref70.figure} " + ("follows from them." if abs(implied / number(ref70) - 1) < 0.2
                                                    else "does not follow from them."))
    return notes


def present_throughput(timings: dict[str, SystemTiming], s: Settings, page: Page) -> None:
    """§5.4's throughput headline: requests/s of full prefill vs CacheBlend, one server kept busy."""
    rows = [Row([f"{tm.get_model(m).name}, {s.paper_device}, recompute {r:.0%}", x.full_rps, x.blend_rps, x.bound,
                 x.blend_rps / x.full_rps], h("throughput", s)) for m, t in timings.items()
            for r, x in t.throughput.items()]
    show(page, Table(f"Throughput of one server kept busy by RAG requests ({s.gpu})", "§5.4",
                     cols("throughput (requests/s)", ("full prefill", "{:.2f}"), ("CacheBlend", "{:.2f}"), "bound by",
                          ("ratio", "{:.1f}x")), rows, "04_cacheblend.throughput", [throughput_note(timings, s)]))


def throughput_note(timings: dict[str, SystemTiming], s: Settings) -> str:
    """Why a busy server's requests/s differ from the latency choice; whether the floor serves the most."""
    floor_best = all(max(t.throughput, key=lambda r: t.throughput[r].blend_rps) == s.min_ratio
                     for t in timings.values())
    return ("A busy server's GPUs do only the recompute and the question per request; loading the KV overlaps other "
            "requests' compute, until the device's bandwidth runs out. The controller's ratio (recompute = load) is "
            f"the latency choice; the {s.min_ratio:.0%} floor " + ("is what throughput wants." if floor_best else
                                                                   "does not serve the most requests/s here."))


def timing_figure(timings: dict[str, SystemTiming], s: Settings, page: Page) -> None:
    colors = lambda t: ["tab:red", "tab:orange"] + ["tab:blue"] * len(t.devices)
    panels = [Chart([Series(["full recompute", f"{s.min_ratio:.0%} recompute"] + [f"load: {d}" for d in t.devices],
                            [t.full_layer_ms, t.floor_layer_ms] + [x.load_ms for x in t.devices.values()], kind="barh",
                            style={"color": colors(t)}, fmt=" {:.1f} ms")],
                    "ms per layer (log scale)", title=f"{tm.get_model(model).name} ({t.tag}), {t.n_gpus} x {s.gpu}",
                    xscale="log", legend=None) for model, t in timings.items()]
    chart_figure(page, "04_load_vs_recompute.png", panels, f"one layer of a {s.rag_chunks} x {s.rag_chunk_tokens}"
                 "-token RAG context: recompute vs load", figsize=(5 * len(panels), 3.8))


# ---------------------------------------------------------------------------- §5.4, exercise 8
def controller_example(layers: int, read_ms: float, prefill_ms: float, min_ratio: float) -> lc.Choice:
    """Exercise 8's controller: the KV on an SSD, `layers` layers, each read in read_ms and prefilled in
    prefill_ms (the question left out, as the exercise says)."""
    return lc.choose(layers, prefill_ms / 1e3, {"SSD": read_ms / 1e3}, "SSD", min_ratio)


def exercise8(s: Settings, page: Page) -> None:
    c = controller_example(s.layers, s.read_ms, s.prefill_ms, s.min_ratio)
    page.exercise(8, "§5.4", f"{s.layers} layers, read {s.read_ms:g} ms/layer, prefill {s.prefill_ms:g} ms/layer, "
                             f"floor {s.min_ratio:.0%}")
    rows = [fact("controller's choice", c.choice, "ex8_choice", handout=h("ex8_choice", s)),
            fact("controller's recompute ratio", c.ratio, "ex8_ratio", "{:.0%}", h("ex8_ratio", s)),
            fact(f"TTFT, {'CacheBlend pipelined' if c.choice == lc.BLEND else 'the full prefill chosen'} (ms)",
                 1e3 * c.ttft_s, "ex8_ttft_ms", handout=h("ex8_ttft_ms", s))]
    if c.choice != lc.BLEND:
        rows.append(fact(f"  blending from the SSD anyway, at {c.stored_ratio:.0%} (ms)", 1e3 * c.stored_ttft_s))
    rows.append(fact("TTFT, full prefill (ms)", 1e3 * c.full_s, "ex8_full_ms", handout=h("ex8_full_ms", s)))
    show(page, Table("", "§5.4", cols("exercise 8", ("ours", "{:.0f}")), rows, "loading_controller.choose",
                     [c.reason[0].upper() + c.reason[1:] + "."]))


# ============================================================================ Parts 1-4, in the handout's order
def record_world(s: Settings, page: Page) -> None:
    """Parts 1-4 and exercises 5-8, each computed and then shown, as the handout poses them."""
    city, lang = city_model()
    docs = city_docs(city, lang, s.city_docs, 0, s.city_chunks, s.city_chunk_len)
    part0_prefix(s, page)                           # §5.1: prefix caching is not enough
    exercise5(docs, lang, s, page)                  # §5.1: moving a chunk's KV
    part1_city(docs, lang, s, page)                 # §5.2: the city language, full reuse vs full prefill
    model = record_world_model(s, page)
    run = part2_records(model, s, page)             # §5.2-5.3: split records, CacheBlend, random
    exercise6(model, run, s, page)                  # §5.2: an even chunk length
    p3 = part3_insights(model, run, s, page)        # §5.3: the two insights, the curve
    pitfall_mask(model, run, s, page)               # §5.3: the released blenders' causal mask
    exercise7(p3.insights, s, page)                 # §5.3: the check at layer 0 vs 1
    part4_pipelining(s, page)                       # §5.4: loading hides the recompute
    exercise8(s, page)                              # §5.4: the controller


# ============================================================================ Part 5: a real model
@dataclass
class ToyInsights:
    top_share: float
    rank_corr: list[float]


@dataclass
class Real:
    study: dict                     # blend_real.real_experiment's result
    source: str                     # where the inputs came from
    model_name: str
    n_layers: int
    best: str                       # the rule with the most quality per measured TTFT (of those measured)
    score: dict[str, float]
    top_per_layer: list[float]      # share of the deviation held by the top TOP_SHARE tokens, layers 1..
    top_share: float
    rank_corr: list[float]
    toy: ToyInsights | None         # the record world's, beside it
    prefix: pc.Measured | None      # §5.1 on the built-in items (None with --passages)
    split: br.Decomposition         # the run's rule, its ranking oracle and the patch oracle at each ratio
    splits: dict                    # every rule measured: its Decomposition (--curve: every rule)
    chunks: br.ChunkLengths | None  # --curve on the built-in items: the same items with shorter chunks
    adaptive: br.RuleComparison | None  # --curve: a rule whose count adapts, beside flat


def real_study(s: Settings) -> Real:
    """SmolLM2-135M on RAG inputs (blend_real.py): KL to full prefill of one rule, random and the oracle at
    r (or, with --curve, of every selection rule at REAL_CURVE_RATIOS); live TTFT per rule; the record
    world's insights for comparison."""
    from common.gguf_llama import load_gguf_llama

    model, tok, info = load_gguf_llama(s.gguf, progress=True)
    if s.passages:
        rags, source = [br.passage_input(it, tok) for it in br.load_passages(s.passages)], s.passages
    else:
        rags, source = br.built_in_inputs(tok, s.items, s.chunk_tokens), "built-in RAG items (common/english.py)"
    path = Path(info["path"])
    model_id = f"{path.name}:{path.stat().st_size}"
    res = br.real_experiment(model, tok, rags, s.real_ratio, model_id, s.rule, s.curve, s.real_curve_ratios,
                             ttft_items=min(s.real_ttft_items, len(rags)), recompute=s.recompute)
    best, score = br.best_rule(res)
    dev, L = res["deviation"], res["deviation"][0].shape[0]
    per_layer = [statistics.fmean(top_share(d[i][None], s.top_share) for d in dev) for i in range(1, L)]
    corr = [statistics.fmean(spearman(d[i][None], d[i + 1][None]) for d in dev) for i in range(1, L - 1)]
    try:  # the toy model's figures beside the real one's (the cached record-world model, 200 documents)
        toy, _ = record_model(False, s.seed, locality=s.locality)
        found = insights(toy, heldout(200), s.chunk_len, s.ratio, s.top_share)
        toy_insights = ToyInsights(found.top_share, found.rank_corr)
    except TrainingFailed:
        toy_insights = None
    prefix = None if s.passages else pc.measured(
        model, tok, model_id, s.real_prefix_items, s.real_prefix_ks, s.chunk_tokens,
        s.rule, s.real_ratio, mp.MASKS, recompute=s.recompute)
    splits = {m: br.decompose(res["curves"], m, source) for m in res["curves"].ranking}
    chunks, adaptive = real_curve_studies(model, tok, rags, res, model_id, source, s) if s.curve else (None, None)
    return Real(res, source, path.stem, L, best, score, per_layer, statistics.fmean(per_layer), corr, toy_insights,
                prefix, splits[s.rule], splits, chunks, adaptive)


def real_curve_studies(model, tok, rags, res: dict, model_id: str, source: str, s: Settings):
    """With --curve: the built-in items with shorter chunks (not for --passages) and the adaptive rule beside
    flat at the same mean recomputed share (both cached)."""
    chunks = None if s.passages else br.chunk_length_study(
        model, tok, n_items=s.items, lengths=s.real_short_chunks, reference=s.chunk_tokens, ratios=res["ratios"],
        at=s.real_ratio, rule=s.rule, model_id=model_id, top=s.top_share, recompute=s.recompute)
    adaptive = br.compare_rules(model, tok, rags, targets=s.adaptive_targets, layer=s.adaptive_layer,
                                floor=s.adaptive_floor, model_id=model_id, source=source, recompute=s.recompute)
    return chunks, adaptive


def real_model(s: Settings, page: Page) -> None:
    with idle_threads():  # the TTFT is measured on one thread inside (blend_real.item_ttft)
        r = real_study(s)
    st, items = r.study, r.study["items"]
    page.part("Part 5", "§5.1-5.4", f"CacheBlend on a real LLaMA: {r.model_name} ({r.n_layers} layers)")
    page.say(inputs_line(r))
    page.say(("  the curve" if st["curve_mode"] else "  KL") + (
        " loaded from the cache (--recompute computes it again)" if st["loaded_from_cache"] else
        f" computed in {st['compute_seconds']:.0f} s and cached") + "; TTFT measured live")
    page.data(real_items=len(items), real_source=r.source, real_answers=[it["text"] for it in items])
    present_real_prefix(r, page)
    if st["curve_mode"]:
        present_real_curve(r, page)
    else:
        page.say(f"  Parts 5a-b and 5g-i, the quality curve of every selection rule, random and the two oracles at "
                 f"{', '.join(f'{x:.0%}' for x in s.real_curve_ratios)}, every rule's ranking oracle, shorter chunks "
                 f"and a rule whose count adapts: --curve ({len(s.real_curve_ratios) * (2 * len(br.RULE_NAMES) + 1)} "
                 "blends per item the first time, then cached; --items 8 for all eight)")
    present_real_ttft(r, s, page)
    present_real_answers(r, page)
    present_real_mask(r, page)
    present_real_insights(r, s, page)
    present_real_split(r, page)
    if st["curve_mode"]:
        present_rule_splits(r, page)
        if r.chunks:
            present_chunk_lengths(r.chunks, page)
        present_adaptive(r, page)
        real_curve_figure(r, s, page)


def inputs_line(r: Real) -> str:
    """The run's inputs in one line: how many, from where, the prefix, the chunks and the question (ranges)."""
    items = r.study["items"]
    span = lambda xs: f"{min(xs)}" if min(xs) == max(xs) else f"{min(xs)}-{max(xs)}"  # noqa: E731
    lens, prefix = [n for it in items for n in it["chunk_lens"]], items[0]["n_context"] - sum(items[0]["chunk_lens"])
    return (f"  {len(items)} inputs from {r.source}: {prefix}-token chat prefix + "
            f"{span([len(it['chunk_lens']) for it in items])} chunks of {span(lens)} tokens (each precomputed alone "
            f"behind the prefix) + a {span([it['n_question'] for it in items])}-token question")


def present_real_prefix(r: Real, page: Page) -> None:
    """§5.1 measured: prefix caching, full reuse and CacheBlend against k chunks (prefix_caching.measured)."""
    x = r.prefix
    if x is None:
        page.say("  §5.1 (prefix caching against k chunks) runs on the built-in items only, not on --passages.")
        return
    fields = [Field("k", "{}", "real_prefix_k", get="ks"), Field("tokens", get="n_tokens"),
              *[Field(f"{m} s", "{:.2f}", f"real_{m}_ttft_s", get=f"{m}_ttft_s") for m in ("full", *HOWS)],
              *[Field(f"{m} saves", "{:.0%}", f"real_{m}_saved_share", get=f"{m}_saved_share")
                for m in ("prefix", "blend")],
              *[Field(f"KL {m}", f, f"real_{m}_kl", get=f"{m}_kl")
                for m, f in zip(HOWS, ("{:+.0e}", "{:.4f}", "{:.4f}"))]]
    show(page, table_of(f"Part 5 (§5.1). Prefix caching, full reuse and CacheBlend {x.ratio:.0%} ({x.rule}) against k "
                     f"chunks of {x.chunk_tokens} tokens:\n  TTFT = CPU time of one thread (median of {x.n_items} "
                     "items, chunks' KV in memory); KL(full prefill || method), first answer token, nats"
                     + (" (loaded from the cache)" if x.loaded else
                        f" (computed in {x.compute_seconds:.0f} s, cached)"),
                     "§5.1", fields, points(x, fields), "prefix_caching.measured", real_prefix_notes(x)))


def real_prefix_notes(x: pc.Measured) -> list[str]:
    """How the saved shares and the KL move with k; whether prefix caching's KL is rounding (its reuse exact)."""
    exact = max(abs(v) for v in x.prefix_kl)
    return [saved_verdict("The share of full prefill's time prefix caching saves", x.prefix_saved_share) + "; "
            + saved_verdict(f"CacheBlend {x.ratio:.0%}'s", x.blend_saved_share) + ".",
            (f"Prefix caching's KL is zero up to float32 rounding (|KL| <= {exact:.0e}): the first chunk's stored "
             "KV is what a full prefill computes for it, its reuse is exact." if exact < 1e-6 else
             f"Prefix caching's KL reaches {exact:.1e}: more than rounding.") + " Full reuse's KL "
            + change(x.reuse_kl[0], x.reuse_kl[-1], "{:.3f}") + " with k, CacheBlend's "
            + change(x.blend_kl[0], x.blend_kl[-1], "{:.3f}") + "."]


def present_real_mask(r: Real, page: Page) -> None:
    """The bottom-right mask's cost on SmolLM2, from the same runs as §5.1's table."""
    x = r.prefix
    if x is None:
        return
    pos, wrong = x.mask_kl["position"], x.mask_kl["bottom-right"]
    worse = all(w > p for p, w in zip(pos, wrong))
    show(page, Table(f"Pitfall (§5.3): CacheBlend {x.ratio:.0%} ({x.rule}) with the position mask and with the "
                     "bottom-right mask of the released blenders,\n  KL(full prefill || method) of the first answer "
                     f"token (mean of {x.n_items} items)", "§5.3",
                     cols("k chunks", ("position mask", "{:.4f}"), ("bottom-right mask", "{:.4f}"),
                          ("bottom-right / position", "{:.2f}x")),
                     [Row([k, p, w, w / p]) for k, p, w in zip(x.ks, pos, wrong)], "prefix_caching.measured",
                     [why_the_mask_is_wrong_real(), "The bottom-right mask " + (
                         "moves the first token further from full prefill at every k" if worse else
                         "is not worse at every k") + f": at k = {x.ks[-1]}, {wrong[-1]:.4f} against {pos[-1]:.4f}."],
                     {"real_mask_k": x.ks[-1], "real_mask_position_kl": pos[-1], "real_mask_pitfall_kl": wrong[-1],
                      "real_mask_kl": x.mask_kl}))


def why_the_mask_is_wrong_real() -> str:
    return ("Why it is wrong: the mask takes the recomputed tokens for the last ones of the context, so a token "
            "picked earlier also attends to the chunks after it, a future no prefill shows (LMCache#1152, "
            "CacheBlend#21).")


def present_real_curve(r: Real, page: Page) -> None:
    st = r.study
    at, ratios, reuse, methods = st["at"], st["ratios"], st["kl_reuse"], st["methods"][1:]
    for name, kl, more, title in (
            ("5a", st["curve"], [(f"{at:.0%} / reuse", "{:.2f}x")],
             f"Mean KL(full prefill || method) of the first answer token, nats, vs recompute ratio r\n  (full reuse: "
             f"{reuse:.4f}; random: {br.RANDOM_RULE}'s counts, tokens at random; ranking-oracle: {st['rule']}'s "
             "counts, the tokens\n  with the largest true deviation, recomputed; oracle (the patch oracle): the full "
             "prefill's K, V of the top r N\n  tokens by true deviation, at every layer)"),
            ("5b", st["curve_answer"], [], f"The same, mean over the first {st['kl_tokens']} answer tokens, "
             f"teacher-forced on\n  full prefill's greedy answer (full reuse: {st['kl_answer_reuse']:.4f})")):
        show(page, Table(f"Part {name} (§5.3). {title}", "§5.3",
                         cols("rule", *[(f"r={x:.0%}", "{:.4f}") for x in ratios], *more),
                         [Row([m, *[kl[m][f"{x:g}"] for x in ratios]] + [kl[m][f"{at:g}"] / reuse] * len(more))
                          for m in methods], "blend_real.real_experiment"))


def present_real_ttft(r: Real, s: Settings, page: Page) -> None:
    st = r.study
    t, k, rule, ref = st["ttft"], f"{st['at']:g}", st["rule"], HANDOUT("real_ttft", s)
    rows = [Row(["full prefill", Val(t["full prefill"], "real_ttft_s.full prefill"), 1.0, "100%", None, None, None])]
    rows += [Row([m, Val(t[m], f"real_ttft_s.{m}"), Val(t["full prefill"] / t[m], "real_ttft_speedup" if m == rule
                                                       else None), st["share"][m], st["curve"].get(m, {}).get(k),
                  r.score.get(m), Val(st["counts"][m], f"real_counts.{m}",
                                      lambda c: " ".join(map(str, c[:4])) + f" ... {c[-1]}")]) for m in br.RULE_NAMES]
    show(page, Table(f"Part 5c (§5.4). Time to first token at r = {st['at']:.0%}, CPU wall clock, median of "
                     f"{st['ttft_items']} input(s), {st['threads']} torch thread(s),\n  chunks' KV in memory "
                     "(shift_kv + blend); noisy on a shared machine." + (f" Paper (GPU): {ref.figure}" if ref else ""),
                     "§5.4", cols("rule", ("TTFT s", "{:.2f}"), ("speed-up", "{:.2f}x"), ("recomputed", pct),
                                  ("KL first token", "{:.4f}"), ("KL removed / s", "{:.2f}"),
                                  "tokens at layers 1 2 3 4 ... last"), rows, "blend_real.real_experiment",
                     real_notes(r), {"real_rule": rule, "real_curve_measured": st["curve_mode"], "real_threads":
                                     st["threads"], "real_best_rule_this_run": r.best if st["curve_mode"] else None}))


def real_notes(r: Real) -> list[str]:
    """The rule reported as CacheBlend and the best rule of this run (how far the oracles are: Part 5f)."""
    st = r.study
    t, k, rule, reuse, kl = st["ttft"], f"{st['at']:g}", st["rule"], st["kl_reuse"], st["curve"]
    gain = lambda m: f"{1 - kl[m][k] / reuse:.0%} of full reuse's KL removed in {t[m]:.2f} s"  # noqa: E731
    notes = []
    if st["curve_mode"]:                # every rule measured: the one with the most quality per second
        rank = sorted(r.score, key=r.score.get, reverse=True).index(REAL_RULE) + 1
        notes.append(f"quality per TTFT = share of full reuse's KL removed / TTFT; best in this run: {r.best} "
                     f"({gain(r.best)}); the default --rule {REAL_RULE} " + (
                         "is that rule." if rank == 1 else f"ranks {rank} of {len(r.score)} (one run's timings on a "
                         "shared CPU can reorder rules whose recomputed shares are close)."))
    notes.append(f"CacheBlend below = --rule {rule} ({gain(rule)})." + (
        "" if st["curve_mode"] else f" The default, {REAL_RULE}, has the lowest first-token KL at 15% summed over "
                                    "the built-in items, passages_example.json and passages_six.json (--curve "
                                    "measures every rule; on passages_six.json alone the check-layer rules are "
                                    "closer)."))
    return notes


def present_real_answers(r: Real, page: Page) -> None:
    st, items = r.study, r.study["items"]
    k, at, rule = f"{st['at']:g}", st["at"], st["rule"]
    keys = {m: f"real_kl_{name}{pk(at)}" for m, name in ((rule, "blend"), ("random", "random"), ("oracle", "oracle"))}
    first = {"full prefill": "0", "full reuse": Val(st["kl_reuse"], "real_kl_reuse"),
             **{m: Val(c[k], keys.get(m)) for m, c in st["curve"].items()}}
    answer = {"full prefill": "0", "full reuse": Val(st["kl_answer_reuse"], "real_kl_answer_reuse"),
              **{m: c[k] for m, c in st["curve_answer"].items()}}
    show(page, Table(f"Part 5d (§5.3). KL and greedy answers at r = {at:.0%} (the answers of --rule {rule} shown "
                     "below)", "§5.3", cols("method", ("KL first token", "{:.4f}"), (
                         f"KL first {st['kl_tokens']} tokens", "{:.4f}"), ("same greedy answer", lambda x: (
                             f"{x}/{len(items)}"), "real_same_answer.{row}")),
                     [Row([m, first[m], answer[m], st["same_answer"][m]], key=m) for m in st["same_answer"]],
                     "blend_real.real_experiment",
                     json={"real_kl_curve": st["curve"], "real_kl_answer_curve": st["curve_answer"]}))
    for it in items:
        page.say(f"\n{it['question']}" + (f"\n  (reference: {it['reference']})" if it["reference"] else "") + "".join(
            f"\n  {m:14s} {it['text'][m].strip()!r}" for m in ("full prefill", "full reuse", rule, "random")))


def present_real_insights(r: Real, s: Settings, page: Page) -> None:
    toy, top, pl = r.toy, pk(s.top_share), r.top_per_layer
    three = lambda f: lambda xs: " / ".join(f(x) for x in (min(xs), statistics.median(xs), max(xs)))  # noqa: E731
    show(page, Table(f"Part 5e (§5.3). The two insights on a real model\n  (deviation = full reuse's KV minus full "
                     f"prefill's, layers 1-{len(pl)})", "§5.3",
                     cols("insight", ("SmolLM2-135M", pct), ("record world", pct), "handout / paper"), [
        Row([f"top {s.top_share:.0%} of tokens: share of KV deviation",
             Val(r.top_share, f"real_top{top}_deviation_share"),
             toy.top_share if toy else None, HANDOUT.figure("top_share", s)]),
        Row(["  per layer: min / median / max", Val(pl, f"real_top{top}_per_layer", three(pct)), None, DASH]),
        Row(["rank correlation of deviation, adjacent layers: min / median / max",
             Val(r.rank_corr, "real_adjacent_layer_rank_corr", three("{:.2f}".format)),
             " ".join(f"{c:.2f}" for c in toy.rank_corr) if toy else None, HANDOUT.figure("rank_corr", s)])],
        "04_cacheblend.real_study"))


SPLIT_COLS = (("ranking oracle", "{:.4f}"), ("patch oracle", "{:.4f}"), ("ranking's part", "{:+.4f}"),
              ("recompute's part", "{:+.4f}"), "larger part")


def split_cells(d: br.Decomposition, x: float) -> list:
    return [d.rule_kl[x], d.ranking[x], d.patch[x], d.ranking_part(x), d.recompute_part(x), d.dominant(x)]


def present_real_split(r: Real, page: Page) -> None:
    """The run's rule, its ranking oracle and the patch oracle at each measured ratio."""
    d, at = r.split, r.study["at"]
    show(page, Table(f"Part 5f (§5.3). Where {d.rule}'s distance from full prefill comes from, mean first-token KL "
                     "(nats)\n"
                     f"  ranking oracle: {d.rule}'s counts and nesting, its tokens picked by their true deviation, "
                     "recomputed by blend();\n  patch oracle: the full prefill's own K, V for as many tokens of "
                     "every layer, no recompute", "§5.3",
                     cols(("r", "{:.0%}"), (d.rule, "{:.4f}"), *SPLIT_COLS),
                     [Row([x, *split_cells(d, x)]) for x in d.ratios], "blend_real.decompose", [split_verdict(d, at)],
                     {f"real_dominant{pk(at)}": d.dominant(at)}))


def split_verdict(d: br.Decomposition, at: float) -> str:
    """Which part of the rule's distance to the patch oracle dominates at `at`, in the words the numbers allow."""
    gap, rank, rec = d.rule_kl[at] - d.patch[at], d.ranking_part(at), d.recompute_part(at)
    head = (f"at {at:.0%}: {d.rule} {d.rule_kl[at]:.4f}, its ranking oracle {d.ranking[at]:.4f}, the patch oracle "
            f"{d.patch[at]:.4f}: ")
    if gap <= 0:
        return head + f"{d.rule} is at or past the patch oracle for these inputs; neither part is left" + (
            "; the true ranking is further from full prefill than the rule's: here the tokens that deviate most are "
            "not the ones the answer needs most." if rank < 0 else ".")
    if rank <= 0:
        return head + ("the true ranking gains nothing over the rule's for these inputs: the whole distance is the "
                       "recompute's (recomputed tokens attend to neighbours that kept their stale K, V).")
    if rec <= 0:
        return head + "the whole distance is the ranking's: the rule picks the wrong tokens for these inputs."
    big = max(rank, rec)
    return head + (f"the {d.dominant(at)} dominates for these inputs ({big / gap:.0%} of the distance): " + (
        "a better ranking could remove it" if d.dominant(at) == "ranking" else
        "a better ranking could remove at most the rest; recomputed tokens attend to neighbours that kept their "
        "stale K, V") + ".")


def ranking_room(d: br.Decomposition, at: float, splits: dict) -> str:
    """How much a better ranking could still gain over the rule at `at` (the decomposition), and how close
    the rules measured come to the rule's ranking oracle."""
    gap = d.rule_kl[at] - d.patch[at]
    if gap <= 0:
        return f"at {at:.0%} {d.rule} is already at or past the patch oracle (Part 5f): no ranking has a gap to close."
    if d.ranking_part(at) <= 0:
        return f"at {at:.0%} the true ranking removes none of {d.rule}'s distance to the patch oracle (Part 5f)."
    best = min(splits.values(), key=lambda x: x.rule_kl[at])
    return (f"at {at:.0%} the true ranking would remove {min(1.0, d.ranking_part(at) / gap):.0%} of {d.rule}'s "
            f"distance to the patch oracle (Part 5f); " + (
                f"{best.rule} gets there ({best.rule_kl[at]:.4f} against {d.ranking[at]:.4f})." if
                best.rule_kl[at] <= d.ranking[at] else
                f"no rule measured gets there (closest: {best.rule} {best.rule_kl[at]:.4f} against "
                f"{d.ranking[at]:.4f})."))


def present_rule_splits(r: Real, page: Page) -> None:
    """Every rule measured, its ranking oracle (same counts) and the patch oracle at the run's ratio."""
    at = r.study["at"]
    show(page, Table(f"Part 5g (§5.3). Every rule at r = {at:.0%} beside its own ranking oracle (the check-layer "
                     "rules compute layers 0-1 in full)", "§5.3", cols("rule", ("KL", "{:.4f}"), *SPLIT_COLS),
                     [Row([m, *split_cells(d, at)]) for m, d in r.splits.items()], "blend_real.decompose",
                     json={"real_kl_ranking_oracle": {m: d.ranking for m, d in r.splits.items()}}))


def present_chunk_lengths(c: br.ChunkLengths, page: Page) -> None:
    """The built-in items at several chunk lengths: the rule's curve, the two oracles at `at`, how spread
    the deviation is, and the ratio that matches the reference length's quality at `at`."""
    at, ratios = c.at, c.row(c.reference).split.ratios
    rows = [Row([x.chunk_tokens, x.n_context, bounds_per_1k(x), x.split.reuse, *[x.split.rule_kl[q] for q in ratios],
                 x.split.ranking[at], x.split.patch[at], x.top_share, c.needed(x)]) for x in c.rows]
    show(page, Table(f"Part 5h (§5.3). Shorter chunks: the built-in items cut to each chunk length, mean first-token "
                     f"KL of full reuse, of {c.rule}\n  at each r and of its two oracles at {at:.0%}; bounds/1k: chunk "
                     f"boundaries per 1,000 context tokens; last column: the least\n  measured r at which {c.rule} "
                     f"gets as close to full prefill as at {at:.0%} with {c.reference}-token chunks", "§5.3",
                     cols("chunk", "context", ("bounds/1k", "{:.1f}"), ("reuse", "{:.4f}"),
                          *[(f"r={q:.0%}", "{:.4f}") for q in ratios], (f"ranking {at:.0%}", "{:.4f}"),
                          (f"patch {at:.0%}", "{:.4f}"), (f"top {c.top:.0%} hold", pct),
                          (f"r like {c.reference}", "{:.0%}")), rows, "blend_real.chunk_length_study", chunk_notes(c),
                     {"real_chunk_kl": {str(x.chunk_tokens): x.split.rule_kl for x in c.rows},
                      "real_chunk_top_share": {str(x.chunk_tokens): x.top_share for x in c.rows}}))


def bounds_per_1k(x: br.ChunkLength) -> float:
    """Chunk boundaries per 1,000 context tokens: where full reuse loses what the chunks would have seen."""
    return 1000 * (x.n_chunks - 1) / x.n_context


def chunk_notes(c: br.ChunkLengths) -> list[str]:
    """Whether the ratio is enough at each other length, and why, from the table's numbers."""
    at, ref, notes = c.at, c.row(c.reference), []
    for x in c.rows:
        if x is ref:
            continue
        need = c.needed(x)
        enough = (f"{at:.0%} is enough" if need is not None and need <= at else
                  f"{at:.0%} is not enough: {c.rule} needs {need:.0%}" if need is not None else
                  f"{at:.0%} is not enough: no measured ratio up to {max(x.split.ratios):.0%} gets there")
        if need is None or need > at:
            enough += (f" (the patch oracle at {at:.0%}: {x.split.patch[at]:.4f}, against {c.rule}'s "
                       f"{ref.split.rule_kl[at]:.4f} with {c.reference}-token chunks)")
        spread = ("more spread" if x.top_share < ref.top_share else "no more spread")
        notes.append(f"{x.chunk_tokens}-token chunks: {enough}; {bounds_per_1k(x):.1f} chunk boundaries per 1,000 "
                     f"tokens against {bounds_per_1k(ref):.1f}, and the deviation is {spread} (the top {c.top:.0%} of "
                     f"tokens hold {x.top_share:.0%} of it against {ref.top_share:.0%}).")
    return notes


def present_adaptive(r: Real, page: Page) -> None:
    """The adaptive rule at each share target beside flat recomputing the same mean share."""
    a = r.adaptive
    fields = [Field("share held", pct, get="target"), Field("recomputed", pct, get="recomputed"),
              Field("min-max over inputs", lambda x: f"{pct(x[0])}-{pct(x[1])}", get="spread"),
              Field("KL adaptive", "{:.4f}", get="kl"), Field("flat r", pct, get="flat_ratio"),
              Field("flat recomputed", pct, get="flat_recomputed"), Field("KL flat", "{:.4f}", get="flat_kl"),
              Field("closer", get=closer)]
    show(page, table_of(f"Part 5i (§5.3). A rule whose count adapts: layers up to {a.layer} in full, then the "
                        f"smallest set holding a share of layer {a.layer}'s\n  measured deviation (at least "
                        f"{a.floor:.0%} of the tokens), beside flat recomputing the same mean share; mean first-token "
                        "KL", "§5.3", fields, a.rows, "blend_real.compare_rules",
                        [f"the adaptive rule is closer to full prefill than flat at "
                         f"{sum(closer(m) == 'adaptive' for m in a.rows)} of {len(a.rows)} matched shares; "
                         + ranking_room(r.split, r.study["at"], r.splits)],
                        {"real_adaptive": [dataclasses.asdict(m) for m in a.rows]}))


def closer(m: br.Matched) -> str:
    """Which rule is closer to full prefill at one matched share ("same" when the KLs print alike)."""
    return "same" if abs(m.kl - m.flat_kl) < 5e-5 else "adaptive" if m.kl < m.flat_kl else "flat"


def real_curve_figure(r: Real, s: Settings, page: Page) -> None:
    """First-answer-token KL against the recompute ratio, one line per rule, random, the ranking oracle of
    the run's rule and the patch oracle."""
    st = r.study
    style = {"random": dict(color="gray", ls="--"), "oracle": dict(color="black", ls=":"),
             "ranking-oracle": dict(color="black", ls="-.")}
    label = {"ranking-oracle": f"ranking oracle ({st['rule']})", "oracle": "patch oracle"}
    lines = [Series([100 * x for x in st["ratios"]], [st["curve"][m][f"{x:g}"] for x in st["ratios"]],
                    label.get(m, m), style=dict(marker="o", ms=3, **style.get(m, {}))) for m in st["methods"][1:]]
    chart_figure(page, "04_real_curve_passages.png" if s.passages else "04_real_curve.png", Chart(
        lines, "recompute ratio r (%)", "KL(full prefill || method), first answer token (nats)", yscale="log",
        hlines=[(st["kl_reuse"], dict(color="tab:red", lw=1, label="full reuse"))]),
        f"{r.model_name}: which tokens to recompute ({len(st['items'])} inputs)", figsize=(7, 4))


# ============================================================================ main
def command_line(argv=None):
    p = Parser(__doc__)
    g = p.add_argument_group("the record world and the time model (Parts 1-4, exercises 5-8)")
    g.add_argument("--chunk-len", type=positive_int, default=CHUNK_LEN, help="record-world chunk length (tokens)")
    g.add_argument("--ratio", type=fraction, default=RATIO, help="CacheBlend's recompute ratio r in the record world")
    g.add_argument("--docs", type=positive_int, default=N_DOCS, help="held-out record-world documents (x 12 questions)")
    g.add_argument("--retrain", action="store_true", help="train the record-world model again")
    g.add_argument("--seed", type=int, default=rt.SEED, help="training seed of the record-world model")
    g.add_argument("--locality", type=nonneg_float, default=rt.LOCALITY,
                   help="weight of the record model's locality penalty (0: none; see record_trainer.TRAIN)")
    g.add_argument("--min-ratio", type=fraction, default=MIN_RATIO, help="the controller's quality floor")
    g.add_argument("--layers", type=positive_int, default=EX8_LAYERS, help="exercise 8: number of layers")
    g.add_argument("--read-ms", type=positive_float, default=EX8_READ_MS, help="exercise 8: read one layer's KV (ms)")
    g.add_argument("--prefill-ms", type=positive_float, default=EX8_PREFILL_MS, help="exercise 8: prefill a layer (ms)")
    g = p.add_argument_group("the real model (Part 5: --model smollm2; these flags need it)")
    g.add_argument("--model", choices=["record", "smollm2"], default="record",
                   help="record: Parts 1-4 (toy models, time model); smollm2: Part 5 on SmolLM2-135M")
    g.add_argument("--real-ratio", type=fraction, default=REAL_RATIO, help="CacheBlend's recompute ratio r on it")
    g.add_argument("--gguf", metavar="PATH", help="another LLaMA GGUF file")
    g.add_argument("--items", type=positive_int, default=REAL_ITEMS, help="RAG items (max 8)")
    g.add_argument("--rule", choices=list(RULES), default=REAL_RULE,
                   help="blend()'s selection rule reported as CacheBlend (JSON real_kl_blend<r>: real_kl_blend15)")
    g.add_argument("--passages", metavar="FILE",
                   help='your own inputs, JSON [{"question": str, "passages": [str, ...], "answer": str (optional)}, '
                        '...]; each passage is one chunk')
    g.add_argument("--chunk-tokens", type=positive_int, default=REAL_CHUNK_TOKENS,
                   help="tokens per chunk of the built-in RAG items")
    g.add_argument("--curve", action="store_true",
                   help="every selection rule, random and the oracle at 5-50%% (cached)")
    g.add_argument("--recompute", action="store_true", help="compute the cached KL again")
    a = p.parse_args(argv)
    if a.model == "smollm2":
        from common.english import RAG_ITEMS
        if a.items > len(RAG_ITEMS):
            fail(f"--items must be at most {len(RAG_ITEMS)} (the RAG items in common/english.py)")
        if a.ratio != RATIO:
            fail("--ratio is the record world's recompute ratio; with --model smollm2 use --real-ratio")
        if a.passages:
            try:
                br.load_passages(a.passages)
            except ValueError as e:
                fail(f"--passages: {e}")
    elif a.passages or a.curve or a.chunk_tokens != REAL_CHUNK_TOKENS or a.real_ratio != REAL_RATIO:
        fail("--passages, --curve, --chunk-tokens and --real-ratio need --model smollm2")
    elif a.chunk_len > DOC_LEN:
        fail(f"--chunk-len must be at most the document length ({DOC_LEN})")
    return a


def settings(a) -> Settings:
    """The run's settings: the command line's flags, and the constants above that have none."""
    return settings_from(Settings, a, city_chunks=CITY_CHUNKS, city_chunk_len=CITY_CHUNK_LEN, city_docs=CITY_DOCS,
                         ex5_shift=EX5_SHIFT, ex6_chunk_len=EX6_CHUNK_LEN, top_share=TOP_SHARE,
                         curve_ratios=tuple(CURVE_RATIOS), curve_chunk_lens=tuple(CURVE_CHUNK_LENS), recover=RECOVER,
                         rag_chunks=RAG_CHUNKS, rag_chunk_tokens=RAG_CHUNK_TOKENS, rag_question=RAG_QUESTION, gpu=GPU,
                         systems=tuple(map(tuple, SYSTEMS)), devices=dict(DEVICES), paper_context=PAPER_CONTEXT,
                         paper_ratio=PAPER_RATIO, paper_device=PAPER_DEVICE, real_curve_ratios=tuple(REAL_CURVE_RATIOS),
                         real_ttft_items=REAL_TTFT_ITEMS, prefix_ks=tuple(PREFIX_KS),
                         prefix_devices=tuple(PREFIX_DEVICES), real_prefix_ks=tuple(REAL_PREFIX_KS),
                         real_prefix_items=REAL_PREFIX_ITEMS, real_short_chunks=tuple(REAL_SHORT_CHUNKS),
                         adaptive_targets=tuple(ADAPTIVE_TARGETS), adaptive_layer=ADAPTIVE_LAYER,
                         adaptive_floor=ADAPTIVE_FLOOR)


def unedited(s: Settings) -> Settings:
    """The settings of a run in the same mode with nothing edited (--model, --curve, --recompute and
    --retrain choose what runs, not its inputs)."""
    return dataclasses.replace(shipped_defaults(Settings, globals()), model=s.model, curve=s.curve,
                               recompute=s.recompute, retrain=s.retrain)


def main(argv=None) -> Page | None:
    a = command_line(argv)
    s = settings(a)
    if s.model == "smollm2":
        from common.gguf_llama import smollm2_or_explain
        if smollm2_or_explain(s.gguf) is None:
            return None
    t_start = time.time()
    # the real model's page is a section of its own (figures/pages/04_smollm2.json beside 04.json)
    page = Page("04" if s.model == "record" else "04_smollm2", "CacheBlend: non-prefix KV reuse, selective recompute"
                + ("" if s.model == "record" else ", on a real LLaMA"), "§5", s, unedited(s), not a.no_plot)
    if s.model == "smollm2":
        real_model(s, page)
    else:
        with single_thread():  # models of d = 64: a second thread gains little, and waits when a core is busy
            record_world(s, page)
    print(f"({time.time() - t_start:.0f} s)")
    page.finish(a.json)
    return page


if __name__ == "__main__":
    main()

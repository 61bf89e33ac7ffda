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
    python code/lecture27/04_cacheblend.py --model smollm2 --passages code/lecture27/passages/passages_example.json
    python code/lecture27/04_cacheblend.py --model smollm2 --curve --passages code/lecture27/passages/passages_six.json

In the handout's order:
§5.1    Part 0: prefix caching is not enough (prefix_caching.py, time model): RAG with k = 1..10 chunks of
        512 tokens + a 32-token question on LLaMA-7B (1 x A40) and LLaMA-70B (2 x A40), the KV in CPU memory
        or on NVMe: TTFT of full prefill, prefix caching (only the first chunk is a prefix), full reuse and
        CacheBlend (MIN_RATIO, pipelined as in Part 4), and the share of full prefill's GPU time each saves.
        Exercise 5: a chunk's K computed at 0 and rotated to 1000 vs computed at 1000, V unchanged, and
        full reuse with the K left unrotated (the city model).
§5.2    Part 1: the city language (city_reuse.py), 3 chunks x 8 tokens + an 8-token question: full prefill vs full KV
        reuse (each chunk precomputed alone, K moved by shift_kv). Sentences are independent: no loss.
§5.2-3  Part 2: the record world (blend_world.py, record_blend.py), chunks of 5: accuracy on split and unsplit records
        under full prefill, full reuse, CacheBlend and a random selection of the same size; the rules
        that read the input first (the question's attention, chunk starts) beside them.
        Exercise 6: how many records chunk length 6 splits, and full reuse's accuracy there.
§5.3    Part 3 (record_blend.py): the two insights (deviation is concentrated; adjacent layers agree), layer 0's picks,
        shorter chunks, and the compute-quality curve. The deviation is concentrated because document
        tokens attend almost only to themselves (and a value to its key): the record model learned that
        locality from a small penalty (record_trainer.LOCALITY), as a pretrained LLM learns it from language.
        The pitfall of the released blenders (mask_pitfall.py): the recomputed tokens' causal mask aligned
        to the bottom right, against blend's position mask. Exercise 7: the check's cost at layer 0 vs
        layer 1 (time model).
§5.4    Part 4: hiding recompute behind loading (blend/timing.py, on common/timemodel.py): per layer load vs recompute
        per storage device, the controller's ratio, pipelined TTFT; LLaMA-7B vs 70B; requests/s of a
        busy server, full prefill vs CacheBlend (the paper's 2.8-5x throughput); the same per layer and over
        every layer on one H200 (CHECK_GPU), beside that GPU's measurement (common/gpu_reference.json, a
        column of its own; gpu_check.py measures yours); the controller
        (loading_controller.py) also says when not to reuse: a read slower than the layer's prefill means a
        full prefill, or the fastest device that still pays; a query rule ranking by layers 1..j waits for
        their KV (QUERY_DEPTHS). Exercise 8.
Part 5 (--model smollm2 and the flags of its own group; blend/rag_study.py, blend/rag.py): the same blend() on
        SmolLM2-135M-Instruct, RAG items of 6 chunks x 256 tokens + the question (or --passages FILE: your
        own, one chunk per passage): KL to full prefill of CacheBlend (RULE), random and an oracle at
        15% (cached), each selection rule's measured CPU TTFT at 15% (live), greedy answers, the two
        insights on a real model; §5.1 measured (k = 2, 4, 6 chunks: TTFT on one thread and KL of prefix
        caching, full reuse, CacheBlend) and the mask pitfall's KL (prefix_caching.measured, cached); where
        the rule's distance from full prefill comes from: its ranking (rule -> ranking oracle) or recomputing
        from a partly stale cache (ranking oracle -> patch oracle).
        The rules that read the input before blend() (blend_rules.INPUT_RULES): the question's attention
        over full reuse's cache (query, query+dev) and EPIC's chunk starts (chunk-start), at r, timed with
        their own pass (Part 5j).
        --curve: KL vs recompute ratio for every selection rule (blend_rules.ALL_RULES), random and
        the two oracles, and a figure; every rule's ranking oracle; the query rules over j, the layers the
        question's attention is read from, KL against TTFT (Part 5k); every chunk prefilled alone at
        position 0; the built-in items with shorter chunks; a rule whose count adapts to the input beside flat.
Each Part is computed here (by the library) and shown by blend/page.py (Parts 0-4, exercises 5-8) or
blend/rag_page.py (Part 5): their tables, notes, figures and --json keys.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace

from lecture27.blend import page as bp
from lecture27.blend import rag as blend_rag
from lecture27.blend import rag_page
from lecture27.blend import rag_study
from lecture27.blend import timing as bt
from lecture27.blend import city_reuse
from lecture27.blend import mask_pitfall as mp
from lecture27.blend import prefix_caching as pc
from lecture27.blend import record_blend as rb
from lecture27 import record_trainer as rt  # rt.SEED, rt.LOCALITY: the trainer's defaults
from lecture27 import blend_rules
from lecture27.blend_world import DOC_LEN
from common import timemodel as tm
from common.checkpoints import TrainingFailed
from common.city import city_model
from common.cli import (Parser, fail, fraction, nonneg_float, positive_float, positive_int, settings,
                        settings_from, shipped_defaults)
from common.llama import idle_threads, single_thread
from common.measured import cached_computation
from common.present import Page

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
DOCS = 1000                               # held-out documents (x 12 questions; 2,000 on split records)
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
QUERY_DEPTHS = [1, 4, 16, 79]             # a query rule ranks by the question's attention at layers 1..j (to the last)
CHECK_GPU = "H200"                        # Part 4 on one GPU of the time model, beside that GPU's measurement
CHECK_CONTEXTS = [4096, 16384]            # ... at these context lengths (common/gpu_reference.json)
LAYERS, READ_MS, PREFILL_MS = 32, 10.0, 20.0   # exercise 8: the controller's inputs (per layer: read, prefill)
# ---- Part 5: the real model (blend/rag_study.py)
ITEMS = 2                                 # RAG items (of 8; --items 8: all, ~40 s each the first time): their
                                          # KL is computed once and cached, as the TTFT is
REAL_CHUNK_TOKENS = 256                   # tokens per retrieved chunk (6 chunks + the question per item)
REAL_RATIO = 0.15                         # CacheBlend's default recompute ratio
# The selection rule reported as CacheBlend: query ranks the tokens by the question's attention over full reuse's
# cache, chosen as the rule closest to full prefill at 15% on the public input sets (Parts 5c and 5j measure it).
RULE = "query"
REAL_CURVE_RATIOS = [0.05, 0.15, 0.30, 0.50]  # --curve: every rule, random and the two oracles at these ratios
REAL_QUERY_J = [1, 4, 15, 29]              # --curve: the query rules at r read the question's attention at layers 1..j
REAL_SHORT_CHUNKS = [64, 128]             # --curve, built-in items: also cut to these chunk lengths (as --passages')
ADAPTIVE_TARGETS = [0.5, 0.7, 0.85]       # --curve: the adaptive rule keeps the smallest set holding these shares
ADAPTIVE_LAYER = 1                        # ... of the deviation measured at this layer (computed in full up to it)
ADAPTIVE_FLOOR = 0.05                     # ... and never fewer than this ratio of the tokens
REAL_TTFT_ITEMS = 1                       # inputs whose TTFT is measured live (a full prefill: ~5.5 s, one thread)
REAL_TIER = "disk"                        # Part 5c's chunks come from this tier of a real store (kvstore: "ram" or
                                          # "disk", its pages dropped before each read): the TTFT includes the fetch
REAL_PREFIX_KS = [2, 4, 6]                # §5.1 on SmolLM2: k chunks of REAL_CHUNK_TOKENS (cached with its TTFT)
REAL_PREFIX_ITEMS = 1                     # built-in items measured at each k (~1 min each on one core; --prefix-items)


@settings(globals())
class Settings:
    """One run's settings: the constants above (field = constant's name), as the command line set them;
    then those whose defaults are not 04's constants: the record model's (record_trainer's), and what
    chooses which Parts run and how."""
    seed: int = rt.SEED             # the record model's training seed and locality penalty: the trainer's
    locality: float = rt.LOCALITY
    model: str = "record"           # "record": Parts 0-4; "smollm2": Part 5
    gguf: str | None = None
    passages: str | None = None
    curve: bool = False
    recompute: bool = False
    remeasure: bool = False
    retrain: bool = False


MODES = ("model", "curve", "recompute", "remeasure", "retrain")   # choose what runs, not its inputs: never a what-if


# ============================================================================ Parts 0-4: the time model, the toys
def part0_prefix(s: Settings) -> pc.PrefixStudy:
    """§5.1 on the time model: prefix caching, full reuse and CacheBlend against k chunks (prefix_caching.py)."""
    return pc.time_model(s.systems, s.gpu, {d: s.devices[d] for d in s.prefix_devices}, s.prefix_ks,
                         s.rag_chunk_tokens, s.rag_question, s.min_ratio)


def record_world_model(s: Settings):
    """(model, rb.Training): the record-world LLaMA of the run's seed and locality, trained once, then loaded;
    a training that fails stops the run with its message."""
    try:
        return rb.trained(s.retrain, s.seed, s.locality)
    except TrainingFailed as e:
        print(f"\n!!! {e}\n", file=sys.stderr)
        sys.exit(1)


def rag(s: Settings) -> bt.Rag:
    return bt.Rag(s.gpu, s.rag_chunks, s.rag_chunk_tokens, s.rag_question, s.devices, s.min_ratio)


def exercise7(s: Settings) -> list[bt.CheckCost]:
    """§5.3, exercise 7: the check's cost at layer 0 and layer 1 on every system (time model)."""
    return [bt.check_cost(m, g, rag(s).n_ctx, s.gpu) for m, g in s.systems]


def part4_pipelining(s: Settings) -> dict[str, bt.SystemTiming]:
    """§5.4 on the time model: per system, loading against recompute, the controller, a busy server."""
    paper = bt.Paper(s.paper_context, s.paper_ratio, s.paper_device)
    return {model: bt.system_timing(model, n_gpus, rag(s), paper) for model, n_gpus in s.systems}


def part4_query_wait(s: Settings) -> list[bt.QueryWait]:
    """§5.4 on the time model: a query rule ranking by layers 1..j waits for their KV (KV on the paper's device)."""
    return [bt.query_wait(model, n_gpus, rag(s), s.paper_device, s.query_depths) for model, n_gpus in s.systems]


def part4_one_gpu(s: Settings) -> list[bt.OneGpuRow]:
    """§5.3-5.4 on one CHECK_GPU of the time model: per system's model and context, a layer's full prefill, its
    recompute at the floor, its KV's read from pinned CPU memory, and the pipeline over every layer."""
    return bt.one_gpu([model for model, _ in s.systems], s.check_gpu, s.check_contexts, s.min_ratio)


def exercise8(s: Settings):
    """§5.4, exercise 8: the controller on the exercise's per-layer read and prefill times."""
    return bt.controller_example(s.layers, s.read_ms, s.prefill_ms, s.min_ratio)


def record_parts(s: Settings, model) -> tuple:
    """Parts 2-3, exercise 6 and the mask pitfall on the record-world model: (the run, the input rules' accuracy,
    exercise 6's split, the findings, the mask pitfall's cost), computed once for this model and these settings,
    then loaded (--recompute computes them again)."""
    x = dict(docs=s.docs, chunk_len=s.chunk_len, ratio=s.ratio, seed=s.seed, ex6_chunk_len=s.ex6_chunk_len,
             top_share=s.top_share, curve_ratios=list(s.curve_ratios), curve_chunk_lens=list(s.curve_chunk_lens),
             recover=s.recover)

    def compute():
        run = rb.record_experiment(model, x["docs"], x["chunk_len"], x["ratio"], x["seed"])
        return (run.shown(), rb.input_rules(model, run), rb.split_at(model, run, x["ex6_chunk_len"]),
                rb.findings(model, run, x["top_share"], x["curve_ratios"], x["curve_chunk_lens"], x["recover"]),
                mp.record_cost(model, run.rec, x["chunk_len"], x["ratio"], run.pre))
    return cached_computation("record-parts", {"model": model.cache_key, **x}, compute, s.recompute, tag="04")


def record_world(s: Settings, page: Page) -> None:
    """Parts 0-4 and exercises 5-8, each computed and then shown, as the handout poses them."""
    city, lang = city_model()
    docs = city_reuse.city_docs(city, lang, s.city_docs, 0, s.city_chunks, s.city_chunk_len)
    bp.show_prefix(page, part0_prefix(s), s)                                     # §5.1: prefix caching is not enough
    bp.show_moved_chunk(page, city_reuse.moved_chunk(docs, lang, s.city_chunk_len, s.ex5_shift), s)  # §5.1: ex. 5
    bp.show_city(page, city_reuse.city_losses(docs, lang, s.city_chunk_len), s)          # §5.2: the city language
    model, training = record_world_model(s)
    bp.show_record_model(page, training, s)
    run, rules, split, found, mask = record_parts(s, model)
    bp.show_records(page, run, s)                                                # §5.2-5.3: split records
    bp.show_input_rules(page, run, rules, s)                                     # §5.3: the question's attention
    bp.show_split_at(page, split, s)                                             # §5.2: exercise 6
    bp.show_findings(page, found, s)                                             # §5.3: the two insights, the curve
    bp.show_mask(page, mask, s)                                                  # §5.3: the mask pitfall
    bp.show_check_cost(page, exercise7(s), found.insights.layer0_vs_layer1, s)   # §5.3: exercise 7
    bp.show_pipelining(page, part4_pipelining(s), s, part4_query_wait(s))        # §5.4: loading hides the recompute
    bp.show_one_gpu(page, part4_one_gpu(s), s)                                   # §5.4: one GPU, a measured reference
    bp.show_controller(page, exercise8(s), s)                                    # §5.4: exercise 8, the controller


# ============================================================================ Part 5: a real model
def part5_real(s: Settings) -> rag_study.Real:
    """SmolLM2-135M on RAG inputs (blend/rag_study.py): KL to full prefill of one rule, random and the
    oracles at r (or, with --curve, of every selection rule at REAL_CURVE_RATIOS); live TTFT per rule; the
    two insights beside the record world's; §5.1 and the mask pitfall measured; where the distance comes from."""
    lm = rag_study.load(s.gguf)
    rags, source = rag_study.inputs(lm, s.passages, s.items, s.real_chunk_tokens)
    run = rag_study.experiment(lm, rags, ratio=s.real_ratio, rule=s.rule, curve=s.curve,
                               curve_ratios=s.real_curve_ratios, ttft_items=s.real_ttft_items,
                               recompute=s.recompute, tier=s.real_tier, depths=s.real_query_j,
                               remeasure=s.remeasure)
    found = rag_study.deviation(run, s.top_share)
    toy = rag_study.toy_insights(s.seed, s.locality, s.chunk_len, s.ratio, s.top_share)
    prefix = None if s.passages else pc.measured(
        lm.model, lm.tok, lm.model_id, s.real_prefix_items, s.real_prefix_ks, s.real_chunk_tokens,
        blend_rules.blend_rule_of(s.rule), s.real_ratio, mp.MASKS, recompute=s.recompute)
    splits = {m: blend_rag.decompose(run.curves, m, source) for m in run.curves.ranking}
    chunks, adaptive = rag_study.curve_studies(
        lm, rags, run, source, built_in=not s.passages, items=s.items, short_chunks=s.real_short_chunks,
        chunk_tokens=s.real_chunk_tokens, top=s.top_share, targets=s.adaptive_targets, layer=s.adaptive_layer,
        floor=s.adaptive_floor, recompute=s.recompute) if s.curve else (None, None)
    return rag_study.Real(run=run, source=source, model_name=lm.name, n_layers=run.deviation[0].shape[0],
                          default_rule=RULE, insights=found, toy=toy, prefix=prefix, split=splits[s.rule],
                          splits=splits, chunks=chunks, adaptive=adaptive)


# ============================================================================ the command line
def parser() -> Parser:
    p = Parser(__doc__)
    g = p.add_argument_group("the record world and the time model (Parts 1-4, exercises 5-8)")
    g.add_argument("--chunk-len", type=positive_int, default=CHUNK_LEN, help="record-world chunk length (tokens)")
    g.add_argument("--ratio", type=fraction, default=RATIO, help="CacheBlend's recompute ratio r in the record world")
    g.add_argument("--docs", type=positive_int, default=DOCS, help="held-out record-world documents (x 12 questions)")
    g.add_argument("--retrain", action="store_true", help="train the record-world model again")
    g.add_argument("--seed", type=int, default=rt.SEED, help="training seed of the record-world model")
    g.add_argument("--locality", type=nonneg_float, default=rt.LOCALITY,
                   help="weight of the record model's locality penalty (0: none; see record_trainer.TRAIN)")
    g.add_argument("--min-ratio", type=fraction, default=MIN_RATIO, help="the controller's quality floor")
    g.add_argument("--check-gpu", choices=sorted(tm.GPUS), default=CHECK_GPU,
                   help="Part 4: the GPU of the time model set beside a real GPU's measurement")
    g.add_argument("--layers", type=positive_int, default=LAYERS, help="exercise 8: number of layers")
    g.add_argument("--read-ms", type=positive_float, default=READ_MS, help="exercise 8: read one layer's KV (ms)")
    g.add_argument("--prefill-ms", type=positive_float, default=PREFILL_MS, help="exercise 8: prefill a layer (ms)")
    g = p.add_argument_group("the real model (Part 5: --model smollm2; these flags need it)")
    g.add_argument("--model", choices=["record", "smollm2"], default="record",
                   help="record: Parts 1-4 (toy models, time model); smollm2: Part 5 on SmolLM2-135M")
    g.add_argument("--real-ratio", type=fraction, default=REAL_RATIO, help="CacheBlend's recompute ratio r on it")
    g.add_argument("--gguf", metavar="PATH", help="another LLaMA GGUF file")
    g.add_argument("--items", type=positive_int, default=ITEMS, help="RAG items (max 8; 2 by default to keep the "
                   "first run short: 8 for the whole set)")
    g.add_argument("--prefix-items", type=positive_int, default=REAL_PREFIX_ITEMS, dest="real_prefix_items",
                   help="§5.1 measured: built-in items at each k (max 8)")
    g.add_argument("--rule", choices=list(blend_rules.ALL_RULES), default=RULE,
                   help="blend()'s selection rule reported as CacheBlend (JSON real_kl_blend<r>: real_kl_blend15)")
    g.add_argument("--passages", metavar="FILE",
                   help='your own inputs, JSON [{"question": str, "passages": [str, ...], "answer": str (optional)}, '
                        '...]; each passage is one chunk')
    g.add_argument("--chunk-tokens", type=positive_int, default=REAL_CHUNK_TOKENS, dest="real_chunk_tokens",
                   help="tokens per chunk of the built-in RAG items")
    g.add_argument("--real-tier", choices=list(blend_rag.STORE_TIERS), default=REAL_TIER,
                   help="Part 5c: the store tier the timed runs fetch the chunks from")
    g.add_argument("--curve", action="store_true",
                   help="every selection rule, random and the oracle at 5-50%% (cached)")
    g.add_argument("--recompute", action="store_true",
                   help="compute the cached results again (the record world's Parts 2-3, the KL)")
    g.add_argument("--remeasure", action="store_true",
                   help="measure the TTFT again (a later run shows the times measured on this machine before)")
    return p


def parse(argv=None) -> tuple:
    """(this run's Settings, the defaults' Settings in the same mode (MODES), the parsed command line).
    Flags of one model given with the other, and inputs out of range, are refused in one line."""
    a = parser().parse_args(argv)
    if a.model == "smollm2":
        from common.english import RAG_ITEMS
        if max(a.items, a.real_prefix_items) > len(RAG_ITEMS):
            fail(f"--items and --prefix-items must be at most {len(RAG_ITEMS)} (the RAG items in common/english.py)")
        if a.ratio != RATIO:
            fail("--ratio is the record world's recompute ratio; with --model smollm2 use --real-ratio")
        if a.passages:
            try:
                blend_rag.load_passages(a.passages)
            except ValueError as e:
                fail(f"--passages: {e}")
    elif (a.passages or a.curve or a.real_chunk_tokens != REAL_CHUNK_TOKENS or a.real_ratio != REAL_RATIO
          or a.real_tier != REAL_TIER or a.real_prefix_items != REAL_PREFIX_ITEMS):
        fail("--passages, --curve, --chunk-tokens, --real-ratio, --real-tier and --prefix-items need --model smollm2")
    elif a.chunk_len > DOC_LEN:
        fail(f"--chunk-len must be at most the document length ({DOC_LEN})")
    s = settings_from(Settings, a, globals())
    return s, replace(shipped_defaults(Settings, globals()), **{m: getattr(s, m) for m in MODES}), a


def main(argv=None) -> Page | None:
    s, defaults, a = parse(argv)
    if s.model == "smollm2":
        from common.gguf_llama import smollm2_or_explain
        if smollm2_or_explain(s.gguf) is None:
            return None
    t_start = time.time()
    # the real model's page is a section of its own (figures/pages/04_smollm2.json beside 04.json)
    page = Page("04" if s.model == "record" else "04_smollm2", "CacheBlend: non-prefix KV reuse, selective recompute"
                + ("" if s.model == "record" else ", on a real LLaMA"), "§5", s, defaults, not a.no_plot)
    if s.model == "smollm2":
        with idle_threads():  # the TTFT is measured on one thread inside (blend/rag.item_ttft)
            real = part5_real(s)
        rag_page.show_real(page, real, s)                # Part 5, §5.1-5.4: the same blend() on a real LLaMA
    else:
        with single_thread():  # models of d = 64: a second thread gains little, and waits when a core is busy
            record_world(s, page)                   # Parts 0-4, §5.1-5.4, exercises 5-8
    print(f"({time.time() - t_start:.0f} s)")
    page.finish(a.json)
    return page


if __name__ == "__main__":
    main()

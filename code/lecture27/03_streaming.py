"""03 -- CacheGen part two (handout §4): when to send KV and when to send text, and adapting to a link
whose bandwidth changes while a context streams in.

    python code/lecture27/03_streaming.py                       # Parts 1-3, four figures
    python code/lecture27/03_streaming.py --json out.json       # + headline figures as JSON
    python code/lecture27/03_streaming.py --trace my.csv --slo 3 --chunk-tokens 1024
    python code/lecture27/03_streaming.py --long-context 65536  # Part 2b with a 64K-token context
    python code/lecture27/03_streaming.py --no-real             # without Part 2c (no SmolLM2 needed)
    python code/lecture27/03_streaming.py --trace-suite 200     # + Part 4: 200 random traces, CDF figure
    python code/lecture27/03_streaming.py --serial              # one chunk at a time: the link idle during a recompute

Part 1 (§4.1, pitfall 1): LLaMA-3.1-70B on 4 x A100 fetching a 12K-token context over a steady link:
        time to first token sending text (then recomputing), raw KV, or KV at each codec level; the
        8B-on-H100 note.
Part 2 (§4.2): the adaptive policy chunk by chunk on a trace (10 -> 1 -> 5 Gb/s, SLO 4 s), against
        always-finest, always-text and an oracle that knows the trace; a steady 25 Gb/s link; why the run
        looks as it does (sizes, the drop, text's break-even).
Part 2b (§4.2, longer context): the same trace and SLO with 48K tokens, still streaming when the link
        drops, so the policy has something to adapt to.
Part 2c (§4.2, real levels): Part 2 again with the levels measured on a real LLaMA (SmolLM2-135M,
        codec_real.py). The record-world model tolerates about 1.8 bits per value, a real LLaMA needs
        2.6-4.1: with levels that large the handout's shape appears (finest level, text after the drop, a
        coarser level).
Part 2d (§4.2): Parts 2-2c in both models of a fetch. The link and the GPU work at once (the default): while
        the GPU recomputes a text chunk from the KV received so far, the link fetches the next chunk. Serial
        (--serial): one chunk at a time, the link idle during a recompute.
Part 3 (§4.2): the chunk-size trade-off on the same trace.
Part 4 (§4.2 on many traces, --trace-suite N): one trace shows a mechanism, not whether a policy is good.
        CacheGen's evaluation replays many bandwidth traces; here N seeded Markov-chain traces x two
        contexts x both level sets, and per policy the SLO-violation rate, TTFT, quality and recomputed
        tokens, a CDF of TTFT, and the promise checked: adaptive meets the SLO wherever a fixed policy does;
        then the SLO misses and mean TTFT of both models side by side.
The codec's four levels come from codec_study.codec_levels() (measured by 02 on the record-world model) and,
for Part 2c, codec_real.real_codec_levels() (fitted on first use, about a minute, then cached); the
simulation, the policy and the oracle are in streaming.py. Recompute times: common/timemodel.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codec_real as cr  # noqa: E402
import codec_study  # noqa: E402
import streaming as st  # noqa: E402
from common import timemodel as tm  # noqa: E402
from common.cli import Parser, fail, positive_float, positive_int, settings_from, shipped_defaults  # noqa: E402
from common.gguf_llama import smollm2_or_explain  # noqa: E402
from common.present import (  # noqa: E402
    DASH, Chart, Col, Field, Handout, Page, Ref, Row, Series, Table, Val, cdf, change, chart_figure, cols,
    plural, table_of)

K = 1024
# ---- Part 1 (§4.1)
MODEL, GPU, N_GPUS = "llama-3.1-70b", "A100-80GB", 4   # §4.1: LLaMA-3.1-70B on 4 x A100
CONTEXT = 12 * K                                       # §4.1: a 12K-token context
BANDWIDTHS = [0.5, 1, 2, 3, 5, 10, 15, 25, 50, 100]    # Gb/s, a slow link to a fast one
NOTE_MODEL, NOTE_GPU = "llama-3.1-8b", "H100"          # §4.1 / pitfall 1: 8B on one H100
NOTE_LINK_GBPS = 25.0    # §4.1: "every link below 25 Gb/s loses to recomputing": what compression would it take?
NO_LOSS_POINTS = 0.005   # a level counts as lossless within 0.5 accuracy points of FP16
# ---- Part 2 (§4.2)
CHUNK_TOKENS = 1536      # §4.2: chunks of 1.5K tokens (CacheGen's default)
TRACE = [(0.0, 10.0), (0.3, 1.0), (3.0, 5.0)]  # §4.2: (from time s, Gb/s): 10 Gb/s for 0-0.3 s, 1 Gb/s to 3 s, then 5
SLO = 4.0                # §4.2: seconds
STEADY_GBPS = 25.0       # §4.2: "a steady 25 Gb/s link picks the finest level throughout"
LONG_CONTEXT = 48 * K    # Part 2b: long enough to still be streaming when the link drops (not in the handout)
MAX_CONTEXT = 128 * K    # LLaMA-3.1's context window (Meta's model card: 128K tokens)
PARALLEL = True          # §4.2: the link fetches the next chunk while the GPU recomputes a text chunk; False
                         # (--serial): one chunk at a time, the link idle during a recompute
# ---- Part 3 (§4.2)
CHUNK_SIZES = [512, 1536, 3072, 6144]                  # about 0.5K, 1.5K, 3K, 6K tokens
HALF_EFFICIENCY_TOKENS = 128   # a recompute batch this small runs at half speed (assumption: streaming.batch_slowdown)
# ---- Part 4 (§4.2 on a suite of traces, like CacheGen's evaluation)
SUITE_TRACES = 0               # --trace-suite N (0: no Part 4); 200 is the study in the README
SUITE_SEED = 0                 # the suite's random seed
SUITE_CONTEXTS = [12 * K, 48 * K]
SUITE_GBPS = [0.1, 0.3, 1.0, 3.0, 10.0, 25.0]   # the Markov chain's bandwidth states, Gb/s
SUITE_DWELL_S = (0.1, 2.0)     # each state lasts a uniform time in this range
SUITE_JUMP = 0.2               # chance that a change jumps to any state (else to a neighbouring one)
SUITE_HORIZON_S = 30.0         # traces are drawn this far; the last rate then holds
SUITE_EXCEPTIONS_SHOWN = 10    # at most this many broken promises printed per context and level set

# The handout's figures beside ours, each with the inputs it holds for: an edit of one of them blanks it.
SETUP_70B = dict(model="llama-3.1-70b", gpu="A100-80GB", n_gpus=4, context=12 * K)   # §4.1-4.2's setup
SETUP_8B = dict(note_model="llama-3.1-8b", note_gpu="H100", context=12 * K)           # §4.1's note
HANDOUT = Handout({
    "part1": Ref("text wins at low bandwidth, compressed KV at high", SETUP_70B),
    "cachegen_delay": Ref("3.2-3.7x"),     # CacheGen's measurement (LLaMA), beside ours whatever the inputs
    "8b_recompute_s": Ref("0.36", SETUP_8B), "8b_breakeven": Ref("below 25", SETUP_8B),
    "codec_vs_8bit": Ref("1.66"),          # §3: the handout's lossless codec against 8-bit quantization
    "trace": Ref("finest level while the link is good, text after the drop, a coarser level at the end chosen by "
                 "the time left (this small model's level 3 answers only 74%)",
                 dict(SETUP_70B, trace=((0.0, 10.0), (0.3, 1.0), (3.0, 5.0)), slo=4.0, chunk_tokens=1536)),
    "steady": Ref("the finest level throughout", dict(SETUP_70B, steady_gbps=25.0, slo=4.0, chunk_tokens=1536)),
    "chunks": Ref("large chunks react late; small chunks recompute in small GPU batches"),
})


@dataclass(frozen=True)
class Settings:
    """One run's inputs: the constants above (lower case), as the command line left them."""
    model: str = MODEL
    gpu: str = GPU
    n_gpus: int = N_GPUS
    context: int = CONTEXT
    bandwidths: tuple = tuple(BANDWIDTHS)
    note_model: str = NOTE_MODEL
    note_gpu: str = NOTE_GPU
    note_link_gbps: float = NOTE_LINK_GBPS
    no_loss_points: float = NO_LOSS_POINTS
    chunk_tokens: int = CHUNK_TOKENS
    trace: tuple = tuple(TRACE)        # ((from time s, Gb/s), ...): TRACE, or the --trace file's
    trace_file: str | None = None
    slo: float = SLO
    steady_gbps: float = STEADY_GBPS
    long_context: int = LONG_CONTEXT
    parallel: bool = PARALLEL          # False: --serial, one chunk at a time
    chunk_sizes: tuple = tuple(CHUNK_SIZES)
    half_efficiency_tokens: float = HALF_EFFICIENCY_TOKENS
    levels_file: str | None = None     # --levels: a JSON file of levels instead of the codec's
    suite_traces: int = SUITE_TRACES
    suite_seed: int = SUITE_SEED
    suite_contexts: tuple = tuple(SUITE_CONTEXTS)
    suite_gbps: tuple = tuple(SUITE_GBPS)
    suite_dwell_s: tuple = SUITE_DWELL_S
    suite_jump: float = SUITE_JUMP
    suite_horizon_s: float = SUITE_HORIZON_S
    suite_exceptions_shown: int = SUITE_EXCEPTIONS_SHOWN


# ------------------------------------------------------------------------------------------ inputs
def nonneg_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if x < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be zero or positive")
    return x


def parse(argv=None) -> tuple[Settings, argparse.Namespace]:
    """The run's Settings (the constants, then the flags) and the parsed command line (--json, --no-plot,
    --no-real: how the run is shown and how far it goes, not its inputs)."""
    p = Parser(__doc__)
    p.add_argument("--trace", dest="trace_file", metavar="FILE",
                   help="CSV 'time_s,gbit_per_s' per line (rate from that time on); default: TRACE (§4.2)")
    p.add_argument("--slo", type=positive_float, default=SLO, help="seconds until the context must be on the GPU")
    p.add_argument("--chunk-tokens", type=positive_int, default=CHUNK_TOKENS, help="tokens per chunk (Part 2)")
    p.add_argument("--long-context", type=positive_int, default=LONG_CONTEXT,
                   help=f"tokens of context in Part 2b (at most {MAX_CONTEXT}, LLaMA-3.1's window)")
    p.add_argument("--levels", dest="levels_file", metavar="FILE",
                   help="JSON list of codec levels instead of codec_study.codec_levels()")
    p.add_argument("--half-tokens", dest="half_efficiency_tokens", type=positive_float, default=HALF_EFFICIENCY_TOKENS,
                   help="recompute batch size that runs at half speed (the small-batch assumption)")
    p.add_argument("--trace-suite", dest="suite_traces", type=nonneg_int, default=SUITE_TRACES, metavar="N",
                   help="Part 4: N random traces (0: skip)")
    p.add_argument("--suite-seed", type=nonneg_int, default=SUITE_SEED, help="the trace suite's random seed")
    p.add_argument("--no-real", action="store_true", help="skip Part 2c (levels measured on SmolLM2)")
    p.add_argument("--serial", dest="parallel", action="store_false", default=PARALLEL,
                   help="one chunk at a time: the link waits while the GPU recomputes (default: both work at once)")
    a = p.parse_args(argv)
    if a.chunk_tokens > CONTEXT:
        p.error(f"argument --chunk-tokens: at most the context, {CONTEXT}")
    if a.long_context > MAX_CONTEXT:
        p.error(f"argument --long-context: at most {MAX_CONTEXT} (LLaMA-3.1's context window)")
    return settings_from(Settings, a, globals(), trace=load_trace(a.trace_file)), a


def load_trace(path: str | None) -> tuple:
    """The trace's (from time s, Gb/s) points: the TRACE constant, or a CSV file (streaming.parse_trace)."""
    if path is None:
        return tuple(TRACE)
    try:
        trace = st.parse_trace(Path(path).read_text())
    except OSError as e:
        fail(f"--trace {path}: {e.strerror}")
    except ValueError as e:
        fail(f"--trace {path}: {e}")
    return tuple(zip(trace.times, trace.gbps))


def load_levels(path: str | None) -> list[dict]:
    """The codec's levels: codec_study.codec_levels() (measured by 02, cached), or a JSON file of
    [{"level", "bits_per_value", "accuracy"}, ...] (for exercises and tests)."""
    if path is None:
        return codec_study.codec_levels()  # trains the record model and fits the codec on first use
    try:
        levels = json.loads(Path(path).read_text())
        for lv in levels:
            if not (lv["bits_per_value"] > 0 and 0 <= lv["accuracy"] <= 1 and int(lv["level"]) == lv["level"]):
                raise ValueError
    except (OSError, ValueError, TypeError, KeyError) as e:
        fail(f"--levels {path}: expected a JSON list of {{level, bits_per_value > 0, accuracy in [0, 1]}}"
             f"{f' ({e.strerror})' if isinstance(e, OSError) else ''}")
    if not levels:
        fail(f"--levels {path}: no levels")
    return levels


def lossless_accuracy(levels) -> tuple[float, str]:
    """Accuracy of exact KV (raw FP16, or text recomputed): the codec's FP16 accuracy if it reports one,
    else its finest level's (the codec's level 0 is built to lose no accuracy, handout §3.4)."""
    for lv in levels:
        if "fp16_accuracy" in lv:
            return lv["fp16_accuracy"], "FP16 accuracy reported by the codec"
    best = max(levels, key=lambda d: d["accuracy"])
    return best["accuracy"], f"taken as level {best['level']}'s (the codec reports no FP16 accuracy)"


def trace_of(s: Settings) -> st.Trace:
    return st.Trace(tuple(t for t, _ in s.trace), tuple(g for _, g in s.trace))


# ------------------------------------------------------------------------- Part 1 (§4.1): one shot
@dataclass
class Bandwidth:
    gbps: float
    ttft: dict           # option name -> seconds until the context is on the GPU
    fastest: str
    best: str            # the fastest option within NO_LOSS_POINTS of lossless
    vs_8bit: float       # 8-bit quantized KV's TTFT over the finest level's (§4.1's headline)


@dataclass
class Part1:
    options: list        # st.Option: raw, the levels finest first, text
    no_loss: list        # the options within NO_LOSS_POINTS of lossless
    rows: list           # Bandwidth, one per link bandwidth
    recompute_s: float   # the whole context recomputed in one batch
    breakeven: dict      # KV option -> the bandwidth at which fetching it takes as long as recomputing
    finest: st.Option
    best_ranges: list    # (option, lowest, highest bandwidth) of each run of bandwidths with the same best


def part1(s: Settings, levels, lossless) -> Part1:
    opts = st.kv_options(levels, s.model, lossless, with_raw=True)
    no_loss = sorted(o.name for o in opts if o.accuracy >= lossless - s.no_loss_points)
    finest = next(o for o in opts if not o.recompute and o.name != "raw")
    eight = st.Option("8-bit", 8 * tm.kv_bytes_per_token(s.model) / 2, lossless, bits_per_value=8.0)
    rows, ranges = [], []
    for g in s.bandwidths:
        ttft = st.whole_context_ttft(s.model, s.gpu, s.n_gpus, s.context, g, opts, s.half_efficiency_tokens)
        t8 = st.whole_context_ttft(s.model, s.gpu, s.n_gpus, s.context, g, [eight], s.half_efficiency_tokens)
        rows.append(Bandwidth(g, ttft, min(ttft, key=ttft.get), min(no_loss, key=ttft.get),
                              t8["8-bit"] / ttft[finest.name]))
        if ranges and ranges[-1][0] == rows[-1].best:
            ranges[-1] = (ranges[-1][0], ranges[-1][1], g)
        else:
            ranges.append((rows[-1].best, g, g))
    recompute = tm.prefill_time(s.model, s.gpu, s.context, 0, s.n_gpus)
    breakeven = {o.name: o.bits_per_token * s.context / recompute / st.GBIT for o in opts if not o.recompute}
    return Part1(opts, no_loss, rows, recompute, breakeven, finest, ranges)


@dataclass
class Note8B:
    recompute_s: float
    raw_breakeven_gbit: float       # raw KV beats recomputing only above this bandwidth
    compression: float              # the compression that puts the break-even at NOTE_LINK_GBPS
    levels_breakeven_gbit: dict     # level -> its break-even bandwidth


def note_8b(s: Settings, levels) -> Note8B:
    """§4.1's note: 8B on one H100 recomputes 12K tokens in 0.36 s; which links lose to recomputing?"""
    t = tm.prefill_time(s.note_model, s.note_gpu, s.context)
    raw_bits = tm.kv_bytes_per_token(s.note_model) * 8 * s.context
    values = tm.kv_bytes_per_token(s.note_model) / 2 * s.context
    raw_be = raw_bits / t / st.GBIT
    return Note8B(t, raw_be, raw_be / s.note_link_gbps,
                  {f"level{lv['level']}": lv["bits_per_value"] * values / t / st.GBIT for lv in levels})


# ------------------------------------------------------------------------- Part 2 (§4.2): one trace
@dataclass
class Why:
    """Why a run looks as it does (explain)."""
    context: int
    finest: str
    coarsest: str
    coarsest_accuracy: float
    finest_gb: float                # the context at the finest level
    finest_s: float                 # always-finest's TTFT
    drop: tuple | None              # (time, rate before, rate after) of the trace's first fall
    complete_before_drop: bool
    coarser_after_drop: bool        # some chunk after the drop took a coarser level
    finest_bits_per_value: float
    vs_8bit: float
    text_recompute_s: float         # all text, chunk by chunk
    text_breakeven_gbit: float      # below it text beats the coarsest level
    slowest_gbps: float             # the trace's slowest rate
    shape: dict                     # the handout's shape, part by part: did the adaptive run show it?
    on_time: dict                   # policy -> met the SLO
    worst_chunk: int                # the adaptive chunk that overran its predicted finish most


@dataclass
class Noise:
    """Part 2c: are the levels' steps larger than their noise (two standard errors over paragraphs)?"""
    kl_clear: bool                  # KL grows level by level beyond the noise
    unclear: list                   # levels whose top-1 agreement moved within the noise


@dataclass
class TraceRun:
    """The policies on one context and trace."""
    setup: st.Setup
    runs: dict                      # policy -> st.Result: adaptive, always <finest>, always text, oracle
    why: Why
    steady: st.Result | None = None  # the adaptive policy on a steady STEADY_GBPS link
    levels: list | None = None      # Part 2c: the levels as measured on SmolLM2, with their noise
    noise: Noise | None = None
    other: dict | None = None       # the same policies in the other model of the link and the GPU (Part 2d)


def policies(setup, trace, slo, parallel) -> dict:
    """The adaptive policy against always-finest, always-text and the oracle, in one model of the link and
    the GPU (streaming.advance)."""
    finest = setup.options[0].name
    return {"adaptive": st.adaptive(setup, trace, slo, parallel=parallel),
            f"always {finest}": st.fixed(setup, trace, finest, parallel=parallel),
            "always text": st.fixed(setup, trace, "text", parallel=parallel),
            "oracle": st.oracle(setup, trace, slo, parallel=parallel)}


def setup_for(s: Settings, context, chunk_tokens, levels, lossless) -> st.Setup:
    return st.make_setup(s.model, s.gpu, s.n_gpus, context, chunk_tokens, levels, lossless, s.half_efficiency_tokens)


def part2(s: Settings, levels, lossless, trace) -> TraceRun:
    setup = setup_for(s, s.context, s.chunk_tokens, levels, lossless)
    runs = policies(setup, trace, s.slo, s.parallel)
    return TraceRun(setup, runs, explain(setup, runs, trace, s.slo),
                    st.adaptive(setup, st.Trace.steady(s.steady_gbps), s.slo, parallel=s.parallel),
                    other=policies(setup, trace, s.slo, not s.parallel))


def part2_long(s: Settings, levels, lossless, trace) -> TraceRun:
    """Part 2b: the same policies on a longer context (the same trace, SLO and chunk size)."""
    setup = setup_for(s, s.long_context, s.chunk_tokens, levels, lossless)
    runs = policies(setup, trace, s.slo, s.parallel)
    return TraceRun(setup, runs, explain(setup, runs, trace, s.slo),
                    other=policies(setup, trace, s.slo, not s.parallel))


def part2_real(s: Settings, trace) -> TraceRun:
    """Part 2c: Part 2 with the levels measured on SmolLM2, and whether their steps stand out of the noise."""
    levels = cr.real_codec_levels()  # fits the codec on SmolLM2 on first use (about a minute)
    return dataclasses.replace(part2(s, levels, 1.0, trace), levels=levels, noise=level_noise_verdict(levels))


def level_noise_verdict(levels) -> Noise | None:
    """Does each level's step from the finer one stand out of the noise? None when no steps were measured."""
    steps = [lv for lv in sorted(levels, key=lambda d: d["level"])[1:] if "agree_step" in lv]
    return Noise(all(lv["kl_step"] > 2 * lv["kl_step_se"] for lv in steps),
                 [f"level{lv['level']}" for lv in steps if abs(lv["agree_step"]) <= 2 * lv["agree_step_se"]]
                 ) if steps else None


def first_drop(trace):
    """(time, rate before, rate after) of the trace's first fall in bandwidth, or None."""
    for k in range(1, len(trace.times)):
        if trace.gbps[k] < trace.gbps[k - 1]:
            return trace.times[k], trace.gbps[k - 1], trace.gbps[k]
    return None


def explain(setup, runs, trace, slo) -> Why:
    """Why a run looks as it does, from the data: how big the context is at the finest level and when it
    arrives, against the trace's first drop; the bandwidth below which text (recompute chunk by chunk)
    beats the coarsest level; which policies met the SLO; and which parts of the handout's shape the
    adaptive run shows. A coarser level counts as "chosen by the time left" when it was predicted to fit
    its chunk's budget (not taken as the fastest option when nothing fit)."""
    finest, coarsest, text = setup.options[0], setup.options[-2], setup.option("text")
    ctx = setup.context_tokens
    recompute_s = sum(setup.recompute_s(f, n) for f, n in setup.plan)      # all text, chunk by chunk
    drop = first_drop(trace)
    ad = runs["adaptive"]
    on_time = {name: r.ttft_s <= slo for name, r in runs.items()}
    after = [r for r in ad.rows if drop and r["start"] >= drop[0]]
    before = [r["choice"] for r in ad.rows if drop and r["start"] < drop[0]]
    coarser = [r for r in after if r["choice"] not in (finest.name, "text")]
    by_time_left = [r for r in coarser if r["predicted"] <= r["start"] + r["budget_s"] + 1e-12]
    return Why(
        ctx, finest.name, coarsest.name, coarsest.accuracy, finest.bits_per_token * ctx / 8e9,
        runs[f"always {finest.name}"].ttft_s, drop, bool(drop) and ad.ttft_s <= drop[0], bool(coarser),
        finest.bits_per_value, 8 / finest.bits_per_value, recompute_s,
        # text beats the coarsest level when its bits take longer than recomputing (token ids included)
        (coarsest.bits_per_token - text.bits_per_token) * ctx / recompute_s / st.GBIT, min(trace.gbps),
        {"finest level while the link is good": bool(before) and set(before) == {finest.name},
         "text after the drop": any(r["choice"] == "text" for r in after),
         "a coarser level after the drop, chosen by the time left": bool(by_time_left),
         "the SLO met": on_time["adaptive"]},
        on_time, max(range(len(ad.rows)), key=lambda k: ad.rows[k]["finish"] - ad.rows[k]["predicted"]))


# ------------------------------------------------------------------------- Part 3 (§4.2): chunk size
@dataclass
class ChunkSize:
    chunk_tokens: int
    chunks: int
    slowdown: float                 # recompute of one chunk against the time model
    adaptive: st.Result
    oracle: st.Result
    text_ttft_s: float              # every chunk recomputed
    overrun_s: float                # reacting late: how far past its predicted finish the worst chunk ran


@dataclass
class ChunkSizes:
    rows: list                      # ChunkSize, one per size of CHUNK_SIZES
    small_batches_cost: bool        # all-text TTFT is longer with the smallest chunks than with the largest
    latest: ChunkSize               # the size whose worst chunk overran most
    before_drop: bool               # at every size the context is in before the trace's first drop


def part3(s: Settings, levels, lossless, trace) -> ChunkSizes:
    rows = []
    for n in s.chunk_sizes:
        setup = setup_for(s, s.context, n, levels, lossless)
        ad = st.adaptive(setup, trace, s.slo, parallel=s.parallel)
        rows.append(ChunkSize(n, len(setup.plan), st.batch_slowdown(n, s.half_efficiency_tokens), ad,
                              st.oracle(setup, trace, s.slo, parallel=s.parallel),
                              st.fixed(setup, trace, "text", parallel=s.parallel).ttft_s,
                              max(r["finish"] - r["predicted"] for r in ad.rows)))
    by_size, drop = sorted(rows, key=lambda c: c.chunk_tokens), first_drop(trace)
    return ChunkSizes(rows, by_size[0].text_ttft_s > by_size[-1].text_ttft_s * 1.001,
                      max(rows, key=lambda c: c.overrun_s),
                      drop is not None and all(c.adaptive.ttft_s <= drop[0] for c in rows))


# ------------------------------------------------------------------------- Part 4: a suite of traces
SUITE_SHOWN = ["adaptive", "naive adaptive", "always level0", "always text", "oracle"]


@dataclass
class SuiteCell:
    """One level set and context over the suite (its fields are the --json's)."""
    levels: str
    context: int
    policies: dict                  # policy -> suite_summary + p95 TTFT
    best_fixed: str                 # the fixed policy missing the SLO least
    rate_ok: bool                   # adaptive misses no more often than the best fixed policy
    quality_on_time_ok: bool        # adaptive's on-time quality at least always level0's
    exceptions: list                # traces where a fixed policy met the SLO and adaptive did not
    other_model: dict               # the other model of the link and the GPU: {parallel, policies, exceptions}


@dataclass
class Suite:
    traces: list
    cells: list                     # SuiteCell
    runs: list                      # per cell: policy -> [st.Result per trace]


def suite_runs(s: Settings, setup, traces, parallel) -> tuple[dict, dict]:
    """({policy: [st.Result per trace]}, {policy: suite_summary + p95 TTFT}) in one model."""
    runs = st.run_suite(setup, traces, s.slo, SUITE_SHOWN, parallel=parallel)
    return runs, {p: st.suite_summary(r, s.slo) | {"p95_ttft_s": st.ttft_percentile(r, 0.95)} for p, r in runs.items()}


def part4(s: Settings, level_sets) -> Suite:
    """The trace suite: s.suite_traces traces from the Markov chain (SUITE_*), each context of
    SUITE_CONTEXTS and each level set {name: (levels, lossless accuracy)}; per policy a summary over the
    traces, and the traces where a fixed policy met the SLO and the adaptive one did not (with the reason);
    the same in the other model of the link and the GPU, for comparison."""
    traces = st.trace_suite(s.suite_traces, s.suite_seed, s.suite_gbps, s.suite_dwell_s, s.suite_jump,
                            s.suite_horizon_s)
    cells, all_runs = [], []
    for name, (levels, lossless) in level_sets.items():
        for ctx in s.suite_contexts:
            setup = setup_for(s, ctx, s.chunk_tokens, levels, lossless)
            runs, summary = suite_runs(s, setup, traces, s.parallel)
            other_runs, other = suite_runs(s, setup, traces, not s.parallel)
            fixed = {p: summary[p]["violation_rate"] for p in ("always level0", "always text")}
            ad, l0 = summary["adaptive"], summary["always level0"]
            cells.append(SuiteCell(name, ctx, summary, min(fixed, key=fixed.get),
                                   ad["violation_rate"] <= min(fixed.values()) + 1e-12,
                                   ad["mean_quality_on_time"] >= l0["mean_quality_on_time"] - 1e-12,
                                   st.promise_exceptions(runs, traces, s.slo),
                                   {"parallel": not s.parallel, "policies": other,
                                    "exceptions": st.promise_exceptions(other_runs, traces, s.slo)}))
            all_runs.append(runs)
    return Suite(traces, cells, all_runs)


# ------------------------------------------------------------------------- every Part
@dataclass
class Results:
    levels: list
    levels_name: str                # where the levels come from: "record-world", or the --levels file
    lossless: float
    lossless_src: str
    trace: st.Trace
    part1: Part1
    note: Note8B
    part2: TraceRun
    long: TraceRun
    sizes: ChunkSizes
    real: TraceRun | None           # Part 2c, or None (with why in real_skipped)
    real_skipped: list
    suite: Suite | None


def compute(s: Settings, real_levels=True) -> Results:
    """Every Part's numbers: the levels, Parts 1-3, Part 2c's real levels if asked and SmolLM2 is at hand,
    Part 4."""
    trace, levels = trace_of(s), load_levels(s.levels_file)
    lossless, lossless_src = lossless_accuracy(levels)
    real, skipped = None, []
    if real_levels and smollm2_or_explain(say=skipped.append) is not None:
        real = part2_real(s, trace)
    name = "record-world" if s.levels_file is None else Path(s.levels_file).name
    suite = None
    if s.suite_traces:
        suite = part4(s, {name: (levels, lossless)} | ({"SmolLM2": (real.levels, 1.0)} if real else {}))
    return Results(levels, name, lossless, lossless_src, trace, part1(s, levels, lossless), note_8b(s, levels),
                   part2(s, levels, lossless, trace), part2_long(s, levels, lossless, trace),
                   part3(s, levels, lossless, trace), real, skipped, suite)


# ========================================================================================= present
SHORT = {"text": "T", "raw": "R", "level0": "L0", "level1": "L1", "level2": "L2", "level3": "L3"}
COLORS = {"level0": "#1a9850", "level1": "#91cf60", "level2": "#fee08b", "level3": "#fc8d59",
          "text": "#4575b4", "raw": "#999999"}


def compact(choices):
    return " ".join(SHORT.get(c, c) for c in choices)


def runs_of(choices):
    """["level0"] * 10 + ["level1"] -> "L0 x10, L1" (long runs of chunks)."""
    out = []
    for c in choices:
        if out and out[-1][0] == c:
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return ", ".join(SHORT.get(c, c) + (f" x{n}" if n > 1 else "") for c, n in out)


def did(setup, run) -> str:
    """What a run fetched, counted: "level0 x5, text x1 (1,536 tokens recomputed), level3 x2"."""
    counts = {o.name: run.choices.count(o.name) for o in setup.options}
    parts = [f"{name} x{k}" + (f" ({run.text_tokens:,} tokens recomputed)" if name == "text" else "")
             for name, k in counts.items() if k]
    gave_up = sum(1 for r in run.rows if r.get("gave_up"))
    probes = sum(1 for r in run.rows if r.get("probe"))
    extra = [plural(gave_up, "KV transfer", "{}") + " given up"] if gave_up else []
    extra += [f"the link probed during {plural(probes, 'recompute', '{}')}"] if probes else []
    return ", ".join(parts) + (f"; {', '.join(extra)}" if extra else "")


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def said(name: str, s: Settings) -> list[str]:
    """The handout's statement `name` as a note, when the run's inputs are those it holds for."""
    ref = HANDOUT(name, s)
    return ["handout: " + ref.figure] if ref else []


def present(page: Page, s: Settings, r: Results) -> None:
    present_part1(page, s, r)
    present_part2(page, s, r.part2, r.trace, r.levels_name)
    present_part2_long(page, s, r.long, r.trace)
    if r.real:
        present_part2_real(page, s, r.real, r.trace)
    for why in r.real_skipped:
        page.say(f"Part 2c (§4.2 with real levels) skipped: {why}")
    present_models(page, s, {"Part 2": r.part2, "Part 2b": r.long} | ({"Part 2c": r.real} if r.real else {}))
    present_part3(page, s, r.sizes)
    if r.suite:
        present_part4(page, s, r.suite)
    page.data(setup={"model": s.model, "gpu": s.gpu, "n_gpus": s.n_gpus, "context": s.context, "slo_s": s.slo,
                     "chunk_tokens": s.chunk_tokens, "long_context": s.long_context,
                     "half_tokens": s.half_efficiency_tokens, "trace": s.trace})


def present_part1(page, s, r):
    p1, m, n = r.part1, tm.MODELS[s.model].name, r.note
    page.part("Part 1", "§4.1", f"{m} on {s.n_gpus} x {s.gpu}, fetching a {s.context:,}-token context")
    where = ("measured by the codec on the record-world\nmodel (256 values/token)" if s.levels_file is None
             else f"read from {r.levels_name}")
    page.table(table_of(
        f"Compressed sizes: each codec level's bits per value, {where}, applied to {m}'s "
        f"{tm.kv_bytes_per_token(s.model) // 2:,} values/token (kv_bytes_per_token / 2).\nText = "
        f"{st.TEXT_BYTES_PER_TOKEN} B/token of token ids, then recompute ({p1.recompute_s:.2f} s for the whole "
        f"context in one batch, time model).\nLossless accuracy (raw, text) = {r.lossless:.3f}, {r.lossless_src}.",
        "§4.1", [Field("option", get="name"),
                 Field("bits/value", "{:.2f}", "levels_bits_per_value.{row}",
                       get=lambda o: None if o.recompute else o.bits_per_value),
                 Field("GB / context", "{:.3f}", get=lambda o: o.bits_per_token * s.context / 8e9),
                 Field("accuracy", "{:.3f}", get="accuracy"),
                 Field("break-even vs text", "{:.1f} Gb/s", "breakeven_gbit_per_s.{row}",
                       get=lambda o: p1.breakeven.get(o.name))],
        {None if o.recompute else o.name: o for o in p1.options},  # text (recomputed) names no JSON key
        "03_streaming.part1", json={"llama31_70b_12k_recompute_s": p1.recompute_s}))
    lo, hi = (f"{f(b.vs_8bit for b in p1.rows):.1f}" for f in (min, max))
    page.table(Table(
        f"\nTTFT (context on the GPU), seconds.\n'best' = fastest of {', '.join(p1.no_loss)} (within "
        f"{s.no_loss_points * 100:.1f} points of lossless).", "§4.1",
        cols(("Gb/s", "{:g}"), *[(f"{o.name} s", "{:.2f}", "ttft_s_at_gbit_per_s.{row}." + o.name) for o in p1.options],
             ("best (no loss)", "{}", "best_at_gbit_per_s.{row}"), ("fastest", "{}", "fastest_at_gbit_per_s.{row}")),
        [Row([b.gbps, *(b.ttft[o.name] for o in p1.options), b.best, b.fastest], key=f"{b.gbps:g}") for b in p1.rows],
        "03_streaming.part1", json={"vs_8bit_at_gbit_per_s": {f"{b.gbps:g}": b.vs_8bit for b in p1.rows}},
        notes=[*said("part1", s), "ours:    best " + "; ".join(
            f"{o} at {a:g}" + (f"-{b:g}" if b != a else "") + " Gb/s" for o, a, b in p1.best_ranges),
            f"§4.1 headline: CacheGen fetches and processes a context {HANDOUT.figure('cachegen_delay', s)} faster "
            f"than 8-bit quantization (LLaMA, end to end). Ours, 8-bit KV TTFT / {p1.finest.name} TTFT over "
            f"{s.bandwidths[0]:g}-{s.bandwidths[-1]:g} Gb/s: {lo}{'' if lo == hi else '-' + hi}x: with the transfer "
            f"alone in the model, the size ratio of 8 bits to {p1.finest.name}'s {p1.finest.bits_per_value:.2f} bits "
            f"per value (a {r.levels_name} level); CacheGen's figure also pays decoding, and its levels were fitted "
            "on LLaMA."]))
    page.table(Table(
        f"\nNote (§4.1, pitfall 1): {tm.MODELS[s.note_model].name} on one {s.note_gpu}, a {s.context:,}-token "
        "context: recompute it, or fetch its KV?", "§4.1", cols("", ("ours", "{:.1f}")), [
            Row(["recompute the context, s (the time model's anchor)",
                 Val(n.recompute_s, "llama31_8b_12k_recompute_s", "{:.2f}")], HANDOUT("8b_recompute_s", s) or DASH),
            Row([f"links that lose to recomputing, raw KV ({tm.kv_bytes_per_token(s.note_model) // K} KiB/token), "
                 "Gb/s", Val(n.raw_breakeven_gbit, "llama31_8b_raw_breakeven_gbit_per_s", "below {:.1f}")],
                HANDOUT("8b_breakeven", s) or DASH),
            Row([f"KV compression whose break-even is {s.note_link_gbps:g} Gb/s", Val(
                n.compression, "llama31_8b_compression_for_25gbit", lambda c: f"{c:.2f}x ({16 / c:.1f} bits/value)")]),
            *[Row([f"{k} KV beats recomputing above, Gb/s", v]) for k, v in n.levels_breakeven_gbit.items()]],
        "03_streaming.note_8b"))
    chart_figure(page, "03_ttft_vs_bandwidth.png", [Chart(
        [Series([b.gbps for b in p1.rows], [b.ttft[o.name] for b in p1.rows], f"{o.name} (acc {o.accuracy:.2f})",
                style={"marker": "o", "ms": 3, "color": COLORS.get(o.name)}) for o in p1.options],
        "link bandwidth, Gb/s", "TTFT (context on GPU), s", f"{m}, {s.n_gpus} x {s.gpu}, {s.context // K}K-token "
        "context", "log", "log", grid="both")], figsize=(7, 4.2))


def present_part2(page, s, run, trace, levels_name):
    page.part("Part 2", "§4.2", f"adaptive streaming, chunks of {s.chunk_tokens:,} tokens, SLO {s.slo:g} s")
    page.say("Trace: " + ", ".join(f"{g:g} Gb/s from {t:g} s" for t, g in s.trace) + ".\n"
             "Each chunk: the throughput measured on the previous chunk is assumed to hold; its budget is its token "
             "share of the time left; it takes the finest level predicted to fit, else text (recompute on the GPU, "
             "attending to the KV received), else the fastest option. " + (
                 "The link and the GPU work at once: while the GPU recomputes a text chunk, the link fetches the next "
                 "one, and that transfer measures the link; text chosen again while the GPU is busy waits, probe bytes "
                 "measuring the idle link until the GPU is free (or the rate changes), then the chunk is decided "
                 "again. " if s.parallel else
                 "One chunk at a time (--serial): the link is idle while the GPU recomputes; a probe measures it "
                 "then. ") + "So a link that recovers is seen. A KV chunk still arriving when only all-text could "
             "meet the SLO is given up and recomputed. Configurations: the codec's levels (each chunk encoded "
             "offline at every level) and text; raw FP16 KV is not streamed (CacheGen streams its levels only).",
             indent=0)
    chunk_table(page, run, shape_notes(s, run.why) + why_notes(s, run.why, codec=True),
                {"trace_rows": run.runs["adaptive"].rows})
    policies_table(page, s, run, "Whole context: quality = token-weighted accuracy (text chunks exact); GPU s = "
                   f"recompute time on {s.n_gpus} GPUs.\nThe oracle knows the trace: meet the SLO, then recompute "
                   "least, then lose least.", "policies", "trace")
    steady(page, s, run.steady, "steady25_choices")
    figure_trace(page, "03_trace_choices.png", run, trace, s.slo,
                 f"Trace and each chunk's choice ({levels_name} levels)")


def present_part2_long(page, s, run, trace):
    page.part("Part 2b", "§4.2, Part 2's trace and SLO, a longer context; not in the handout",
              f"{run.setup.context_tokens:,} tokens")
    page.say(f"(--long-context; LLaMA-3.1 reads up to {MAX_CONTEXT // K}K)")
    w = run.why
    policies_table(page, s, run, "", "long_policies", "long_trace", runs_of, quality=False,
                   notes=shape_notes(s, w) + why_notes(s, w))
    figure_trace(page, "03_trace_choices_long.png", run, trace, s.slo, f"Part 2b, {w.context // K}K tokens: adaptive "
                 f"{'coarsens' if w.coarser_after_drop else 'does not coarsen'} after the drop\n(TTFT "
                 f"{run.runs['adaptive'].ttft_s:.2f} s vs always {w.finest} {w.finest_s:.2f} s; SLO {s.slo:g} s)")


def pm(x, se, f):
    """x +- its standard error, formatted with f (nan: no noise known)."""
    return f"{x:{f}} +- {se:{f.lstrip('+')}}" if se == se else f"{x:{f}}"


def present_part2_real(page, s, run, trace):
    page.part("Part 2c", "§4.2 with real levels", "Part 2 again, the codec's levels measured on a real LLaMA")
    page.say(f"(SmolLM2-135M; codec_real.py, the same codec with its steps searched under a KL budget of "
             f"{cr.REAL_MAX_KL} nats/token on prose)")
    lvs, nan, noise = sorted(run.levels, key=lambda d: d["level"]), float("nan"), run.noise
    page.table(Table(
        f"Measured on {lvs[0]['positions']:,} next-token positions of evaluation prose" + (
            f" ({lvs[0]['paragraphs']} paragraphs; +- one standard error over paragraphs;\nstep: the paired change "
            "from the finer level, each paragraph scored at both)." if "paragraphs" in lvs[0] else "."), "§4.2",
        cols("level", ("bits/value", "{:.2f}"), ("GB / context", "{:.3f}"), "KL from FP16", "top-1 = FP16's",
             "KL step", "top-1 step"),
        [Row([o.name, o.bits_per_value, o.bits_per_token * run.setup.context_tokens / 8e9,
              pm(lv["kl"], lv.get("kl_se", nan), ".4f"),
              pm(100 * o.accuracy, 100 * lv.get("agree_se", nan), ".1f") + "%",
              pm(lv["kl_step"], lv["kl_step_se"], "+.4f") if "kl_step" in lv else "",
              pm(100 * lv["agree_step"], 100 * lv["agree_step_se"], "+.1f") if "agree_step" in lv else ""])
         for o, lv in zip(run.setup.options, lvs)], "codec_real.real_codec_levels", json={"real_levels": run.levels},
        notes=[f"KL grows level by level {'beyond' if noise.kl_clear else 'NOT beyond'} two standard errors; top-1 "
               "agreement " + (f"changes within two standard errors at {', '.join(noise.unclear)}: a coarser level "
                               "can score as well or better there by chance, so KL is the measure to trust."
                               if noise.unclear else "falls level by level beyond two standard errors.")]
        if noise else []))
    chunk_table(page, run, shape_notes(s, run.why, "agrees with FP16's next token") + why_notes(s, run.why))
    policies_table(page, s, run, "Whole context: quality = token-weighted share of next tokens equal to FP16's "
                                 "(text chunks exact).", "real_policies", "real_trace")
    steady(page, s, run.steady, "real_steady25_choices")
    figure_trace(page, "03_trace_choices_smollm2_levels.png", run, trace, s.slo,
                 "Trace and each chunk's choice, levels measured on SmolLM2")


MODEL_KEYS = {"Part 2": "policies", "Part 2b": "long_policies", "Part 2c": "real_policies"}


def present_models(page, s, runs):
    """Part 2d: each run of Part 2-2c in both models of the link and the GPU, side by side."""
    page.part("Part 2d", "§4.2", "the link and the GPU at once, or one chunk at a time")
    by = {name: {s.parallel: run.runs, not s.parallel: run.other} for name, run in runs.items()}
    notes = []
    for name, b in by.items():
        par, ser = b[True]["adaptive"], b[False]["adaptive"]
        ok = [x.ttft_s <= s.slo for x in (ser, par)]
        notes.append(f"{name}: adaptive's TTFT {change(ser.ttft_s, par.ttft_s, '{:.2f} s')} from one chunk at a "
                     f"time to both at once; SLO {met(ok[0])} " + ("in both" if ok[0] == ok[1] else
                                                                   f"serially, {met(ok[1])} in parallel")
                     + f". Parallel: {runs_of(par.choices)}; serial: {runs_of(ser.choices)}.")
    kv = [(b[True][p].ttft_s, b[False][p].ttft_s) for b in by.values() for p in b[True]
          if p.startswith("always") and p != "always text"]
    text = max(abs(b[True]["always text"].ttft_s - b[False]["always text"].ttft_s) for b in by.values())
    notes.append(("A fixed KV level never uses the GPU: the same TTFT in both models. " if all(a == b for a, b in kv)
                  else "A fixed KV level's TTFT differs between the models. ") + f"Always text differs by "
                 f"{text * 1e3:.2f} ms at most: only the GPU works there, and the token ids of the next chunk cross "
                 "during a recompute.")
    both = [(True, "parallel"), (False, "serial")]
    page.table(table_of(
        "TTFT and recomputed tokens of each policy. parallel: the link fetches while the GPU recomputes; serial: one "
        "chunk at a time (--serial).", "§4.2",
        [Field("Part", get=lambda x: x[0].removeprefix("Part ")),
         Field("context", get=lambda x: f"{x[1].setup.context_tokens // K}K"), Field("policy", get=2),
         *(Field(f"{w} s", "{:.2f}", get=lambda x, m=m: by[x[0]][m][x[2]].ttft_s) for m, w in both),
         *(Field(f"{w}: recomputed", "{:,}", get=lambda x, m=m: by[x[0]][m][x[2]].text_tokens) for m, w in both)],
        [(name, run, p) for name, run in runs.items() for p in run.runs], "03_streaming.part2", notes,
        {"by_model": {w: {MODEL_KEYS[n]: policy_json(b[m]) for n, b in by.items()} for m, w in both}}))


def policy_json(runs) -> dict:
    return {name: {"choices": r.choices, "ttft_s": r.ttft_s, "quality": r.quality, "text_tokens": r.text_tokens,
                   "gpu_s": r.gpu_s} for name, r in runs.items()}


def chunk_table(page, run, notes, json=None):
    """One row per chunk of an adaptive run: what it expected, chose, and got."""
    rows = [Row([i, f"{first:,}-{first + n - 1:,}", r["start"], r["est_gbps"], r["budget_s"],
                 r["choice"] + (f" ({SHORT[r['gave_up']]} given up)" if r["gave_up"] else ""), r["predicted"],
                 r["finish"],
                 None if r["measured_gbps"] is None else f"{r['measured_gbps']:.2f}" + " (probe)" * r["probe"],
                 r["gpu_start"]])
            for i, (r, (first, n)) in enumerate(zip(run.runs["adaptive"].rows, run.setup.plan))]
    page.table(Table("The adaptive policy, chunk by chunk:", "§4.2", cols(
        "chunk", "tokens", ("start s", "{:.3f}"), ("est Gb/s", "{:.2f}"), ("budget s", "{:.3f}"), "choice",
        ("predicted s", "{:.3f}"), ("finish s", "{:.3f}"), "measured Gb/s", ("GPU from s", "{:.3f}")), rows,
        "streaming.adaptive", notes,
        json or {}))


def shape_notes(s, w, answers="answers") -> list[str]:
    """The handout's expected shape (when the run's inputs are its), and part by part what the adaptive run did."""
    return said("trace", s) + ["ours:    " + ("the trace has no drop in bandwidth, so the handout's shape cannot "
                                              "appear" if w.drop is None else "; ".join(
        f"{k}: {'yes' if v else 'NO'}" for k, v in w.shape.items()) + f" (our {w.coarsest} {answers} "
        f"{w.coarsest_accuracy:.1%})")]


def why_notes(s, w, codec=False) -> list[str]:
    """Why the run looks as it does, all computed; the handout's codec (1.66x smaller than 8-bit) for scale."""
    where = "the trace never drops" if w.drop is None else (
        f"{'before' if w.complete_before_drop else 'after'} the drop at {w.drop[0]:g} s "
        f"({w.drop[1]:g} -> {w.drop[2]:g} Gb/s)")
    out = [f"Why: at {w.finest} the {w.context:,}-token context is {w.finest_gb:.3f} GB and arrives (always "
           f"{w.finest}) in {w.finest_s:.2f} s, {where}."]
    ref = HANDOUT("codec_vs_8bit", s)
    if codec and ref:
        bits = 8 / float(ref.figure)
        x = bits / w.finest_bits_per_value
        out.append(f"  The handout's codec was {ref.figure}x smaller than 8-bit quantization (about {bits:.1f} "
                   f"bits/value); ours is {w.vs_8bit:.1f}x smaller ({w.finest_bits_per_value:.2f} bits/value at "
                   f"{w.finest}): the handout's levels were about " + (f"{x:.1f}x larger." if x >= 1 else
                                                                       f"{1 / x:.1f}x smaller."))
    return out + [f"  Text (recompute chunk by chunk, {w.text_recompute_s:.2f} s of GPU) beats {w.coarsest} only "
                  f"below {w.text_breakeven_gbit:.2f} Gb/s; the trace's slowest rate is {w.slowest_gbps:g} Gb/s"
                  + (", so text never pays." if w.slowest_gbps > w.text_breakeven_gbit else ".")]


def policies_table(page, s, run, title, key, trace_key, fmt=compact, quality=True, notes=()):
    """The four policies on the trace; the adaptive row's cells also go to `trace_key`_choices, ..."""
    def cell(name, v, k):
        return Val(v, f"{trace_key}_{k}") if name == "adaptive" and (quality or k != "quality") else v
    page.table(Table(title, "§4.2", [
        Col("policy"), Col("choices", fmt, f"{key}.{{row}}.choices"), Col("TTFT s", "{:.2f}", f"{key}.{{row}}.ttft_s"),
        Col(f"SLO {s.slo:g} s", met), Col("quality", "{:.3f}", f"{key}.{{row}}.quality"),
        Col("recomputed tokens", "{:,}", f"{key}.{{row}}.text_tokens"), Col("GPU s", "{:.2f}", f"{key}.{{row}}.gpu_s")],
        [Row([name, cell(name, r.choices, "choices"), cell(name, r.ttft_s, "ttft_s"), run.why.on_time[name],
              cell(name, r.quality, "quality"), r.text_tokens, r.gpu_s], key=name) for name, r in run.runs.items()],
        "03_streaming.policies", [*notes, *so_notes(s, run)]))


def so_notes(s, run) -> list[str]:
    """What the adaptive policy did (counted from its choices) and its outcome, the oracle's, and what a policy
    that arrives sooner trades: a miss is said as a miss, a trade only when adaptive arrives in time."""
    ad, orc, text, ok = run.runs["adaptive"], run.runs["oracle"], run.runs["always text"], run.why.on_time
    out = [f"So: adaptive fetched {did(run.setup, ad)}: TTFT {ad.ttft_s:.2f} s (SLO {met(ok['adaptive'])}), "
           f"quality {ad.quality:.3f}.", f"    The oracle, knowing the trace, fetched {did(run.setup, orc)}: TTFT "
           f"{orc.ttft_s:.2f} s (SLO {met(ok['oracle'])}), quality {orc.quality:.3f}."]
    out += [f"    {name.capitalize()} arrives sooner here ({r.ttft_s:.2f} s vs {ad.ttft_s:.2f} s; " + (
        "both miss the SLO" if not ok[name] else "it meets the SLO, adaptive does not" if not ok["adaptive"] else
        "both meet the SLO") + "): adaptive chose by the rates it had measured, and the link then changed."
        for name, r in run.runs.items() if name not in ("adaptive", "always text", "oracle") and r.ttft_s < ad.ttft_s]
    gpu = (f"the GPUs recompute {text.text_tokens:,} tokens ({text.gpu_s:.2f} s on {s.n_gpus} GPUs) against "
           f"adaptive's {ad.text_tokens:,} ({ad.gpu_s:.2f} s)")
    if text.ttft_s < ad.ttft_s:
        out.append(f"    Always text arrives sooner ({text.ttft_s:.2f} s vs {ad.ttft_s:.2f} s) and " + (
            f"exact (quality {text.quality:.3f}), but {gpu}: adaptive trades {text.quality - ad.quality:.3f} of "
            "quality for that GPU time, which the cache exists to save." if ok["adaptive"] else
            ("meets the SLO that adaptive misses" if ok["always text"] else "misses the SLO too") + f"; {gpu}."))
    if ok["oracle"] and not ok["adaptive"]:
        row = ad.rows[run.why.worst_chunk]
        out.append(f"    Adaptive misses the SLO that the oracle meets: it chose by the rates it had measured, and "
                   f"chunk {run.why.worst_chunk} ({row['choice']}), due at {row['predicted']:.2f} s at "
                   f"{row['est_gbps']:.2f} Gb/s, ended at {row['finish']:.2f} s.")
    return out


def steady(page, s, run, key):
    page.say(f"\nSteady {s.steady_gbps:g} Gb/s: {compact(run.choices)} (TTFT {run.ttft_s:.2f} s)"
             + "".join(f"; {h}" for h in said("steady", s)))
    page.data(**{key: run.choices})


def present_part3(page, s, c):
    h, key, late = s.half_efficiency_tokens, "chunk_sizes.{row}.", c.latest
    text = [x.text_ttft_s for x in c.rows]
    page.part("Part 3", "§4.2", "chunk size on the same trace")
    page.say(f"Recompute of a chunk of n tokens runs (1 + {h:g}/n) / (1 + {h:g}/12K) times slower than the time "
             f"model (a batch\nof n tokens at n/(n+{h:g}) of large-batch speed; an assumption, --half-tokens, see "
             "streaming.batch_slowdown).")
    page.table(table_of(
        "chunk: tokens per chunk; slowdown: recompute of one chunk vs the time model; all-text s: TTFT with\n"
        "every chunk recomputed (small batches cost); overrun s: the worst chunk's finish minus its predicted\n"
        "finish (large chunks react late); TTFT ... GPU s: the adaptive policy; oracle s, q: the oracle's TTFT, "
        "quality.", "§4.2", [
            Field("chunk", "{:,}", get="chunk_tokens"), Field("chunks", get="chunks"),
            Field("slowdown", "{:.3f}", get="slowdown"),
            Field("all-text s", "{:.2f}", key + "all_text_ttft_s", get="text_ttft_s"),
            Field("overrun s", "{:.2f}", key + "worst_overrun_s", get="overrun_s"),
            Field("TTFT s", "{:.2f}", key + "ttft_s", get="adaptive.ttft_s"),
            Field("SLO", met, key + "slo_met", get=lambda x: x.adaptive.ttft_s <= s.slo),
            Field("quality", "{:.3f}", key + "quality", get="adaptive.quality"),
            Field("GPU s", "{:.2f}", get="adaptive.gpu_s"),
            Field("oracle s", "{:.2f}", key + "oracle_ttft_s", get="oracle.ttft_s"),
            Field("oracle q", "{:.3f}", key + "oracle_quality", get="oracle.quality")],
        {str(x.chunk_tokens): x for x in c.rows}, "03_streaming.part3",
        [f"adaptive's choices, {x.chunk_tokens:,}-token chunks: {runs_of(x.adaptive.choices)}" for x in c.rows]
        + said("chunks", s) + [
            f"ours:    small batches cost{'' if c.small_batches_cost else ' little here'}: all-text TTFT "
            f"{min(text):.2f}-{max(text):.2f} s across chunk sizes; " + (
                f"reacting late: worst overrun {late.overrun_s:.2f} s with {late.chunk_tokens:,}-token chunks"
                if late.overrun_s > 1e-9 else "reacting late costs nothing here: no chunk ran past its predicted "
                "finish" + " (at every size the context is in before the trace's first drop)" * c.before_drop)],
        {f"chunk_sizes.{x.chunk_tokens}.choices": x.adaptive.choices for x in c.rows}))


def present_part4(page, s, suite):
    n, (lo, hi), most = len(suite.traces), s.suite_dwell_s, s.suite_exceptions_shown
    page.part("Part 4", "§4.2 on many traces", f"{n} traces, seed {s.suite_seed}, as CacheGen's evaluation "
              "replays throughput traces")
    page.say(f"SLO {s.slo:g} s, chunks of {s.chunk_tokens:,} tokens. Each trace: a Markov chain over "
             f"{', '.join(f'{g:g}' for g in s.suite_gbps)} Gb/s, each rate held {lo:g}-{hi:g} s, then a neighbouring "
             f"rate (or any rate, chance {s.suite_jump:g}).")
    notes = ["The promise, per levels and context: wherever always level0 or always text meets the SLO, adaptive "
             "does; its SLO-miss rate is at most the best fixed policy's; its on-time quality at least always "
             "level0's."]
    for c in suite.cells:
        ad, l0, ex = c.policies["adaptive"], c.policies["always level0"], c.exceptions
        notes += [f"{c.levels} {c.context // K}K: broken on {len(ex)} of {n} traces; misses {ad['violation_rate']:.1%}"
                  f" vs {c.best_fixed}'s {c.policies[c.best_fixed]['violation_rate']:.1%}: "
                  f"{'yes' if c.rate_ok else 'NO'}; on-time quality {ad['mean_quality_on_time']:.4f} vs "
                  f"{l0['mean_quality_on_time']:.4f}: {'yes' if c.quality_on_time_ok else 'NO'}"]
        notes += [f"  trace {e['trace']}: {' and '.join(e['fixed_met'])} met it, adaptive took "
                  f"{e['adaptive_ttft_s']:.2f} s: chunk {e['chunk']} ({e['choice']}) was due at {e['predicted_s']:.2f}"
                  f" s at {e['est_gbps']:.2f} Gb/s, ended at {e['finish_s']:.2f} s (the link fell to "
                  f"{e['lowest_gbps']:g} Gb/s)" for e in ex[:most]]
        notes += [f"  ... and {len(ex) - most} more (--json lists them all)"] * (len(ex) > most)
        notes += [f"  quality of what arrived: adaptive {ad['mean_quality']:.4f} < always level0's "
                  f"{l0['mean_quality']:.4f}: the coarser levels it takes to arrive in time"] * (
            ad["mean_quality"] < l0["mean_quality"])
    page.table(Table(
        "quality: of what arrived, late or not; on-time quality: a context past the SLO counts 0. naive adaptive: "
        "the\nsame rule keeping its last KV measurement through text and waiting for every KV chunk (no probe, no "
        "give-up).", "§4.2", cols("levels, context", "policy", ("SLO missed", "{:.1%}"), ("mean TTFT s", "{:.2f}"),
                                 ("p95 TTFT s", "{:.2f}"), ("quality", "{:.4f}"), ("on-time quality", "{:.4f}"),
                                 ("recomputed tokens", "{:,.0f}")),
        [Row([f"{c.levels} {c.context // K}K", p, m["violation_rate"], m["mean_ttft_s"], m["p95_ttft_s"],
              m["mean_quality"], m["mean_quality_on_time"], m["mean_text_tokens"]])
         for c in suite.cells for p, m in c.policies.items()], "03_streaming.part4", notes,
        {"suite": {"traces": n, "seed": s.suite_seed, "slo_s": s.slo, "contexts": s.suite_contexts,
                   "cells": suite.cells}}))
    suite_models(page, s, suite)
    figure_suite(page, s, suite)


def suite_models(page, s, suite):
    """The suite in both models of the link and the GPU, side by side: SLO misses and mean TTFT per policy."""
    both = [({s.parallel: c.policies, not s.parallel: c.other_model["policies"]},
             {s.parallel: c.exceptions, not s.parallel: c.other_model["exceptions"]}) for c in suite.cells]
    rows = [Row([f"{c.levels} {c.context // K}K", p, *(m[w][p][k] for k in ("violation_rate", "mean_ttft_s")
                                                       for w in (True, False))])
            for c, (m, _) in zip(suite.cells, both) for p in c.policies]
    notes = [f"{c.levels} {c.context // K}K: adaptive's SLO-miss rate "
             + change(m[False]["adaptive"]["violation_rate"], m[True]["adaptive"]["violation_rate"], "{:.1%}")
             + f" from serial to parallel; traces where a fixed policy meets the SLO and adaptive does not: "
               f"{len(ex[True])} in parallel, {len(ex[False])} serially" for c, (m, ex) in zip(suite.cells, both)]
    page.table(Table("Both models of the link and the GPU (parallel: at once; serial: one chunk at a time):",
                     "§4.2", cols("levels, context", "policy", ("parallel: missed", "{:.1%}"),
                                  ("serial: missed", "{:.1%}"), ("parallel: TTFT s", "{:.2f}"),
                                  ("serial: TTFT s", "{:.2f}")), rows, "03_streaming.part4", notes))


# ----------------------------------------------------------------------------------------- figures
def figure_trace(page, name, run, trace, slo, title):
    """The trace above, each policy's chunks below (coloured by what each fetched), the SLO in red."""
    if not page.plot:
        return
    end = max(max(r.ttft_s for r in run.runs.values()), slo) * 1.05
    with page.figure(name, title, figsize=(8, 5), nrows=2, sharex=True,
                     gridspec_kw={"height_ratios": [1, 1.3]}) as (fig, (top, bot)):
        top.step(list(trace.times) + [end], list(trace.gbps) + [trace.gbps[-1]], where="post", color="k")
        top.set(ylabel="link, Gb/s", ylim=(0, max(trace.gbps) * 1.1))
        for i, row in ((i, row) for i, r in enumerate(run.runs.values()) for row in r.rows):
            text = row["gpu_start"] is not None
            spans = [] if text and not row.get("gave_up") else [      # token ids alone take microseconds
                (i - 0.2, row["start"], row["link_end"], "#bbbbbb" if text else COLORS.get(row["choice"]))]
            spans += [(i + 0.2, row["gpu_start"], row["finish"], COLORS["text"])] if text else []
            for y, a, b, color in spans:
                bot.barh(y, b - a, left=a, height=0.4, color=color, edgecolor="k", lw=0.5)
                if b - a > 0.08:
                    bot.text((a + b) / 2, y, SHORT[row["choice"]] if color != "#bbbbbb" else "x", ha="center",
                             va="center", fontsize=6)
        bot.set_yticks(range(len(run.runs)), list(run.runs))
        bot.invert_yaxis()
        for a in (top, bot):
            a.axvline(slo, color="r", ls="--", lw=1)
        bot.set(xlabel="time, s (red: SLO; each policy: the link above, the GPU below; grey: a KV transfer given up)",
                xlim=(0, end))


SUITE_STYLES = {"adaptive": ("C3", "-"), "naive adaptive": ("C3", ":"), "always level0": ("#1a9850", "-"),
                "always text": ("#4575b4", "-"), "oracle": ("k", "--")}


def figure_suite(page, s, suite):
    """CDF of TTFT over the suite, one panel per level set and context, one line per policy."""
    ctxs = list(s.suite_contexts)
    charts = [Chart([Series(*cdf(r.ttft_s for r in res), p, "step",
                            {"color": SUITE_STYLES[p][0], "ls": SUITE_STYLES[p][1]}) for p, res in runs.items()],
                    title=f"{c.levels} levels, {c.context // K}K tokens", xscale="log", grid="both", legend=None,
                    vlines=[(s.slo, {"color": "0.5", "ls": "--", "lw": 1})], axes={"ylim": (0, 1.02)})
              for c, runs in zip(suite.cells, suite.runs)]   # part4's order: each level set, then each context
    for i, c in enumerate(charts):
        c.xlabel = "TTFT (context on GPU), s (grey dashes: SLO)" if i >= len(charts) - len(ctxs) else ""
        c.ylabel = "share of traces" if i % len(ctxs) == 0 else ""
    charts[0].legend = {"fontsize": 7, "loc": "lower right"}
    chart_figure(page, "03_trace_suite_ttft_cdf.png", charts, ncols=len(ctxs), sharex=True,
                 figsize=(4.2 * len(ctxs), 3.2 * (len(charts) // len(ctxs))))


# -------------------------------------------------------------------------------------------- main
def main(argv=None) -> Page:
    """Compute every Part, then present it; the page (its tables, notes and --json) is returned for tests."""
    s, a = parse(argv)
    page = Page("03", "CacheGen part two: streaming with adaptation", "§4", s, shipped_defaults(Settings, globals()),
                plot=not a.no_plot)
    r = compute(s, real_levels=not a.no_real)
    present(page, s, r)
    page.finish(a.json)
    return page


if __name__ == "__main__":
    main()
